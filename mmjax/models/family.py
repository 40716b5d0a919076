"""The family protocol: what a model family (LLaVA, Qwen2-VL, ...) provides to the core.

A family is a set of pure pieces the runner and engine drive; it never calls the runner or
imports the engine:

- loading: config parsing and weight-name mapping (`load(path, hf_cfg) -> (family, params)` in
  the family's module, registered in `mmjax.models.FAMILIES`);
- host image preparation with the exact token count known before any compute (`prepare_image`);
- for families that take video: a frame plan from the container metadata (`plan_video`: which
  frames, token count, before decoding) and the preparation of the decoded frames
  (`prepare_video`); a prepared video is an `ImageInput` with kind "video" that goes through the
  same encode plan, caches and placement as images, its tokens being `video_token_id`;
- an encode plan (how prepared images group into bucketed compiled calls, `encode_plan`); the
  encode itself is the model's (`VisionLanguageModel.encode`, which the runner jits);
- prompt positions (1-D RoPE or M-RoPE rows, `positions`);
- how features enter the sequence (`feature_placement`: "replace" = image placeholder tokens
  take the features; "cross_attention" = the decoder's cross-attention layers read them from a
  per-slot cache the engine fills once per request, Mllama);
- its modules: a `VisionLanguageModel` (the vision side and `language_model`, an `nn.Decoder`),
  built abstractly and filled from the checkpoint by the family module's `load`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import nnx

from mmjax.errors import InvalidRequestError, PromptError, UnsupportedModelError
from mmjax.models.nn.decoder import Decoder


@dataclass
class ImageInput:
    """One prepared image: the encoder's input, its LLM token count, its encoder-cache key (content
    hash + preprocessing) and its vision patch grid (t, h, w) (for positions and heatmaps).

    An intervention (mmjax.research.interventions) may add `post`, a host transform of the
    encoder's features [tokens, hidden] -> [num_tokens, hidden] (its `key` then names it, so
    the encoder cache keeps the transformed features apart), and `token_grid`, the (frames,
    rows, cols) layout of the transformed tokens."""
    pixels: np.ndarray
    num_tokens: int
    key: str
    grid: tuple[int, int, int]
    post: Callable[[np.ndarray], np.ndarray] | None = None
    token_grid: tuple[int, int, int] | None = None
    kind: str = "image"            # "image" | "video" (its prompt tokens are Family.video_token_id)
    video: Any = None              # a video's mmjax.video.VideoPlan (frames, sampled fps) for positions
    embeds: np.ndarray | None = None     # precomputed features [num_tokens, lm hidden] (image_embeds input)
    source_size: tuple[int, int] | None = None   # (height, width) of the decoded image it was made from


@dataclass(frozen=True)
class ImageOptions:
    """Per-image preprocessing options (offline `image_options`, the server's `detail` and
    budget). Families with one fixed size ignore the resolution bounds.

    min_pixels / max_pixels: resize bounds for dynamic-resolution families.
    max_tokens: the most LLM tokens this image may take; a larger one is a ContextLengthError.
    pan_and_scan: Gemma 3's pan-and-scan crops on (True) / off (False) for this image; None: the
        checkpoint's processor default (the server's --pan-and-scan, `detail: "high"`).
    max_tiles: the most tiles a tiling family (Idefics3 / SmolVLM, LLaVA-NeXT / OneVision) cuts
        this image into, besides its global image / overview; 0: the global image / overview
        alone (`detail: "low"`); None: the checkpoint's full tiling (capped by the server's
        --max-image-tiles).
    """
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_tokens: int | None = None
    pan_and_scan: bool | None = None
    max_tiles: int | None = None

    @classmethod
    def from_dict(cls, opts: dict | None) -> "ImageOptions":
        """{"min_pixels", "max_pixels", "image_max_tokens" | "max_tokens", "pan_and_scan",
        "max_tiles"} -> ImageOptions; an unknown key, a non-positive size (negative max_tiles) or
        a non-bool pan_and_scan is an InvalidRequestError naming it."""
        opts = dict(opts or {})
        if "image_max_tokens" in opts:
            opts["max_tokens"] = opts.pop("image_max_tokens")
        pas = opts.pop("pan_and_scan", None)
        if pas is not None and not isinstance(pas, (bool, np.bool_)):
            raise InvalidRequestError(f"pan_and_scan must be true or false, got {pas!r}", param="pan_and_scan")
        names = {f.name for f in fields(cls)} - {"pan_and_scan"}
        for k, v in opts.items():
            if k not in names:
                raise InvalidRequestError(f"unknown image option {k!r} (known: min_pixels, max_pixels, "
                                          "image_max_tokens, pan_and_scan, max_tiles)", param=f"image_options.{k}")
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                  or v < (0 if k == "max_tiles" else 1)):
                name = "image_max_tokens" if k == "max_tokens" else k
                kind = "a non-negative" if k == "max_tiles" else "a positive"
                raise InvalidRequestError(f"{name} must be {kind} integer, got {v!r}", param=name)
        return cls(**{k: (None if v is None else int(v)) for k, v in opts.items()},
                   pan_and_scan=None if pas is None else bool(pas))


@dataclass(frozen=True)
class VideoOptions:
    """Per-video options (the offline API's `video_options`).

    min_pixels / max_pixels: per-frame resize bounds (the video processor's size range).
    max_tokens: the most LLM tokens this video may take (ContextLengthError above, before decoding).
    fps: frames sampled per second of video (None: the checkpoint's video processor setting).
    """
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_tokens: int | None = None
    fps: float | None = None

    @classmethod
    def from_dict(cls, opts: dict | None) -> "VideoOptions":
        """{"min_pixels", "max_pixels", "video_max_tokens" | "max_tokens", "fps"} -> VideoOptions;
        an unknown key or a non-positive value is an InvalidRequestError naming it."""
        opts = dict(opts or {})
        if "video_max_tokens" in opts:
            opts["max_tokens"] = opts.pop("video_max_tokens")
        out = {}
        for k, v in opts.items():
            if k not in ("min_pixels", "max_pixels", "max_tokens", "fps"):
                raise InvalidRequestError(f"unknown video option {k!r} (known: min_pixels, max_pixels, "
                                          "video_max_tokens, fps)", param=f"video_options.{k}")
            if v is None:
                continue
            ok = isinstance(v, (int, np.integer, float)) and not isinstance(v, bool) and v > 0
            if k != "fps":
                ok = ok and isinstance(v, (int, np.integer))
            if not ok or (k == "fps" and not np.isfinite(v)):
                name = "video_max_tokens" if k == "max_tokens" else k
                raise InvalidRequestError(f"video option {name} must be a positive "
                                          f"{'number' if k == 'fps' else 'integer'}, got {v!r}",
                                          param=f"video_options.{name}")
            out[k] = float(v) if k == "fps" else int(v)
        return cls(**out)


class EncodedImage(NamedTuple):
    """One image's encoder output as `VLM.encode` gives it (`Family.encoded`).

    features: [n_image_tokens, lm_hidden], what the LLM takes for the image (the embeddings its
        image tokens get; Llama 3.2 Vision: the projected vision tokens of the image's real tiles,
        (patches + 1) per tile, which its cross-attention layers read).
    deepstack: [n_deepstack, n_image_tokens, lm_hidden], Qwen3-VL's DeepStack features (block k is
        added to the residual stream at the image tokens after decoder layer k); [0, n, lm_hidden]
        for families without them."""
    features: np.ndarray
    deepstack: np.ndarray


@dataclass
class EncodeCall:
    """One compiled encode call: `bucket` names its compiled shape (a key of the runner's
    compile record), `inputs` are the padded host arrays passed to `Family.encode`, and `split`
    maps the call's output to one feature array [num_tokens, hidden] per image, in order."""
    bucket: tuple
    inputs: Any
    split: Callable[[np.ndarray], list[np.ndarray]]


class VisionLanguageModel(nnx.Module):
    """A family's top module (`vlm.model`): its vision side (tower, projector: names as the HF
    model's) and `language_model`, the decoder. `encode` is the pure encode step the runner jits:
    one EncodeCall's inputs -> features; `hf_weights(w)` reads the checkpoint (nn/weights.py)."""
    language_model: Decoder

    def encode(self, inputs: Any) -> jax.Array:
        raise NotImplementedError

    @property
    def embed_dtype(self):
        """The dtype image features enter the decoder in (the token embedding's)."""
        return self.language_model.embed_tokens.embedding.get_value().dtype


class Family(abc.ABC):
    """A model family bound to one checkpoint (see the module docstring)."""
    name: str
    image_token_id: int
    image_token: str                     # the prompt placeholder for one image
    feature_placement: str = "replace"
    # Each maximal run of consecutive image tokens attends to itself in both directions during
    # prefill (Gemma 3's token_type_ids mask); the engine keeps prefill chunk boundaries out of runs.
    bidirectional_images: bool = False
    # Video: the prompt placeholder for one video and its token id (None: the family takes no video).
    video_token: str | None = None
    video_token_id: int | None = None

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """Token ids whose prompt positions take encoder features (image, then video if any)."""
        return (self.image_token_id,) + (() if self.video_token_id is None else (self.video_token_id,))

    def token_id_of(self, item: ImageInput) -> int:
        """The prompt token id of a prepared input's tokens (its placeholder's id)."""
        return self.video_token_id if item.kind == "video" else self.image_token_id

    def feature_token_id(self, item: ImageInput) -> int:
        """The prompt token id whose positions take the item's features: its placeholder's
        (`token_id_of`), unless the processor expands the placeholder into other tokens
        (InternVL: a video's `<video>` becomes frames of image tokens; GLM-4.xV: a video's
        `<|video|>` becomes frames of `<|image|>` tokens)."""
        return self.token_id_of(item)

    # ---- host: videos --------------------------------------------------------------------------
    def plan_video(self, meta, opts: VideoOptions = VideoOptions()):
        """Container metadata (mmjax.video.VideoMeta) -> mmjax.video.VideoPlan: which frames to
        decode and the exact token count, before any pixel is decoded; over-budget videos raise
        ContextLengthError. Families without video raise UnsupportedModelError."""
        raise UnsupportedModelError(f"{self.name} does not take video input", param="video_url")

    def prepare_video(self, frames: np.ndarray, plan, key: str) -> ImageInput:
        """Decoded uint8 frames [n, H, W, 3] (the plan's indices) -> ImageInput(kind="video");
        `key` is the video's content hash."""
        raise UnsupportedModelError(f"{self.name} does not take video input", param="video_url")

    @property
    def cross_attention(self) -> bool:
        """Images enter through the decoder's cross-attention (Mllama), not the token sequence:
        the engine fills the text model's per-slot cross cache once per request (`fill_cross`)
        and passes `cross_ranges` per prefill token in MaskSpec.spans."""
        return self.feature_placement == "cross_attention"

    def cross_ranges(self, ids: np.ndarray, images: list) -> np.ndarray | None:
        """Cross-attention families: [len(ids)] int32, each token's packed image range (the text
        model's encoding). Others: None."""
        return None

    # ---- host: images --------------------------------------------------------------------------
    @abc.abstractmethod
    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """A decoded RGB PIL image -> ImageInput; over-budget images raise ContextLengthError
        before any resize or encode."""

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """Options that make an image take at most `max_tokens` tokens where the family can
        resize (the server's `detail: low` and --image-max-tokens); fixed-size families: none."""
        return ImageOptions()

    def prompt_options(self, opts: ImageOptions, n_images: int) -> ImageOptions:
        """The options for each image of a prompt holding `n_images` images (LLaVA-OneVision's
        processor does not tile the images of a multi-image prompt). Default: `opts`."""
        return opts

    def configure(self, *, image_max_tokens: int | None = None) -> None:
        """Server-wide limits, set before the engine exists (they may shape encode buckets)."""

    # ---- encode ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Group prepared images into bucketed compiled calls (`max_batch`: the engine's limit on
        images per call for families that batch whole images; `shards`: the devices a packed
        encode splits its groups over, families that pack patches)."""

    @abc.abstractmethod
    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """One dummy call per encode bucket (compiles them all)."""

    def encode(self, model: VisionLanguageModel, inputs: Any) -> jax.Array:
        """The pure encode step (jitted by the runner): inputs of one EncodeCall -> features."""
        return model.encode(inputs)

    def encoded(self, image: ImageInput, feats: np.ndarray, hidden_size: int) -> EncodedImage:
        """One image's features as the encode step lays them out for the engine ([tokens,
        feature width]: with per-layer image features (DeepStack) the blocks of `hidden_size`
        columns side by side) -> the public `EncodedImage` (`VLM.encode`)."""
        d = hidden_size
        feats = np.asarray(feats)
        n = feats.shape[-1] // d - 1
        deepstack = feats[:, d:].reshape(len(feats), n, d).transpose(1, 0, 2)
        return EncodedImage(feats[:, :d], np.ascontiguousarray(deepstack))

    # ---- prompt ---------------------------------------------------------------------------------
    def image_prompt(self, image: ImageInput) -> str | None:
        """The text that replaces this image's placeholder (`image_token`) in the prompt before
        tokenizing, for families whose processor expands it as text (Gemma: begin/end-of-image
        markers around the soft tokens). None: the placeholder token becomes `num_tokens` image
        tokens after tokenizing."""
        return None

    def image_prompts(self, images: list[ImageInput]) -> list[str | None]:
        """`image_prompt` of each input of one prompt, in order (families whose text numbers the
        images, MiniCPM-V's `<image_id>`, override this)."""
        return [self.image_prompt(im) for im in images]

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(frames or tiles, rows, cols) of the image's LLM tokens in feature order (heatmaps,
        pooling). Default: one square grid when num_tokens is a square, else one row."""
        if image.token_grid is not None:
            return image.token_grid
        side = int(round(image.num_tokens ** 0.5))
        return (1, side, side) if side * side == image.num_tokens else (1, 1, image.num_tokens)

    def image_pixels(self, image: ImageInput) -> np.ndarray:
        """The image's preprocessed (normalized) pixels laid out as an image [..., H, W, C], the
        space saliency maps live in. Default: `pixels` already is."""
        return np.asarray(image.pixels)

    def input_pixels(self, image: ImageInput, pixels: np.ndarray) -> np.ndarray:
        """Inverse of `image_pixels`: image-shaped pixels -> the encoder's `ImageInput.pixels`
        layout (a rearrangement: gradients flow through it by index)."""
        return pixels

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """Where `image_pixels(image)` lies on the height x width image it was prepared from
        (the processor's resize, padding and crops undone: saliency maps in the image's own
        coordinates, `mmjax.image.geometry.to_image`): one (index into image_pixels' leading
        axes, `mmjax.image.geometry.Frame`) per view. Default: one [H, W, C] view, the whole
        image resized (Qwen2-VL's smart_resize, Pixtral, Gemma 4)."""
        from mmjax.image.geometry import Frame

        shape = np.shape(self.image_pixels(image))
        if len(shape) != 3:
            raise UnsupportedModelError(f"{self.name}: no pixel geometry for views of shape {shape}", param="model")
        return [((), Frame.of(height, width).resize(shape[0], shape[1]))]

    def image_starts(self, ids: np.ndarray, counts: list[int]) -> list[int]:
        """Prompt index of each image's first token. The prompt's image tokens are the images'
        tokens in order: image i owns the next counts[i] of them (one run, or several, e.g. the
        crops of one image). Image tokens that no image accounts for (e.g. bare image-token ids
        in a token-id prompt) are a PromptError."""
        where = np.flatnonzero(np.isin(ids, self.media_token_ids))
        if len(where) != sum(counts):
            what = "image tokens" if self.video_token_id is None else "image and video tokens"
            raise PromptError(f"prompt has {len(where)} {what} but the inputs need {sum(counts)}",
                              param="images")
        return [int(where[o]) for o in np.cumsum([0] + list(counts))[:-1]]

    def positions(self, ids: np.ndarray, images: list[ImageInput], image_starts: list[int]
                  ) -> tuple[np.ndarray, int]:
        """RoPE positions [text_model.position_rows, prompt_len] int32 and the decode offset
        (decode position = cache index + offset). Default: 1-D positions 0..len-1."""
        return np.arange(len(ids), dtype=np.int32)[None], 0


def image_runs(ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """[n_runs, 2] (start, end) of each maximal run of consecutive image tokens in `ids`."""
    is_img = np.r_[False, np.asarray(ids) == image_token_id, False]
    edges = np.flatnonzero(is_img[1:] != is_img[:-1])
    return edges.reshape(-1, 2)


def run_spans(ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """[len] int32: the index of the image-token run each token is in, -1 outside runs (the
    `MaskSpec.spans` of a bidirectional-image family)."""
    spans = np.full(len(ids), -1, np.int32)
    for i, (a, b) in enumerate(image_runs(ids, image_token_id)):
        spans[a:b] = i
    return spans
