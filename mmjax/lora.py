"""PEFT LoRA adapters: read from a directory (or hub id), kept in a fixed number of slots.

`read_adapter(path)` parses a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`:
r, lora_alpha, target_modules, rank_pattern / alpha_pattern, use_rslora, bias "none") into host
arrays per HF module name (A [in, r], B [r, out] with PEFT's scaling folded in); anything else
PEFT can save (DoRA, biases, modules_to_save, fan_in_fan_out, trainable tokens, ...) is refused
with a `LoRAError` naming the option. Adapted: the language model's attention and MLP projections
and every linear layer of the vision tower and projector (not the patch embedding, a conv in HF).

`Adapters` is one engine's set of loaded adapters: name -> slot of the stacked adapter weights of
the decoder and the encoder (models/nn/lora.py). Loading writes the slot's arrays (no recompile);
requests carry the slot index, and their prefix-cache keys a salt derived from the adapter
(`Adapters.salt`); an adapter with encoder tensors also keys its requests' image features in the
encoder cache (`Adapters.encoder_salt`), since they are not the base model's.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmjax.errors import LoRAError, LoRANotFoundError

# adapter_config.json options that change what the adapter computes, with the values mmjax serves
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "modules_to_save": None,
            "layer_replication": None, "target_parameters": None, "trainable_token_indices": None,
            "alora_invocation_tokens": None, "use_qalora": False, "megatron_config": None, "arrow_config": None}
_VISION = ("visual", "vision", "multi_modal_projector", "mm_projector", "connector", "embed_vision", "merger")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request uses (vLLM's offline API): its name and where to load it from (a PEFT
    directory or hub id) if the engine has not loaded it yet."""
    name: str
    path: str | os.PathLike | None = None


@dataclass
class Adapter:
    """One PEFT LoRA adapter on the host: rank (the largest of its modules) and per HF module name
    (as PEFT names it, without `base_model.model.`) A [in, r] and scaled B [r, out] (float32)."""
    name: str
    path: str
    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = field(repr=False)


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    text = str(path)
    if p.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise LoRAError(f"LoRA adapter {text!r} is neither a directory nor a hub id 'org/name'", param="lora_path")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=["adapter_config.json", "*.safetensors"]))
    except Exception as e:
        raise LoRAError(f"could not resolve LoRA adapter {text!r}: {type(e).__name__}: {e}",
                        param="lora_path") from e


def _pattern_value(pattern: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_adapter(path: str | os.PathLike, name: str | None = None) -> Adapter:
    """A PEFT LoRA adapter directory (or hub id) -> Adapter; a LoRAError says what is wrong."""
    d = _resolve(path)
    cfg_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise LoRAError(f"{d} has no adapter_config.json (not a PEFT adapter directory)", param="lora_path")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: not valid JSON ({e})", param="lora_path") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_file}: not a JSON object", param="lora_path")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{d}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)", param="lora_path")
    for key, ok in _REFUSED.items():
        value = cfg.get(key, ok)
        if value not in (ok, None, False, [], {}):
            raise LoRAError(f"{d}: adapter option {key}={value!r} is not supported", param="lora_path")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{d}: adapter option bias={cfg['bias']!r} is not supported (only 'none')", param="lora_path")
    if not weights.is_file():
        raise LoRAError(f"{d} has no adapter_model.safetensors", param="lora_path")
    try:
        r, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    except (KeyError, TypeError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: r and lora_alpha must be numbers ({type(e).__name__}: {e})",
                        param="lora_path") from e
    from safetensors import safe_open
    try:
        with safe_open(str(weights), "np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise LoRAError(f"{weights}: cannot read ({type(e).__name__}: {e})", param="lora_path") from e
    modules, rank = {}, 0
    for key in sorted(tensors):
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAError(f"{weights}: tensor {key!r} is not a LoRA A / B weight", param="lora_path")
        if m.group(2) == "B":
            continue
        mod = m.group(1)
        b_key = key.replace(".lora_A", ".lora_B")
        if b_key not in tensors:
            raise LoRAError(f"{weights}: {key!r} has no {b_key!r}", param="lora_path")
        a, b = np.asarray(tensors[key], np.float32), np.asarray(tensors[b_key], np.float32)
        if a.ndim != 2:
            raise LoRAError(f"{weights}: {mod}: lora_A {a.shape} adapts a convolution (a patch embedding?); "
                            "mmjax adapts linear layers only", param="lora_path")
        if b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{weights}: {mod}: lora_A {a.shape} and lora_B {b.shape} do not chain",
                            param="lora_path")
        mr = a.shape[0]
        ma = float(_pattern_value(cfg.get("alpha_pattern"), mod, alpha))
        scale = ma / math.sqrt(mr) if rslora else ma / mr
        modules[mod] = (a.T.copy(), (b.T * scale).astype(np.float32))
        rank = max(rank, mr)
    if not modules:
        raise LoRAError(f"{weights} holds no LoRA weights", param="lora_path")
    return Adapter(name or d.name, str(d), rank, modules)


def _align(want: list[str], have: list[str]) -> int | None:
    """How many components PEFT name `want` and module path `have` leave unmatched when aligned in
    order (equal components matched; any other skipped, on either side), or None where they do
    not align: a number (a layer index) skipped on either side, or `have`'s first component (the
    vision tower / projector attribute) or last (the layer's own name) unmatched."""
    n, m = len(want), len(have)
    neg = -1 << 20
    best = [[neg] * (m + 1) for _ in range(n + 1)]      # best[i][j]: matched pairs of want[:i], have[:j]
    best[0][0] = 0
    for i in range(n + 1):
        for j in range(m + 1):
            b = best[i][j]
            if b < 0:
                continue
            if i < n and not want[i].isdigit():
                best[i + 1][j] = max(best[i + 1][j], b)
            if j < m and j > 0 and j < m - 1 and not have[j].isdigit():
                best[i][j + 1] = max(best[i][j + 1], b)
            if i < n and j < m and want[i] == have[j]:
                best[i + 1][j + 1] = max(best[i + 1][j + 1], b + 1)
    matched = best[n][m]
    if matched < 0 or want[-1] != have[-1]:
        return None
    return n + m - 2 * matched


def _encoder_match(mod: str, index: dict[str, list[str]]) -> str | None:
    """The encoder layer name (`nn.lora.encoder_layers`, indexed by last component) PEFT module
    `mod` names: the one whose path aligns with `mod` leaving the fewest components unmatched
    (`_align`: `mod` may hold wrappers the module tree does not, `model.`, CLIP's `vision_model.`;
    the tree may hold a container HF does not, GLM's merger `mlp.`; layer indexes always match)
    -> that name, or None (none, or a tie)."""
    want = mod.split(".")
    scored = sorted((c, name) for name in index.get(want[-1], ())
                    if (c := _align(want, name.split("."))) is not None)
    if not scored or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]


def _unbuilt(mod: str, index: dict[str, list[str]]) -> bool:
    """Does PEFT module `mod` sit in a block past the last one the model builds (a tower cut after
    its deepest feature layer, `llava.vision_layers_needed`: that block never reaches the output,
    in transformers either)? True where the same module of block 0 exists and the block's index is
    past every built block's."""
    if _encoder_match(mod, index) is not None:
        return False
    want = mod.split(".")
    for j, w in enumerate(want):
        block = lambda n: ".".join([*want[:j], str(n), *want[j + 1:]])     # noqa: E731
        if not w.isdigit() or _encoder_match(block(0), index) is None:
            continue
        built = 0
        while _encoder_match(block(built), index) is not None:
            built += 1
        return int(w) >= built
    return False


class Adapters:
    """The adapters one engine serves: up to `slots` at once in the adapter slots of `model`'s
    decoder and encoder, rank up to `max_rank` (`Adapters.enable` gives the modules their slots)."""

    def __init__(self, model, slots: int, max_rank: int):
        from mmjax.models.nn.lora import adapted_layers, encoder_layers
        self.model, self.slots, self.max_rank = model, slots, max_rank
        self._layers = adapted_layers(model.language_model)
        self._encoder = encoder_layers(model)
        self._encoder_index: dict[str, list[str]] = {}
        for n in self._encoder:
            self._encoder_index.setdefault(n.rsplit(".", 1)[-1], []).append(n)
        self.loaded: dict[str, tuple[int, Adapter]] = {}
        self._loads = 0
        self._salts: dict[str, str] = {}
        self._touches_encoder: dict[str, bool] = {}

    @classmethod
    def enable(cls, model, slots: int, max_rank: int, mesh=None) -> "Adapters":
        """Give `model` (a family's top module, before the runner places it) its adapter slots:
        the decoder's projections and the encoder's linears -> its (empty) Adapters."""
        from mmjax.errors import UnsupportedModelError
        from mmjax.models.nn import lora
        from mmjax.sharding import MODEL, axis_size
        if mesh is not None and axis_size(mesh, MODEL) > 1:
            raise UnsupportedModelError("LoRA adapters are not supported with tensor parallelism", param="max_loras")
        lm = model.language_model
        dtype = lm.embed_tokens.embedding.get_value().dtype
        lora.enable(lm, slots, max_rank, dtype)
        lora.enable_encoder(model, slots, max_rank, dtype)
        return cls(model, slots, max_rank)

    def slot_of(self, name: str) -> int:
        if name not in self.loaded:
            raise LoRANotFoundError(f"the model {name!r} does not exist (served: the base model and adapters "
                                    f"{sorted(self.loaded) or 'none'})", param="model")
        return self.loaded[name][0]

    def salt(self, name: str) -> str:
        """The prefix-cache salt of requests using adapter `name`: its name and which load of it
        (an adapter unloaded and loaded again under the same name may hold other weights)."""
        self.slot_of(name)
        return self._salts[name]

    def encoder_salt(self, name: str | None) -> str:
        """The encoder-cache salt of requests using adapter `name`: its `salt` if the adapter has
        vision-tower or projector tensors (their image features are its own), else "" (the base
        model's features, shared with every request whose adapter leaves the encoder alone)."""
        if name is None:
            return ""
        self.slot_of(name)
        return self._salts[name] if self._touches_encoder[name] else ""

    def _place(self, adapter: Adapter) -> dict[int, tuple[object, dict]]:
        """The adapter's arrays per adapted layer: {id: (layer, {part: (A, B)})}; a LoRAError names a
        module mmjax does not adapt or a shape that does not fit."""
        out: dict[int, tuple[object, dict]] = {}
        for mod, (a, b) in adapter.modules.items():
            if _unbuilt(mod, self._encoder_index):
                continue
            layer, part = self._layer_of(adapter.name, mod)
            width = layer.lora.widths[part]
            if a.shape[0] != layer.d_in or b.shape[1] != width:
                raise LoRAError(f"adapter {adapter.name!r}: {mod} is [{a.shape[0]} -> {b.shape[1]}], the model's "
                                f"[{layer.d_in} -> {width}] (an adapter of another base model?)", param="lora_path")
            out.setdefault(id(layer), (layer, {}))[1][part] = (a, b)
        return out

    def _layer_of(self, adapter: str, mod: str) -> tuple[object, int]:
        """(linear layer, part index) PEFT module `mod` names: a decoder projection, or a linear of
        the vision tower / projector; a LoRAError for anything else."""
        name = _encoder_match(mod, self._encoder_index)
        if name is not None:
            return self._encoder[name]
        i = mod.find("layers.")
        prefix, rel = (mod[:i], mod[i:]) if i >= 0 else (mod, "")
        lm = "language_model" in prefix or "text_model" in prefix or prefix in ("", "model.")
        if lm and rel in self._layers and not any(v in prefix for v in _VISION):
            return self._layers[rel]
        raise LoRAError(f"adapter {adapter!r} targets {mod!r}: mmjax adapts the language model's attention and "
                            "MLP projections (q/k/v/o_proj, gate/up/down_proj) and the linear layers of the vision "
                            "tower and projector (not the patch embedding)", param="lora_path")

    def load(self, name: str, adapter: Adapter, busy: set[int] = frozenset()) -> int:
        """Write `adapter` into a free slot (not in `busy`: slots live requests still use) under
        `name` -> the slot. The caller re-places the decoder's weights afterwards."""
        if name in self.loaded:
            raise LoRAError(f"an adapter named {name!r} is already loaded", param="lora_name")
        if adapter.rank > self.max_rank:
            raise LoRAError(f"adapter {name!r} has rank {adapter.rank}, over --max-lora-rank {self.max_rank}",
                            param="lora_path", code="lora_rank_too_large")
        placed = self._place(adapter)
        used = {s for s, _ in self.loaded.values()} | set(busy)
        free = [s for s in range(self.slots) if s not in used]
        if not free:
            raise LoRAError(f"all {self.slots} adapter slots (--max-loras) are in use; unload one first",
                            param="lora_name", code="lora_slots_full")
        slot = free[0]
        layers = {id(m): m for m, _ in (*self._layers.values(), *self._encoder.values())}
        for key, layer in layers.items():
            layer.lora.write(slot, placed.get(key, (None, {}))[1])
        self.loaded[name] = (slot, adapter)
        self._loads += 1
        self._salts[name] = f"lora:{name}#{self._loads}"
        encoder = {id(m) for m, _ in self._encoder.values()}
        self._touches_encoder[name] = any(key in encoder for key in placed)
        return slot

    def unload(self, name: str) -> int:
        """Forget adapter `name` -> its slot (free again once no request uses it)."""
        slot = self.slot_of(name)
        del self.loaded[name]
        return slot
