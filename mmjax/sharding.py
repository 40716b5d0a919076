"""The placement seam: where params, KV cache and decode state live, and the shardings every
compiled step takes from there.

`Placement(mesh=None)` is one device (JAX's default device, no sharding annotations: the
compiled steps are exactly the single-device ones). With a `jax.sharding.Mesh` over the axes
("data", "model"), arrays are placed with `NamedSharding`s derived from one table of rules
(`LOGICAL_RULES`, MaxText's logical axis rules): every parameter and cache axis has a logical
name (heads, kv_heads, mlp, vocab, embed, ...) and the table maps names to mesh axes. Logical
names come from the parameter's path (`PARAM_AXES`, by the last path components: a new family
whose decoder uses the same names inherits them) or from a text model's own
`logical_axes(params)` hook.

Tensor parallelism (Megatron style, run by XLA's SPMD partitioner): a text model that supports
it provides `tensor_parallel(tp)` (a copy of itself for `tp` shards: e.g. the KV heads its cache
holds) and `tp_layout(params, tp)` (host-side re-layout of fused weights into per-shard blocks so
no weight is gathered; see models/text/llama.py). Both run once at placement time; with tp == 1
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

# Logical axes of parameters by their trailing path components (most specific first). A path
# that matches nothing is replicated.
PARAM_AXES: tuple[tuple[tuple[str, ...], tuple], ...] = (
    (("text", "embed"), ("vocab", "embed")),
    (("text", "lm_head"), ("embed", "vocab")),
    (("qkv", "w"), ("embed", "heads", None)),        # [hidden, tp, q|k|v per shard] after tp_layout
    (("qkv", "b"), ("heads", None)),
    (("o", "w"), ("heads", "embed")),                # [heads * head_dim, hidden]: row parallel
    (("gate_up", "w"), ("embed", "mlp", None)),      # [hidden, tp, gate|up per shard]
    (("gate_up", "b"), ("mlp", None)),
    (("down", "w"), ("mlp", "embed")),               # row parallel
)

# The tensor-parallel ViT option (`vision_tensor_parallel=True`, for towers too big to
# replicate): the same Megatron split of the vision blocks and projector by name. Fused vision
# weights (Qwen's qkv, gate_up) are split by columns as they are, not regrouped per shard:
# memory is 1/TP, and XLA moves the activations their split needs.
VISION_PARAM_AXES: tuple[tuple[tuple[str, ...], tuple], ...] = (
    (("q", "w"), ("embed", "heads")), (("k", "w"), ("embed", "heads")), (("v", "w"), ("embed", "heads")),
    (("q", "b"), ("heads",)), (("k", "b"), ("heads",)), (("v", "b"), ("heads",)),
    (("qkv", "w"), ("embed", "heads")), (("qkv", "b"), ("heads",)),
    (("o", "w"), ("heads", "embed")), (("proj", "w"), ("heads", "embed")),
    (("fc1", "w"), ("embed", "mlp")), (("fc1", "b"), ("mlp",)), (("fc2", "w"), ("mlp", "embed")),
    (("gate_up", "w"), ("embed", "mlp")), (("gate_up", "b"), ("mlp",)), (("down", "w"), ("mlp", "embed")),
)

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


def key_names(path) -> tuple[str, ...]:
    """A pytree path as plain strings (dict keys, list indexes)."""
    return tuple(_key_name(k) for k in path)


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


def param_logical_axes(params: Any, vision_tp: bool = False) -> Any:
    """The pytree of logical-axis tuples for `params` (the PARAM_AXES table by path, for the
    decoder under "text"; everything else, e.g. the vision tower and projector, is replicated
    unless `vision_tp` (VISION_PARAM_AXES); unmatched leaves get all-None axes: replicated).
    An 8-bit weight (QArray) gets a QArray of axes (`qarray_axes`)."""
    def axes(path, x):
        names = key_names(path)
        table = PARAM_AXES if names[:1] == ("text",) else VISION_PARAM_AXES if vision_tp else ()
        for suffix, ax in table:
            if names[-len(suffix):] == suffix and len(ax) == np.ndim(x):
                return qarray_axes(ax, x)
        return qarray_axes((None,) * np.ndim(x), x)
    return jax.tree_util.tree_map_with_path(axes, params, is_leaf=is_qarray)


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

    # ---- model -----------------------------------------------------------------------------
    def text_model(self, tm):
        """The text model as this placement runs it (`tm.tensor_parallel(tp)` when tp > 1)."""
        if self.tp == 1:
            return tm
        if not hasattr(tm, "tensor_parallel"):
            raise ValueError(f"{type(tm).__name__} does not support tensor parallelism (no tensor_parallel hook)")
        return tm.tensor_parallel(self.tp)

    def layout_params(self, params: dict, tm) -> dict:
        """Host-side re-layout of the text params for tp shards (fused weights in per-shard
        blocks, vocab padded to a multiple of tp); identity at tp == 1."""
        if self.tp == 1:
            return params
        from mmjax.packed_weights import with_packing
        params = with_packing(params, False)    # (a CPU host's packed weights: the re-layout is by columns)
        groups = [x.scale.shape[0] for x in jax.tree.leaves(params, is_leaf=is_qarray) if is_qarray(x) and x.ndim == 2]
        check_quantized_tp(self.tp, any(g > 1 for g in groups))
        return {**params, "text": tm.tp_layout(params["text"], self.tp)}

    def logical_axes(self, params: dict, tm=None) -> Any:
        axes = param_logical_axes(params, self.vision_tp)
        if tm is not None and hasattr(tm, "logical_axes") and "text" in params:
            axes = {**axes, "text": tm.logical_axes(params["text"])}
        return axes

    @property
    def all_rules(self) -> tuple:
        """The rules this placement applies (vision ones first when the ViT is tensor parallel)."""
        return (VISION_TP_RULES + self.rules) if self.vision_tp else self.rules

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

    def shardings_for(self, tree: Any, axes: Any) -> Any:
        """NamedShardings for `tree` from its logical-axes tree (None without a mesh)."""
        if self.mesh is None:
            return None
        return jax.tree.map(lambda x, ax: NamedSharding(self.mesh, spec_from_logical(ax, np.shape(x), self.mesh,
                                                                                      self.rules)),
                            tree, axes)

    def param_shardings(self, params: dict, tm=None) -> Any:
        return self.shardings_for(params, self.logical_axes(params, tm))

    def cache_shardings(self, cache: Any) -> Any:
        """Shardings for a KV cache whose leaves sit under "k" / "v" keys (CACHE_AXES)."""
        if self.mesh is None:
            return None

        def one(path, x):
            names = [_key_name(k) for k in path]
            ax = next((CACHE_AXES[n] for n in reversed(names) if n in CACHE_AXES), (None,) * np.ndim(x))
            return NamedSharding(self.mesh, spec_from_logical(ax, np.shape(x), self.mesh, self.rules))
        return jax.tree_util.tree_map_with_path(one, cache)

    def place_params(self, params: dict, tm=None) -> dict:
        s = self.param_shardings(params, tm)
        return jax.device_put(params) if s is None else jax.device_put(params, s)

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


def offload_to_host(params: dict) -> tuple[dict, dict]:
    """Every top-level entry of the placed `params` except "text" (the vision tower and the
    projector) moved to host memory, same shardings -> (params, the device shardings to fetch
    them back to inside a step). The decoder stays on the device."""
    device = jax.tree.leaves(params["text"])[0].sharding._device_assignment[0]
    kind = host_memory_kind(device)
    if kind is None:
        from mmjax.errors import UnsupportedModelError
        raise UnsupportedModelError(f"vision offload: {device.platform} devices have no host memory kind",
                                    param="vision_offload")
    rest = {k: v for k, v in params.items() if k != "text"}
    device_shardings = jax.tree.map(lambda x: x.sharding, rest)
    host = jax.device_put(rest, jax.tree.map(lambda s: s.with_memory_kind(kind), device_shardings))
    return {**params, **host}, device_shardings


def fetch_to_device(params: dict, device_shardings: dict) -> dict:
    """Inside a step: the offloaded entries brought back to device memory (one transfer per
    call; device memory holds them only while the step runs)."""
    fetched = {k: jax.device_put(params[k], device_shardings[k]) for k in device_shardings}
    return {**params, **fetched}


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
