"""From a parsed OpenAI request to engine Requests, shared by every route that takes a prompt:
the model check, images fetched / decoded concurrently, and (in the thread pool) the chat
template, tokenization, validation and the completion's size."""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from mmjax.errors import ContextLengthError, InvalidRequestError, PromptError
from serve import schema, tools
from serve.schema import NotFoundError
from serve.state import State

log = logging.getLogger("mmjax.serve")


def check_model(st: State, model: str | None) -> None:
    if model is not None and model != st.config.served_model_name and model not in st.engine.lora_names:
        raise NotFoundError(f"the model {schema.short(model)} does not exist; this server serves "
                            f"{st.config.served_model_name!r}"
                            + (f" and the LoRA adapters {st.engine.lora_names}" if st.engine.lora_names else ""),
                            param="model")


def _lora_of(st: State, model: str | None) -> str | None:
    """The LoRA adapter a request's "model" names (None: the base model)."""
    return model if model is not None and model != st.config.served_model_name else None


def _retrieve(task: asyncio.Future) -> None:
    """Mark a finished task's exception as retrieved: asyncio logs 'Task exception was never
    retrieved' for every one it collects otherwise (several images failing together, or failing
    after the request itself failed, was cancelled or its client left)."""
    if not task.cancelled():
        task.exception()


async def _load_embeds(st: State, ref):
    """An image_embeds part -> ImageInput (base64 .npy decoded and checked in the pool)."""
    from mmjax.image.embeds import decode_npy, image_from_embeds

    b64, grid = ref.embeds

    def run():
        return image_from_embeds(st.vlm.family, st.vlm.model.language_model, decode_npy(b64, st.config.max_image_bytes, ref.param), grid,
                                 param=ref.param)
    return await asyncio.get_running_loop().run_in_executor(st.executor, run)


async def load_images(st: State, refs) -> list:
    """Fetch + decode all images concurrently; the first failure (in prompt order) cancels the
    rest. Every task's outcome is retrieved, whichever way this returns."""
    if not refs:
        return []
    n_images = sum(getattr(r, "kind", "image") == "image" for r in refs)    # a prompt's images (not videos)
    tasks = [asyncio.ensure_future(_load_embeds(st, r) if r.embeds is not None else st.fetcher.load(r, n_images=n_images))
             for r in refs]
    for t in tasks:
        t.add_done_callback(_retrieve)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


def warn_ignored(names: list[str], path: str) -> None:
    """Unknown request fields are ignored with a warning (vLLM's policy, every endpoint)."""
    if names:
        log.warning("%s: the following fields were present in the request but ignored: %s", path, names)


def build_request(st: State, parsed: schema.ParsedRequest, images: list, rid: str):
    """Runs in the thread pool: template, tokenize, validate, size the completion."""
    eng = st.engine
    if parsed.kind == "chat":
        kw = dict(parsed.template_kwargs)
        if parsed.tools is not None and parsed.tools.template_tools:
            kw["tools"] = parsed.tools.template_tools
        prompt = st.vlm.tokenizer.render_chat(tools.normalize_messages(parsed.messages),
                                              add_generation_prompt=parsed.add_generation_prompt, **kw)
    else:
        prompt = parsed.prompt
        tok = st.vlm.tokenizer
        if isinstance(prompt, list):
            if images:
                raise InvalidRequestError("'images' needs a string prompt (token-id prompts cannot carry "
                                          "image placeholders)", param="images")
            bad = [t for t in prompt if t >= tok.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary (size {tok.vocab_size})",
                                          param="prompt")
        elif images and tok.image_token and tok.image_token not in prompt:
            prompt = (tok.image_token + "\n") * len(images) + prompt
    extra = {}
    if parsed.intervention is not None:      # research extension: Pool / Ablate on the features, Prune in the LLM
        images = [parsed.intervention.apply(st.vlm.family, im) for im in images]
        extra = parsed.intervention.engine_args(sum(im.num_tokens for im in images))
    try:
        req = eng.make_request(prompt, images, dataclasses.replace(parsed.sampling), request_id=rid,
                               lora=_lora_of(st, parsed.model), **extra)
    except ContextLengthError as e:
        if parsed.kind == "completion" and e.param == "messages":
            e.param = "prompt"
        raise
    except PromptError as e:
        if parsed.kind == "completion" and e.param == "messages":
            e.param = "prompt"
        raise
    room = eng.max_model_len - req.prompt_len
    if parsed.max_tokens is None:
        req.sampling.max_tokens = room
    elif parsed.max_tokens > room:
        raise ContextLengthError(
            f"this model's maximum context length is {eng.max_model_len} tokens; you requested "
            f"{req.prompt_len + parsed.max_tokens} tokens ({req.prompt_len} in the prompt, including "
            f"{sum(im.num_tokens for im in images)} image and video tokens, and {parsed.max_tokens} for the completion, "
            f"'{parsed.max_tokens_param}')", param=parsed.max_tokens_param)
    else:
        req.sampling.max_tokens = parsed.max_tokens
    return eng.siblings(req, parsed.n)

