"""Input processing: a client's prompt, images and sampling parameters -> a validated `Request`
(vLLM's InputProcessor). Tokenizing (image placeholders expanded), the family's positions, the
prefix-cache keys (salted by a LoRA adapter), the token rules a request samples under (penalties,
bias, allowed / bad tokens, its structured-output grammar) and the n > 1 copies of a request.
Host-only and free of engine state: safe from any thread (the server builds requests off the
engine thread)."""
from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from mmjax.errors import ContextLengthError, InvalidRequestError, PromptError, UnsupportedModelError
from mmjax.models.family import ImageInput, image_runs
from mmjax.serving.caches import salt_keys, token_keys
from mmjax.serving.constraints import BadWords, bad_word_ids
from mmjax.serving.request import Request
from mmjax.serving.sampling import SamplingParams, vocab_row
from mmjax.serving.structured import Grammar, GrammarCompiler, GrammarError, allowed_bits, grammar_constraint
from mmjax.tokenizer import IncrementalDetokenizer


class InputProcessor:
    def __init__(self, model, runner, *, max_model_len: int, prefill_chunk: int, max_images_per_request: int,
                 adapters=None):
        """model: the loaded VLM (its tokenizer, family and EOS ids); runner: the engine's
        `ModelRunner` (vocabulary size, bitmask width, the text model's pruning limits);
        adapters: the engine's `mmjax.lora.Adapters` (None: no LoRA)."""
        self.model = model
        self.tokenizer = model.tokenizer
        self.family = model.family
        self.runner = runner
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.max_images_per_request = max_images_per_request
        self.adapters = adapters
        self.grammars = GrammarCompiler(self.tokenizer, runner.vocab_size, model.eos_token_ids)
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()

    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text (UTF-8 bytes) that could still fit the context: anything longer is
        rejected before the tokenizer runs (tokenizing 100 MiB of text costs seconds and GBs)."""
        return self.max_model_len * self.tokenizer.max_token_bytes

    def lora_slot(self, name: str | None) -> int:
        """The adapter slot of a loaded adapter (None: -1, the base model); LoRANotFoundError."""
        if name is None:
            return -1
        if self.adapters is None:
            from mmjax.errors import LoRANotFoundError
            raise LoRANotFoundError(f"the model {name!r} does not exist (this engine serves no LoRA adapters: "
                                    "max_loras=0)", param="model")
        return self.adapters.slot_of(name)

    def make_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     prune: tuple[int, int] | None = None, lora: str | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        prune (layer, keep): FastV, keep `keep` image tokens after decoder `layer` (see
        mmjax.research.Prune). lora: the name of a loaded LoRA adapter (None: the base model)."""
        adapter = self.lora_slot(lora)
        if lora is not None and prune is not None:
            raise InvalidRequestError("image-token pruning cannot be combined with a LoRA adapter", param="model")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}",
                                      param="sampling")
        images = list(images)
        if len(images) > self.max_images_per_request:
            raise InvalidRequestError(f"{len(images)} images in one request exceeds the limit of "
                                      f"{self.max_images_per_request}", param="images", code="too_many_images")
        counts = [im.num_tokens for im in images]
        if isinstance(prompt, str):
            try:
                n_bytes = len(prompt.encode("utf-8"))
            except UnicodeEncodeError as e:  # a lone surrogate (e.g. JSON "\ud800") is not text
                raise InvalidRequestError(f"prompt text is not valid Unicode: {e.reason} at character {e.start}",
                                          param="messages", code="invalid_text") from None
            if n_bytes > self.max_prompt_bytes:
                raise ContextLengthError(f"prompt text is {n_bytes} bytes, more than any prompt that fits the "
                                         f"context of {self.max_model_len} tokens can hold "
                                         f"({self.max_prompt_bytes} bytes)", param="messages")
            ids = self.tokenizer.encode_prompt(prompt, counts, self.family.image_prompts(images),
                                               [self.family.token_id_of(im) for im in images])
        else:
            ids = list(prompt)
        ids = np.asarray(ids, np.int32)
        if len(ids) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens (including {sum(counts)} image tokens); "
                                     f"the context is {self.max_model_len} tokens", param="messages")
        starts = self.family.image_starts(ids, counts)
        for i, (im, st) in enumerate(zip(images, starts)):
            if counts[i] and ids[st] != self.family.feature_token_id(im):
                raise PromptError(f"input {i} is {'a video' if im.kind == 'video' else 'an image'} but its "
                                  "placeholder tokens are not", param="videos" if im.kind == "video" else "images")
        runs = None
        if self.family.bidirectional_images:
            runs = image_runs(ids, self.family.image_token_id)
            longest = int((runs[:, 1] - runs[:, 0]).max(initial=0))
            if longest > self.prefill_chunk:
                raise ContextLengthError(f"an image of {longest} tokens must be prefilled in one chunk, but "
                                         f"prefill_chunk is {self.prefill_chunk}", param="images")
        positions, rope_delta = self.family.positions(ids, images, starts)
        cross = self.family.cross_ranges(ids, images) if self.family.cross_attention else None
        image_pos = np.flatnonzero(np.isin(ids, self.family.media_token_ids))
        if prune is not None:
            self._check_prune(prune, len(ids), len(image_pos))
            if sampling.prompt_logprobs is not None:
                raise InvalidRequestError("prompt_logprobs cannot be combined with image-token pruning",
                                          param="prompt_logprobs")
        seed = sampling.seed if sampling.seed is not None else int(self._seed_rng.integers(2**31))
        rng_key = np.asarray([0, seed & 0xFFFFFFFF], np.uint32)  # == jax.random.PRNGKey(seed) for 32-bit seeds
        rid = request_id or f"req-{next(self._ids)}"
        vrow, constraints, allow = self.token_rules(sampling, ids)
        prefix_keys = token_keys(ids, images, image_pos, all_images_first=cross is not None)
        if lora is not None:           # the adapter's KV is not the base model's
            prefix_keys = salt_keys(prefix_keys, self.adapters.salt(lora))
        return Request(id=rid, prompt_ids=ids, images=images, image_starts=starts, positions=positions,
                       rope_delta=rope_delta, sampling=sampling, rng_key=rng_key,
                       detok=IncrementalDetokenizer(self.tokenizer, sampling.skip_special_tokens),
                       prefix_keys=prefix_keys, cross=cross, lora=lora, adapter=adapter,
                       encoder_salt=self.adapters.encoder_salt(lora) if lora is not None else "",
                       logprobs=[] if sampling.logprobs is not None else None, features=[im.embeds for im in images],
                       image_pos=image_pos, runs=runs, prune=None if prune is None else tuple(prune),
                       vrow=vrow, constraints=constraints, allow=allow)

    def siblings(self, req: Request, n: int) -> list[Request]:
        """n > 1: `req` and n - 1 copies sampling the same prompt (ids `{id}-1` ...), each with its
        own PRNG stream (with a seed: (i, seed), so the same seed gives the same choices; request
        0 keeps the PRNG key a lone request with that seed has). The copies wait until `req`'s prompt
        is in the cache, then copy its cache row and recompute only the last prompt token."""
        out = [req]
        seed = req.sampling.seed
        for i in range(1, n):
            sp = dataclasses.replace(req.sampling, prompt_logprobs=None)   # choice 0 carries the prompt's
            rng_key = (np.asarray([i, seed & 0xFFFFFFFF], np.uint32) if seed is not None
                   else np.asarray([0, int(self._seed_rng.integers(2**31))], np.uint32))
            vrow, constraints, allow = self.token_rules(sp, req.prompt_ids)
            out.append(dataclasses.replace(
                req, id=f"{req.id}-{i}", sampling=sp, rng_key=rng_key,
                detok=IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens),
                logprobs=[] if sp.logprobs is not None else None, features=list(req.features), vrow=vrow,
                constraints=constraints, allow=allow, parent=req, index=i, output_ids=[], arrival=time.monotonic()))
        return out

    def token_rules(self, sp: SamplingParams, prompt_ids: np.ndarray):
        """(VocabRow or None, host constraints, allowed-token bitmask or None) of a request:
        penalties, logit_bias, allowed_token_ids, min_tokens and bad words (token ids checked
        against the vocabulary), and its structured-output grammar, if any (refused up front
        when it cannot be satisfied, within allowed_token_ids / bad words too). The bitmask
        holds the tokens allowed_token_ids and one-token bad words leave (None: all), for the
        per-step check that a constrained request still has a token to sample (`fill_bits`)."""
        vocab = self.runner.vocab_size
        for name, ids in (("logit_bias", list(sp.logit_bias or ())), ("allowed_token_ids", sp.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name} holds token id {bad[0]}, out of the vocabulary (size {vocab})",
                                          param=name)
        constraints: list = []
        single: list[int] = []
        if sp.bad_words:
            seqs = bad_word_ids(self.tokenizer, sp.bad_words)
            single = [s[0] for s in seqs if len(s) == 1]
            if any(len(s) > 1 for s in seqs):
                constraints.append(BadWords(seqs))
        allow = allowed_bits(self.runner.bit_words, vocab, sp.allowed_token_ids, single)
        if allow is not None and not allow.any():
            raise InvalidRequestError("no token is left to sample: bad_words ban every one of allowed_token_ids",
                                      param="bad_words")
        if sp.structured is not None:
            constraints.append(grammar_constraint(self, sp.structured, allow))
        vrow = None
        if sp.needs_vocab_row:
            vrow = vocab_row(sp, vocab, prompt_ids, self.model.eos_token_ids, single)
        return vrow, constraints, (allow if constraints else None)


    def _check_prune(self, prune, prompt_len: int, n_image: int) -> None:
        tm = self.runner.text_model
        if not tm.supports_prune:
            raise UnsupportedModelError(f"token pruning is not implemented for {type(tm).__name__}",
                                        param="intervention")
        layer, keep = prune
        last = tm.max_prune_layer     # a later layer must remain
        if not 0 <= layer <= last:
            raise InvalidRequestError(f"Prune.layer must lie in [0, {last}] for this model, got {layer}",
                                      param="intervention.layer")
        if not 1 <= keep <= n_image:
            raise InvalidRequestError(f"Prune.keep must lie in [1, {n_image}] (the prompt's image tokens), "
                                      f"got {keep}", param="intervention.keep")
        if prompt_len > self.prefill_chunk:
            raise ContextLengthError(f"a pruned request is prefilled in one call: its prompt of {prompt_len} "
                                     f"tokens is over prefill_chunk={self.prefill_chunk}", param="intervention")

def fill_bits(req: Request, out: np.ndarray) -> None:
    """AND `req`'s host constraints into its bitmask row out [bit_words]. Raises (the request's
    error: GrammarError for an output constraint) when its grammar's matcher fails or no
    token is left to sample (within allowed_token_ids / one-token bad words too)."""
    for c in req.constraints:
        c.fill(out, req.output_ids)
    left = out if req.allow is None else out & req.allow
    if not left.any():
        g = next((c for c in req.constraints if isinstance(c, Grammar)), None)
        if g is not None:
            raise GrammarError(f"the output constraint '{g.param}' cannot go on after {len(req.output_ids)} "
                               "generated token(s): no token it allows is left"
                               + (" within allowed_token_ids / bad_words" if req.allow is not None else ""),
                               param=g.param)
        raise InvalidRequestError(f"no token is left to sample after {len(req.output_ids)} generated token(s): "
                                  "bad_words ban every token allowed_token_ids leaves", param="bad_words")
