"""OpenAI request validation (hand-written, so every error names the offending field) and the
response / stream-chunk builders.

Parsing never touches the engine: it turns a JSON body into a `ParsedRequest` (messages or a
prompt, image references in order, sampling parameters) or raises an `InvalidRequestError` whose
`param` is the JSON path of the bad field (e.g. ``messages[0].content[1].image_url.url``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from mmjax.errors import ContextLengthError, InvalidRequestError, MMJaxError
from mmjax.serving.structured import StructuredSpec, check_spec
from serve.tool_parsers import HermesParser, ToolParser
from serve.tools import choice_grammar, parse_tools
from mmjax.serving.sampling import (MAX_N, INT32_MAX, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
                                    SamplingParams)

DETAILS = ("auto", "low", "high")
ROLES = ("system", "developer", "user", "assistant", "tool")


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


class InvalidTextError(InvalidRequestError):
    """A string that is not Unicode text (a lone surrogate such as JSON "\\ud800"): it cannot be
    encoded, tokenized or logged, so it is refused where it enters, naming its JSON path."""
    code = "invalid_text"


class TooManyItemsError(InvalidRequestError):
    """A list over a server limit (messages, content parts, images, stop strings, stop ids)."""
    code = "too_many_items"


class RequestTimeoutError(MMJaxError):
    """The client did not send its request head or body within the server's timeout."""
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, checked while parsing (before any template, tokenizer, image
    or engine work). `max_text_bytes` is the engine's `max_prompt_bytes`: prompt text longer than
    that cannot fit the context whatever it tokenizes to; None leaves text unbounded here."""
    limit_images: int = 8
    limit_videos: int = 2
    max_messages: int = 4096
    max_content_parts: int = 512            # per message
    max_text_bytes: int | None = None       # UTF-8 bytes of prompt text, per message and per request
    max_model_len: int | None = None        # context tokens: token-id prompts must be shorter
    image_embeds: bool = False              # accept {"type": "image_embeds"} parts (--enable-image-embeds)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ImageRef:
    """One image (or video: kind "video") of a request, in prompt order: where it came from and
    its resolution budget."""
    url: str
    detail: str = "auto"
    param: str = "image_url"   # JSON path, for error messages
    kind: str = "image"        # "image" | "video"
    options: Any = None        # the request's mm_processor_kwargs (ImageOptions), if any
    embeds: Any = None         # an image_embeds part: (base64 .npy, image_grid_thw or None)


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
    n: int = 1                                 # choices (siblings sharing the prompt's KV)
    template_kwargs: dict = field(default_factory=dict)   # chat_template_kwargs (+ add_generation_prompt)
    add_generation_prompt: bool = True
    image_options: Any = None                  # mm_processor_kwargs as models.family.ImageOptions
    ignored: list[str] = field(default_factory=list)      # unknown fields (logged, as vLLM)
    tools: Any = None                          # serve.tools.ToolRequest (chat)
    prompt_logprobs: int | None = None         # top-k alternatives per prompt token (vLLM's extension)
    intervention: Any = None                   # mmjax.research intervention on the request's images (extension)


# ---- small typed getters ----------------------------------------------------------------------

def short(v: Any, limit: int = 80) -> str:
    """repr of a client value for an error message, cut: an error never echoes a megabyte back."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {msg}", param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def text_bytes(s: str, param: str) -> int:
    """UTF-8 length of a client string; a lone surrogate (valid JSON, not text) is a 400 naming
    `param` instead of a UnicodeEncodeError deep inside the template, tokenizer or a log line."""
    if s.isascii():  # O(1) for CPython's compact strings: the common case costs nothing
        return len(s)
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidTextError(f"'{param}' is not valid Unicode text: {e.reason} at character {e.start}",
                               param=param) from None


def _text(v: Any, param: str, what: str = "must be a string") -> str:
    if not isinstance(v, str):
        raise _bad(param, what)
    text_bytes(v, param)
    return v


class _TextBudget:
    """Prompt text of one request against `max_text_bytes`: each piece alone (the error names
    it) and all pieces together (the error names `total_param`)."""

    def __init__(self, limits: RequestLimits, total_param: str):
        self.limit, self.total_param, self.used = limits.max_text_bytes, total_param, 0
        self.context = limits.max_model_len

    def take(self, s: str, param: str) -> None:
        n = text_bytes(s, param)
        if self.limit is None:
            return
        self.used += n
        if n > self.limit:
            raise self._error(param, n)
        if self.used > self.limit:
            raise self._error(self.total_param, self.used)

    def _error(self, param: str, n: int) -> ContextLengthError:
        ctx = f"the context of {self.context} tokens" if self.context else "the context"
        return ContextLengthError(f"'{param}' holds {n} bytes of text; no prompt that fits {ctx} can hold "
                                  f"more than {self.limit} bytes", param=param)


def _check_len(v: list, limit: int, param: str, what: str) -> None:
    """Lists are bounded before their elements are looked at (a 10M-element list costs nothing)."""
    if len(v) > limit:
        raise TooManyItemsError(f"'{param}' holds {len(v)} {what}, over the limit of {limit}", param=param)


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
    if not _is_int(v):  # JSON true is not 1 here: a bool is never an integer
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
    """Stop strings (their length is SamplingParams' range); each must be text: they are matched
    against decoded output and echoed in errors."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [_text(v, "stop")] if v else []
    if not isinstance(v, list):
        raise _bad("stop", "must be a string or a list of strings")
    _check_len(v, MAX_STOP_STRINGS, "stop", "strings")
    return [s for i, s in enumerate(v) if _text(s, f"stop[{i}]")]


def _stop_token_ids(body: dict) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad("stop_token_ids", "must be a list of non-negative integers")
    _check_len(v, MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
    for i, t in enumerate(v):
        if not (_is_int(t) and 0 <= t <= INT32_MAX):
            raise _bad(f"stop_token_ids[{i}]", f"must be an integer in [0, {INT32_MAX}], got {short(t)}")
    return v


def _unsupported(body: dict) -> None:
    """Fields whose non-default values this server cannot honour: refuse instead of ignoring."""
    for name in ("functions", "function_call"):
        if body.get(name):
            raise InvalidRequestError(f"'{name}' (deprecated) is not supported by this server; use 'tools'",
                                      param=name, code="unsupported_parameter")
    if body.get("suffix"):
        raise InvalidRequestError("'suffix' is not supported", param="suffix", code="unsupported_parameter")
    mods = body.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise InvalidRequestError("'modalities' other than ['text'] are not supported (text output only)",
                                  param="modalities", code="unsupported_parameter")
    for name in ("audio", "web_search_options"):
        if body.get(name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name,
                                      code="unsupported_parameter")
    if body.get("chat_template") is not None:
        raise InvalidRequestError("a per-request 'chat_template' is not accepted (the server's --chat-template "
                                  "applies); use 'chat_template_kwargs'", param="chat_template",
                                  code="unsupported_parameter")
    if body.get("tools") and "messages" not in body:
        raise InvalidRequestError("'tools' needs the chat completions API", param="tools",
                                  code="unsupported_parameter")
    v = _int(body, "best_of", 1, INT32_MAX)  # `true == 1` in Python: type first
    if v is not None and v != _int(body, "n", 1, INT32_MAX, 1):
        raise InvalidRequestError(f"'best_of' other than n is not supported (got {v}); use n and pick by logprobs",
                                  param="best_of", code="unsupported_parameter")


def _token_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise _bad(name, "must be a non-empty list of token ids")
    for i, t in enumerate(v):
        if not (_is_int(t) and 0 <= t <= INT32_MAX):
            raise _bad(f"{name}[{i}]", f"must be an integer in [0, {INT32_MAX}], got {short(t)}")
    return v


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured(body: dict) -> StructuredSpec | None:
    """At most one output constraint: `response_format` (json_object / json_schema), vLLM's
    `structured_outputs` {json | regex | choice | grammar | json_object} or the older `guided_*`
    fields. The grammar is compiled (and its errors reported) with the request."""
    found: list[StructuredSpec] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _bad("response_format", "must be an object with a 'type'")
        t = rf.get("type")
        if t == "json_object":
            found.append(check_spec("json_object", None, "response_format"))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("response_format.json_schema", "must be an object with a 'schema'")
            schema = js.get("schema", js.get("json_schema"))
            if schema is None:
                raise _bad("response_format.json_schema.schema", "is required")
            found.append(check_spec("json", schema, "response_format.json_schema.schema"))
        elif t != "text":
            raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {short(t)}")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "must be an object")
        for k in ("json", "regex", "choice", "grammar"):
            if so.get(k) is not None:
                found.append(check_spec(k, so[k], f"structured_outputs.{k}"))
        if so.get("json_object"):
            found.append(check_spec("json_object", None, "structured_outputs.json_object"))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(check_spec(kind, body[name], name))
    if len(found) > 1:
        raise InvalidRequestError(f"only one output constraint may be given; got {', '.join(f.param for f in found)}",
                                  param=found[1].param)
    return found[0] if found else None


# Every field the server reads, honours or refuses on purpose; anything else is ignored with a
# logged warning (vLLM's policy), the same way on every endpoint. ACCEPTED_NO_EFFECT: OpenAI
# fields that do not change what this server computes (bookkeeping for OpenAI's platform).
ACCEPTED_NO_EFFECT = ("user", "metadata", "store", "service_tier", "guided_decoding_backend", "reasoning_effort",
                      "prediction")
COMMON_FIELDS = frozenset((
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "min_tokens", "allowed_token_ids", "bad_words", "response_format", "structured_outputs", "n", "best_of",
    "logprobs", "mm_processor_kwargs", "functions", "tools", "tool_choice", "suffix", "prompt_logprobs",
    "intervention", "skip_special_tokens", "function_call", "parallel_tool_calls", "modalities", "audio",
    "web_search_options", *GUIDED, *ACCEPTED_NO_EFFECT))
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                               "add_generation_prompt", "chat_template"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "images", "echo"}
EMBEDDING_FIELDS = frozenset(("model", "input", "messages", "encoding_format", "pooling", "normalize",
                              "add_special_tokens", "add_generation_prompt", "chat_template_kwargs",
                              "mm_processor_kwargs", "dimensions", *ACCEPTED_NO_EFFECT))
TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "tools", "add_generation_prompt", "add_special_tokens",
                             "chat_template_kwargs", "mm_processor_kwargs", "return_token_strs", "images",
                             *ACCEPTED_NO_EFFECT))
DETOKENIZE_FIELDS = frozenset(("model", "tokens", *ACCEPTED_NO_EFFECT))
MAX_IGNORED_NAMES = 32       # unknown field names named in one warning


def unknown_fields(body: dict, known: frozenset) -> list[str]:
    """Names of `body`'s fields this endpoint does not know (cut to a few, shortened)."""
    return [short(k, 64) for k in body if k not in known][:MAX_IGNORED_NAMES]


# Template variables the server itself sets: chat_template_kwargs cannot override them.
RESERVED_TEMPLATE_KEYS = frozenset(("messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                    "raise_exception", "strftime_now"))


def template_kwargs(body: dict, req: "ParsedRequest") -> None:
    """chat_template_kwargs (JSON values passed to the chat template, e.g. enable_thinking) and
    add_generation_prompt."""
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise _bad("chat_template_kwargs", "must be an object")
        for k in ctk:
            if not isinstance(k, str) or not k.isidentifier() or k in RESERVED_TEMPLATE_KEYS:
                name = k if isinstance(k, str) and len(k) <= 40 else short(k, 40)
                raise _bad(f"chat_template_kwargs.{name}", "is not a template variable a request may set")
        req.template_kwargs = dict(ctk)
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)


def image_options(body: dict):
    """mm_processor_kwargs -> ImageOptions ({min_pixels, max_pixels, max_image_tokens,
    do_pan_and_scan | pan_and_scan}); the server's limits still bound every image."""
    from mmjax.models.family import ImageOptions

    v = body.get("mm_processor_kwargs")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("mm_processor_kwargs", "must be an object")
    alias = {"do_pan_and_scan": "pan_and_scan", "max_image_tokens": "image_max_tokens"}
    opts = {alias.get(k, k): x for k, x in v.items()}
    try:
        return ImageOptions.from_dict(opts)
    except InvalidRequestError as e:
        e.param = f"mm_processor_kwargs.{(e.param or '').split('.')[-1]}"
        raise


def _penalties(body: dict) -> dict:
    """presence/frequency/repetition penalties, logit_bias, min_tokens, allowed_token_ids,
    bad_words: types here, ranges in SamplingParams."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            out[name] = _num(body, name, -math.inf, math.inf, 0.0)
    if body.get("min_tokens") is not None:
        out["min_tokens"] = _int(body, "min_tokens", 0, INT32_MAX)
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _bad("logit_bias", "must be an object mapping token ids to biases")
        out["logit_bias"] = lb
    ati = _token_list(body, "allowed_token_ids")
    if ati is not None:
        out["allowed_token_ids"] = ati
    bw = body.get("bad_words")
    if bw is not None:
        if isinstance(bw, str):
            bw = [bw]
        if not isinstance(bw, list):
            raise _bad("bad_words", "must be a string or a list of strings")
        out["bad_words"] = [_text(w, f"bad_words[{i}]") for i, w in enumerate(bw)]
    return out


def _common(body: dict, req: ParsedRequest) -> None:
    """Model, streaming options and the sampling fields. Types are checked here; ranges once, by
    SamplingParams (its InvalidRequestError names the field)."""
    model = body.get("model")
    if model is not None:
        _text(model, "model")
    req.model = model
    for name in ("temperature", "top_p", "min_p"):
        _num(body, name, -math.inf, math.inf, 0.0)
    for name in ("top_k", "seed"):
        _int(body, name, -(2**63))
    stop = _stop(body)
    sti = _stop_token_ids(body)
    fields_ = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed") if body.get(k) is not None}
    fields_.update(_penalties(body))
    req.n = _int(body, "n", 1, MAX_N, 1)
    req.prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    req.image_options = image_options(body)
    if body.get("intervention") is not None:
        from mmjax.research.interventions import intervention_from_json
        req.intervention = intervention_from_json(body["intervention"])
    req.ignored = unknown_fields(body, CHAT_FIELDS if req.kind == "chat" else COMPLETION_FIELDS)
    fields_["structured"] = _structured(body)
    req.sampling = SamplingParams(max_tokens=1, stop=stop, stop_token_ids=list(sti),
                                  ignore_eos=_bool(body, "ignore_eos"), logprobs=req.logprobs,
                                  skip_special_tokens=_bool(body, "skip_special_tokens", True), **fields_)
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


def _image_ref(part: dict, path: str, key: str = "image_url") -> ImageRef:
    """`key` is the field holding the URL (or {"url", "detail"}) under `path`; '' when `part`
    is that value itself (the completions `images` extension)."""
    iu = part.get("image_url")
    base = f"{path}.{key}" if key else path
    if isinstance(iu, str):  # vLLM and some clients send the URL directly
        iu = {"url": iu}
    if not isinstance(iu, dict):
        raise _bad(base, "must be a URL string or an object with a 'url'")
    url = iu.get("url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{base}.url", "must be a non-empty string (data: URI, http(s) or file URL)")
    text_bytes(url, f"{base}.url")  # the media layer parses, resolves and logs it
    detail = iu.get("detail", "auto")
    if detail is None:
        detail = "auto"
    if detail not in DETAILS:
        raise _bad(f"{base}.detail", f"must be one of {list(DETAILS)}, got {short(detail)}")
    return ImageRef(url=url, detail=detail, param=base)


def _add_image(req: ParsedRequest, ref: ImageRef, limits: RequestLimits, param: str) -> None:
    """Images are counted as they are found: the request fails at the first one over the limit."""
    if sum(r.kind == "image" for r in req.images) >= limits.limit_images:
        raise InvalidRequestError(f"more than {limits.limit_images} images in one request (--limit-images)",
                                  param=param, code="too_many_images")
    req.images.append(ref)


def _video_ref(part: dict, path: str) -> ImageRef:
    """A `video_url` content part: {"video_url": {"url": ...}} (or the URL string directly)."""
    vu = part.get("video_url")
    base = f"{path}.video_url"
    if isinstance(vu, str):
        vu = {"url": vu}
    if not isinstance(vu, dict):
        raise _bad(base, "must be a URL string or an object with a 'url'")
    url = vu.get("url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{base}.url", "must be a non-empty string (data: URI, http(s) or file URL)")
    text_bytes(url, f"{base}.url")
    return ImageRef(url=url, param=base, kind="video")


def _add_video(req: ParsedRequest, ref: ImageRef, limits: RequestLimits, param: str) -> None:
    if limits.limit_videos == 0:
        raise InvalidRequestError("this model does not take video input (video_url parts)", param=ref.param,
                                  code="video_not_supported")
    if sum(r.kind == "video" for r in req.images) >= limits.limit_videos:
        raise InvalidRequestError(f"more than {limits.limit_videos} videos in one request (--limit-videos)",
                                  param=param, code="too_many_videos")
    req.images.append(ref)


def _limits(limit_images: int | None, limits: RequestLimits | None) -> RequestLimits:
    if limits is None:
        return RequestLimits() if limit_images is None else RequestLimits(limit_images=limit_images)
    return limits if limit_images is None else dataclasses.replace(limits, limit_images=limit_images)


def _content_parts(req: ParsedRequest, content: list, p: str, limits: RequestLimits,
                   budget: _TextBudget) -> list[dict]:
    _check_len(content, limits.max_content_parts, f"{p}.content", "content parts")
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
            budget.take(text, f"{pp}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            _add_image(req, _image_ref(part, pp), limits, "messages")
            parts.append({"type": "image"})
        elif kind == "video_url":
            _add_video(req, _video_ref(part, pp), limits, "messages")
            parts.append({"type": "video"})
        elif kind == "image_embeds":
            if not limits.image_embeds:
                raise InvalidRequestError("image_embeds input is disabled on this server (start it with "
                                          "--enable-image-embeds)", param=f"{pp}.type", code="unsupported_parameter")
            v = part.get("image_embeds")
            grid = None
            if isinstance(v, dict):
                v, grid = v.get("image_embeds"), v.get("image_grid_thw")
            if not isinstance(v, str):
                raise _bad(f"{pp}.image_embeds", "must be a base64 .npy string (or {'image_embeds', 'image_grid_thw'})")
            _add_image(req, ImageRef(url="", param=f"{pp}.image_embeds", embeds=(v, grid)), limits, "messages")
            parts.append({"type": "image"})
        else:
            raise _bad(f"{pp}.type", f"must be 'text', 'image_url', 'video_url' or 'image_embeds', got {short(kind)}")
    return parts


def _message(req: ParsedRequest, m: Any, p: str, limits: RequestLimits, budget: _TextBudget) -> dict:
    if not isinstance(m, dict):
        raise _bad(p, "must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{p}.role", f"must be one of {list(ROLES)}, got {short(role)}")
    if role == "developer":
        role = "system"
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    extra = {}
    if role == "assistant" and m.get("tool_calls") is not None:
        extra["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls", budget)
    if role == "tool":
        tid = m.get("tool_call_id")
        if tid is not None:
            extra["tool_call_id"] = _text(tid, f"{p}.tool_call_id")
        if m.get("name") is not None:
            extra["name"] = _text(m["name"], f"{p}.name")
    if isinstance(content, str):
        budget.take(content, f"{p}.content")
        return {"role": role, "content": content, **extra}
    if not isinstance(content, list):
        raise _bad(f"{p}.content", "must be a string or a list of content parts")
    return {"role": role, "content": _content_parts(req, content, p, limits, budget), **extra}


def _tool_calls(v: Any, p: str, budget: _TextBudget) -> list[dict]:
    """An assistant message's earlier tool calls (OpenAI shape), text counted in the budget."""
    if not isinstance(v, list) or len(v) > 128:
        raise _bad(p, "must be a list of at most 128 tool calls")
    out = []
    for i, c in enumerate(v):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(f"{p}[{i}]", "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        args = f.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _bad(f"{p}[{i}].function.arguments", "must be a JSON string")
        budget.take(f["name"] + (args if isinstance(args, str) else json.dumps(args)), f"{p}[{i}].function")
        out.append({"id": str(c.get("id", f"call_{i}")), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def parse_chat(body: Any, *, limit_images: int | None = None, limits: RequestLimits | None = None,
               tool_parser: ToolParser | None = None) -> ParsedRequest:
    """`tool_parser`: the checkpoint's tool-call format (serve/tool_parsers.py; default hermes)."""
    limits = _limits(limit_images, limits)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    req = ParsedRequest(kind="chat", model=None)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of messages")
    _check_len(msgs, limits.max_messages, "messages", "messages")
    budget = _TextBudget(limits, "messages")
    req.messages = [_message(req, m, f"messages[{i}]", limits, budget) for i, m in enumerate(msgs)]
    template_kwargs(body, req)
    req.tools = parse_tools(body)
    mct = _int(body, "max_completion_tokens", 1, INT32_MAX)
    mt = _int(body, "max_tokens", 1, INT32_MAX)
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
    parser = tool_parser or HermesParser()
    if req.tools is not None:
        req.tools.parser = parser
    spec = choice_grammar(req.tools, parser) if req.tools is not None else None
    if req.tools is not None and req.tools.parse and parser.keep_special:
        req.sampling.skip_special_tokens = False    # the format's markers are special tokens
    if spec is not None:
        if req.sampling.structured is not None:
            raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with another "
                                      "output constraint", param="tool_choice")
        req.sampling.structured = spec
    return req


def _prompt(body: dict, limits: RequestLimits) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        ctx = limits.max_model_len
        if ctx is not None and len(prompt) >= ctx:  # before looking at 10M elements
            raise ContextLengthError(f"prompt is {len(prompt)} tokens; the context is {ctx} tokens", param="prompt")
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise _bad("prompt", "must be a string, a list of one string, or a non-empty list of token ids "
                                 "(batched prompts are not supported)")
        return prompt
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "must be a non-empty string")
    _TextBudget(limits, "prompt").take(prompt, "prompt")
    return prompt


def parse_completion(body: Any, *, limit_images: int | None = None,
                     limits: RequestLimits | None = None) -> ParsedRequest:
    """/v1/completions. Extension: `images`, a list of image URLs (or {"url", "detail"} objects),
    one per image placeholder in the prompt; with no placeholder in the prompt they are prepended."""
    limits = _limits(limit_images, limits)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    req = ParsedRequest(kind="completion", model=None)
    req.prompt = _prompt(body, limits)
    imgs = body.get("images")
    if imgs is not None:
        if not isinstance(imgs, list):
            raise _bad("images", "must be a list of image URLs or {'url', 'detail'} objects")
        for j, im in enumerate(imgs):
            _add_image(req, _image_ref({"image_url": im}, f"images[{j}]", key=""), limits, "images")
    req.max_tokens = _int(body, "max_tokens", 1, INT32_MAX, 16)
    req.logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.echo = _bool(body, "echo")
    _common(body, req)
    return req


# ---- responses ----------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, image_tokens: int,
          video_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens, "image_tokens": image_tokens,
                                      "video_tokens": video_tokens}}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries}


def now() -> int:
    return int(time.time())
