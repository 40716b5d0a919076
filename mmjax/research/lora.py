"""Train a LoRA adapter on mmjax's own modules with Flax NNX (`nnx.LoRA`), save it in PEFT's format.

`add_lora(decoder, rank, alpha, targets)` wraps each targeted linear layer of a decoder (the q / k /
v / o and gate / up / down projections of its layers) in `LoRALinear`: the layer as it was plus one
`nnx.LoRA` per HF module it stands for (a fused q|k|v has three), scaled by alpha / rank as PEFT
scales. Their weights are `nnx.LoRAParam`s, so `nnx.split(decoder, nnx.LoRAParam, ...)` separates
what trains from the frozen base. `save_peft(decoder, out, ...)` writes `adapter_config.json` +
`adapter_model.safetensors` as PEFT does (lora_A [r, in], lora_B [out, r] under the HF module
names), which `mmjax.load(..., max_loras=N)` serves (mmjax.lora) and peft loads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.nn.linear import Linear
from mmjax.models.nn.lora import TARGETS, adapted_layers


class LoRALinear(nnx.Module):
    """`base` (a Linear or FusedLinear) + an `nnx.LoRA` per output part, scaled by alpha / rank."""

    def __init__(self, base: Linear, names: list[str], rank: int, alpha: float, *, rngs: nnx.Rngs):
        self.base, self.names, self.rank, self.alpha = base, tuple(names), rank, alpha
        parts = getattr(base, "parts", None)
        self.widths = tuple(p.width for p in parts) if parts else (base.d_out,)
        self.adapters = nnx.List([nnx.LoRA(base.d_in, rank, w, rngs=rngs) for w in self.widths])

    def __call__(self, x, out_dtype=None):
        y = Linear.__call__(self.base, x, out_dtype)           # the whole (fused) output
        delta = jnp.concatenate([a(x) for a in self.adapters], axis=-1) * (self.alpha / self.rank)
        y = y + delta.astype(y.dtype)
        if getattr(self.base, "parts", None) is None:
            return y
        return tuple(jnp.split(y, np.cumsum(self.widths)[:-1].tolist(), axis=-1))


def add_lora(decoder: nnx.Module, rank: int, alpha: float, targets=TARGETS, *, seed: int = 0) -> list[str]:
    """Wrap every linear of `decoder` with a part named in `targets` in a LoRALinear (in place)
    -> the HF module names that now carry an adapter."""
    rngs = nnx.Rngs(seed)
    layers = {}
    for name, (m, _) in adapted_layers(decoder).items():
        if name.rsplit(".", 1)[-1] in targets:
            layers.setdefault(id(m), m)
    names = []
    for path, m in list(nnx.iter_modules(decoder)):
        if id(m) not in layers:
            continue
        parent = decoder
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        from mmjax.models.nn.lora import hf_names
        hf = hf_names(path, m)
        setattr(parent, path[-1], LoRALinear(m, hf, rank, alpha, rngs=rngs))
        names += hf
    return names


def save_peft(decoder: nnx.Module, out: str | os.PathLike, base_model: str | os.PathLike | None = None,
              prefix: str = "model.language_model.") -> Path:
    """The decoder's LoRALinear adapters as a PEFT LoRA adapter directory. prefix: where the decoder
    sits in the HF model (transformers' *ForConditionalGeneration: model.language_model.)."""
    from safetensors.numpy import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, targets, rank, alpha = {}, set(), None, None
    for _, m in nnx.iter_modules(decoder):
        if not isinstance(m, LoRALinear):
            continue
        rank, alpha = m.rank, m.alpha
        for name, a in zip(m.names, m.adapters):
            key = f"base_model.model.{prefix}{name}"
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a.lora_a[...], np.float32).T)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(np.asarray(a.lora_b[...], np.float32).T)
            targets.add(name.rsplit(".", 1)[-1])
    if not tensors:
        raise ValueError("the decoder has no LoRALinear adapters (add_lora)")
    save_file(tensors, str(out / "adapter_model.safetensors"))
    lm = prefix.rstrip(".").rsplit(".", 1)[-1]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": rf".*{lm}.*\.({'|'.join(sorted(targets))})", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
              "base_model_name_or_path": None if base_model is None else str(base_model), "task_type": None,
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
