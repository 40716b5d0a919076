"""One runner's split of the live model: split and flattened once per model version, its weights
as the runner's platform keeps them, on the runner's devices.

The compiled steps are plain `jax.jit` functions of flat weight lists that `nnx.merge` the
module inside the trace (never an `nnx.split` or a State flatten per step: the split, the
treedef and the leaves are made here, once, and again only on `refresh` after an edit).
The decoder's leaves (`lm_leaves`) are what the text steps take; encode takes the rest
(`vision_leaves`), the decoder standing in as shapes.

Per weight, for the platform: packed for mmjax's CPU kernels where they run (a linear layer's
f32 / bf16 kernel a `PackedWeight`, an int8 one a packed `QArray`), [in, out] elsewhere; under
tensor parallelism the decoder's fused projections regrouped per shard and vocab-sized axes
padded (`tp_layout`); then placed by its logical axes (`Placement.put`). The primary runner
writes what it placed back into the live module (one copy of the weights); a data-parallel
replica keeps its own copy on its own devices.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from mmjax.sharding import Placement, check_quantized_tp

_LM = nnx.PathContains("language_model")


def for_platform(value, metadata: dict, pack: bool):
    """One weight as a runner of this platform keeps it: packed (pack) or [in, out]."""
    from mmjax import quant
    from mmjax.packed_weights import _PACKED_DTYPES, PackedWeight, pack_weight
    if isinstance(value, PackedWeight):
        return value if pack else value.unpack()
    if isinstance(value, quant.QArray):
        return quant.pack(value) if pack else quant.unpack(value)
    if (pack and metadata.get("quantize") and np.ndim(value) == 2
            and np.dtype(getattr(value, "dtype", np.float32)) in _PACKED_DTYPES):
        return pack_weight(np.asarray(value))
    return value


def tp_layout(decoder: nnx.Module, tp: int) -> None:
    """The decoder's weights in their tensor-parallel layout for tp shards, in place and once
    (a laid-out weight is left as it is): fused q|k|v and gate|up kernels [in, sum] -> [in, tp,
    per shard] (their `Part`s say how, `linear.tp_regroup`), biases alike, vocab-sized axes
    zero-padded to a multiple of tp (vocab-parallel embedding and head)."""
    from mmjax import quant
    from mmjax.models.nn.linear import FusedLinear, tp_regroup
    from mmjax.packed_weights import PackedWeight
    if tp == 1:
        return
    decoder.check_tensor_parallel(tp)
    groups = [v.get_value().scale.shape[0] for _, v in nnx.to_flat_state(nnx.state(decoder))
              if isinstance(v.get_value(), quant.QArray) and v.get_value().ndim == 2]
    check_quantized_tp(tp, any(g > 1 for g in groups))
    for _, var in nnx.to_flat_state(nnx.state(decoder)):     # the CPU kernels' packing: the [in, out] layout
        if isinstance(var.get_value(), (PackedWeight, quant.QArray)):
            var.set_value(for_platform(var.get_value(), var.get_metadata(), False))
    for _, m in nnx.iter_modules(decoder):
        if not isinstance(m, FusedLinear) or m.kernel.get_value().ndim != 2:
            continue
        regroup = lambda a, parts=m.parts: _host(lambda x: tp_regroup(x, parts, tp), a)       # noqa: E731
        m.kernel.set_value(quant.map_columns(regroup, m.kernel.get_value()))
        m.kernel.set_metadata(axes=m.kernel.get_metadata()["axes"] + (None,))
        if m.bias is not None:
            m.bias.set_value(regroup(m.bias.get_value()))
            m.bias.set_metadata(axes=m.bias.get_metadata()["axes"] + (None,))
    for _, var in nnx.to_flat_state(nnx.state(decoder)):
        axes = var.get_metadata().get("axes") or ()
        if "vocab" not in axes:
            continue
        i = axes.index("vocab")
        value = var.get_value()
        size = value.shape[i]
        if size % tp:
            def pad(a, i=i):
                widths = [(0, 0)] * len(a.shape)
                widths[i] = (0, -a.shape[i] % tp)
                return _host(lambda x: (jax.numpy if isinstance(x, jax.core.Tracer) else np).pad(x, widths), a)
            var.set_value(quant.map_columns(pad, value) if i == len(value.shape) - 1 else pad(value))


def _host(fn, a):
    """fn over a host copy of `a` (numpy), or over its shape when `a` is abstract (a
    ShapeDtypeStruct: shapes-only models, e.g. benchmarks/sharding.py's)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.eval_shape(fn, a)
    return fn(np.asarray(a))


@dataclass
class Split:
    """One model version as the steps take it."""
    graphdef: nnx.GraphDef
    lm_graphdef: nnx.GraphDef
    lm_treedef: object
    lm_leaves: list
    vision_treedef: object
    vision_leaves: list
    lm_shapes: object              # the decoder's state as ShapeDtypeStructs (encode's stand-in)


class PlacedModel:
    """A runner's view of `model` (see the module docstring). pack: keep linear weights packed for
    the CPU kernels; primary: write the placed weights back into the live module; offload:
    vision weights in host memory (fetched to the device inside encode)."""

    def __init__(self, model: nnx.Module, placement: Placement, *, pack: bool, primary: bool = True,
                 offload: bool = False):
        self.model, self.placement, self.pack, self.primary, self.offload = model, placement, pack, primary, offload
        self.split: Split | None = None
        self.vision_device_shardings = None
        self._graphs: dict = {}
        self._ids: dict = {}
        self._states: dict = {}
        self.refresh()

    def _place_state(self, state, offload: bool = False):
        """A State's values for this platform, put on this placement's devices."""
        from mmjax.sharding import host_memory_kind

        def one(var):
            value = for_platform(var.get_value(), var.get_metadata(), self.pack)
            value = self.placement.put(value, tuple(var.get_metadata().get("axes") or (None,) * np.ndim(value)))
            if offload:
                device = jax.tree.leaves(value)[0].sharding._device_assignment[0]
                kind = host_memory_kind(device)
                if kind is None:
                    from mmjax.errors import UnsupportedModelError
                    raise UnsupportedModelError(f"vision offload: {device.platform} devices have no host memory kind",
                                                param="vision_offload")
                value = jax.device_put(value, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), value))
            return var.replace(value)
        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def _live(self) -> tuple[dict, dict]:
        """The live module's graphs and leaf identities per part: what an edit changes."""
        _, lm, vision = nnx.split(self.model, _LM, ...)
        graphs = {"language_model": nnx.graphdef(self.model.language_model),
                  "vision": tuple((k, nnx.graphdef(v)) for k, v in vars(self.model).items()
                                  if isinstance(v, nnx.Module) and k != "language_model")}
        ids = {"language_model": [id(x) for x in jax.tree.leaves(lm)], "vision": [id(x) for x in jax.tree.leaves(vision)]}
        return graphs, ids

    def refresh(self) -> set[str]:
        """(Re)split the live model and place what changed -> the parts that changed since the
        last split ("language_model", "vision": a part whose module graph or weights changed).
        An unchanged part keeps its placed arrays and its steps' split (nothing is copied or
        recompiled for it)."""
        graphs, ids = self._live()
        changed = {p for p in ("language_model", "vision")
                   if self.split is None or graphs[p] != self._graphs[p] or ids[p] != self._ids[p]}
        if not changed:
            return changed
        # a replica lays its copy out on a clone (the live module keeps the primary's layout)
        model = self.model if self.primary else nnx.clone(self.model)
        tp_layout(model.language_model, self.placement.tp)
        graphdef, lm_state, vision_state = nnx.split(model, _LM, ...)
        states = dict(self._states)
        if "language_model" in changed:
            states["language_model"] = self._place_state(lm_state)
        if "vision" in changed:
            states["vision"] = self._place_state(vision_state, offload=self.offload)
        if self.primary:       # the live module holds what the steps read (one copy of the weights)
            nnx.update(self.model, *(states[p] for p in sorted(changed)))
            graphs, ids = self._live()
        self._graphs, self._ids, self._states = graphs, ids, states
        old = self.split
        lm_leaves, lm_treedef = jax.tree.flatten(states["language_model"])
        if "vision" in changed:          # encode's view: the new model graph, its decoder as shapes
            vision_leaves, vision_treedef = jax.tree.flatten(states["vision"])
            lm_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                    sharding=getattr(x, "sharding", None)),
                                     states["language_model"])
        else:                            # the old view stands (encode never reads the decoder's weights)
            graphdef, vision_leaves, vision_treedef, lm_shapes = (old.graphdef, old.vision_leaves, old.vision_treedef,
                                                                  old.lm_shapes)
        self.split = Split(graphdef, nnx.graphdef(model.language_model), lm_treedef, lm_leaves, vision_treedef,
                           vision_leaves, lm_shapes)
        if self.offload and "vision" in changed:
            self.vision_device_shardings = [x.sharding.with_memory_kind("device") for x in vision_leaves]
        return changed

    @property
    def states(self) -> dict:
        """The placed weights as States: {"language_model": ..., "vision": ...}."""
        return dict(self._states)

    # ---- what the steps call (inside their traces) ----------------------------------------------
    def lm_of(self):
        """leaves -> the decoder module (for the text steps of this version)."""
        gd, td = self.split.lm_graphdef, self.split.lm_treedef
        return lambda leaves: nnx.merge(gd, jax.tree.unflatten(td, leaves))

    def model_of(self):
        """vision leaves -> the whole module, its decoder as shapes (encode reads only the vision
        side and the features' dtype); offloaded leaves come to the device first."""
        sp, shardings = self.split, self.vision_device_shardings

        def merge(leaves):
            if shardings is not None:
                leaves = [jax.device_put(x, s) for x, s in zip(leaves, shardings)]
            return nnx.merge(sp.graphdef, sp.lm_shapes, jax.tree.unflatten(sp.vision_treedef, leaves))
        return merge
