"""The placement seam: where params, KV cache and decode state live, and the shardings every
compiled step takes from there.

`Placement(mesh=None)` is one device (JAX's default device, no sharding annotations: the
compiled steps are exactly the single-device ones). With a `jax.sharding.Mesh` over the axes
("data", "model"), arrays are placed with `NamedSharding`s derived from one table of rules
(`LOGICAL_RULES`, MaxText's logical axis rules): every parameter carries its logical axis names
(heads, kv_heads, mlp, vocab, embed, ...) as Flax metadata (`nn.linear`: `axes=`), every cache
axis has one (`CACHE_AXES`), and the table maps names to mesh axes, so a new family inherits it.

Tensor parallelism (Megatron style, run by XLA's SPMD partitioner): the decoder's fused
projections (`nn.FusedLinear`) name their parts' axes, so their per-shard layout follows from
them (`serving.placed_model.tp_layout`: each shard's q | k | v and gate | up side by side, KV
heads replicated when fewer than shards, vocab padded), once at placement time; with tp == 1
nothing changes.

Data parallel serving is M engine replicas over M sub-meshes (`sub_meshes`); inside one runner
the "data" axis has size 1 and the rules that name it are no-ops.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger("mmjax.sharding")

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)

# logical axis -> mesh axis (None: replicated); MaxText's logical_axis_rules, one table for all
# families. "images" is the encode batch: the vision tower is data parallel over the images of
# one encode call (over every device of a replica), its weights replicated.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("vocab", MODEL),        # embedding rows and LM-head columns (vocab-parallel)
    ("heads", MODEL),        # query heads; the per-shard group axis of fused q|k|v
    ("kv_heads", MODEL),     # KV heads of the weights and the KV cache (replicated to tp when fewer)
    ("mlp", MODEL),          # MLP intermediate; the per-shard group axis of fused gate|up
    ("embed", None),         # the residual stream: replicated (Megatron TP)
    ("head_dim", None),
    ("kv_len", None),
    ("slots", None),         # decode slots belong to one replica (DP is across engines)
    ("images", (DATA, MODEL)),
    ("vision_heads", None),  # ViT / projector weights: replicated by default (VISION_TP_RULES)
    ("vision_mlp", None),
)

# The tensor-parallel ViT option (`vision_tensor_parallel=True`, for towers too big to
# replicate): the vision blocks' and projector's heads / MLP split like the decoder's. Fused
# vision weights (Qwen's qkv, gate_up) are split by columns as they are, not regrouped per shard:
# memory is 1/TP, and XLA moves the activations their split needs.
VISION_TP_RULES: tuple[tuple[str, Any], ...] = (("vision_heads", MODEL), ("vision_mlp", MODEL))

# K segments [slots, kv_heads, head_dim, len], V segments [slots, kv_heads, len, head_dim]
CACHE_AXES = {"k": ("slots", "kv_heads", "head_dim", "kv_len"), "v": ("slots", "kv_heads", "kv_len", "head_dim"),
              # int8 / fp8 caches: per-(token, KV head) scales, split with their heads (kv_quant)
              "k_scale": ("slots", "kv_heads", "kv_len"), "v_scale": ("slots", "kv_heads", "kv_len")}


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh of data_parallel x tensor_parallel devices (`jax.make_mesh`;
    the model axis is the fast one, so a TP group sits on neighbouring devices)."""
    n = tensor_parallel * data_parallel
    devices = list(devices if devices is not None else jax.devices())
    if n > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} needs {n} devices, "
                         f"{len(devices)} are visible")
    # Auto axes: XLA's SPMD partitioner propagates the shardings (the params / cache carry them)
    auto = (jax.sharding.AxisType.Auto,) * 2
    if devices == list(jax.devices()) and n == len(devices):
        return jax.make_mesh((data_parallel, tensor_parallel), MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(devices[:n]).reshape(data_parallel, tensor_parallel), MESH_AXES, axis_types=auto)


def sub_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tp) mesh per index of the data axis: the devices of each engine replica."""
    if DATA not in mesh.axis_names:
        return [mesh]
    d = mesh.axis_names.index(DATA)
    devs = np.moveaxis(mesh.devices, d, 0)
    names = (DATA,) + tuple(a for a in mesh.axis_names if a != DATA)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return [Mesh(devs[i:i + 1], names, axis_types=tuple(types[a] for a in names)) for i in range(devs.shape[0])]


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None or name not in mesh.axis_names else int(mesh.shape[name])


def spec_from_logical(axes: tuple, shape: tuple, mesh: Mesh, rules=LOGICAL_RULES) -> PartitionSpec:
    """Logical axis names (one per array axis, None = unnamed) -> PartitionSpec over `mesh`.
    A mesh axis is used at most once per array, and a dimension the mesh axes do not divide
    stays replicated (e.g. a vocab of 401 over 2 shards: tp_layout pads where it matters)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape):
        target = table.get(name) if name is not None else None
        names = tuple(a for a in ((target,) if isinstance(target, str) else (target or ()))
                      if a in mesh.axis_names and a not in used)
        size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        if not names or size == 1 or dim % size:
            out.append(None)
            continue
        used.update(names)
        out.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*out)


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def is_qarray(x) -> bool:
    """An 8-bit weight (`mmjax.quant.QArray`): one leaf for the axis tables."""
    from mmjax.quant import QArray
    return isinstance(x, QArray)


def qarray_axes(ax: tuple, x: Any) -> Any:
    """Logical axes of a weight -> those of its QArray (values q split like the float weight;
    scales [groups, ...out] split like q on every axis they span, i.e. along the output axis,
    and along a sharded input axis only for group scales); a float weight's axes unchanged."""
    if not is_qarray(x):
        return ax
    scale = tuple(a if n > 1 else None for a, n in zip(ax, x.scale.shape))
    return type(x)(ax, scale, x.dtype)


def check_quantized_tp(tp: int, group_scales: Any) -> None:
    """Refuse int8 group scales (`quantize_group_size`) under tensor parallelism: a row-parallel
    layer's groups would split over shards and qmatmul's per-group dots slice the sharded input
    axis (gathers); per-channel scales shard cleanly."""
    if tp > 1 and group_scales:
        from mmjax.errors import InvalidRequestError
        raise InvalidRequestError("quantize_group_size is not supported with tensor parallelism: use per-channel "
                                  "scales (no group size) or tensor_parallel=1", param="quantize_group_size")


@dataclass(frozen=True)
class Placement:
    """Where one runner's arrays live. `mesh` None: the default device, no annotations."""
    mesh: Mesh | None = None
    rules: tuple = LOGICAL_RULES
    vision_tp: bool = False       # tensor-parallel vision tower instead of data parallel

    @property
    def tp(self) -> int:
        """Size of the model (tensor-parallel) axis."""
        return axis_size(self.mesh, MODEL)

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.devices.size)

    # ---- kinds without logical axes (decode state, sampled outputs): replicated ----------------
    def sharding(self, kind: str) -> NamedSharding | None:
        """The sharding of one kind of replicated state ("state", "outputs"); None on one
        device (JAX's default placement)."""
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec_for(kind))

    def spec_for(self, kind: str) -> PartitionSpec:
        return PartitionSpec()  # decode state and step outputs are small: every device has them

    def place(self, tree: Any, kind: str) -> Any:
        """Put a pytree (numpy or jax arrays) on its devices, replicated."""
        s = self.sharding(kind)
        return jax.device_put(tree) if s is None else jax.device_put(tree, s)

    @property
    def all_rules(self) -> tuple:
        """The rules this placement applies (vision ones first when the ViT is tensor parallel)."""
        return (self.rules + VISION_TP_RULES) if self.vision_tp else self.rules    # (later rules win)

    def sharding_of(self, value: Any, axes: tuple) -> Any:
        """NamedShardings for one weight (an array, or a QArray's values and scales) from its
        logical axes (`qarray_axes`); None without a mesh."""
        if self.mesh is None:
            return None
        return jax.tree.map(lambda x, ax: NamedSharding(self.mesh, spec_from_logical(ax, np.shape(x), self.mesh,
                                                                                      self.all_rules)),
                            value, qarray_axes(axes, value))

    def put(self, value: Any, axes: tuple) -> Any:
        """One weight on its devices, sharded by its logical axes (the default device without a mesh)."""
        s = self.sharding_of(value, axes)
        return jax.device_put(value) if s is None else jax.device_put(value, s)

    def cache_shardings(self, cache: Any) -> Any:
        """Shardings for a KV cache whose leaves sit under "k" / "v" keys (CACHE_AXES)."""
        if self.mesh is None:
            return None

        def one(path, x):
            names = [_key_name(k) for k in path]
            ax = next((CACHE_AXES[n] for n in reversed(names) if n in CACHE_AXES), (None,) * np.ndim(x))
            return NamedSharding(self.mesh, spec_from_logical(ax, np.shape(x), self.mesh, self.rules))
        return jax.tree_util.tree_map_with_path(one, cache)

    def encode_input_sharding(self, shape: tuple) -> NamedSharding | None:
        """An encode call's batched input [images, ...] split over the replica's devices when
        they divide the batch (data-parallel vision tower); None: leave it to JAX."""
        if self.mesh is None or self.num_devices == 1 or self.vision_tp:
            return None
        spec = spec_from_logical(("images",) + (None,) * (len(shape) - 1), shape, self.mesh, self.rules)
        return NamedSharding(self.mesh, spec)

    # ---- reporting -------------------------------------------------------------------------
    def describe(self) -> dict:
        if self.mesh is None:
            return {"devices": 1, "axes": {}, "platform": jax.devices()[0].platform}
        return {"devices": self.num_devices, "axes": {k: int(v) for k, v in self.mesh.shape.items()},
                "platform": self.mesh.devices.flat[0].platform}


def host_memory_kind(device) -> str | None:
    """The host memory a device can address for offloaded weights: "pinned_host" (DMA without a
    staging copy) where the backend has it, else "unpinned_host"; None if neither."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of `tree`'s arrays held by each device (from addressable shards), keyed by device."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "addressable_shards"):
            continue
        for s in x.addressable_shards:
            out[str(s.device)] = out.get(str(s.device), 0) + s.data.nbytes
    return out


def step_shardings(*shardings):
    """out_shardings for a step returning one pytree per argument (None everywhere: no mesh)."""
    if all(s is None for s in shardings):
        return None
    return tuple(shardings)
