"""Abstract build, direct load: a model is built with `nnx.eval_shape` (shapes only, nothing
allocated, no random init) and each safetensors tensor is streamed into its Variable: read,
re-laid (HF's [out, in] transposed, fused projections concatenated, tensor-parallel regrouping,
vocab padding), cast, quantized or packed as asked, and placed with its sharding, one tensor at a
time, so the host holds about one copy of the weights while loading.

Modules read their own weights (`hf_weights(w, name)`: `Linear`, `RMSNorm`, `Embed`, ...); a module
without that method reads its children by attribute name (`load_children`), which is why module
attributes follow transformers' names. Strict like the checkpoint reader: a missing or
mis-shaped tensor, a tensor no module used, or a Variable no tensor filled is a CheckpointError
naming it.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError


class Weights:
    """The loader modules read from. dtype: float weights' dtype; placement: a
    `mmjax.sharding.Placement` (None: the default device); pack: matmul weights re-laid for the CPU
    kernels (`mmjax.packed_weights`); quantize / group_size: matmul weights as 8-bit QArrays
    (`mmjax.quant`); on_device=False: host numpy arrays (placed later)."""

    def __init__(self, src: TensorSource, *, dtype=jnp.float32, placement=None, pack: bool = False,
                 quantize: str | None = None, group_size: int | None = None, on_device: bool = True):
        self.src, self.dtype, self.placement = src, jnp.dtype(dtype), placement
        self.pack, self.quantize, self.group_size, self.on_device = pack, quantize, group_size, on_device

    @property
    def tp(self) -> int:
        return 1 if self.placement is None else self.placement.tp

    def take(self, name: str, shape: tuple) -> np.ndarray:
        return self.src.take(name, shape)

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def ignore(self, pattern: str) -> None:
        self.src.ignore(pattern)

    def set(self, var: nnx.Variable, value, *, fused=None, matmul: bool = False) -> None:
        """value (host array, the Variable's logical layout) -> var, converted and placed.
        fused: the `linear.Part`s of a fused projection (regrouped per shard under tensor
        parallelism: [.., sum] -> [.., tp, per shard], the axes metadata following); matmul: a
        matmul weight (quantized / packed as this loader asks)."""
        from mmjax.models.nn.linear import tp_regroup
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating):
            value = value.astype(self.dtype, copy=False)
        axes = tuple(var.get_metadata().get("axes") or (None,) * value.ndim)
        want = tuple(getattr(var.get_value(), "shape", value.shape))
        if value.shape != want:
            raise CheckpointError(f"weight for {axes} has shape {value.shape}, the model expects {want}")
        tp = self.tp
        if tp > 1 and fused is not None:
            value = tp_regroup(value, fused, tp)
            axes = axes[:-1] + (axes[-1], None) if value.ndim > len(axes) else axes
            var.set_metadata(axes=axes)
        if tp > 1 and "vocab" in axes:
            i = axes.index("vocab")
            pad = [(0, 0)] * value.ndim
            pad[i] = (0, -value.shape[i] % tp)
            value = np.pad(value, pad)
        takes = matmul and var.get_metadata().get("quantize", True)   # patch embeddings, routers: as they are
        if takes and self.quantize is not None and value.ndim in (2, 3):
            from mmjax.quant import quantize_weight
            value = quantize_weight(value, self.quantize, None if value.ndim == 3 else self.group_size,
                                    on_device=False, packed=self.pack and value.ndim == 2)
        elif takes and self.pack and value.ndim == 2:
            from mmjax.packed_weights import pack_weight
            value = pack_weight(value)
        var.set_value(self.place(value, axes))

    def place(self, value, axes: tuple):
        """A host value (array, QArray, PackedWeight) on its device(s): sharded by its logical
        axes over the placement's mesh, else the default device (on_device=False: left on the host)."""
        if not self.on_device:
            return value
        if self.placement is None or self.placement.mesh is None:
            return jax.tree.map(jnp.asarray, value)
        return self.placement.put(value, axes)

    def finish(self, model: nnx.Module) -> None:
        """Every tensor used and every Variable filled, else a CheckpointError naming them."""
        self.src.check_all_used()
        missing = [".".join(map(str, path)) for path, v in nnx.to_flat_state(nnx.state(model))
                   if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(v.get_value()))]
        if missing:
            raise CheckpointError(f"the checkpoint filled no weight for {', '.join(missing[:8])}"
                                  + (f", ... ({len(missing)} in all)" if len(missing) > 8 else ""), param=missing[0])


def load_module(module: nnx.Module, w: Weights, name: str) -> None:
    """Read a module's weights under HF prefix `name`: its own `hf_weights(w, name)`, else its
    children's (`load_children`)."""
    if hasattr(type(module), "hf_weights"):
        module.hf_weights(w, name)
    else:
        load_children(module, w, name)


def load_children(module: nnx.Module, w: Weights, name: str) -> None:
    """Read each child module under `{name}.{attribute}` (list items `{name}.{attribute}.{i}`)."""
    for attr, child in vars(module).items():
        if attr.startswith("_"):
            continue
        prefix = f"{name}.{attr}" if name else attr
        if isinstance(child, nnx.Module):
            load_module(child, w, prefix)
        elif isinstance(child, (nnx.List, list, tuple)):
            for i, item in enumerate(child):
                if isinstance(item, nnx.Module):
                    load_module(item, w, f"{prefix}.{i}")


def build(make: Callable[[], nnx.Module]) -> nnx.Module:
    """The model `make()` builds, abstractly: every Variable a ShapeDtypeStruct (nothing allocated)."""
    return nnx.eval_shape(make)


def ignore_tail(w: Weights, prefix: str, keep: int, what: str = "layers") -> None:
    """Tensors of blocks >= keep under `{prefix}.{what}.N.` (towers whose later blocks never reach
    the output are built short: they are read past, not loaded)."""
    rx = re.compile(re.escape(f"{prefix}.{what}.") + r"(\d+)\..*")
    names = [n for n in w.src.names() if (m := rx.fullmatch(n)) and int(m.group(1)) >= keep]
    for n in names:
        w.ignore(re.escape(n))


def state_arrays(model: nnx.Module) -> Any:
    """The model's Variable values as a plain nested dict (for orbax and inspection)."""
    return nnx.to_pure_dict(nnx.state(model))
