"""OpenAI request validation (hand-written, so every error names the offending field) and the
response / stream-chunk builders.

Parsing never touches the engine: it turns a JSON body into a `ParsedRequest` (messages or a
prompt, image references in order, sampling parameters) or raises an `InvalidRequestError` whose
`param` is the JSON path of the bad field (e.g. ``messages[0].content[1].image_url.url``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from mmjax.errors import InvalidRequestError, MMJaxError
from mmjax.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams

DETAILS = ("auto", "low", "high")
ROLES = ("system", "developer", "user", "assistant")


class NotFoundError(MMJaxError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class AuthError(MMJaxError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class UnavailableError(MMJaxError):
    """Draining (SIGTERM) or the engine loop is gone."""
    status = 503
    type = "server_busy"
    code = "server_unavailable"


class RequestTooLargeError(InvalidRequestError):
    status = 413
    code = "request_too_large"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ImageRef:
    """One image of a request, in prompt order: where it came from and its resolution budget."""
    url: str
    detail: str = "auto"
    param: str = "image_url"   # JSON path, for error messages


@dataclass
class ParsedRequest:
    kind: str                                  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None         # chat: normalised, image parts as {"type": "image"}
    prompt: str | list[int] | None = None      # completion
    images: list[ImageRef] = field(default_factory=list)
    max_tokens: int | None = None              # None: the rest of the context
    max_tokens_param: str = "max_tokens"       # the field the client used (for errors)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens set once the prompt is known
    logprobs: int | None = None                # top-n alternatives (0 = chosen token only)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


# ---- small typed getters ----------------------------------------------------------------------

def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {msg}", param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body: dict, name: str, lo: float, hi: float, default: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {type(v).__name__}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(name, f"must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "must be a string or a list of strings")
    if len(v) > 16:
        raise _bad("stop", f"may hold at most 16 strings, got {len(v)}")
    return [s for s in v if s]


def _unsupported(body: dict) -> None:
    """Fields whose non-default values this server cannot honour: refuse instead of ignoring."""
    for name, default in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        v = body.get(name)
        if v is not None and v != default:
            raise InvalidRequestError(f"'{name}' is not supported by this server (only {default})",
                                      param=name, code="unsupported_parameter")
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name,
                                      code="unsupported_parameter")
    tc = body.get("tool_choice")
    if tc not in (None, "none", "auto"):
        raise InvalidRequestError("'tool_choice' is not supported by this server", param="tool_choice",
                                  code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise InvalidRequestError("'response_format' other than {'type': 'text'} is not supported",
                                  param="response_format", code="unsupported_parameter")
    if body.get("n") is not None and body.get("n") != 1:
        raise InvalidRequestError(f"'n' must be 1 (got {body.get('n')!r}); send several requests instead",
                                  param="n", code="unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequestError("'best_of' must be 1", param="best_of", code="unsupported_parameter")
    if body.get("suffix"):
        raise InvalidRequestError("'suffix' is not supported", param="suffix", code="unsupported_parameter")


def _common(body: dict, req: ParsedRequest) -> None:
    """Model, streaming options and the sampling fields. Types are checked here; ranges once, by
    SamplingParams (its InvalidRequestError names the field)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string")
    req.model = model
    for name in ("temperature", "top_p", "min_p"):
        _num(body, name, -math.inf, math.inf, 0.0)
    for name in ("top_k", "seed"):
        _int(body, name, -(2**63))
    stop = _stop(body)
    sti = body.get("stop_token_ids")
    if sti is not None and (not isinstance(sti, list) or not all(_is_int(t) and t >= 0 for t in sti)):
        raise _bad("stop_token_ids", "must be a list of non-negative integers")
    fields_ = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed") if body.get(k) is not None}
    req.sampling = SamplingParams(max_tokens=1, stop=stop, stop_token_ids=list(sti or []),
                                  ignore_eos=_bool(body, "ignore_eos"), logprobs=req.logprobs, **fields_)
    req.stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", "must be an object")
        if not req.stream:
            raise _bad("stream_options", "is only allowed when 'stream' is true")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        req.include_usage = bool(iu)
    _unsupported(body)


def _image_ref(part: dict, path: str) -> ImageRef:
    iu = part.get("image_url")
    if isinstance(iu, str):  # vLLM and some clients send the URL directly
        iu = {"url": iu}
    if not isinstance(iu, dict):
        raise _bad(f"{path}.image_url", "must be an object with a 'url'")
    url = iu.get("url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{path}.image_url.url", "must be a non-empty string (data: URI, http(s) or file URL)")
    detail = iu.get("detail", "auto")
    if detail is None:
        detail = "auto"
    if detail not in DETAILS:
        raise _bad(f"{path}.image_url.detail", f"must be one of {list(DETAILS)}, got {detail!r}")
    return ImageRef(url=url, detail=detail, param=f"{path}.image_url")


def parse_chat(body: Any, *, limit_images: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    req = ParsedRequest(kind="chat", model=None)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{p}.role", f"must be one of {list(ROLES)}, got {role!r}")
        if role == "developer":
            role = "system"
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{p}.content", "must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(content):
            pp = f"{p}.content[{j}]"
            if not isinstance(part, dict):
                raise _bad(pp, "must be an object with a 'type'")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(f"{pp}.text", "must be a string")
                parts.append({"type": "text", "text": text})
            elif kind == "image_url":
                req.images.append(_image_ref(part, pp))
                parts.append({"type": "image"})
            else:
                raise _bad(f"{pp}.type", f"must be 'text' or 'image_url', got {kind!r}")
        out.append({"role": role, "content": parts})
    req.messages = out
    if len(req.images) > limit_images:
        raise InvalidRequestError(f"{len(req.images)} images in one request exceeds the limit of {limit_images} "
                                  "(--limit-images)", param="messages", code="too_many_images")
    mct = _int(body, "max_completion_tokens", 1)
    mt = _int(body, "max_tokens", 1)
    req.max_tokens = mct if mct is not None else mt
    req.max_tokens_param = "max_completion_tokens" if mct is not None else "max_tokens"
    if body.get("logprobs") is not None and not isinstance(body.get("logprobs"), bool):
        raise _bad("logprobs", "must be a boolean (use 'top_logprobs' for alternatives)")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if body.get("logprobs"):
        req.logprobs = top or 0
    elif top:
        raise _bad("top_logprobs", "requires 'logprobs': true")
    _common(body, req)
    return req


def parse_completion(body: Any, *, limit_images: int) -> ParsedRequest:
    """/v1/completions. Extension: `images`, a list of image URLs (or {"url", "detail"} objects),
    one per image placeholder in the prompt; with no placeholder in the prompt they are prepended."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    req = ParsedRequest(kind="completion", model=None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise _bad("prompt", "must be a string, a list of one string, or a non-empty list of token ids "
                                 "(batched prompts are not supported)")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "must be a non-empty string")
    req.prompt = prompt
    imgs = body.get("images")
    if imgs is not None:
        if not isinstance(imgs, list):
            raise _bad("images", "must be a list of image URLs or {'url', 'detail'} objects")
        for j, im in enumerate(imgs):
            req.images.append(_image_ref({"image_url": im}, f"images[{j}]"))
        for r in req.images:
            r.param = r.param[: -len(".image_url")]
    if len(req.images) > limit_images:
        raise InvalidRequestError(f"{len(req.images)} images in one request exceeds the limit of {limit_images} "
                                  "(--limit-images)", param="images", code="too_many_images")
    req.max_tokens = _int(body, "max_tokens", 1, None, 16)
    req.logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.echo = _bool(body, "echo")
    if req.echo:
        raise InvalidRequestError("'echo' is not supported", param="echo", code="unsupported_parameter")
    _common(body, req)
    return req


# ---- responses ----------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, image_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens, "image_tokens": image_tokens}}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries}


def now() -> int:
    return int(time.time())
