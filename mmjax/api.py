"""Offline API: `vlm = mmjax.load(path)`, then `vlm.generate`, `vlm.chat`, `vlm.encode`, `vlm.logits`."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np

from mmjax import hub
from mmjax.checkpoint import cast_params
from mmjax.errors import InvalidRequestError, PromptError, UnsupportedModelError
from mmjax.sampling import SamplingParams
from mmjax.tokenizer import Tokenizer
from mmjax.vision_io import ImageLimits, load_image

log = logging.getLogger("mmjax")

DTYPES = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}


def enable_compilation_cache(directory: str | None = None) -> None:
    """JAX's persistent compilation cache, on by default so a restart does not recompile
    (MMJAX_COMPILATION_CACHE=0 turns it off, MMJAX_COMPILATION_CACHE_DIR moves it)."""
    if os.environ.get("MMJAX_COMPILATION_CACHE", "1") == "0":
        return
    directory = directory or os.environ.get("MMJAX_COMPILATION_CACHE_DIR") or str(
        Path.home() / ".cache" / "mmjax" / "jax")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _family_for(model_type: str):
    if model_type == "llava":
        from mmjax.models import llava
        return llava
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from mmjax.models import qwen2_vl
        return qwen2_vl
    raise UnsupportedModelError(f"config.json: model_type={model_type!r} is not supported "
                                "(supported: llava, qwen2_vl, qwen2_5_vl)", param="model_type")


@dataclass
class LoadedModel:
    """Everything host code needs about one checkpoint."""
    path: Path
    family: Any
    params: dict
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    hf_config: dict = field(repr=False, default_factory=dict)


def load_model(model: str | os.PathLike, dtype: str = "float32", params_dir: str | os.PathLike | None = None
               ) -> LoadedModel:
    """Resolve, parse and convert a checkpoint. `params_dir`: orbax params written by
    `save_params` / `mmjax convert`, restored instead of converting the safetensors again."""
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}", param="dtype")
    path = hub.resolve(model)
    hf_cfg = json.loads((path / "config.json").read_text())
    fam_mod = _family_for(hf_cfg.get("model_type"))
    family, np_params = fam_mod.load(path, hf_cfg)
    params = cast_params(np_params, DTYPES[dtype])
    if params_dir is not None:
        from mmjax.checkpoint import restore_params
        params = restore_params(params_dir, like=params)
    tokenizer = Tokenizer(path, image_token=fam_mod.image_token(path, hf_cfg))
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", hf_cfg.get("eos_token_id", hf_cfg.get("text_config", {}).get("eos_token_id")))
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_id is not None and not eos_ids:
        eos_ids.add(tokenizer.eos_id)
    return LoadedModel(path, family, params, tokenizer, frozenset(int(e) for e in eos_ids), hf_cfg)


class VLM:
    """A loaded model plus a lazily created engine; all generation runs on that engine."""

    def __init__(self, model: LoadedModel, *, image_limits: ImageLimits = ImageLimits(), **engine_kw):
        self.model = model
        self.tokenizer = model.tokenizer
        self.family = model.family
        self.params = model.params
        self.image_limits = image_limits
        self._engine_kw = engine_kw
        self._engine = None
        self._logits = None

    @property
    def engine(self):
        if self._engine is None:
            from mmjax.engine import Engine
            self._engine = Engine(self.model, **self._engine_kw)
        return self._engine

    def save_params(self, directory: str | os.PathLike) -> Path:
        """Write the converted params with orbax; reload with `mmjax.load(path, params_dir=...)`."""
        from mmjax.checkpoint import save_params
        return save_params(self.params, directory)

    # ---- images ------------------------------------------------------------------------------
    def prepare_images(self, images: Iterable[Any], **opts):
        """PIL images / bytes / paths / data URIs -> engine ImageInputs (decode, validate, resize)."""
        return [self.family.prepare_image(load_image(im, self.image_limits), **opts) for im in images]

    def encode(self, images: Iterable[Any]) -> list[np.ndarray]:
        """Images -> list of image token embeddings, each np.ndarray [n_image_tokens, lm_hidden]."""
        inputs = self.prepare_images(images)
        return self.family.encode_batch(self.engine.runner, inputs)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, requests, sampling: SamplingParams | None = None) -> list:
        """requests: a prompt string, or a list of {"prompt": str, "images": [...]} (one image
        placeholder in the prompt per image; optional "image_options" such as min_pixels /
        max_pixels / image_max_tokens for dynamic-resolution families, and "sampling").
        Returns RequestOutputs in order."""
        if isinstance(requests, (str, dict)):
            requests = [requests]
        sampling = sampling or SamplingParams()
        ids = []
        for r in requests:
            r = {"prompt": r} if isinstance(r, str) else r
            images = self.prepare_images(r.get("images", ()), **r.get("image_options", {}))
            ids.append(self.engine.add_request(r["prompt"], images, r.get("sampling", sampling)))
        return self.engine.run_until_done(ids)

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **template_kw):
        """OpenAI-style messages; image parts as {"type": "image", "image": PIL/bytes/path} or
        {"type": "image_url", "image_url": {"url": data URI or path}}."""
        prompt, images = self.render_chat(messages, **template_kw)
        return self.generate([{"prompt": prompt, "images": images}], sampling)[0]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kw):
        """messages -> (prompt text with one placeholder per image, image sources in order)."""
        images: list[Any] = []
        norm = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise PromptError(f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part.get("type")
                    if kind == "text":
                        parts.append({"type": "text", "text": part.get("text", "")})
                    elif kind in ("image", "image_url"):
                        src = part.get("image") if kind == "image" else part.get("image_url")
                        if isinstance(src, dict):
                            src = src.get("url")
                        if src is None:
                            raise PromptError(f"messages[{i}].content[{j}] has no image", param=f"messages[{i}].content[{j}]")
                        images.append(src)
                        parts.append({"type": "image"})
                    else:
                        raise PromptError(f"messages[{i}].content[{j}].type={kind!r} is not supported",
                                          param=f"messages[{i}].content[{j}].type")
                norm.append({**m, "content": parts})
            else:
                norm.append({**m, "content": content or ""})
        return self.tokenizer.render_chat(norm, add_generation_prompt, **template_kw), images

    def logits(self, prompt: str, images: Iterable[Any] = ()) -> np.ndarray:
        """Logits [prompt_tokens, vocab] (float32) over a whole prompt (research / parity)."""
        from mmjax.runner import prompt_logits_fn

        inputs = self.prepare_images(images)
        ids = np.asarray(self.tokenizer.encode_prompt(prompt, [im.num_tokens for im in inputs]), np.int32)
        eng = self.engine
        starts = eng.image_starts(ids, [im.num_tokens for im in inputs])
        positions, _ = self.family.positions(ids, inputs, starts)
        emb = np.zeros((len(ids), self.family.text.hidden_size), np.float32)
        if inputs:
            feats = self.family.encode_batch(eng.runner, inputs)
            for f, s in zip(feats, starts):
                emb[s:s + len(f)] = f
        if self._logits is None:
            r = eng.runner
            self._logits = jax.jit(prompt_logits_fn(r.text_cfg, r.inv_freq, r.mrope))
        dtype = self.params["text"]["embed"].dtype
        out = self._logits(self.params, ids, emb.astype(dtype), ids == self.family.image_token_id, positions)
        return np.asarray(out)


def load(model: str | os.PathLike, dtype: str = "float32", *, image_limits: ImageLimits = ImageLimits(),
         params_dir: str | os.PathLike | None = None, **engine_kw) -> VLM:
    """Load a Hugging Face-layout VLM checkpoint (local dir or hub id) into a VLM.

    params_dir: converted params saved with `VLM.save_params` (orbax) for a fast reload.
    engine_kw: max_num_seqs, max_model_len, prefill_chunk, max_encode_batch, encoder_cache_bytes,
    max_images_per_request.
    """
    enable_compilation_cache()
    return VLM(load_model(model, dtype, params_dir), image_limits=image_limits, **engine_kw)
