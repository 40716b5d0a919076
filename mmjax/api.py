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
from mmjax.errors import InvalidRequestError, PromptError
from mmjax.image.decode import ImageLimits, load_image
from mmjax.models import build_family, load_family
from mmjax.models.family import Family, ImageInput, ImageOptions, VideoOptions, VisionLanguageModel
from mmjax.models.nn.capture import Capture
from mmjax.serving.sampling import SamplingParams
from mmjax.tokenizer import Tokenizer

log = logging.getLogger("mmjax")

DTYPES = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}
# the keys of an offline request dict (`VLM.generate`); any other is an InvalidRequestError
REQUEST_KEYS = ("prompt", "images", "videos", "image_options", "video_options", "intervention", "sampling", "lora")
SHIPPED_MODEL = "mmjax-shapes"   # the trained default model shipped in the package (mmjax/demo)


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


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(local directory, model name). None or "mmjax-shapes" is the shipped model; a local
    directory is named by its base name, a hub id by the id (vLLM's convention)."""
    from mmjax.demo import default_model_path

    shipped = default_model_path()
    if model is None or str(model) == SHIPPED_MODEL:
        if shipped is None:
            raise InvalidRequestError(f"the shipped model {SHIPPED_MODEL!r} is not installed with this package",
                                      param="model")
        return shipped, SHIPPED_MODEL
    path = hub.resolve(model)
    if shipped is not None and path.resolve() == shipped.resolve():
        return path, SHIPPED_MODEL
    p = Path(str(model)).expanduser()
    return path, (p.resolve().name if p.is_dir() else str(model)) or "mmjax"


@dataclass
class LoadedModel:
    """One loaded checkpoint: its module (`module`, what `vlm.model` is) and everything host code
    needs about it."""
    path: Path
    name: str
    family: Family
    module: VisionLanguageModel
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    dtype: Any = jax.numpy.float32
    hf_config: dict = field(repr=False, default_factory=dict)
    quantize: str | None = None               # None | "int8" | "fp8" (mmjax.quant)
    quantize_group_size: int | None = None


def load_model(model: str | os.PathLike | None = None, dtype: str = "float32",
               params_dir: str | os.PathLike | None = None, on_device: bool = True,
               quantize: str | None = None, quantize_group_size: int | None = None) -> LoadedModel:
    """Resolve, parse and convert a checkpoint. `params_dir`: orbax params written by
    `save_params` / `mmjax convert`, restored instead of converting the safetensors again (a
    quantized copy restores quantized: its quantization is recorded next to it).
    on_device=False keeps the params as host numpy arrays (for placement over a mesh).
    quantize: None, "int8" or "fp8": the linear layers' weights as 8-bit `mmjax.quant.QArray`s,
    applied after loading (`mmjax.quant`); quantize_group_size: int8 scales per group of that many
    input rows instead of per output channel."""
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}", param="dtype")
    if params_dir is not None:
        from mmjax.quant import read_quantization
        saved = read_quantization(params_dir)
        if saved is not None:
            if quantize not in (None, saved["quantize"]):
                raise InvalidRequestError(f"{params_dir} holds {saved['quantize']} weights, not {quantize}",
                                          param="quantize")
            quantize, quantize_group_size = saved["quantize"], saved.get("group_size")
        elif quantize is not None:   # orbax cannot restore float arrays into 8-bit ones
            raise InvalidRequestError(f"{params_dir} holds unquantized weights: load it without quantize={quantize!r}, "
                                      f"or save a quantized copy (mmjax convert --quantize {quantize})",
                                      param="quantize")
    path, name = resolve_model(model)
    hf_cfg = json.loads((path / "config.json").read_text())
    # weights on a CPU host are packed for mmjax's matmul kernels once, as each is placed (f32 /
    # bf16 ones as themselves, int8 ones as each is quantized), so the model and its runner share
    # one copy (a runner for another platform or a mesh unpacks its own)
    from mmjax import packed_weights
    packed = on_device and packed_weights.cpu_packs()
    if params_dir is None:
        family, module = load_family(path, hf_cfg, DTYPES[dtype], pack=packed, quantize=quantize,
                                     group_size=quantize_group_size, on_device=on_device)
    else:
        from mmjax.checkpoint import restore_module
        family, module, _ = build_family(path, hf_cfg, DTYPES[dtype])
        restore_module(module, params_dir, quantize, quantize_group_size)
    tokenizer = Tokenizer(path, image_token=family.image_token, video_token=family.video_token)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", hf_cfg.get("eos_token_id", hf_cfg.get("text_config", {}).get("eos_token_id")))
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_id is not None and not eos_ids:
        eos_ids.add(tokenizer.eos_id)
    return LoadedModel(path, name, family, module, tokenizer, frozenset(int(e) for e in eos_ids), DTYPES[dtype],
                       hf_cfg, quantize, quantize_group_size)


class VLM:
    """A loaded model plus a lazily created engine; all generation runs on that engine.

    `vlm.model` is the live Flax NNX module tree (`model.language_model.layers[3].mlp`, ...):
    edit its weights (`nnx.update`, assignment) or replace a submodule, then call `vlm.refresh()`
    and the offline API, the engine and a server on it use the edited model."""

    def __init__(self, loaded: LoadedModel, *, image_limits: ImageLimits = ImageLimits(), engine=None,
                 video_limits=None, **engine_kw):
        from mmjax.video import VideoCache, VideoLimits

        self.loaded = loaded
        self.video_limits = video_limits or VideoLimits()
        self.video_cache = VideoCache()
        self.tokenizer = loaded.tokenizer
        self.family = loaded.family
        self.image_limits = image_limits
        self._engine_kw = engine_kw
        self._engine = engine
        self._forward: dict = {}

    @classmethod
    def from_engine(cls, engine) -> "VLM":
        """A VLM over an existing Engine (its model)."""
        return cls(engine.model, engine=engine)

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def model(self) -> VisionLanguageModel:
        """The live module tree (see the class docstring). On a CPU host its linear layers'
        kernels hold the engine's packed layout (`mmjax.packed_weights.PackedWeight`: `.shape` /
        `.dtype` the logical weight's, `.unpack()` the [in, out] array); assign a plain [in, out]
        array to edit one."""
        return self.loaded.module

    def refresh(self) -> set[str]:
        """Serve the edited `vlm.model`: re-split and re-place what changed (recompiling only the
        steps of a part whose module graph changed), drop what the old weights produced (encoder
        cache when the vision side changed, prefix cache when anything did) -> the parts that
        changed ("language_model", "vision")."""
        changed = self.engine.refresh()
        if changed:
            self._forward.clear()
            self.__dict__.pop("_research_fns", None)
        return changed

    @property
    def engine(self):
        if self._engine is None:
            from mmjax.serving.data_parallel import make_engine
            self._engine = make_engine(self.loaded, **self._engine_kw)   # DP replicas when the mesh asks
        return self._engine

    def save_params(self, directory: str | os.PathLike) -> Path:
        """Write the module's weights with orbax; reload with `mmjax.load(path, params_dir=...)`."""
        from mmjax.checkpoint import save_module
        from mmjax.quant import write_quantization
        out = save_module(self.model, directory)          # the portable [in, out] layout
        write_quantization(out, self.loaded.quantize, self.loaded.quantize_group_size)
        return out

    # ---- images ------------------------------------------------------------------------------
    def prepare_images(self, images: Iterable[Any], options: dict | ImageOptions | None = None,
                       intervention=None) -> list[ImageInput]:
        """PIL images / bytes / paths / data URIs -> ImageInputs (decode, validate, resize); an
        {"image_embeds": np.ndarray [tokens, lm hidden], "image_grid_thw": (t, h, w) (M-RoPE
        families)} item is a precomputed image (the vision tower is skipped).
        options: {"min_pixels", "max_pixels", "image_max_tokens"} (dynamic-resolution families),
        {"max_tiles"} (tiling families: 0 = overview only).
        intervention: a `mmjax.research` intervention (Ablate, Pool) applied to every image."""
        from mmjax.image.embeds import image_from_embeds

        opts = options if isinstance(options, ImageOptions) else ImageOptions.from_dict(options)
        images = list(images)
        opts = self.family.prompt_options(opts, len(images))
        out = [im if isinstance(im, ImageInput) else
               image_from_embeds(self.family, self.model.language_model, im["image_embeds"], im.get("image_grid_thw"))
               if isinstance(im, dict) and "image_embeds" in im else
               self._prepare_image(im, opts) for im in images]
        if intervention is not None:
            from mmjax.research.interventions import Intervention
            if not isinstance(intervention, Intervention):
                raise InvalidRequestError(f"intervention must be a mmjax.research intervention, got "
                                          f"{type(intervention).__name__}", param="intervention")
            out = [intervention.apply(self.family, im) for im in out]
        return out

    def _prepare_image(self, source: Any, opts: ImageOptions) -> ImageInput:
        img = load_image(source, self.image_limits)
        item = self.family.prepare_image(img, opts)
        item.source_size = (img.height, img.width)     # saliency maps in the image's coordinates
        return item

    def prepare_videos(self, videos: Iterable[Any], options: dict | VideoOptions | None = None) -> list[ImageInput]:
        """Videos -> ImageInputs (kind "video"): each a path, bytes, a data URI, a list of frames (PIL
        images or uint8 [H, W, 3]) or {"frames": [...], "fps": rate}. options: {"fps", "min_pixels",
        "max_pixels", "video_max_tokens"} (see docs/families.md, "Video"). Limits: `self.video_limits`."""
        from mmjax.video import prepare_video

        opts = options if isinstance(options, VideoOptions) else VideoOptions.from_dict(options)
        return [v if isinstance(v, ImageInput) else prepare_video(self.family, v, self.video_limits, opts,
                                                                  cache=self.video_cache)
                for v in videos]

    def encode(self, images: Iterable[Any], *, with_deepstack: bool = False, lora=None) -> list:
        """Images -> one np.ndarray [n_image_tokens, lm_hidden] per image: the embeddings the LLM
        takes for the image (Llama 3.2 Vision: the projected vision tokens of its real tiles,
        which the cross-attention layers read). with_deepstack=True: one
        `mmjax.models.family.EncodedImage(features, deepstack)` per image instead, `deepstack`
        [n_deepstack, n_image_tokens, lm_hidden] being Qwen3-VL's DeepStack features (block k
        added after decoder layer k; empty for other families). lora: a LoRA adapter as `generate`
        takes one (its vision-tower / projector tensors apply; None: the base model)."""
        # each image on its own: a list of images here is not one prompt (prompt_options)
        items = [self.prepare_images([im])[0] for im in images]
        d = self.model.language_model.hidden_size
        feats = self.engine.runner.encode_images(items, self._adapter_slots(lora)[1])
        out = [self.family.encoded(im, f, d) for im, f in zip(items, feats)]
        return out if with_deepstack else [e.features for e in out]

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, requests, sampling: SamplingParams | list[SamplingParams] | None = None, *,
                 lora=None) -> list:
        """requests: a prompt string, or a list of prompts / {"prompt": str, "images": [...],
        "videos": [...]} (one image placeholder in the prompt per image, one video placeholder per
        video, e.g. Qwen's "<|vision_start|><|video_pad|><|vision_end|>"; optional "video_options"
        {"fps", "min_pixels", "max_pixels", "video_max_tokens"}; optional "image_options" such as min_pixels /
        max_pixels / image_max_tokens for dynamic-resolution families, "intervention" (a
        `mmjax.research` Ablate / Pool / Prune) and "sampling").
        sampling: one SamplingParams for all, or a list with one per request (vLLM's convention).
        Returns RequestOutputs in order; with SamplingParams.n > 1 each holds choices 1..n-1 in
        `.siblings` (they share the prompt's KV: prefilled once). A request dict with a key not
        listed here (a typo such as "image_token_keep") is an InvalidRequestError naming it,
        raised before any request runs.
        lora: a `mmjax.lora.LoRARequest` (name, PEFT path; loaded into a free slot on first use:
        `mmjax.load(..., max_loras=N)`), an adapter name, or a list with one per request (None:
        the base model); a request dict's "lora" overrides it."""
        if isinstance(requests, (str, dict)):
            requests = [requests]
        requests = [{"prompt": r} if isinstance(r, str) else r for r in requests]
        for i, r in enumerate(requests):
            check_request_dict(r, REQUEST_KEYS, f"requests[{i}]")
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(requests):
                raise InvalidRequestError(f"got {len(sampling)} SamplingParams for {len(requests)} requests; "
                                          "pass one, or one per request", param="sampling")
            per_request = list(sampling)
        else:
            per_request = [sampling] * len(requests)
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(requests)
        if len(loras) != len(requests):
            raise InvalidRequestError(f"got {len(loras)} LoRA requests for {len(requests)} requests; pass one, or "
                                      "one per request", param="lora")
        names = [self._lora_name(r.get("lora", lo)) for r, lo in zip(requests, loras)]
        ids = []
        for r, sp, name in zip(requests, per_request, names):
            sp = r.get("sampling", sp) or SamplingParams()
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sp).__name__}",
                                          param="sampling")
            iv = r.get("intervention")
            images = self.prepare_images(r.get("images", ()), r.get("image_options"), iv)
            if r.get("videos"):
                images = self._in_prompt_order(r["prompt"], images,
                                               self.prepare_videos(r["videos"], r.get("video_options")))
            extra = iv.engine_args(sum(im.num_tokens for im in images)) if iv is not None else {}
            req = self.engine.make_request(r["prompt"], images, sp, lora=name, **extra)
            ids.append([self.engine.submit(q) for q in self.engine.siblings(req, sp.n)])
        outs = self.engine.run_until_done([i for group in ids for i in group])
        it = iter(outs)
        result = []
        for group in ids:                 # n > 1: choices 1..n-1 ride on choice 0
            first = next(it)
            first.siblings = [next(it) for _ in group[1:]]
            result.append(first)
        return result

    def _lora_name(self, lora) -> str | None:
        """A LoRARequest / adapter name -> the name of an adapter the engine has loaded (a
        LoRARequest with a path is loaded on first use)."""
        from mmjax.lora import LoRARequest
        if lora is None or isinstance(lora, str):
            return lora
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora must be a mmjax.lora.LoRARequest or an adapter name, got "
                                      f"{type(lora).__name__}", param="lora")
        if lora.name not in self.engine.lora_names and lora.path is not None:
            self.engine.load_lora(lora.name, lora.path)
        return lora.name

    def _in_prompt_order(self, prompt, images: list[ImageInput], videos: list[ImageInput]) -> list[ImageInput]:
        """Images and videos interleaved in the order of their placeholders in the prompt (the
        engine gives the prompt's media tokens to the inputs in order)."""
        if isinstance(prompt, str):
            kinds = self.tokenizer.placeholder_kinds(prompt)
        else:
            ids = list(prompt)
            kinds = ["image" if t == self.tokenizer.image_token_id else "video" for t in ids
                     if t in (self.tokenizer.image_token_id, self.tokenizer.video_token_id)]
        if sorted(kinds) != sorted(["image"] * len(images) + ["video"] * len(videos)):
            return list(images) + list(videos)   # the engine reports the mismatch
        its, vids = iter(images), iter(videos)
        return [next(vids) if k == "video" else next(its) for k in kinds]

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, *,
             video_options: dict | None = None, **template_kw):
        """OpenAI-style messages; image parts as {"type": "image", "image": PIL/bytes/path} or
        {"type": "image_url", "image_url": {"url": data URI or path}}; video parts as
        {"type": "video", "video": path/bytes/frames} or {"type": "video_url", "video_url": {"url": ...}}."""
        prompt, media = self.render_chat(messages, with_kinds=True, **template_kw)
        items = [self.prepare_images([src])[0] if kind == "image" else self.prepare_videos([src], video_options)[0]
                 for kind, src in media]
        return self.generate([{"prompt": prompt, "images": items}], sampling)[0]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, with_kinds: bool = False,
                    **template_kw):
        """messages -> (prompt with one placeholder per image / video, their sources in order;
        with_kinds: (kind, source) pairs, kind "image" or "video").

        The prompt is a `mmjax.tokenizer.ChatPrompt`: the template's output as a str that also
        records where message text lies, so that special-token strings typed in messages (e.g.
        "</s>", "<|im_start|>") tokenize as plain text in `generate` / `logits` /
        `Engine.make_request`, while the template's own special tokens stay special. Pass it on
        as is: a plain str (or the result of string operations on it) is a raw prompt, whose
        special-token strings are parsed."""
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
                        images.append(("image", src))
                        parts.append({"type": "image"})
                    elif kind in ("video", "video_url"):
                        src = part.get("video") if kind == "video" else part.get("video_url")
                        if isinstance(src, dict) and kind == "video_url":
                            src = src.get("url")
                        if src is None:
                            raise PromptError(f"messages[{i}].content[{j}] has no video", param=f"messages[{i}].content[{j}]")
                        if self.family.video_token is None:
                            raise PromptError(f"{self.family.name} does not take video input",
                                              param=f"messages[{i}].content[{j}].type")
                        images.append(("video", src))
                        parts.append({"type": "video"})
                    else:
                        raise PromptError(f"messages[{i}].content[{j}].type={kind!r} is not supported",
                                          param=f"messages[{i}].content[{j}].type")
                norm.append({**m, "content": parts})
            else:
                norm.append({**m, "content": content or ""})
        prompt = self.tokenizer.render_chat(norm, add_generation_prompt, **template_kw)
        return prompt, (images if with_kinds else [src for _, src in images])

    def logits(self, prompt: str, images: Iterable[Any] = (), capture: Capture | None = None, *, lora=None):
        """Logits [prompt_tokens, vocab] (float32) over a whole prompt (research / parity): a raw
        str (special-token strings parsed) or a ChatPrompt from `render_chat` (message text never
        makes special tokens), tokenized as `generate` does. With
        `capture` (models.text.Capture: per-layer hidden states, chosen layers' attention
        probabilities), returns (logits, intermediates). lora: a LoRA adapter as `generate`
        takes one (a LoRARequest or a loaded adapter's name; None: the base model)."""
        from mmjax.research.prompt import prompt_inputs

        capture = capture or Capture()
        logits, inter = self.prompt_forward(prompt_inputs(self, prompt, images), capture, lora=lora)
        return (logits, inter) if capture.any else logits

    def prompt_forward(self, p, capture: Capture = Capture(), *, lora=None):
        """(logits [t, vocab] float32, intermediates) for `mmjax.research.prompt.PromptInputs`,
        through the jitted whole-prompt forward (one compile per capture and length; and per
        with / without an adapter), under LoRA adapter `lora` (as `logits`)."""
        return self._prompt_run(p, capture, hidden=False, lora=lora)

    def _adapter_slots(self, lora) -> tuple[int | None, int]:
        """A LoRA adapter (LoRARequest, name or None) -> (its slot for the decoder, None without
        one; its slot for the encoder, -1 where it leaves the encoder alone)."""
        name = self._lora_name(lora)
        if name is None:
            return None, -1
        slot = self.engine.lora_slot(name)
        return slot, slot if self.engine.adapters.encoder_salt(name) else -1

    def _prompt_run(self, p, capture: Capture, hidden: bool, pad_to: int | None = None, lora=None):
        """(logits or hidden [t, ...], intermediates) of PromptInputs `p`, optionally padded to
        `pad_to` tokens (outputs cut back to the prompt), under LoRA adapter `lora`."""
        from mmjax.serving.runner import make_prompt_forward

        adapter, encoder_adapter = self._adapter_slots(lora)
        emb = np.zeros((len(p.ids), self.engine.runner.feature_width), np.float32)
        if p.images:
            # the prompt's image tokens, in order, take the images' features in order
            todo = [im for im in p.images if im.embeds is None]
            enc = iter(self.engine.runner.encode_images(todo, encoder_adapter) if todo else [])
            emb[p.image_pos] = np.concatenate([im.embeds if im.embeds is not None else next(enc)
                                               for im in p.images])
        ids, pos, spans = p.ids, p.positions, p.spans
        if pad_to is not None and pad_to > len(ids):   # causal: padding after the prompt changes nothing before it
            k = pad_to - len(ids)
            ids = np.pad(ids, (0, k))
            emb = np.pad(emb, ((0, k), (0, 0)))
            pos = np.pad(pos, ((0, 0), (0, k)), mode="edge")
            spans = None if spans is None else np.pad(spans, (0, k), constant_values=-1)
        runner = self.engine.runner
        key = (capture, hidden)
        if key not in self._forward:
            fwd = make_prompt_forward(self.family, capture, hidden=hidden, tp=runner.placement.tp)
            lm_of = runner.weights.lm_of()
            self._forward[key] = jax.jit(runner.tuning.traced(lambda leaves, *a: fwd(lm_of(leaves), *a)))
        out, inter = self._forward[key](runner.lm_leaves, ids, emb.astype(self.loaded.dtype),
                                        np.isin(ids, self.family.media_token_ids), pos, spans,
                                        None if adapter is None else np.int32(adapter))
        return np.asarray(out)[:len(p.ids)], jax.tree.map(np.asarray, inter)

    def embed(self, inputs, pooling: str = "last", normalize: bool = True) -> np.ndarray:
        """Embeddings [len(inputs), hidden] (float32) of prompts: each a raw prompt string, a list
        of OpenAI-style messages (rendered with the chat template and a generation prompt), or
        {"prompt", "images"} (images as in `generate`, {"image_embeds": ...} included). The
        final normed hidden state of the last token (pooling="last", vLLM's default for decoder
        models) or the mean over all tokens ("mean"); L2-normalised unless normalize=False.
        Computed in batches (`embed_prompts`)."""
        from mmjax.research.prompt import prompt_inputs

        if pooling not in ("last", "mean"):
            raise InvalidRequestError(f"pooling must be 'last' or 'mean', got {pooling!r}", param="pooling")
        if isinstance(inputs, (str, dict)):
            inputs = [inputs]
        ps = []
        for i, x in enumerate(inputs):
            if isinstance(x, dict):
                check_request_dict(x, ("prompt", "images"), f"inputs[{i}]")
            p = prompt_inputs(self, x["prompt"], x.get("images", ())) if isinstance(x, dict) else \
                prompt_inputs(self, x)
            n = len(p.ids)
            if n >= self.engine.max_model_len:
                from mmjax.errors import ContextLengthError
                raise ContextLengthError(f"input is {n} tokens; the context is {self.engine.max_model_len} tokens",
                                         param="input")
            ps.append(p)
        return self.embed_prompts(ps, pooling, normalize)

    def embed_prompt(self, p, pooling: str = "last", normalize: bool = True) -> np.ndarray:
        """The embedding [hidden] of `mmjax.research.prompt.PromptInputs` (see `embed`)."""
        return self.embed_prompts([p], pooling, normalize)[0]

    def embed_prompts(self, ps: list, pooling: str = "last", normalize: bool = True,
                      max_batch_tokens: int = 16384) -> np.ndarray:
        """Embeddings [len(ps), hidden] of PromptInputs, batched: prompts right-padded to a
        power of two (at least 16) tokens, rows to a power of two, at most `max_batch_tokens`
        padded tokens per forward (one compile per (rows, tokens) bucket). With data-parallel
        replicas (`load(data_parallel=M)`) the batches are split over the replicas, which run at
        the same time, each on its own devices and params copy."""
        if self.family.cross_attention:
            from mmjax.errors import UnsupportedModelError
            raise UnsupportedModelError(f"{self.family.name}: embeddings are not implemented for cross-attention "
                                        "families (generation is)", param="model")
        if not ps:
            return np.zeros((0, self.model.language_model.hidden_size), np.float32)
        runners = [e.runner for e in self.engine.replicas]
        order = sorted(range(len(ps)), key=lambda i: len(ps[i].ids))     # similar lengths batch together
        batches, cur = [], []
        for i in order:
            t = max(16, 1 << (len(ps[i].ids) - 1).bit_length())
            if cur and (1 << len(cur).bit_length()) * t > max(max_batch_tokens, t):
                batches.append(cur)
                cur = []
            cur.append(i)
        batches.append(cur)
        if len(runners) > 1 and len(batches) < len(runners):     # one batch per replica at least
            flat = [i for b in batches for i in b]
            k = -(-len(flat) // len(runners))
            batches = [flat[j:j + k] for j in range(0, len(flat), k)]
        work = [(runners[j % len(runners)], [ps[i] for i in b]) for j, b in enumerate(batches)]
        if len(runners) > 1:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(len(runners)) as pool:     # jax releases the GIL: replicas overlap
                results = list(pool.map(lambda w: self._embed_batch(*w), work))
        else:
            results = [self._embed_batch(*w) for w in work]
        out = np.zeros((len(ps), self.model.language_model.hidden_size), np.float32)
        for b, (last, mean) in zip(batches, results):
            out[b] = last if pooling == "last" else mean
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out

    def _embed_batch(self, runner, ps: list) -> tuple[np.ndarray, np.ndarray]:
        """(last, mean) [len(ps), hidden] of one padded batch on `runner`'s devices."""
        from mmjax.serving.runner import make_embed_forward

        t = max(16, 1 << (max(len(p.ids) for p in ps) - 1).bit_length())
        b = 1 << (len(ps) - 1).bit_length()
        rows = ps[0].positions.shape[0]
        ids = np.zeros((b, t), np.int32)
        emb = np.zeros((b, t, runner.feature_width), np.float32)
        pos = np.zeros((rows, b, t), np.int32)
        spans = np.full((b, t), -1, np.int32)
        lens = np.ones(b, np.int32)
        todo = [im for p in ps for im in p.images if im.embeds is None]
        enc = iter(runner.encode_images(todo) if todo else [])     # every image of the batch in one encode
        for r, p in enumerate(ps):
            n = len(p.ids)
            ids[r, :n], lens[r] = p.ids, n
            pos[:, r, :n] = p.positions
            pos[:, r, n:] = p.positions[:, -1:]
            if p.spans is not None:
                spans[r, :n] = p.spans
            if p.images:
                emb[r, p.image_pos] = np.concatenate([im.embeds if im.embeds is not None else next(enc)
                                                      for im in p.images])
        key = ("embed", id(runner))
        if key not in self._forward:
            fwd, lm_of = make_embed_forward(self.family, tp=runner.placement.tp), runner.weights.lm_of()
            self._forward[key] = jax.jit(runner.tuning.traced(lambda leaves, *a: fwd(lm_of(leaves), *a)))
        last, mean = self._forward[key](runner.lm_leaves, ids, emb.astype(self.loaded.dtype),
                                        np.isin(ids, self.family.media_token_ids), pos,
                                        None if all(p.spans is None for p in ps) else spans, lens)
        return np.asarray(last)[:len(ps)], np.asarray(mean)[:len(ps)]

    # ---- research (mmjax.research) --------------------------------------------------------------
    def trace(self, prompt: Any, images: Iterable[Any] = (), **kw):
        """Per-layer hidden states and attention over a prompt, split into text and image tokens
        (see `mmjax.research.trace.trace` for the arguments)."""
        from mmjax.research.trace import trace
        return trace(self, prompt, images, **kw)

    def saliency(self, image: Any, prompt: Any, answer: str, **kw):
        """Gradient (or integrated gradients) of log p(answer) w.r.t. the normalized input pixels,
        as an image-shaped map (see `mmjax.research.gradients.saliency`)."""
        from mmjax.research.gradients import saliency
        return saliency(self, image, prompt, answer, **kw)

    def loss(self, params, prompt: Any, answer: str, images: Iterable[Any] = ()):
        """Mean negative log-likelihood of `answer`'s tokens after the prompt, a jax scalar
        differentiable in `params`, the model's State (e.g. `jax.grad(vlm.loss)(nnx.state(vlm.model),
        prompt, answer, images)`; None: the live model's)."""
        from mmjax.research.gradients import loss
        return loss(self, params, prompt, answer, images)

def check_request_dict(r: Any, keys: tuple[str, ...], where: str) -> None:
    """An offline request dict: a dict with a "prompt" and no key outside `keys` (InvalidRequestError
    naming the key: a typo must not silently run the unmodified experiment)."""
    if not isinstance(r, dict):
        raise InvalidRequestError(f"{where}: a request is a prompt string or a dict, got {type(r).__name__}",
                                  param=where)
    for k in r:
        if k not in keys:
            raise InvalidRequestError(f"{where}: unknown request key {k!r} (known: {', '.join(keys)})", param=k)
    if "prompt" not in r:
        raise InvalidRequestError(f"{where}: the request has no \"prompt\"", param="prompt")


def load(model: str | os.PathLike | None = None, dtype: str = "float32", *,
         image_limits: ImageLimits = ImageLimits(), params_dir: str | os.PathLike | None = None,
         quantize: str | None = None, quantize_group_size: int | None = None,
         mesh=None, tensor_parallel: int | None = None, data_parallel: int | None = None,
         verbose: bool = False, **engine_kw) -> VLM:
    """Load a Hugging Face-layout VLM checkpoint (local dir or hub id; None or "mmjax-shapes" for
    the shipped model) into a VLM.

    params_dir: converted params saved with `VLM.save_params` (orbax) for a fast reload.
    quantize: None | "int8" | "fp8": 8-bit linear-layer weights (`mmjax.quant`: int8 with
    per-token int8 activations, s8 dots, for CPU and GPU; fp8 e4m3 for GPUs);
    quantize_group_size: int8 scales per group of that many input rows.
    mesh: a jax.sharding.Mesh with axes ("data", "model"), or tensor_parallel=N /
    data_parallel=M to build one over the first N x M devices (`mmjax.sharding.make_mesh`):
    the decoder is split N ways (Megatron-style tensor parallel), and M engine replicas serve
    behind one engine API (docs/scaling.md).
    verbose: print progress to stderr (`mmjax.progress`: the one-time CPU kernel build, each shape
    `vlm.engine.warmup()` compiles); without it the offline API prints nothing unless logging is
    set up at INFO.
    engine_kw: the Engine's options (max_num_seqs, max_model_len, prefill_chunk, kv_cache_dtype,
    memory_budget, decode_steps, ...), each with its default and meaning in
    `mmjax.engine_args.EngineArgs` (the same options as `mmjax serve`'s flags).
    """
    if verbose:
        from mmjax import progress
        progress.enable()
    enable_compilation_cache()
    if "kv_cache_dtype" in engine_kw:      # a bad name fails here, not at the first request
        from mmjax.models.nn.kv_quant import resolve
        resolve(engine_kw["kv_cache_dtype"], jax.numpy.float32)
    if mesh is None and (tensor_parallel or 1) * (data_parallel or 1) > 1:
        from mmjax.sharding import make_mesh
        mesh = make_mesh(tensor_parallel or 1, data_parallel or 1)
    elif mesh is not None and (tensor_parallel or data_parallel):
        raise InvalidRequestError("pass either mesh or tensor_parallel / data_parallel, not both", param="mesh")
    if mesh is not None:
        from mmjax.sharding import MODEL, axis_size, check_quantized_tp
        # before loading (a saved copy's group size: at placement)
        check_quantized_tp(axis_size(mesh, MODEL), quantize_group_size)
        engine_kw["mesh"] = mesh
    # over a mesh, params stay on the host until the runner places each shard on its device
    return VLM(load_model(model, dtype, params_dir, on_device=mesh is None, quantize=quantize,
                          quantize_group_size=quantize_group_size), image_limits=image_limits,
               **engine_kw)
