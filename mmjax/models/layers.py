"""Small shared layers: pure functions of (params, x)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mmjax.backend import current_platform


def matmul(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in out_dtype (default: the usual promotion).

    Every weight matmul of the models goes through here (dense layers, LM heads, projectors,
    patch embeddings), so the precision policy sits in one place: bf16 x bf16 runs as a dot with
    an f32 result (`preferred_element_type`), cast back to bf16 where the activations are bf16
    (AMX / tensor cores take bf16 operands and accumulate in f32; a bf16-result dot gains
    nothing on CPU), and a quantized weight (`mmjax.quant.QArray`) takes its 8-bit dot. On the
    CPU, a packed weight (`mmjax.packed_weights`: f32, bf16 and int8 ones on a CPU host) takes
    mmjax's kernel at any number of rows, and a few rows (decode) of an [in, out] weight go to
    the row-major kernel (`mmjax.kernels.cpu_gemv`), which reads it at memory bandwidth."""
    from mmjax.kernels import cpu_gemv
    from mmjax.packed_weights import PackedWeight, matmul as packed_matmul
    from mmjax.quant import QArray, qmatmul
    if isinstance(w, PackedWeight):
        if x.dtype == w.dtype and cpu_gemv.enabled():   # any number of rows: one kernel call
            return packed_matmul(x, w).astype(out_dtype or w.dtype)
        w = w.unpack()
    kernel = cpu_gemv.covers(x, w)
    if isinstance(w, QArray):
        dot = lambda x: qmatmul(x, w, out_dtype)          # (its int8 dot is the kernel when covered)
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
    converts the whole weight to f32 / s32 on every call (a 2048x8192 bf16 matvec took 22 ms
    against 1.6 ms in f32). From two rows the dot goes to the YNNPACK library, which reads the
    narrow weight as it is (the decode step must allow library dots: `Tuning.compiler_options`).
    Only where mmjax's CPU kernel does not take the matmul (`cpu_gemv.covers`: a step sharded
    over a mesh, fp8, no C++ compiler). Other backends and more rows: dot(x) unchanged."""
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


def dense(p: dict, x: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b); w may be a quantized `mmjax.quant.QArray`."""
    y = matmul(x, p["w"])
    return y + p["b"] if "b" in p else y


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm computed in float32 (as torch does for f32 and autocast bf16)."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rms_norm(scale: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """Llama RMSNorm: normalise in float32, cast back, then scale (HF's order of operations)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of RoPE angles [..., head_dim], each evaluated once per element of `angles`.

    XLA:CPU fuses the transcendentals into every consumer and re-evaluates them there per
    head and layer (32 fusions of [t, heads, head_dim] cos + sin in a 230-token prefill of
    the bench model; it drops optimization barriers before fusing), so on the CPU the tables
    come out of a lax.cond whose two branches are the same: a conditional's results are
    computed once, whichever branch runs (32 rotations of [240, 16, 64]: 18.2 -> 4.1 ms).
    Elsewhere plain ops (a GPU's conditional syncs with the host, its sin / cos are cheap)."""
    def tables(a):
        return jnp.cos(a), jnp.sin(a)
    if current_platform() != "cpu" or angles.size == 0:
        return tables(angles)
    return jax.lax.cond(angles.reshape(-1)[0] < 0, tables, tables, angles)


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
