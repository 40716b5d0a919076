"""Request types: what a client submits and the engine's state of it (`Request`, built and
validated by `InputProcessor.make_request`), what each step streams back (`Delta`) and what a
finished request returns (`RequestOutput`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmjax.errors import MMJaxError
from mmjax.models.family import ImageInput
from mmjax.serving.sampling import SamplingParams
from mmjax.tokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    """What one step produced for one request (streamed to clients)."""
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool = False
    finish_reason: str | None = None
    error: MMJaxError | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_image_tokens: int = 0        # image tokens in the prompt (videos' not included)
    cached_tokens: int = 0
    pruned_tokens: int = 0           # image tokens FastV pruning dropped after its layer
    num_video_tokens: int = 0        # video tokens in the prompt
    index: int = 0                   # choice index (n > 1)
    siblings: list["RequestOutput"] = field(default_factory=list)  # n > 1: choices 1..n-1 (offline API)
    # SamplingParams.prompt_logprobs (vLLM's offline shape): None for the first prompt token, then per
    # position {token id: prompt_logprobs.Logprob(logprob, rank, decoded_token)} for the prompt token
    # and the top-k; choice 0 only (siblings share its prompt)
    prompt_logprobs: list[dict | None] | None = None


@dataclass(kw_only=True)
class Request:
    """One request: what the client asked for, fixed once `InputProcessor.make_request` built it
    (n > 1 copies differ in `id`, `sampling`, `rng_key` and its token rules), and the state the
    engine keeps while it runs (written only by the engine thread)."""
    # ---- the input: the tokenized prompt and how to sample it ---------------------------------
    id: str
    prompt_ids: np.ndarray           # [prompt_len] with image tokens expanded
    images: list[ImageInput]         # its images and videos (ImageInput.kind), in prompt order
    image_starts: list[int]          # prompt index of each image's first token
    image_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # prompt index of
    #                                  each image token, in order (image i owns the next num_tokens)
    positions: np.ndarray            # [position_rows, prompt_len]
    rope_delta: int
    runs: np.ndarray | None = None   # [n, 2] bidirectional image-token runs (start, end), if any
    cross: np.ndarray | None = None  # [prompt_len] packed image ranges (cross-attention families)
    prefix_keys: np.ndarray          # [prompt_len] int64 prefix-cache key of each prompt token
    sampling: SamplingParams
    rng_key: np.ndarray              # [2] uint32 PRNG key of its sampling stream
    vrow: Any = None                 # sampling.VocabRow of penalties / bias / token limits (None: none)
    constraints: list = field(default_factory=list)  # host TokenConstraints (bad words, grammar)
    allow: np.ndarray | None = None  # with constraints: [bit words] uint32, the tokens allowed_token_ids and
    #                                  one-token bad words leave (None: all), checked against each step's mask
    prune: tuple[int, int] | None = None   # FastV (layer, keep): image tokens kept after `layer`
    lora: str | None = None          # the LoRA adapter's name (None: the base model)
    adapter: int = -1                # its adapter slot (mmjax.lora.Adapters)
    encoder_salt: str = ""           # its adapter's salt if the adapter changes the encoder (else "")
    cache_salt: str = ""             # folded into its page hashes (e.g. a LoRA adapter's name)
    parent: "Request | None" = None  # n > 1: the sibling whose prompt KV this one copies (see Engine.siblings)
    index: int = 0                   # choice index among its siblings
    arrival: float = field(default_factory=time.monotonic)

    # ---- scheduling: where it runs and how far its prefill got -------------------------------
    slot: int | None = None
    prefilled: int = 0
    cached_tokens: int = 0
    admitted_seq: int = 0            # admission order: the latest admitted is preempted first
    inflight: int = 0                # tokens sampled by dispatched steps the host has not read yet
    compile_wait: Any = None         # (kind, shape) of its step compiling in the background: not prefilled until done
    features: list = field(default_factory=list)  # per image: its features [tokens, hidden] once encoded
    #                                  (None before; dropped once its prompt is in the KV cache)
    cross_filled: bool = False       # its images' cross-attention K/V are in its slot
    # the paged KV cache (serving/pages.py): its pages in cache-index order, the chain hash of each
    # full page of its prompt (prefix sharing), and preemption (recompute: `resume_ids`, the output
    # tokens whose KV is recomputed after the prompt, and `resume_row`, its saved decode-state row)
    pages: list = field(default_factory=list)
    page_hashes: list = field(default_factory=list)
    preemptions: int = 0
    resume_ids: np.ndarray | None = None
    resume_row: Any = None

    # ---- output: what it produced ------------------------------------------------------------
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_scores: list | None = None  # prompt_logprobs: per prefill chunk, runner.prompt_scores arrays
    text: str = ""                   # text after stop-string handling
    emitted: int = 0                 # chars of `text` already streamed
    finish_reason: str | None = None
    error: MMJaxError | None = None
    first_token_time: float | None = None

    @property
    def encoder_adapter(self) -> int:
        """The adapter slot its images are encoded under (-1: the base encoder)."""
        return self.adapter if self.encoder_salt else -1

    def feature_key(self, image) -> str:
        """The encoder-cache key of one of its images: the image's, salted by the adapter where
        the adapter changes the encoder (its features are not the base model's)."""
        return f"{image.key}|{self.encoder_salt}" if self.encoder_salt else image.key

    def waits_for_parent(self) -> bool:
        """A sibling is admitted once its parent's prompt is in the cache (then copied), unless
        the parent ended first."""
        p = self.parent
        return p is not None and p.finish_reason is None and (p.slot is None or p.prefilling)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_image_tokens(self) -> int:
        """Image tokens (videos' not included)."""
        return sum(im.num_tokens for im in self.images if im.kind != "video")

    @property
    def num_video_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images if im.kind == "video")

    def image_end(self, i: int) -> int:
        """Prompt index just past image i's last token."""
        return int(self.image_pos[sum(im.num_tokens for im in self.images[:i + 1]) - 1]) + 1

    @property
    def pruned_tokens(self) -> int:
        """Image tokens FastV pruning removes from the layers after its layer."""
        return 0 if self.prune is None else sum(im.num_tokens for im in self.images) - self.prune[1]

    def kv_positions(self, layer: int) -> int:
        """Cache positions this request uses in `layer` (prompt + output tokens, less what
        pruning dropped there)."""
        n = self.prompt_len + len(self.output_ids) + self.inflight
        return n - self.pruned_tokens if self.prune is not None and layer > self.prune[0] else n

    @property
    def prefill_len(self) -> int:
        """Tokens the prefill writes: the prompt, plus the output tokens a preempted request
        recomputes (`resume_ids`)."""
        return self.prompt_len + (0 if self.resume_ids is None else len(self.resume_ids))

    def seq_ids(self, lo: int, hi: int) -> np.ndarray:
        """Token ids [lo, hi) of the prefilled sequence (prompt, then `resume_ids`)."""
        if self.resume_ids is None or hi <= self.prompt_len:
            return self.prompt_ids[lo:hi]
        return np.concatenate([self.prompt_ids, self.resume_ids.astype(self.prompt_ids.dtype)])[lo:hi]

    def seq_positions(self, lo: int, hi: int) -> np.ndarray:
        """RoPE positions [rows, hi - lo] of the prefilled sequence: a resumed output token's is
        its cache index + rope_delta (as the decode step's)."""
        if self.resume_ids is None or hi <= self.prompt_len:
            return self.positions[:, lo:hi]
        extra = np.arange(self.prompt_len, self.prefill_len) + self.rope_delta
        both = np.concatenate([self.positions, np.broadcast_to(extra, (self.positions.shape[0], len(extra)))
                               .astype(self.positions.dtype)], axis=1)
        return both[:, lo:hi]

    def seq_keys(self) -> np.ndarray:
        """Prefix-cache keys of the prefilled sequence (`prefix_keys`, then the resumed output ids)."""
        if self.resume_ids is None:
            return self.prefix_keys
        return np.concatenate([self.prefix_keys, self.resume_ids.astype(np.int64)])

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_len

    def output(self) -> RequestOutput:
        return RequestOutput(self.id, self.prompt_ids.tolist(), list(self.output_ids), self.text, self.logprobs,
                             self.finish_reason, self.num_image_tokens, self.cached_tokens, self.pruned_tokens,
                             num_video_tokens=self.num_video_tokens, index=self.index)
