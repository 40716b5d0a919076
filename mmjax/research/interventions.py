"""Per-request interventions on image tokens, batched by the engine like any other request.

`Ablate` and `Pool` act on an image's encoder features on the host, between the encoder (and its
cache) and the LLM: they return a new `ImageInput` whose `post` transforms the features and whose
`key` names the intervention, so the encoder cache keeps the transformed features apart and the
prefix cache never shares KV between an image and its ablated or pooled self. A pooled image
really has fewer tokens: its prompt, KV cache and compute shrink with it (`usage` shows it).
`Prune` (FastV) acts inside the LLM instead: the engine drops image tokens after a decoder layer.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from mmjax.errors import InvalidRequestError
from mmjax.models.family import Family, ImageInput


class Intervention:
    """Base: `apply(family, image) -> ImageInput` (host, before the request is tokenized)."""

    def apply(self, family: Family, image: ImageInput) -> ImageInput:
        raise NotImplementedError

    def tag(self) -> str:
        """Names the intervention inside cache keys."""
        return repr(self)

    def engine_args(self, num_image_tokens: int) -> dict:
        """Extra `Engine.add_request` arguments (interventions acting inside the LLM)."""
        return {}


@dataclass(frozen=True)
class Ablate(Intervention):
    """Replace chosen image tokens' features before the LLM.

    tokens: indexes into the image's tokens (feature order; see `Family.token_grid`), or None
        for all of them.
    mode: "zero" (features set to 0), "mean" (set to the mean over the image's tokens) or
        "noise" (Gaussian noise added, `scale` x the std of the image's features, seeded).
    """
    tokens: tuple[int, ...] | None = None
    mode: str = "zero"
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("zero", "mean", "noise"):
            raise InvalidRequestError(f"Ablate.mode must be 'zero', 'mean' or 'noise', got {self.mode!r}",
                                      param="intervention.mode")
        if self.tokens is not None:
            object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))

    def tag(self) -> str:
        toks = "all" if self.tokens is None else hashlib.sha256(np.asarray(self.tokens).tobytes()).hexdigest()[:16]
        return f"ablate:{self.mode}:{toks}:{self.scale}:{self.seed}"

    def apply(self, family: Family, image: ImageInput) -> ImageInput:
        n = image.num_tokens
        rows = np.arange(n) if self.tokens is None else np.asarray(self.tokens, np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise InvalidRequestError(f"Ablate.tokens must lie in [0, {n}) for this image", param="intervention.tokens")

        def post(feats: np.ndarray, inner=image.post) -> np.ndarray:
            f = np.array(inner(feats) if inner else feats, copy=True)
            if self.mode == "zero":
                f[rows] = 0
            elif self.mode == "mean":
                f[rows] = f.mean(axis=0, keepdims=True)
            else:
                noise = np.random.default_rng(self.seed).standard_normal((len(rows), f.shape[1]))
                f[rows] += (self.scale * f.std() * noise).astype(f.dtype)
            return f
        return dataclasses.replace(image, post=post, key=f"{image.key}|{self.tag()}")


@dataclass(frozen=True)
class Pool(Intervention):
    """Average-pool each frame's grid of image tokens by `factor` x `factor` before the LLM (edge
    windows average the tokens they hold): ceil(rows / f) x ceil(cols / f) tokens per frame."""
    factor: int = 2

    def __post_init__(self):
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 1:
            raise InvalidRequestError(f"Pool.factor must be a positive integer, got {self.factor!r}",
                                      param="intervention.factor")

    def tag(self) -> str:
        return f"pool:{self.factor}"

    def apply(self, family: Family, image: ImageInput) -> ImageInput:
        t, r, c = family.token_grid(image)
        f = self.factor
        pr, pc = -(-r // f), -(-c // f)

        def post(feats: np.ndarray, inner=image.post) -> np.ndarray:
            x = np.asarray(inner(feats) if inner else feats)
            return pool_grid(x.reshape(t, r, c, -1), f).reshape(t * pr * pc, -1)
        return dataclasses.replace(image, post=post, key=f"{image.key}|{self.tag()}",
                                   num_tokens=t * pr * pc, token_grid=(t, pr, pc))


def pool_grid(x: np.ndarray, f: int) -> np.ndarray:
    """[t, r, c, d] -> [t, ceil(r/f), ceil(c/f), d]: the mean of each f x f window (edge windows
    over the cells they hold)."""
    t, r, c, d = x.shape
    pr, pc = -(-r // f), -(-c // f)
    pad = np.zeros((t, pr * f, pc * f, d), np.float64)
    cnt = np.zeros((1, pr * f, pc * f, 1), np.float64)
    pad[:, :r, :c] = x
    cnt[:, :r, :c] = 1
    s = pad.reshape(t, pr, f, pc, f, d).sum(axis=(2, 4))
    n = cnt.reshape(1, pr, f, pc, f, 1).sum(axis=(2, 4))
    return (s / n).astype(x.dtype)



@dataclass(frozen=True)
class Prune(Intervention):
    """FastV: after decoder layer `layer`, keep the `keep` image tokens that received the most
    attention at that layer (head-averaged, from the prompt's last token) and drop the others
    from the later layers' computation and KV cache, for the prefill and every decode step
    (`RequestOutput.pruned_tokens`). keep: a count over the request's image tokens, or a
    fraction in (0, 1] of them. The prompt is prefilled in one call (it must fit prefill_chunk)
    and its KV is not shared through the prefix cache. Text models with `supports_prune`
    (every decoder here); `layer` at most the text model's `max_prune_layer` (Gemma 4's KV-shared
    layers must read caches written after the prune)."""
    keep: int | float
    layer: int = 2

    def __post_init__(self):
        k = self.keep
        if isinstance(k, bool) or not isinstance(k, (int, float)) or k <= 0 or (isinstance(k, float) and k > 1):
            raise InvalidRequestError(f"Prune.keep must be a positive count or a fraction in (0, 1], got {k!r}",
                                      param="intervention.keep")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise InvalidRequestError(f"Prune.layer must be a non-negative integer, got {self.layer!r}",
                                      param="intervention.layer")

    def apply(self, family: Family, image: ImageInput) -> ImageInput:
        return image                     # acts inside the LLM (`engine_args`), not on features

    def engine_args(self, num_image_tokens: int) -> dict:
        """The engine's `prune=(layer, keep)` for a request with this many image tokens."""
        keep = self.keep if isinstance(self.keep, int) else max(1, round(self.keep * num_image_tokens))
        return {"prune": (self.layer, int(keep))}


def intervention_from_json(obj) -> Intervention:
    """The server's request field: {"type": "prune", "keep": 0.25 | 16, "layer": 2},
    {"type": "pool", "factor": 2} or {"type": "ablate", "tokens": [..] | null, "mode": "zero" |
    "mean" | "noise", "scale": 1.0, "seed": 0} -> the intervention (InvalidRequestError naming
    the bad field otherwise)."""
    param = "intervention"
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{param} must be an object with a 'type'", param=param)
    kinds = {"prune": (Prune, {"keep", "layer"}), "pool": (Pool, {"factor"}),
             "ablate": (Ablate, {"tokens", "mode", "scale", "seed"})}
    kind = obj.get("type")
    if kind not in kinds:
        raise InvalidRequestError(f"{param}.type must be one of {sorted(kinds)}, got {kind!r}", param=f"{param}.type")
    cls, allowed = kinds[kind]
    extra = set(obj) - allowed - {"type"}
    if extra:
        raise InvalidRequestError(f"{param}: unknown field(s) {sorted(extra)} for type {kind!r} "
                                  f"(allowed: {sorted(allowed)})", param=f"{param}.{sorted(extra)[0]}")
    kw = {k: v for k, v in obj.items() if k != "type"}
    if kind == "prune" and "keep" not in kw:
        raise InvalidRequestError(f"{param}.keep is required for type 'prune'", param=f"{param}.keep")
    if kind == "ablate":
        toks = kw.get("tokens")
        if toks is not None and (not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                        for t in toks)):
            raise InvalidRequestError(f"{param}.tokens must be a list of integers or null", param=f"{param}.tokens")
        for name, types in (("scale", (int, float)), ("seed", (int,))):
            if name in kw and (isinstance(kw[name], bool) or not isinstance(kw[name], types)):
                raise InvalidRequestError(f"{param}.{name} must be a number", param=f"{param}.{name}")
    return cls(**kw)     # the dataclasses check their values (InvalidRequestError naming the field)
