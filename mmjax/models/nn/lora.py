"""LoRA adapters served many at once: per-slot stacks on the decoder's and the encoder's linear layers.

`enable(decoder, slots, rank)` gives every adapted `Linear` of a decoder (the q / k / v / o and
gate / up / down projections of its layers, `TARGETS`) a `LoRASlots`, `enable_encoder(model, ...)`
every linear layer of the vision tower and projector (all but the patch embedding, HF's conv): `a` [slots, in, R] and `b`
[slots, R, out], zero until an adapter is written into a slot (`LoRASlots.write`: arrays only, so
loading an adapter compiles nothing). A fused projection (q|k|v, gate|up) holds one rank block of
`rank` columns per part (R = parts x rank), each part's B in its own output columns, so an adapter
may target any subset of the parts with its own rank (padded to `rank`). PEFT's scaling
(lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B when written.

Which slot a token uses is per token (S-LoRA / punica style): the step puts it in the attention
metadata (`AttentionMetadata.adapters` [b, t] int32, -1: the base model) and the decoder's layer
loop holds it here (`adapter_rows`) while its layers run; each adapted linear then adds
`(x @ A[slot]) @ B[slot]` to its base output. The product is computed for all slots at once and
masked by the one-hot slot (two dense matmuls of R x slots columns, no gather): every row's result
is its own (a base row adds exact zeros), and a step's graph does not depend on which adapters are
loaded. The base weight may be anything `matmul` takes (f32 / bf16 / packed / int8 / fp8): the
adapter is a float path beside it.

The encode step runs one adapter per call (its images were grouped by adapter): `rows` is then a
scalar slot, and each linear gathers that slot's A / B (R columns, not slots x R), zeroed for -1.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_ROWS: contextvars.ContextVar = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def adapter_rows(rows: jax.Array | None):
    """While a decoder's layers (or an encode step) are traced inside the block, adapted linears
    read each token's adapter slot from rows [b, t] int32, or one slot for every token from a
    scalar int32 (-1: none); rows None: no adapter anywhere."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


class LoRASlots(nnx.Module):
    """The adapters of one linear layer: a [slots, in, R], b [slots, R, out] (B already scaled).
    `widths`: the layer's output parts (one for a plain Linear), each with its own rank block of
    `rank` columns."""

    def __init__(self, d_in: int, widths: tuple[int, ...], slots: int, rank: int, dtype=jnp.float32):
        self.slots, self.rank, self.widths = slots, rank, tuple(widths)
        r = rank * len(widths)
        self.a = nnx.Param(jnp.zeros((slots, d_in, r), dtype), axes=(None, None, None), quantize=False)
        self.b = nnx.Param(jnp.zeros((slots, r, sum(widths)), dtype), axes=(None, None, None), quantize=False)

    def __call__(self, x: jax.Array, rows: jax.Array) -> jax.Array:
        """x [..., in], rows (slot per row of x, or one scalar slot for all; -1: none) -> the
        adapters' output [..., out]."""
        a, b = self.a.get_value(), self.b.get_value()
        s, d_in, r = a.shape
        lead = x.shape[:-1]
        if jnp.ndim(rows) == 0:         # one slot for every row: gather it (R columns, not s x R)
            slot = jnp.maximum(rows, 0)
            h = jnp.matmul(x, a[slot].astype(x.dtype), preferred_element_type=jnp.float32)
            h = h * (rows >= 0).astype(h.dtype)
            return jnp.matmul(h.astype(x.dtype), b[slot].astype(x.dtype), preferred_element_type=jnp.float32)
        rows = jnp.reshape(rows, lead)
        xf = x.reshape(-1, d_in)
        h = jnp.matmul(xf, a.transpose(1, 0, 2).reshape(d_in, s * r).astype(x.dtype),
                       preferred_element_type=jnp.float32).reshape(-1, s, r)
        h = h * jax.nn.one_hot(rows.reshape(-1), s, dtype=h.dtype)[:, :, None]     # -1: all zeros
        y = jnp.matmul(h.reshape(-1, s * r).astype(x.dtype), b.reshape(s * r, -1).astype(x.dtype),
                       preferred_element_type=jnp.float32)
        return y.reshape(*lead, -1)

    def write(self, slot: int, parts: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Slot `slot` := the adapter given per part index: (A [in, r], B [r, width], scaled), r <=
        rank; parts not given are zero (the adapter leaves them as they are)."""
        a = np.zeros(self.a.get_value().shape[1:], np.float32)
        b = np.zeros(self.b.get_value().shape[1:], np.float32)
        col = np.cumsum((0,) + self.widths)
        for i, (pa, pb) in parts.items():
            r = pa.shape[1]
            a[:, i * self.rank:i * self.rank + r] = pa
            b[i * self.rank:i * self.rank + r, col[i]:col[i + 1]] = pb
        dtype = self.a.get_value().dtype
        self.a.set_value(self.a.get_value().at[slot].set(jnp.asarray(a, dtype)))
        self.b.set_value(self.b.get_value().at[slot].set(jnp.asarray(b, dtype)))


def apply(layer, x: jax.Array, y: jax.Array) -> jax.Array:
    """A linear layer's output y plus its adapters' for x, where the layer has them and a step
    gave the tokens' slots (`adapter_rows`); else y."""
    lora = getattr(layer, "lora", None)
    rows = _ROWS.get()
    if lora is None or rows is None:
        return y
    return y + lora(x, rows).astype(y.dtype)


def hf_names(path: tuple, layer) -> list[str]:
    """The HF module names (relative to the decoder) of a linear layer's outputs, in part order:
    a FusedLinear's parts live beside it under their own names (q_proj, k_proj, v_proj)."""
    parts = getattr(layer, "parts", None)
    prefix = ".".join(map(str, path[:-1]))
    if parts is None:
        return [".".join(map(str, path))]
    return [f"{prefix}.{p.name}" if prefix else p.name for p in parts]


def adapted_layers(decoder: nnx.Module) -> dict[str, tuple[object, int]]:
    """{HF module name relative to the decoder (layers.3.self_attn.q_proj): (its linear layer, the
    part index)} for every linear `enable` adapts (or would)."""
    from mmjax.models.nn.linear import Linear
    out = {}
    for path, m in nnx.iter_modules(decoder):
        if not isinstance(m, Linear) or "layers" not in path:
            continue
        names = hf_names(path, m)
        if any(n.rsplit(".", 1)[-1] in TARGETS for n in names):
            for i, n in enumerate(names):
                out[n] = (m, i)
    return out


def encoder_layers(model: nnx.Module) -> dict[str, tuple[object, int]]:
    """{module path in `model` as HF-like names (vision_tower.encoder.layers.0.self_attn.q_proj,
    multi_modal_projector.linear_1, visual.blocks.0.mlp.gate_proj): (its linear layer, the part
    index)} for every linear outside the language model that an adapter may target: all but those
    not quantized as matmuls (patch embeddings: a convolution in HF, which LoRA adapts otherwise)
    and any whose kernel is not one [in, out] matrix (a stacked layout)."""
    from mmjax.models.nn.linear import Linear
    modules = dict(nnx.iter_modules(model))
    out = {}
    for path, m in modules.items():
        if not isinstance(m, Linear) or not path or path[0] == "language_model":
            continue
        if m.kernel.get_metadata().get("quantize", True) is False or len(m.kernel.get_value().shape) != 2:
            continue
        path = (*path[:-1], _hf_attr(modules[path[:-1]], path[-1]))
        for i, n in enumerate(hf_names(path, m)):
            out[n] = (m, i)
    return out


def _hf_attr(parent: nnx.Module, attr: str) -> str:
    """The HF name of `parent`'s linear `attr` where the module names it otherwise (an MLP's
    fc1 / fc2 as its `names`, e.g. Qwen's merger mlp.0 / mlp.2; a vision attention's out_proj as
    its `o_name`)."""
    from mmjax.models.nn.mlp import MLP
    if isinstance(parent, MLP) and attr in ("fc1", "fc2"):
        return parent.names[attr == "fc2"]
    if attr == "out_proj" and isinstance(getattr(parent, "o_name", None), str):
        return parent.o_name
    return attr


def _give_slots(layers, slots: int, rank: int, dtype) -> int:
    from mmjax.errors import UnsupportedModelError
    for m in layers:
        if len(m.kernel.get_value().shape) != 2:
            raise UnsupportedModelError("LoRA adapters are not supported with tensor parallelism", param="max_loras")
        widths = tuple(p.width for p in m.parts) if getattr(m, "parts", None) else (m.d_out,)
        m.lora = LoRASlots(m.d_in, widths, slots, rank, dtype)
    return len(layers)


def enable_encoder(model: nnx.Module, slots: int, rank: int, dtype) -> int:
    """Give the vision tower's and projector's linears (`encoder_layers`) `slots` zero adapter
    slots of rank `rank` -> the number of layers adapted."""
    return _give_slots(list({id(m): m for m, _ in encoder_layers(model).values()}.values()), slots, rank, dtype)


def enable(decoder: nnx.Module, slots: int, rank: int, dtype) -> int:
    """Give the decoder's adapted linears `slots` zero adapter slots of rank `rank` -> the number
    of layers adapted. Under tensor parallelism (a [in, tp, out/tp] kernel) there are none."""
    from mmjax.errors import UnsupportedModelError
    if getattr(decoder, "cross_attention", False):
        raise UnsupportedModelError("LoRA adapters are not supported for cross-attention decoders (Mllama)",
                                    param="max_loras")
    return _give_slots(list({id(m): m for m, _ in adapted_layers(decoder).values()}.values()), slots, rank, dtype)
