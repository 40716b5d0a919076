"""serve/: the OpenAI-compatible server on a tiny LLaVA checkpoint (CPU, 127.0.0.1, free ports).

Servers run in-process (aiohttp AppRunner in a background thread, one per module) and talk to the
official `openai` client; the SIGTERM test runs `python -m serve` as a subprocess. Reference
outputs come from a second, independent `mmjax.load` of the same checkpoint (offline API).
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import http.client
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import noise_image

import openai  # noqa: E402

from mmjax.serving.sampling import SamplingParams  # noqa: E402
from serve.app import STATE, ServerConfig, create_app, start_server  # noqa: E402

MAX_TOKENS = 6
REPO = Path(__file__).resolve().parents[1]


# ---- helpers ----------------------------------------------------------------------------------------

class Resp:
    def __init__(self, status: int, body: bytes, headers):
        self.status_code, self.content, self.headers = status, body, headers

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def http_req(method: str, url: str, content: bytes | None = None, headers=None, timeout: float = 60) -> Resp:
    """Plain stdlib HTTP (no dependency on the openai client's transport)."""
    req = urllib.request.Request(url, data=content, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Resp(r.status, r.read(), r.headers)
    except urllib.error.HTTPError as e:
        return Resp(e.code, e.read(), e.headers)


def http_get(url: str, timeout: float = 60) -> Resp:
    return http_req("GET", url, timeout=timeout)


def open_stream(url: str, body: dict):
    """POST and return (connection, response) to read SSE lines from (close the connection to leave)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def png_bytes(seed: int, w: int = 40, h: int = 30, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    noise_image(seed, w, h).save(b, fmt)
    return b.getvalue()


def data_uri(seed: int, fmt: str = "PNG", w: int = 40, h: int = 30) -> str:
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(png_bytes(seed, w, h, fmt)).decode()


def img_part(url: str, detail: str | None = None) -> dict:
    iu = {"url": url}
    if detail:
        iu["detail"] = detail
    return {"type": "image_url", "image_url": iu}


class LoopThread:
    """An asyncio loop in a daemon thread (for in-process servers)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Server:
    def __init__(self, vlm, cfg: ServerConfig):
        self.lt = LoopThread()
        self.vlm = vlm

        async def start():
            self.app = create_app(vlm, cfg)
            self.runner, self.site, self.port = await start_server(self.app, "127.0.0.1", 0)
        self.lt.run(start())
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = self.app[STATE]

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def post(self, path: str, body=None, *, raw: bytes | None = None, headers=None) -> Resp:
        content = raw if raw is not None else json.dumps(body).encode()
        return http_req("POST", self.url + path, content, {"Content-Type": "application/json", **(headers or {})})

    def metric(self, name: str) -> float:
        text = http_get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def close(self):
        self.lt.run(self.runner.cleanup())
        self.lt.stop()


def image_server(lt: LoopThread, files: dict[str, bytes]):
    """Plain aiohttp server on 127.0.0.1 serving `files`, plus /slow.png, redirects and a loop."""
    from aiohttp import web

    async def serve_file(request):
        name = request.match_info["name"]
        if name not in files:
            raise web.HTTPNotFound()
        return web.Response(body=files[name], content_type="image/png")

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(body=files["a.png"], content_type="image/png")

    async def redirect(request):
        raise web.HTTPFound("/img/a.png")

    async def loop(request):
        raise web.HTTPFound("/loop")

    async def start():
        app = web.Application()
        app.router.add_get("/img/{name}", serve_file)
        app.router.add_get("/slow.png", slow)
        app.router.add_get("/redirect", redirect)
        app.router.add_get("/loop", loop)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]
    return lt.run(start())


# ---- fixtures ----------------------------------------------------------------------------------------

ENGINE_KW = dict(max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(llava_dirs):
    return llava_dirs["gqa"]


@pytest.fixture(scope="module")
def ref(ckpt):
    """Offline reference: an independent load of the same checkpoint."""
    import mmjax
    return mmjax.load(ckpt, **ENGINE_KW)


@pytest.fixture(scope="module")
def server(ckpt):
    import mmjax
    vlm = mmjax.load(ckpt, **ENGINE_KW)
    s = Server(vlm, ServerConfig(served_model_name="tiny", limit_images=4, max_image_bytes=300_000,
                                 log_stats_interval=0.5, media_fetch_timeout=2.0))
    yield s
    s.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(png_bytes(1))
    return d


@pytest.fixture(scope="module")
def open_server(ckpt, media_dir):
    """API key, private image URLs and local files allowed, short fetch timeout."""
    import mmjax
    vlm = mmjax.load(ckpt, **ENGINE_KW)
    s = Server(vlm, ServerConfig(served_model_name="tiny", api_key="sekret", allow_private_media_urls=True,
                                 allowed_local_media_path=str(media_dir), media_fetch_timeout=1.5,
                                 media_max_redirects=2, log_stats_interval=0))
    yield s
    s.close()


@pytest.fixture(scope="module")
def images_http():
    lt = LoopThread()
    runner, port = image_server(lt, {"a.png": png_bytes(1), "big.png": b"\x89PNG" + os.urandom(400_000)})
    yield f"http://127.0.0.1:{port}"
    lt.run(runner.cleanup())
    lt.stop()


def offline_chat(ref, messages, max_tokens=MAX_TOKENS, **kw):
    """The offline API's answer for OpenAI-style messages (data URIs decoded by vision_io)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return ref.chat(messages, sp)


# ---- happy paths ----------------------------------------------------------------------------------------

def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http_get(server.url + "/health").json() == {"status": "ok"}
    r = http_get(server.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_image_stream_equals_nonstream_equals_offline(server, ref):
    msgs = [{"role": "user", "content": [img_part(data_uri(0)), {"type": "text", "text": "what is this?"}]}]
    c = server.client()
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    off = offline_chat(ref, msgs)
    assert full.choices[0].message.content == streamed == off.text
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == off.finish_reason == "length"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # usage: image tokens are prompt tokens; the final stream chunk carries the same usage
    u = full.usage
    assert u.prompt_tokens == len(off.prompt_token_ids) and off.num_image_tokens == 16
    assert u.prompt_tokens > 16 and u.completion_tokens == MAX_TOKENS
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == u.prompt_tokens
    assert last.usage.completion_tokens == MAX_TOKENS
    assert all(ch.usage is None for ch in chunks[:-1])
    # the second identical prompt hits the prefix cache (when the engine has one) and the encoder cache
    assert last.usage.prompt_tokens_details.cached_tokens >= u.prompt_tokens_details.cached_tokens
    # (the image is either re-used from the encoder cache or skipped entirely by a prefix-cache hit)
    assert (server.metric("mmjax_encoder_cache_hits_total") >= 1
            or last.usage.prompt_tokens_details.cached_tokens > 16)


def test_intervention_extension_field(server, ref):
    """The research `intervention` extension: Pool shrinks the image tokens usage reports, Prune
    reports its dropped tokens, both give the offline API's answer with the same intervention; a
    malformed one is a 400 naming the field."""
    from mmjax.research import Pool, Prune
    msgs = [{"role": "user", "content": [img_part(data_uri(3)), {"type": "text", "text": "what is this?"}]}]
    c = server.client()
    prompt, images = ref.render_chat(msgs)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for body, iv in (({"type": "pool", "factor": 2}, Pool(2)), ({"type": "prune", "keep": 4, "layer": 0}, Prune(4, 0))):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"intervention": body})
        off = ref.generate([{"prompt": prompt, "images": images, "intervention": iv}], sp)[0]
        assert r.choices[0].message.content == off.text
        details = r.usage.model_dump()["prompt_tokens_details"]
        assert details["image_tokens"] == off.num_image_tokens == (4 if body["type"] == "pool" else 16)
        assert details.get("pruned_tokens", 0) == off.pruned_tokens == (12 if body["type"] == "prune" else 0)
    bad = server.post("/v1/chat/completions", {"model": "tiny", "messages": msgs,
                                               "intervention": {"type": "pool", "factor": 0}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "intervention.factor"


def test_two_images_text_before_and_after(server, ref):
    msgs = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "left"}, img_part(data_uri(2, "JPEG")),
                                         {"type": "text", "text": "right"}, img_part(data_uri(3, "WEBP")),
                                         {"type": "text", "text": "which is bigger?"}]},
            {"role": "assistant", "content": "the left one"},
            {"role": "user", "content": "why?"}]
    r = server.client().chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=MAX_TOKENS,
                                                temperature=0)
    off = offline_chat(ref, msgs)
    assert r.choices[0].message.content == off.text
    assert off.num_image_tokens == 32 and r.usage.prompt_tokens == len(off.prompt_token_ids)


@pytest.mark.parametrize("fmt", ["GIF", "BMP"])
def test_other_formats_and_detail(server, ref, fmt):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "describe"}, img_part(data_uri(4, fmt), "low")]}]
    r = server.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == offline_chat(ref, msgs).text


def test_sampling_seed_stop_logprobs(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hello world"}]
    a = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    g = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                  top_logprobs=3)
    lp = g.choices[0].logprobs.content
    assert len(lp) == g.usage.completion_tokens
    for e in lp:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5  # greedy picks the top token
    text = g.choices[0].message.content
    if len(text) >= 2:
        stop = text[1:3] if len(text) > 2 else text[1]
        s = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stop=[stop])
        assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == text[:text.find(stop)]


def test_completions_with_images_extension(server, ref):
    c = server.client()
    r = c.completions.create(model="tiny", prompt="USER: <image>\nwhat color? ASSISTANT:", max_tokens=MAX_TOKENS,
                             temperature=0, extra_body={"images": [data_uri(5)]}, logprobs=2)
    off = ref.generate([{"prompt": "USER: <image>\nwhat color? ASSISTANT:", "images": [data_uri(5)]}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert r.choices[0].text == off.text and r.usage.prompt_tokens == len(off.prompt_token_ids)
    assert len(r.choices[0].logprobs.tokens) == MAX_TOKENS
    # no placeholder in the prompt: images are prepended, one per image
    r2 = c.completions.create(model="tiny", prompt="what color?", max_tokens=2, temperature=0,
                              extra_body={"images": [{"url": data_uri(5)}]})
    assert r2.usage.prompt_tokens > 16
    chunks = list(c.completions.create(model="tiny", prompt="hello", max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True))
    plain = c.completions.create(model="tiny", prompt="hello", max_tokens=MAX_TOKENS, temperature=0)
    assert "".join(ch.choices[0].text for ch in chunks) == plain.choices[0].text


def test_http_image_url_allowed_only_with_flag(server, open_server, images_http, ref):
    url = images_http + "/img/a.png"
    msgs = [{"role": "user", "content": [img_part(url), {"type": "text", "text": "what?"}]}]
    ok = open_server.client("sekret").chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                                              temperature=0)
    off = offline_chat(ref, [{"role": "user", "content": [img_part(data_uri(1)), {"type": "text", "text": "what?"}]}])
    assert ok.choices[0].message.content == off.text
    # redirects are followed (and re-checked) up to the limit
    r = open_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        img_part(images_http + "/redirect")]}], "max_tokens": 2}, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200, r.text
    r = open_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        img_part(images_http + "/loop")]}], "max_tokens": 2}, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and "redirect" in r.json()["error"]["message"]
    # the same URL without the flag: refused before connecting
    with pytest.raises(openai.BadRequestError) as ei:
        server.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS)
    err = ei.value.body
    assert err["code"] == "media_url_forbidden" and err["param"] == "messages[0].content[0].image_url"
    # 404 from the image host, over-the-cap body
    r = open_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        img_part(images_http + "/img/missing.png")]}]}, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_fetch_failed"


def test_slow_image_fetch_times_out_without_blocking_others(open_server, images_http):
    hdr = {"Authorization": "Bearer sekret"}
    results = {}

    def slow():
        results["slow"] = open_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            img_part(images_http + "/slow.png")]}], "max_tokens": 2}, headers=hdr)
        results["slow_end"] = time.monotonic()
    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.2)
    fast = open_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}, headers=hdr)
    fast_end = time.monotonic()
    t.join(30)
    assert fast.status_code == 200
    assert fast_end < results["slow_end"]  # answered while the slow fetch (1.5 s timeout) was pending
    r = results["slow"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_fetch_failed"
    assert "timed out" in r.json()["error"]["message"]


def test_local_files_only_under_allowed_dir(server, open_server, media_dir, tmp_path):
    hdr = {"Authorization": "Bearer sekret"}
    body = lambda p: {"messages": [{"role": "user", "content": [img_part(Path(p).as_uri())]}],  # noqa: E731
                      "max_tokens": 2}
    assert open_server.post("/v1/chat/completions", body(media_dir / "a.png"), headers=hdr).status_code == 200
    (tmp_path / "b.png").write_bytes(png_bytes(2))
    os.symlink(tmp_path / "b.png", media_dir / "link.png")
    for p in (tmp_path / "b.png", media_dir / "link.png", str(media_dir) + "/../" + tmp_path.name + "/b.png"):
        r = open_server.post("/v1/chat/completions", body(p), headers=hdr)
        assert r.status_code == 400 and r.json()["error"]["code"] == "local_media_forbidden", p
    r = server.post("/v1/chat/completions", body(media_dir / "a.png"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "local_media_forbidden"


# ---- errors ----------------------------------------------------------------------------------------------

def _chat(content, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def bad_requests():
    """(name, body or raw bytes, status, code, param-substring)."""
    big = base64.b64encode(png_bytes(9, 400, 400)).decode()  # ~480 KB PNG of noise > 300 KB cap
    undecodable = base64.b64encode(b"\x89PNG\r\n\x1a\nnot really a png").decode()
    from PIL import Image
    b = io.BytesIO()
    Image.new("1", (8000, 6000)).save(b, "PNG")  # 6 KB file, 48 MP > the 40 MP default
    bomb = base64.b64encode(b.getvalue()).decode()
    return [
        ("malformed json", b'{"messages": [', 400, "invalid_json", None),
        ("empty body", b"", 400, "invalid_json", None),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
        ("invalid utf-8", b'{"messages": "\xff\xfe"}', 400, "invalid_json", None),
        ("not an object", [1, 2], 400, "invalid_request", None),
        ("no messages", {"model": "tiny"}, 400, "invalid_request", "messages"),
        ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
        ("bad part type", _chat([{"type": "audio"}]), 400, "invalid_request", "messages[0].content[0].type"),
        ("temperature type", _chat("x", temperature="hot"), 400, "invalid_request", "temperature"),
        ("temperature range", _chat("x", temperature=5), 400, "invalid_request", "temperature"),
        ("max_tokens 0", _chat("x", max_tokens=0), 400, "invalid_request", "max_tokens"),
        ("n over the limit", _chat("x", n=17), 400, "invalid_request", "n"),
        ("best_of", _chat("x", n=2, best_of=3), 400, "unsupported_parameter", "best_of"),
        ("top_logprobs", _chat("x", logprobs=True, top_logprobs=50), 400, "invalid_request", "top_logprobs"),
        ("unknown model", {**_chat("x"), "model": "gpt-4o"}, 404, "model_not_found", "model"),
        ("bad base64", _chat([img_part("data:image/png;base64,@@@notbase64")]), 400, "invalid_image",
         "messages[0].content[0].image_url"),
        ("not an image", _chat([img_part("data:text/plain;base64,aGVsbG8=")]), 400, "invalid_image",
         "messages[0].content[0].image_url"),
        ("undecodable", _chat([{"type": "text", "text": "x"}, img_part("data:image/png;base64," + undecodable)]),
         400, "invalid_image", "messages[0].content[1].image_url"),
        ("oversized", _chat([img_part("data:image/png;base64," + big)]), 413, "image_too_large",
         "messages[0].content[0].image_url"),
        ("pixel bomb", _chat([img_part("data:image/png;base64," + bomb)]), 413, "image_too_large",
         "messages[0].content[0].image_url"),
        ("too many images", _chat([img_part(data_uri(i)) for i in range(5)]), 400, "too_many_images", "messages"),
        ("bad scheme", _chat([img_part("ftp://example.com/a.png")]), 400, "invalid_image", "image_url"),
        ("placeholder injection", _chat("look: <image>"), 400, "invalid_prompt", "messages[0]"),
        ("prompt over context", _chat("hello world " * 200), 400, "context_length_exceeded", "messages"),
        ("max_tokens over context", _chat("hi", max_tokens=10_000), 400, "context_length_exceeded", "max_tokens"),
        ("max_completion_tokens over context", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 10_000}, 400, "context_length_exceeded",
         "max_completion_tokens"),
        ("top_k over int32", _chat("x", top_k=2**31), 400, "invalid_request", "top_k"),
        ("completion no prompt", ("/v1/completions", {"model": "tiny"}), 400, "invalid_request", "prompt"),
        ("completion long prompt", ("/v1/completions", {"prompt": "hello world " * 200}), 400,
         "context_length_exceeded", "prompt"),
        ("completion bad image", ("/v1/completions", {"prompt": "x", "images": ["data:image/png;base64,AAAA"]}),
         400, "invalid_image", "images[0]"),
        ("completion token out of vocab", ("/v1/completions", {"prompt": [1, 10**7]}), 400, "invalid_request",
         "prompt"),
    ]


def _send(server, body):
    path = "/v1/chat/completions"
    if isinstance(body, tuple):
        path, body = body
    if isinstance(body, bytes):
        return server.post(path, raw=body)
    return server.post(path, body)


def test_every_error_class_gets_an_openai_error(server):
    for name, body, status, code, param in bad_requests():
        r = _send(server, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert err["code"] == code, (name, err)
        assert err["message"], name
        if param is not None:
            assert err["param"] and param in err["param"], (name, err)
    # routing errors are JSON too
    r = http_get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http_get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # a body over the server's size cap
    r = server.post("/v1/chat/completions", raw=b'{"x": "' + b"a" * (server.state.body_cap + 10) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # the openai client maps them to its exception classes
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_bare_image_token_ids_without_images_are_rejected(server):
    """A token-id prompt holding the image token id but no images would embed zeros there: 400."""
    image_id = server.state.vlm.family.image_token_id
    r = _send(server, ("/v1/completions", {"model": "tiny", "prompt": [1, 5, image_id, image_id, 7], "max_tokens": 2}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_prompt"
    assert "image tokens" in r.json()["error"]["message"]


def test_image_over_token_budget(server):
    st = server.state
    st.fetcher.cfg.image_max_tokens = 8          # the tiny LLaVA needs 16 tokens per image
    try:
        r = server.post("/v1/chat/completions", _chat([img_part(data_uri(0))]))
    finally:
        st.fetcher.cfg.image_max_tokens = None
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "image_token_budget_exceeded" and err["param"] == "messages[0].content[0].image_url"


def test_auth(open_server):
    body = _chat("hi")
    r = open_server.post("/v1/chat/completions", body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = open_server.post("/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        open_server.client("wrong").models.list()
    assert http_get(open_server.url + "/health").status_code == 200  # health and metrics need no key
    assert http_get(open_server.url + "/metrics").status_code == 200
    assert open_server.post("/v1/chat/completions", body, headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_queue_full_and_engine_failure(open_server):
    hdr = {"Authorization": "Bearer sekret"}
    st = open_server.state
    st.aengine.max_waiting = 0
    try:
        r = open_server.post("/v1/chat/completions", _chat("hi"), headers=hdr)
    finally:
        st.aengine.max_waiting = 256
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.InternalServerError):  # 503 via the client too
        st.aengine.max_waiting = 0
        try:
            open_server.client("sekret").chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                                        "content": "x"}])
        finally:
            st.aengine.max_waiting = 256

    eng = st.engine
    orig = eng.runner.encode_images

    def boom(images, adapter=-1):
        raise RuntimeError("simulated device failure")
    eng.runner.encode_images = boom
    try:
        r = open_server.post("/v1/chat/completions", _chat([img_part(data_uri(0))]), headers=hdr)
    finally:
        eng.runner.encode_images = orig
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error" and "simulated" in r.json()["error"]["message"]
    ok = open_server.post("/v1/chat/completions", _chat([img_part(data_uri(0))]), headers=hdr)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_200_bad_requests_then_a_good_one(server, ref):
    cases = bad_requests()
    statuses = []
    for i in range(200):
        name, body, status, code, _ = cases[i % len(cases)]
        statuses.append(_send(server, body).status_code == status)
    assert all(statuses)
    msgs = [{"role": "user", "content": [img_part(data_uri(11)), {"type": "text", "text": "and now?"}]}]
    r = server.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == offline_chat(ref, msgs).text
    assert http_get(server.url + "/health").json()["status"] == "ok"
    assert server.metric("mmjax_num_requests_running") == 0


# ---- concurrency, disconnects, drain ----------------------------------------------------------------------

def test_16_concurrent_streaming_clients(server, ref):
    prompts = [[img_part(data_uri(100 + i)), {"type": "text", "text": f"picture {i}?"}] for i in range(16)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(content):
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                      max_tokens=MAX_TOKENS, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()
    texts = asyncio.run(main())
    expected = [offline_chat(ref, [{"role": "user", "content": p}]).text for p in prompts]
    assert texts == expected


def test_disconnect_mid_stream_frees_the_slot(server):
    aborted0 = server.metric("mmjax_engine_requests_aborted_total")
    body = _chat("tell me a long story", max_tokens=200, stream=True, ignore_eos=True)
    conn, r = open_stream(server.url + "/v1/chat/completions", body)
    assert r.status == 200
    first = r.readline().decode()
    assert first.startswith("data: ")
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (server.metric("mmjax_num_requests_running") == 0 and server.metric("mmjax_http_requests_in_flight") == 0
                and server.metric("mmjax_engine_requests_aborted_total") > aborted0):
            break
        time.sleep(0.1)
    assert server.metric("mmjax_num_requests_running") == 0
    assert server.metric("mmjax_http_requests_in_flight") == 0
    assert server.metric("mmjax_engine_requests_aborted_total") == aborted0 + 1
    assert server.metric("mmjax_engine_decode_tokens_total") > 0


def test_disconnect_non_streaming_aborts(server):
    aborted0 = server.metric("mmjax_engine_requests_aborted_total")
    body = _chat("another long story", max_tokens=220, ignore_eos=True)
    u = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 20
    while server.metric("mmjax_num_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.sock.shutdown(2)
    conn.close()
    while time.monotonic() < deadline:
        if server.metric("mmjax_num_requests_running") == 0 and server.metric("mmjax_http_requests_in_flight") == 0:
            break
        time.sleep(0.05)
    assert server.metric("mmjax_num_requests_running") == 0
    assert server.metric("mmjax_engine_requests_aborted_total") == aborted0 + 1
    assert server.metric("mmjax_client_disconnects_total") >= 1


def test_failure_mid_stream_is_an_sse_error_event(open_server):
    st = open_server.state
    eng = st.engine
    orig = eng.runner.decode
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated decode failure")
        return orig(*a, **kw)
    eng.runner.decode = flaky
    try:
        body = _chat("stream then fail", max_tokens=20, stream=True, ignore_eos=True)
        r = open_server.post("/v1/chat/completions", body, headers={"Authorization": "Bearer sekret"})
    finally:
        del eng.runner.decode
    assert r.status_code == 200
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "internal_error" and "simulated decode failure" in err["message"]
    assert sum(1 for e in events if '"content"' in e) >= 1
    ok = open_server.post("/v1/chat/completions", _chat("fine again"), headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_metrics_exposition(server):
    text = http_get(server.url + "/metrics").text
    for name in ("mmjax_http_requests_total", "mmjax_request_latency_seconds_bucket",
                 "mmjax_time_to_first_token_seconds_bucket", "mmjax_prompt_tokens_total",
                 "mmjax_completion_tokens_total", "mmjax_image_tokens_total", "mmjax_slots_used",
                 "mmjax_slot_utilization", "mmjax_queue_depth", "mmjax_encoder_cache_hits_total",
                 'mmjax_compiled_shapes{kind="decode"}', "mmjax_cached_prompt_tokens_total",
                 "mmjax_engine_preemptions_total"):
        assert name in text, name
    assert re.search(r'mmjax_http_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', text)


def test_qwen2_vl_detail_maps_to_a_resolution_budget(tmp_path):
    """Dynamic-resolution family: detail=low caps the image tokens, high/auto use the full budget;
    streamed == non-streamed == offline."""
    from tiny_qwen import build_qwen

    import mmjax
    path = build_qwen(tmp_path / "qwen", family="qwen2_vl", seed=0)
    s = Server(mmjax.load(path, max_num_seqs=2, max_model_len=512),
               ServerConfig(served_model_name="qwen", low_detail_image_tokens=16, log_stats_interval=0))
    try:
        c = s.client()
        uri = data_uri(21, "PNG", 260, 190)
        usage = {}
        for detail in ("low", "high"):
            msgs = [{"role": "user", "content": [img_part(uri, detail), {"type": "text", "text": "what?"}]}]
            r = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=4, temperature=0)
            usage[detail] = r.usage
            chunks = list(c.chat.completions.create(model="qwen", messages=msgs, max_tokens=4, temperature=0,
                                                    stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
        assert usage["low"].prompt_tokens_details.image_tokens <= 16
        assert usage["high"].prompt_tokens_details.image_tokens == 63  # 260x190 -> 252x196 -> 9x7 merged
        assert usage["high"].prompt_tokens - usage["low"].prompt_tokens == \
            usage["high"].prompt_tokens_details.image_tokens - usage["low"].prompt_tokens_details.image_tokens
        ref = mmjax.load(path, max_num_seqs=2, max_model_len=512)
        msgs = [{"role": "user", "content": [img_part(uri), {"type": "text", "text": "what?"}]}]
        r = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=4, temperature=0)
        assert r.choices[0].message.content == offline_chat(ref, msgs, max_tokens=4).text
    finally:
        s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_fails_requests_instead_of_hanging(ckpt):
    import mmjax
    s = Server(mmjax.load(ckpt, **ENGINE_KW), ServerConfig(served_model_name="tiny", log_stats_interval=0))
    try:
        ae = s.state.aengine

        def broken():
            raise SystemError("simulated loop crash")
        ae._drain_inbox = broken
        t0 = time.monotonic()
        r = s.post("/v1/chat/completions", _chat("hi"))
        assert r.status_code == 503 and "engine loop stopped" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
        assert http_get(s.url + "/health").status_code == 503
        r = s.post("/v1/chat/completions", _chat("hi"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_unavailable"
    finally:
        s.close()


def test_media_guards_unit():
    from serve.media import MediaConfig, MediaFetcher, ip_forbidden

    for ip in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.5.4", "169.254.169.254", "::1", "fe80::1",
               "::ffff:127.0.0.1", "0.0.0.0", "100.64.0.1", "224.0.0.1", "fc00::1"):
        assert ip_forbidden(ip), ip
    for ip in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert not ip_forbidden(ip), ip
    f = MediaFetcher(MediaConfig(allowed_domains=("example.com", "*.cdn.example.org")), None)
    f._check_host("example.com")
    f._check_host("img.cdn.example.org")
    from serve.media import MediaForbiddenError
    for h in ("evil.com", "example.com.evil.com", "cdn.example.org.evil"):
        with pytest.raises(MediaForbiddenError):
            f._check_host(h)


def test_sigterm_drains_and_exits_zero(ckpt):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "JAX_PLATFORMS": "cpu"}
    p = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(ckpt), "--port", "0",
                          "--served-model-name", "tiny", "--max-num-seqs", "2", "--max-model-len", "256",
                          "--log-stats-interval", "0.2"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port, "".join(lines)
        url = f"http://127.0.0.1:{port}"
        out = {}

        def streamer():
            body = _chat("a story", max_tokens=200, stream=True, ignore_eos=True,
                         stream_options={"include_usage": True})
            conn, r = open_stream(url + "/v1/chat/completions", body)
            out["lines"] = [ln for ln in r.read().decode().splitlines() if ln]
            conn.close()
        t = threading.Thread(target=streamer)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the request is running
            m = re.search(r"^mmjax_http_requests_in_flight (\S+)$", http_get(url + "/metrics").text, re.M)
            if m and float(m.group(1)) >= 1:
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # while draining: no new work (listener closed, or 503 if the connection raced in)
            assert http_get(url + "/health", timeout=5).status_code == 503
        except OSError:
            pass
        t.join(60)
        rc = p.wait(60)
        rest = p.stdout.read()
        assert rc == 0, "".join(lines) + rest
        got = out["lines"]
        assert got[-1] == "data: [DONE]"
        usage = json.loads(got[-2][6:])["usage"]
        final = json.loads(got[-3][6:])
        assert final["choices"][0]["finish_reason"] == "length"   # the running request finished
        assert usage["completion_tokens"] == 200
        with pytest.raises(OSError):
            http_get(url + "/health", timeout=2)
        assert "Decode batch." in "".join(lines) + rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
