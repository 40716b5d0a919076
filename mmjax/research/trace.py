"""Look inside: per-layer hidden states and attention probabilities over a whole prompt, split
into text and image tokens, each image with its token grid, and attention heatmaps on that grid.

Runs `runner.make_prompt_forward(family, Capture(...))`: the text model's own `forward` with a
static capture flag (captured layers use the explicit-softmax attention, same math), so the
serving steps are untouched."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from mmjax.errors import InvalidRequestError
from mmjax.models.nn.capture import Capture


@dataclass
class TracedImage:
    """One image of a traced prompt: its prompt indexes (feature order) and token grid (frames or
    tiles, rows, cols)."""
    index: int
    positions: np.ndarray
    grid: tuple[int, int, int]


@dataclass
class Trace:
    """ids [t]; tokens: their strings (image tokens as the family's placeholder); logits [t, vocab]
    float32; hidden {i: [t, hidden]} with HF's `hidden_states` numbering (0 = embeddings, i + 1 =
    after decoder layer i, the last one final-normed); attn {layer i: [heads, t, t]} (or
    [1, t, t] head-averaged);
    text_positions: prompt indexes of non-image tokens; answer_positions: those of the appended
    answer's tokens (empty without one)."""
    ids: np.ndarray
    tokens: list[str]
    logits: np.ndarray
    images: list[TracedImage]
    text_positions: np.ndarray
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    attn: dict[int, np.ndarray] = field(default_factory=dict)
    answer_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def attention_to_image(self, layer: int, image: int = 0, query: int = -1, head: int | None = None) -> np.ndarray:
        """Attention [image tokens] that prompt token `query` pays to each of `image`'s tokens at
        `layer` (head-averaged unless `head`), in feature order."""
        if layer not in self.attn:
            raise InvalidRequestError(f"layer {layer} was not traced (traced: {sorted(self.attn)})", param="layer")
        a = self.attn[layer]
        row = a[:, query].mean(axis=0) if head is None else a[head, query]
        return row[self.images[image].positions]

    def heatmap(self, layer: int, image: int = 0, query: int = -1, head: int | None = None) -> np.ndarray:
        """`attention_to_image` on the image's token grid: [rows, cols], or [frames, rows, cols]
        for an image with several frames or tiles."""
        im = self.images[image]
        m = self.attention_to_image(layer, image, query, head).reshape(im.grid)
        return m[0] if im.grid[0] == 1 else m

    def image_hidden(self, index: int, image: int = 0) -> np.ndarray:
        """hidden[index] rows of `image`'s tokens [num_tokens, hidden]."""
        return self.hidden[index][self.images[image].positions]


def trace(vlm, prompt: Any, images: Iterable[Any] = (), *, layers: Iterable[int] | None = None,
          what: Iterable[str] = ("hidden", "attn"), heads: str = "all", image_options: dict | None = None,
          intervention=None, answer: str | None = None, lora=None) -> Trace:
    """Trace one prompt (raw / ChatPrompt with placeholders, or OpenAI-style messages).

    layers: decoder layers whose attention (and hidden state after them) to keep; None: all.
    what: any of "hidden", "attn". heads: "all" ([heads, t, t]) or "mean" ([1, t, t]).
    answer: text appended after the prompt (e.g. the model's reply), so its tokens' attention
    rows are traced too (`Trace.answer_positions`). lora: a LoRA adapter as `vlm.generate` takes
    one (a `mmjax.lora.LoRARequest` or a loaded adapter's name; None: the base model)."""
    from mmjax.research.prompt import prompt_inputs

    what = set(what)
    if not what or what - {"hidden", "attn"}:
        raise InvalidRequestError(f"what must be a non-empty subset of ('hidden', 'attn'), got {sorted(what)}",
                                  param="what")
    if heads not in ("all", "mean"):
        raise InvalidRequestError(f"heads must be 'all' or 'mean', got {heads!r}", param="heads")
    n_layers = vlm.model.language_model.num_layers
    layers = tuple(range(n_layers)) if layers is None else tuple(sorted({int(i) for i in layers}))
    if any(not 0 <= i < n_layers for i in layers):
        raise InvalidRequestError(f"layers must lie in [0, {n_layers})", param="layers")
    p = prompt_inputs(vlm, prompt, images, image_options=image_options, intervention=intervention, answer=answer)
    capture = Capture(hidden="hidden" in what, attn_layers=layers if "attn" in what else ())
    logits, inter = vlm.prompt_forward(p, capture, lora=lora)
    hidden = {}
    if "hidden" in what:
        keep = set(range(n_layers + 1)) if len(layers) == n_layers else {0, *(i + 1 for i in layers)}
        hidden = {i: h[0] for i, h in enumerate(inter["hidden"]) if i in keep}
    attn = {}
    for i, probs in inter.get("attn", {}).items():
        a = probs[0]                                    # [heads, t, t]
        attn[int(i)] = a.mean(axis=0, keepdims=True) if heads == "mean" else a
    family = vlm.family
    placeholder = family.image_token
    tokens = [placeholder if t == family.image_token_id else (vlm.tokenizer.id_to_token(t) or "") for t in p.ids]
    traced = [TracedImage(i, p.image_positions(i), family.token_grid(im)) for i, im in enumerate(p.images)]
    text_pos = np.flatnonzero(p.ids != family.image_token_id)
    return Trace(p.ids, tokens, logits, traced, text_pos, hidden, attn, np.arange(p.prompt_len, len(p.ids)))
