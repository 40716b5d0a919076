"""Linear layers, embeddings and the precision policy every weight matmul goes through.

A `Linear` keeps its weight as `kernel` [in, out] (HF's [out, in] transposed once at load:
XLA:CPU streams `x @ W` with W [in, out] much faster than `x @ W.T`; benchmarks/README.md,
"Figures behind code choices"). What the weight *is* decides
how it multiplies (`matmul`), nothing ambient: a float array takes XLA's dot (bf16 x bf16 with an
f32 result), a `mmjax.packed_weights.PackedWeight` (f32 / bf16 in the CPU kernels' panels) and a
`mmjax.quant.QArray` (int8 / fp8, packed or not) take their kernels. The runner sets those value
types when it places a model for its platform (packs for the CPU, unpacks elsewhere, quantizes on
request), so the same module tree serves every backend.

Logical axis names ride on every Param as Flax metadata (`axes`): `mmjax.sharding` maps them to a
mesh with one rules table. A `FusedLinear` (q|k|v, gate|up) also names its parts, so its
tensor-parallel layout ([in, tp, per-shard parts]) follows from those names (`tp_regroup`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.backend import current_platform
from mmjax.models.nn import lora


def matmul(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in out_dtype (default: the usual promotion).

    The precision policy of every weight matmul: bf16 x bf16 runs as a dot with an f32 result
    (`preferred_element_type`), cast back to bf16 where the activations are bf16 (AMX / tensor
    cores take bf16 operands and accumulate in f32; a bf16-result dot gains nothing on CPU), and a
    quantized weight (`mmjax.quant.QArray`) takes its 8-bit dot. On the CPU, a packed weight
    (`mmjax.packed_weights`) takes mmjax's kernel at any number of rows, and a few rows (decode)
    of an [in, out] weight go to the row-major kernel (`mmjax.kernels.cpu_gemv`), which reads it
    at memory bandwidth."""
    from mmjax.kernels import cpu_gemv
    from mmjax.packed_weights import PackedWeight, matmul as packed_matmul
    from mmjax.quant import QArray, qmatmul
    if isinstance(w, PackedWeight):
        if x.dtype == w.dtype and cpu_gemv.enabled():   # any number of rows: one kernel call
            return packed_matmul(x, w).astype(out_dtype or w.dtype)
        w = w.unpack()
    kernel = cpu_gemv.covers(x, w)
    if isinstance(w, QArray):
        dot = lambda x: qmatmul(x, w, out_dtype)          # noqa: E731 (its int8 dot is the kernel when covered)
        return dot(x) if kernel else one_row_as_two(dot, x)
    if x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16:
        if kernel:
            return cpu_gemv.gemv_bf16(x, w).astype(out_dtype or jnp.bfloat16)
        return one_row_as_two(
            lambda x: jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype or jnp.bfloat16), x)
    y = cpu_gemv.gemv_f32(x, w) if kernel else x @ w
    return y if out_dtype is None else y.astype(out_dtype)


def one_row_as_two(dot, x: jax.Array) -> jax.Array:
    """dot(x) for x [..., in] holding one row, run on [2, in] on CPU (the row twice) and sliced.

    XLA:CPU lowers a one-row dot to its own matrix-vector loop, which has no bf16 / int8 form: it
    converts the whole weight to f32 / s32 on every call. From two rows the dot goes to the
    YNNPACK library, which reads the narrow weight as it is (the decode step must allow library
    dots: `Tuning.compiler_options`). Only where mmjax's CPU kernel does not take the matmul
    (`cpu_gemv.covers`: a step sharded over a mesh, fp8, no C++ compiler)."""
    if current_platform() != "cpu" or math.prod(x.shape[:-1]) != 1:
        return dot(x)
    y = dot(jnp.broadcast_to(x.reshape(1, x.shape[-1]), (2, x.shape[-1])))
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def bf16_einsum(spec: str, a: jax.Array, b: jax.Array, **kw) -> jax.Array:
    """jnp.einsum with bf16 x bf16 as a dot with an f32 result cast back to bf16 (see `matmul`);
    any other dtypes as jnp.einsum."""
    if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16 and "preferred_element_type" not in kw:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, **kw).astype(jnp.bfloat16)
    return jnp.einsum(spec, a, b, **kw)


def grouped_matmul(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, groups, cols] -> [..., groups, cols]: a fused projection in its
    tensor-parallel layout (`tp_regroup`), each shard's block local."""
    from mmjax.quant import QArray, as_2d
    if isinstance(w, QArray):   # 8-bit: the grouped columns as one [in, groups * cols] weight
        return matmul(x, as_2d(w)).reshape(*x.shape[:-1], *w.shape[1:])
    return bf16_einsum("...d,dgc->...gc", x, w)


def param(shape, dtype, axes: tuple) -> nnx.Param:
    """A zero Param of `shape` carrying logical axis names (filled by the loader; under
    `nnx.eval_shape` nothing is allocated)."""
    return nnx.Param(jnp.zeros(shape, dtype), axes=tuple(axes), quantize=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). kernel [in, out] (or [in, tp, out / tp] in a tensor-parallel
    layout), bias [out]; `axes`: the logical names of (in, out)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype=jnp.float32,
                 axes: tuple = (None, None), quantize: bool = True):
        self.d_in, self.d_out = d_in, d_out
        self.kernel = nnx.Param(jnp.zeros((d_in, d_out), dtype), axes=tuple(axes), quantize=quantize)
        self.bias = param((d_out,), dtype, axes[1:]) if bias else None

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        w = self.kernel.get_value()
        y = grouped_matmul(x, w) if w.ndim == 3 else matmul(x, w, out_dtype)
        if self.bias is not None:
            y = y + self.bias.get_value()
        return lora.apply(self, x, y)     # the adapters' part, where a step serves them (nn/lora.py)

    def hf_weights(self, w, name: str) -> None:
        """Read HF Linear `name` (weight [out, in], bias [out]) into this layer."""
        w.set(self.kernel, w.take(f"{name}.weight", (self.d_out, self.d_in)).T, matmul=True)
        if self.bias is not None:
            w.set(self.bias, w.take(f"{name}.bias", (self.d_out,)))


@dataclass(frozen=True)
class Part:
    """One projection of a `FusedLinear`: its HF module name, output width, the logical axis its
    columns belong to ("heads", "kv_heads", "mlp") and the columns of one unit of that axis (a
    head's head_dim; 1 for the MLP), which is what a tensor-parallel shard takes whole."""
    name: str
    width: int
    axis: str
    unit: int = 1

    @property
    def units(self) -> int:
        return self.width // self.unit


class FusedLinear(Linear):
    """Several HF Linears reading the same input (q / k / v, gate / up) as one matmul:
    kernel [in, sum of widths] (fused along the output), split back into `parts` by `__call__`.
    Under tensor parallelism the kernel is [in, tp, per-shard widths] (`tp_regroup`): each shard
    splits its own block, and every part's output comes out in the original column order."""

    def __init__(self, d_in: int, parts: tuple[Part, ...], *, bias: bool = False, dtype=jnp.float32):
        super().__init__(d_in, sum(p.width for p in parts), bias=bias, dtype=dtype, axes=("embed", parts[0].axis))
        self.parts = tuple(parts)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        y = super().__call__(x)
        if y.ndim == x.ndim:                       # [..., sum of widths]
            return tuple(jnp.split(y, np.cumsum([p.width for p in self.parts])[:-1].tolist(), axis=-1))
        tp = y.shape[-2]                           # [..., tp, per-shard widths]
        widths = [shard_width(p, tp) for p in self.parts]
        cuts = np.cumsum(widths)[:-1].tolist()
        return tuple(part.reshape(*part.shape[:-2], -1) for part in jnp.split(y, cuts, axis=-1))

    def hf_weights(self, w, name: str) -> None:
        """Read the parts' HF Linears `{prefix}{part.name}` (name = the common prefix) and fuse them."""
        ws = [w.take(f"{name}{p.name}.weight", (p.width, self.d_in)).T for p in self.parts]
        w.set(self.kernel, np.concatenate(ws, axis=1), fused=self.parts, matmul=True)
        if self.bias is not None:
            bs = [w.take(f"{name}{p.name}.bias", (p.width,)) for p in self.parts]
            w.set(self.bias, np.concatenate(bs), fused=self.parts)


def shard_width(part: Part, tp: int) -> int:
    """Columns of `part` one of tp shards holds (a KV head replicated to each shard when there
    are fewer heads than shards, Megatron's KV replication)."""
    return max(part.units // tp, 1) * part.unit


def tp_index(units: int, tp: int) -> np.ndarray:
    """The units (heads) a tp-shard layout holds, in order: all of them, or (units < tp) each
    repeated so shard s holds the one its query heads read."""
    return np.arange(units) if units >= tp else np.arange(tp) // (tp // units)


def tp_regroup(a, parts: tuple[Part, ...], tp: int):
    """[..., sum of widths] (numpy or traced) -> [..., tp, per-shard widths]: shard s takes unit
    block s of every part (its heads' q columns, the KV heads they read, its slice of gate and
    of up), side by side. The inverse of what `FusedLinear.__call__` undoes per shard."""
    xp = jnp if isinstance(a, jax.core.Tracer) else np
    lead = a.shape[:-1]
    out, start = [], 0
    for p in parts:
        block = a[..., start:start + p.width].reshape(*lead, p.units, p.unit)[..., tp_index(p.units, tp), :]
        out.append(block.reshape(*lead, tp, -1))
        start += p.width
    return xp.concatenate(out, axis=-1)


def check_divisible(parts: tuple[Part, ...], tp: int, what: str = "") -> None:
    """Can `parts` be split over tp shards (heads and the MLP evenly; fewer KV heads replicate)?"""
    from mmjax.errors import UnsupportedModelError
    bad = [f"{p.name} ({p.units} {p.axis})" for p in parts
           if p.units % tp and not (p.axis == "kv_heads" and tp % p.units == 0)]
    if bad:
        raise UnsupportedModelError(f"tensor_parallel={tp} does not divide {', '.join(bad)}{what}",
                                    param="tensor_parallel")


class Embed(nnx.Module):
    """Token embedding: embedding [vocab, hidden] (rows padded to a multiple of tp under tensor
    parallelism: vocab-parallel)."""

    def __init__(self, vocab: int, hidden: int, *, dtype=jnp.float32):
        self.vocab, self.hidden = vocab, hidden
        self.embedding = param((vocab, hidden), dtype, ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.get_value(), ids, axis=0, mode="clip")

    def hf_weights(self, w, name: str) -> None:
        w.set(self.embedding, w.take(f"{name}.weight", (self.vocab, self.hidden)))


def activation(name: str):
    acts = {
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "relu": jax.nn.relu,
    }
    if name not in acts:
        from mmjax.errors import UnsupportedModelError
        raise UnsupportedModelError(f"activation {name!r} is not supported", param="hidden_act")
    return acts[name]
