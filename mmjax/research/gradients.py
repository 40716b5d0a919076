"""Gradients through the whole VLM: log p(answer | image, prompt) as one pure function of
(the model's state, image-shaped normalized pixels), differentiable in both. `params` is an
`nnx.State` of `vlm.model` (default `nnx.state(vlm.model)`; a module is taken as its state), so
`jax.grad(vlm.loss)(nnx.state(vlm.model), ...)` gives the gradient of every weight.

The family's encode plan lays pixels out for its encoder (stacking, patchifying, window order,
padding); that layout is a rearrangement, recovered once per prompt by running the plan on
images whose pixels are their own flat indexes, and replayed inside the function with
`jnp.take`, so gradients reach the image-shaped pixels of every family without
family-specific code. The features are split per image the same way (the plan's `split` run on
row indexes)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import InvalidRequestError
from mmjax.research.prompt import PromptInputs, prompt_inputs

_EXACT = 2 ** 24    # float32 holds every integer index below this exactly


@dataclass
class Saliency:
    """map [..., H, W]: |attribution| summed over channels; attribution [..., H, W, C] (the
    gradient, or integrated gradients x (pixels - baseline)); pixels [..., H, W, C]: the
    normalized input; logprob: log p(answer) at the input. All in the model's input layout
    (`Family.image_pixels`: after the processor's resize, padding and crops; tiling families:
    one map per view).

    image_map [height, width] and image_attribution [height, width, C]: the same in the image's
    own pixels (the decoded image, EXIF orientation applied): each view's values moved back
    through the processor's geometry (`Family.pixel_views`, `mmjax.image.geometry.to_image`:
    the transpose of bilinear resampling, so each model pixel's value keeps its sum), padding
    left out, overlapping views (tiles and an overview) added, so it overlays the image and,
    for the attribution, sums like it (integrated gradients stay complete up to the padding's
    share). None when the image came as a prepared `ImageInput` that does not know its source
    size (`ImageInput.source_size`, set by `VLM.prepare_images`)."""
    map: np.ndarray
    attribution: np.ndarray
    pixels: np.ndarray
    logprob: float
    image_map: np.ndarray | None = None
    image_attribution: np.ndarray | None = None


@dataclass
class _Layout:
    """How image-shaped pixels become encoder inputs and features become image tokens."""
    calls: tuple                # per encode call: (treedef, index of pixel leaves)
    leaves: list                # per call: its leaves, pixel leaves as int32 indexes into [0] + pixels
    feat_index: np.ndarray      # [image tokens] row of the concatenated call outputs for each image token


def _layout(vlm, p: PromptInputs) -> tuple[list[np.ndarray], _Layout]:
    family, runner = vlm.family, vlm.engine.runner
    if any(im.post is not None for im in p.images):
        raise InvalidRequestError("gradients through host interventions (Ablate, Pool) are not supported",
                                  param="intervention")
    pixels = [np.asarray(family.image_pixels(im), np.float32) for im in p.images]
    offsets = np.cumsum([0] + [x.size for x in pixels])
    if offsets[-1] + 1 >= _EXACT:
        raise InvalidRequestError("images too large for pixel gradients", param="images")
    probes = [dataclasses.replace(im, pixels=family.input_pixels(
        im, np.arange(1, x.size + 1, dtype=np.float64).reshape(x.shape) + off))
        for im, x, off in zip(p.images, pixels, offsets)]
    plan = runner.encode_plan(probes)
    calls, leaves, per_image, row0 = [], [], [], 0
    for call in plan:
        flat, treedef = jax.tree.flatten(call.inputs)
        pix = tuple(i for i, leaf in enumerate(flat) if np.issubdtype(np.asarray(leaf).dtype, np.floating))
        calls.append((treedef, pix))
        leaves.append([np.rint(np.asarray(leaf)).astype(np.int32) if i in pix else np.asarray(leaf)
                       for i, leaf in enumerate(flat)])
        shape = jax.eval_shape(lambda inputs: family.encode(runner.encode_model(), inputs), call.inputs).shape
        rows = int(np.prod(shape[:-1]))
        per_image += [np.asarray(r).reshape(-1) for r in call.split(
            (row0 + np.arange(rows)).reshape(shape[:-1] + (1,)))]
        row0 += rows
    return pixels, _Layout(tuple(calls), leaves, np.concatenate(per_image) if per_image else np.zeros(0, np.int64))


def _logprob_fn(vlm, calls: tuple, n_answer: int):
    """The jitted pure log p(answer) for one layout structure (cached on the VLM)."""
    key = ("answer_logprob", calls, n_answer)
    fns = vlm.__dict__.setdefault("_research_fns", {})
    if key in fns:
        return fns[key]
    family = vlm.family
    runner = vlm.engine.runner
    graphdef = nnx.graphdef(vlm.model)
    from mmjax.models.nn.metadata import AttentionMetadata
    from mmjax.serving.runner import step_spans

    def fn(params, pixels, leaves, feat_index, ids, positions, spans, image_pos):
        """params (the model's State), pixels (list of [..., H, W, C]) -> log p(answer tokens)
        (sum, float32)."""
        model = nnx.merge(graphdef, params)
        lm = model.language_model
        dtype = lm.embed(ids[:1]).dtype
        # image tokens' features (with per-layer blocks for DeepStack decoders: Decoder.inputs)
        feats = jnp.zeros((ids.shape[0], lm.feature_width), dtype)
        if pixels:
            flat = jnp.concatenate([jnp.zeros((1,), jnp.float32)] + [x.reshape(-1).astype(jnp.float32) for x in pixels])
            outs = []
            for (treedef, pix), call_leaves in zip(calls, leaves):
                args = [flat[leaf] if i in pix else leaf for i, leaf in enumerate(call_leaves)]
                f = family.encode(model, jax.tree.unflatten(treedef, args))
                outs.append(f.reshape(-1, f.shape[-1]))
            feats = feats.at[image_pos].set(jnp.concatenate(outs)[feat_index].astype(dtype))
        mask = jnp.zeros(ids.shape, bool).at[image_pos].set(True)
        embeds, extra = lm.inputs(ids[None], feats[None], mask[None])
        t = ids.shape[0]
        cache = lm.init_cache(1, t, embeds.dtype, max_chunk=t, tp=runner.placement.tp)
        meta = AttentionMetadata(positions[:, None, :], jnp.zeros((1,), jnp.int32), t,
                                 spans=step_spans(family, spans[None]), valid=jnp.ones((1, t), bool))
        hidden, _ = lm(embeds, meta, cache, **extra)
        logits = lm.logits(hidden[0, t - n_answer - 1:t - 1])            # [n_answer, vocab]
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(lp, ids[t - n_answer:, None], axis=1).sum()

    fns[key] = (jax.jit(fn), jax.jit(jax.value_and_grad(fn, argnums=1)))
    return fns[key]


def _prepare(vlm, prompt: Any, images: Iterable[Any], answer: str, image_options: dict | None):
    p = prompt_inputs(vlm, prompt, images, answer=answer, image_options=image_options)
    pixels, layout = _layout(vlm, p)
    n_answer = len(p.ids) - p.prompt_len
    fn, vg = _logprob_fn(vlm, layout.calls, n_answer)
    args = (layout.leaves, layout.feat_index, p.ids, p.positions, p.spans, p.image_pos)
    return pixels, fn, vg, args, n_answer, p.images


def model_state(vlm, params=None) -> nnx.State:
    """The State the pure functions take: `params` as given (a State, or a module's), else the
    live model's."""
    if params is None:
        return nnx.state(vlm.model)
    return nnx.state(params) if isinstance(params, nnx.Module) else params


def answer_logprob(vlm, params, prompt: Any, answer: str, images: Iterable[Any] = (),
                   pixels: list | None = None):
    """log p(answer | prompt, images) (a jax scalar, differentiable in params and pixels).
    params: the model's State (None: the live model's); pixels: image-shaped normalized pixels to
    use instead of the images' own (same shapes)."""
    own, fn, _, args, _, _ = _prepare(vlm, prompt, images, answer, None)
    return fn(model_state(vlm, params), own if pixels is None else list(pixels), *args)


def loss(vlm, params, prompt: Any, answer: str, images: Iterable[Any] = ()):
    """Mean negative log-likelihood per answer token (jax scalar, differentiable in params: the
    model's State, None for the live model's)."""
    pixels, fn, _, args, n_answer, _ = _prepare(vlm, prompt, images, answer, None)
    return -fn(model_state(vlm, params), pixels, *args) / n_answer


def saliency(vlm, image: Any, prompt: Any, answer: str, *, method: str = "gradient", steps: int = 16,
             baseline: float | np.ndarray = -1.0, image_options: dict | None = None) -> Saliency:
    """Attribution of log p(answer) to the normalized input pixels of `image`.

    prompt: a question (the image goes first in a user message, the chat template applies), a raw
    prompt / ChatPrompt holding one image placeholder, or messages with one image part.
    method: "gradient" (d log p / d pixels) or "integrated" (integrated gradients from a constant
    `baseline` image in normalized space (a scalar, or anything broadcasting to the pixels,
    e.g. a per-channel color), `steps` midpoint-rule steps; attributions sum to
    log p(x) - log p(baseline)). The default baseline -1 is a dark image; exactly 0 is a bad
    one: an encoder without a patch-embedding bias (Qwen2-VL) normalizes an all-zero input
    differently from its limit, so completeness fails there.
    Returns a `Saliency`: in the model's input layout, and (`image_map`, `image_attribution`) in
    the image's own pixels."""
    if method not in ("gradient", "integrated"):
        raise InvalidRequestError(f"method must be 'gradient' or 'integrated', got {method!r}", param="method")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidRequestError(f"steps must be a positive integer, got {steps!r}", param="steps")
    images: list = [image]
    if isinstance(prompt, list):
        images = []
    elif vlm.family.image_token not in str(prompt):
        prompt = vlm.render_chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                               {"type": "text", "text": str(prompt)}]}])[0]
    pixels, _, vg, args, _, inputs = _prepare(vlm, prompt, images, answer, image_options)
    if len(pixels) != 1:
        raise InvalidRequestError(f"saliency takes one image, the prompt has {len(pixels)}", param="image")
    params, x = model_state(vlm), pixels[0]
    lp, (g,) = vg(params, [x], *args)
    if method == "gradient":
        attr = np.asarray(g)
    else:
        base = np.broadcast_to(np.asarray(baseline, np.float32), x.shape)
        total = np.zeros_like(x)
        for k in range(steps):
            _, (gk,) = vg(params, [base + (k + 0.5) / steps * (x - base)], *args)
            total += np.asarray(gk)
        attr = (x - base) * total / steps
    sal = Saliency(np.abs(attr).sum(axis=-1), attr, x, float(lp))
    if inputs[0].source_size is not None:
        from mmjax.image.geometry import to_image
        h, w = inputs[0].source_size
        views = vlm.family.pixel_views(inputs[0], h, w)
        sal.image_map = to_image(sal.map, views, h, w)
        sal.image_attribution = to_image(attr, views, h, w)
    return sal
