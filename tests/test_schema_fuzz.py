"""Property-based fuzz of the request schema over every route of serve/app.py (hypothesis).

Bodies mix valid and invalid fields (wrong types, huge ints, bools for ints, nested junk, lone
surrogates, junk bytes) and go to a real in-process server over HTTP; the property: never a 5xx,
every 4xx is an OpenAI error body, every 200 is a well-formed answer. A faster fuzz calls the
parsers directly with many more examples: only typed 4xx errors may come out of them.

Examples are derandomized (the same ones every run, so CI is stable); set MMJAX_FUZZ_RANDOM=1 to
explore new ones. Valid generation requests use max_tokens <= 3, so a run takes ~30 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_serve import ENGINE_KW, Server, data_uri, http_req

from mmjax.errors import MMJaxError
from serve import schema
from serve.app import ServerConfig

FUZZ = settings(deadline=None, derandomize=not os.environ.get("MMJAX_FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ---- strategies ----------------------------------------------------------------------------------------

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(alphabet=st.one_of(st.characters(), surrogates), max_size=12)
huge_ints = st.sampled_from([2**31, 2**31 - 1, -(2**31) - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), huge_ints,
                    st.floats(allow_nan=True, allow_infinity=True), texts)
junk = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
                    max_leaves=8)

# Image URLs that never reach the network: data URIs (valid and not), private / loopback hosts
# (refused before connecting), schemes the server refuses.
TINY_PNG = data_uri(5, "PNG", 8, 8)
image_urls = st.one_of(st.sampled_from([TINY_PNG, "data:image/png;base64,@@", "data:,", "data:image/png;base64,",
                                        "http://127.0.0.1:9/a.png", "http://10.0.0.1/a.png", "https://[::1]/x",
                                        "ftp://a/b.png", "file:///etc/passwd", "", "x"]), texts, junk)
image_url_objs = st.one_of(image_urls, st.fixed_dictionaries({"url": image_urls}, optional={
    "detail": st.one_of(st.sampled_from(["auto", "low", "high"]), junk)}), junk)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, junk)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_url_objs}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["audio", "input_text", ""]), junk)}),
    junk)
contents = st.one_of(texts, st.lists(parts, max_size=4), junk)
roles = st.one_of(st.sampled_from(list(schema.ROLES) + ["tool", "function", ""]), junk)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": roles, "content": contents}, optional={"name": junk}), max_size=4),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}), min_size=1, max_size=2),
    junk)


def mixed(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value, sometimes junk of any type."""
    return st.one_of(valid, valid, junk)


# Valid values of every field. max_tokens is always there (1..3, or junk) so no valid request
# generates for long.
clean = st.text(max_size=12)
valid_parts = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": clean}),
                        st.just({"type": "image_url", "image_url": {"url": TINY_PNG}}),
                        st.just({"type": "image_url", "image_url": {"url": TINY_PNG, "detail": "low"}}))
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(schema.ROLES),
                                                 "content": st.one_of(clean, st.lists(valid_parts, max_size=2))}),
                          min_size=1, max_size=3)
VALID = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(clean, st.lists(clean, max_size=4)), "stop_token_ids": st.lists(st.integers(0, 500), max_size=4),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "n": st.just(1), "best_of": st.just(1),
    "presence_penalty": st.just(0), "frequency_penalty": st.just(0.0), "response_format": st.just({"type": "text"}),
    "model": st.just("tiny"), "user": clean, "unknown_field": junk,
}
CHAT_VALID = {**VALID, "max_completion_tokens": st.integers(1, 3), "logprobs": st.booleans(),
              "top_logprobs": st.integers(0, 5)}
COMPLETION_VALID = {**VALID, "images": st.lists(st.just(TINY_PNG), max_size=2), "logprobs": st.integers(0, 5),
                    "echo": st.just(False)}
JUNK_ONLY = {"logit_bias": junk, "tools": junk, "tool_choice": junk, "suffix": junk, "stream_options": junk}
max_tokens = st.one_of(st.integers(1, 3), st.integers(1, 3), huge_ints, st.booleans(), st.floats(), texts)


def bodies(required: dict, valid: dict) -> st.SearchStrategy:
    """Valid bodies; valid bodies with one field turned to junk; bodies where any field may be junk."""
    ok = st.fixed_dictionaries({k: v[0] for k, v in required.items()}, optional=valid)
    one_bad = st.tuples(ok, st.sampled_from(sorted({**required, **valid, **JUNK_ONLY})), junk).map(
        lambda t: {**t[0], t[1]: t[2]})
    anything = st.fixed_dictionaries({k: v[1] for k, v in required.items()},
                                     optional={**{k: mixed(v) for k, v in valid.items()}, **JUNK_ONLY})
    return st.one_of(ok, one_bad, anything)


chat_bodies = bodies({"messages": (valid_messages, messages), "max_tokens": (st.integers(1, 3), max_tokens)},
                     CHAT_VALID)
completion_bodies = bodies(
    {"prompt": (st.one_of(clean.filter(bool), st.lists(st.integers(0, 399), min_size=1, max_size=8)),
                st.one_of(texts.filter(bool), st.lists(st.integers(0, 450), min_size=1, max_size=8),
                          st.lists(texts, min_size=1, max_size=2), junk)),
     "max_tokens": (st.integers(1, 3), max_tokens)},
    COMPLETION_VALID)
# a body: a JSON object (mostly), any JSON value, or raw bytes that may not be JSON at all
raw_bytes = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b'{"a":1}{}', b"\xff\xfe"]))


def encode(body) -> bytes:
    """JSON with \\uXXXX escapes (ensure_ascii), so lone surrogates travel as JSON allows."""
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()


# ---- the server ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llava_dirs):
    import mmjax
    s = Server(mmjax.load(llava_dirs["gqa"], **ENGINE_KW),
               ServerConfig(served_model_name="tiny", limit_images=2, max_image_bytes=100_000, log_stats_interval=0,
                            max_messages=16, max_content_parts=8, header_timeout=10, body_timeout=10))
    yield s
    s.close()


def check(r, path: str) -> None:
    """The property: no 5xx; a 4xx is an OpenAI error; a 200 is a well-formed answer."""
    assert r.status_code < 500, (path, r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
        assert err["param"] is None or isinstance(err["param"], str)
        return
    assert r.status_code == 200, r.status_code
    if r.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e   # an engine failure mid-stream would be a server bug here
    elif path in (CHAT, COMPLETIONS):
        out = r.json()
        assert out["choices"][0]["finish_reason"] in ("stop", "length"), out
        # max_tokens <= 3 a choice (a junk-for-valid swap can give n = 2: two choices)
        assert out["usage"]["completion_tokens"] <= 3 * len(out["choices"])


def send(server: Server, path: str, body) -> None:
    check(http_req("POST", server.url + path, encode(body), {"Content-Type": "application/json"}), path)


@settings(FUZZ, max_examples=150)
@given(body=st.one_of(chat_bodies, chat_bodies, chat_bodies, junk, raw_bytes))
def test_fuzz_chat_completions(server, body):
    send(server, CHAT, body)


@settings(FUZZ, max_examples=100)
@given(body=st.one_of(completion_bodies, completion_bodies, completion_bodies, junk, raw_bytes))
def test_fuzz_completions(server, body):
    send(server, COMPLETIONS, body)


ROUTES = ["/v1/models", "/v1/models/{x}", "/health", "/metrics", CHAT, COMPLETIONS, "/v1/{x}", "/{x}"]


@settings(FUZZ, max_examples=60)
@given(route=st.sampled_from(ROUTES), method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       segment=st.text(max_size=10), query=st.text(max_size=10), body=st.one_of(raw_bytes, junk))
def test_fuzz_routes(server, route, method, segment, query, body):
    """Every route, every method, fuzzed path segments and query strings (bodies on GET too)."""
    path = route.replace("{x}", urllib.parse.quote(segment, safe="")) + "?" + urllib.parse.urlencode({"q": query})
    data = encode(body) if method != "GET" or body else None
    r = http_req(method, server.url + path, data, {"Content-Type": "application/json"})
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    if r.status_code >= 400 and not path.startswith("/health"):
        check(r, path)


# ---- the parsers alone (fast, many examples) --------------------------------------------------------------

LIMITS = schema.RequestLimits(limit_images=2, max_messages=16, max_content_parts=8, max_text_bytes=3072,
                              max_model_len=256)


@settings(FUZZ, max_examples=400)
@given(body=st.one_of(chat_bodies, junk), kind=st.sampled_from(["chat", "completion"]),
       completion=completion_bodies)
def test_fuzz_parsers_raise_only_typed_4xx(body, kind, completion):
    """Whatever the JSON, parsing ends in a ParsedRequest or a typed 4xx error naming a field."""
    body = body if kind == "chat" else completion
    try:
        parsed = schema.parse_chat(body, limits=LIMITS) if kind == "chat" else \
            schema.parse_completion(body, limits=LIMITS)
    except MMJaxError as e:
        assert 400 <= e.status < 500, e
        assert e.param is None or isinstance(e.param, str)
        json.dumps(e.to_openai())   # renderable, whatever the client sent
        return
    assert parsed.sampling.max_tokens == 1 and len(parsed.images) <= LIMITS.limit_images
    for ref in parsed.images:
        ref.url.encode("utf-8")    # everything passed on is text
    for m in parsed.messages or []:
        c = m["content"]
        for t in [c] if isinstance(c, str) else [p.get("text", "") for p in c]:
            t.encode("utf-8")
