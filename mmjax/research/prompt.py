"""A prompt with its images laid out as the serving path lays them out (host side, numpy): the
token ids with image tokens expanded, which prompt index takes which image feature, RoPE
positions and the bidirectional image spans. Shared by `VLM.logits`, `trace` and `gradients`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from mmjax.errors import InvalidRequestError
from mmjax.models.family import ImageInput, run_spans


@dataclass
class PromptInputs:
    ids: np.ndarray             # [t] int32, image tokens expanded (and the answer, if any, appended)
    images: list[ImageInput]
    image_pos: np.ndarray       # [image tokens] prompt index of each image token (image i: the next num_tokens)
    positions: np.ndarray       # [position_rows, t] int32
    spans: np.ndarray           # [t] int32 image-token run ids, -1 elsewhere
    prompt_len: int             # tokens before the answer

    def image_positions(self, i: int) -> np.ndarray:
        """Prompt indexes of image i's tokens, in feature order."""
        off = sum(im.num_tokens for im in self.images[:i])
        return self.image_pos[off:off + self.images[i].num_tokens]


def prompt_inputs(vlm, prompt: Any, images: Iterable[Any] = (), *, answer: str | None = None,
                  image_options: dict | None = None, intervention=None) -> PromptInputs:
    """prompt: a raw prompt / ChatPrompt with one placeholder per image, or OpenAI-style messages
    (their image parts are the images; `images` must then be empty). answer: text appended after
    the prompt as its own tokens (no special tokens)."""
    if isinstance(prompt, list):
        if list(images):
            raise InvalidRequestError("pass images inside the messages or as `images`, not both", param="images")
        prompt, images = vlm.render_chat(prompt)
    if vlm.family.cross_attention:
        from mmjax.errors import UnsupportedModelError
        raise UnsupportedModelError(f"{vlm.family.name}: whole-prompt logits / research tools are not implemented for "
                                    "cross-attention families (generation is)", param="model")
    inputs = vlm.prepare_images(images, image_options, intervention=intervention)
    family = vlm.family
    counts = [im.num_tokens for im in inputs]
    ids = vlm.tokenizer.encode_prompt(prompt, counts, family.image_prompts(inputs),
                                      [family.token_id_of(im) for im in inputs])
    prompt_len = len(ids)
    if answer is not None:
        answer_ids = vlm.tokenizer.encode(answer, add_special_tokens=False)
        if not answer_ids:
            raise InvalidRequestError("the answer is empty", param="answer")
        ids = list(ids) + list(answer_ids)
    ids = np.asarray(ids, np.int32)
    starts = family.image_starts(ids, counts)
    positions, _ = family.positions(ids, inputs, starts)
    return PromptInputs(ids, inputs, np.flatnonzero(np.isin(ids, family.media_token_ids)), positions,
                        run_spans(ids, family.image_token_id), prompt_len)
