"""serve/media.py guards: SSRF through IPv6 forms that embed IPv4, and the decode pool's fairness
(per-request pixel budget before any decode, per-request concurrency, queue limit, time budget,
worker-process isolation) on a tiny LLaVA server (CPU, 127.0.0.1)."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import threading
import time

import pytest

from serve.media import (DecodePool, DecodeQueueFullError, ImageGroup, MediaConfig, MediaFetcher,
                         MediaForbiddenError, RequestDecodeTimeError, RequestPixelBudgetError, _ThreadBackend,
                         embedded_ipv4, ip_forbidden)
from test_serve import Server, data_uri, img_part

from serve.app import ServerConfig

# ---- SSRF: IPv6 forms embedding IPv4 --------------------------------------------------------------

REFUSED, ALLOWED = True, False

SSRF_CASES = [
    # 6to4 2002:V4ADDR::/48
    ("2002:7f00:1::", REFUSED),                  # 127.0.0.1 (the finding)
    ("2002:7f00:1:1::1", REFUSED),
    ("2002:a00:1::", REFUSED),                   # 10.0.0.1
    ("2002:a9fe:a9fe::", REFUSED),               # 169.254.169.254 (cloud metadata)
    ("2002:c0a8:101::", REFUSED),                # 192.168.1.1
    ("2002:6440:1::", REFUSED),                  # 100.64.0.1 (CGNAT)
    ("2002:808:808::", ALLOWED),                 # 8.8.8.8
    ("2002:808:808:1::1", ALLOWED),
    # NAT64 well-known prefix 64:ff9b::/96
    ("64:ff9b::7f00:1", REFUSED),                # 127.0.0.1
    ("64:ff9b::a9fe:a9fe", REFUSED),
    ("64:ff9b::10.1.2.3", REFUSED),
    ("64:ff9b::808:808", ALLOWED),
    ("64:ff9b::1.1.1.1", ALLOWED),
    # NAT64 local-use 64:ff9b:1::/48: every RFC 6052 position (/48 /56 /64 /96) is checked
    ("64:ff9b:1::7f00:1", REFUSED),              # /96 position: 127.0.0.1
    ("64:ff9b:1:7f00:1::", REFUSED),             # /48 position: 127.0.1.0
    ("64:ff9b:1:808:a:0:108:808", REFUSED),      # 10.0.0.1 in the /64 position only
    ("64:ff9b:1:808:808:808:808:808", ALLOWED),  # 8.8.8.8 in every position
    # Teredo 2001:0:SERVER:FLAGS:PORT:~CLIENT
    ("2001:0:808:808::fefe:fefe", ALLOWED),      # server 8.8.8.8, client 1.1.1.1
    ("2001:0:808:808:8000:63bf:fefe:fefe", ALLOWED),
    ("2001:0:808:808::80ff:fffe", REFUSED),      # client ~0x80fffffe = 127.0.0.1
    ("2001:0:808:808::3f57:fefe", REFUSED),      # client 192.168.1.1
    ("2001:0:a00:1::fefe:fefe", REFUSED),        # server 10.0.0.1
    ("2001:0:7f00:1::fefe:fefe", REFUSED),       # server 127.0.0.1
    # IPv4-mapped ::ffff:0:0/96
    ("::ffff:8.8.8.8", ALLOWED),
    ("::ffff:127.0.0.1", REFUSED),
    ("::ffff:169.254.169.254", REFUSED),
    ("::ffff:10.0.0.1", REFUSED),
    ("::ffff:a9fe:a9fe", REFUSED),
    # IPv4-compatible ::/96 (deprecated by RFC 4291): refused whatever it embeds
    ("::127.0.0.1", REFUSED),
    ("::10.0.0.1", REFUSED),
    ("::8.8.8.8", REFUSED),
    ("::", REFUSED),
    ("::1", REFUSED),
    # SIIT IPv4-translated ::ffff:0:V4 and other special blocks stay refused by the base rules
    ("::ffff:0:7f00:1", REFUSED),
    ("::ffff:0:808:808", REFUSED),
    ("100::1", REFUSED),
    ("2001:db8::1", REFUSED),
    # plain addresses
    ("8.8.8.8", ALLOWED),
    ("2606:4700:4700::1111", ALLOWED),
    ("127.0.0.1", REFUSED),
    ("fe80::1%eth0", REFUSED),
    ("fd00::1", REFUSED),
    ("not-an-ip", REFUSED),
]


@pytest.mark.parametrize("ip,refused", SSRF_CASES, ids=[c[0] for c in SSRF_CASES])
def test_ip_forbidden_embedded_ipv4(ip, refused):
    assert ip_forbidden(ip) is refused, ip


def test_embedded_ipv4_decoding():
    import ipaddress as ipa
    v6 = ipa.IPv6Address
    assert embedded_ipv4(v6("2002:7f00:1::")) == (ipa.IPv4Address("127.0.0.1"),)
    assert embedded_ipv4(v6("64:ff9b::c0a8:101")) == (ipa.IPv4Address("192.168.1.1"),)
    assert embedded_ipv4(v6("::ffff:10.0.0.1")) == (ipa.IPv4Address("10.0.0.1"),)
    assert embedded_ipv4(v6("2001:0:808:808::80ff:fffe")) == (ipa.IPv4Address("8.8.8.8"), ipa.IPv4Address("127.0.0.1"))
    # local use: /48, /56, /64, /96 positions (the u octet, byte 8, is skipped)
    local = embedded_ipv4(v6("64:ff9b:1:0102:0003:0405:0607:0809"))
    assert [str(a) for a in local] == ["1.2.3.4", "2.3.4.5", "3.4.5.6", "6.7.8.9"]
    assert embedded_ipv4(v6("2606:4700:4700::1111")) is None


def test_fetch_refuses_embedded_loopback_before_connecting():
    """IP-literal hosts in URLs and DNS answers (the connect-time resolver) get the same check."""
    from serve.media import ForbiddenAddress, GuardedResolver

    async def go():
        f = MediaFetcher(MediaConfig(fetch_timeout=2.0), None)
        try:
            for host in ("[2002:7f00:1::]", "[64:ff9b::7f00:1]", "[::ffff:7f00:1]", "[2001:0:808:808::80ff:fffe]",
                         "[::127.0.0.1]"):
                with pytest.raises(MediaForbiddenError):
                    await f.fetch(f"http://{host}/a.png")
        finally:
            await f.close()

        r = GuardedResolver(allow_private=False)

        async def answer(host, port=0, family=0):
            return [{"hostname": host, "host": "2002:a9fe:a9fe::", "port": port, "family": 10, "proto": 0,
                     "flags": 0}]
        r._inner.resolve = answer
        with pytest.raises(ForbiddenAddress):
            await r.resolve("rebind.example", 80)
        await r.close()
    asyncio.run(go())


# ---- the pool, without a server -------------------------------------------------------------------

class GatedBackend:
    """A fake decode backend: each call blocks until released (or sleeps `seconds`), then returns
    "done:<name>" or, with `inner`, the real backend's result. Records order and concurrency."""

    kind = "test"

    def __init__(self, seconds: float | None = None, inner=None):
        self.lock = threading.Lock()
        self.order: list = []
        self.running = 0
        self.max_running = 0
        self.gates: dict = {}
        self.seconds = seconds
        self.inner = inner
        self.closed = False

    def gate(self, name) -> threading.Event:
        with self.lock:
            ev = self.gates.setdefault(name, threading.Event())
            if self.closed:
                ev.set()
            return ev

    def call(self, slot, args, timeout, started=None):
        if started is not None:
            started()
        with self.lock:
            name = args[0] if isinstance(args[0], str) else f"job{len(self.order)}"
            self.order.append(name)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if self.seconds is not None:
                time.sleep(self.seconds)
            else:
                assert self.gate(name).wait(30), f"{name} never released"
            return self.inner.call(slot, args, timeout, started) if self.inner is not None else f"done:{name}"
        finally:
            with self.lock:
                self.running -= 1

    def start_workers(self):
        pass

    def close(self):
        with self.lock:
            self.closed = True
            for g in self.gates.values():
                g.set()


async def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


def test_pool_fair_order_and_per_request_limit():
    async def go():
        be = GatedBackend()
        pool = DecodePool(be, workers=2, per_request=1, max_waiting=100, time_budget=0)
        heavy, light = ImageGroup(10**9), ImageGroup(10**9)
        h = [asyncio.ensure_future(pool.run(heavy, f"h{i}")) for i in range(4)]
        await _until(lambda: be.order == ["h0"])
        assert pool.stats()["running"] == 1 and pool.stats()["waiting"] == 3   # h1..h3 wait: 1 per request
        lt = asyncio.ensure_future(pool.run(light, "l0"))
        await _until(lambda: be.order == ["h0", "l0"])                           # the free worker: no queueing
        be.gate("l0").set()
        assert await lt == "done:l0"
        for i in range(4):
            be.gate(f"h{i}").set()
        assert await asyncio.gather(*h) == [f"done:h{i}" for i in range(4)]
        assert be.max_running <= 2
        pool.close()
        pool.close_backend()
    asyncio.run(go())


def test_pool_free_worker_goes_to_the_request_with_fewest_running():
    async def go():
        be = GatedBackend()
        pool = DecodePool(be, workers=2, per_request=2, max_waiting=100, time_budget=0)
        a, b = ImageGroup(10**9), ImageGroup(10**9)
        ja = [asyncio.ensure_future(pool.run(a, f"a{i}")) for i in range(4)]
        await _until(lambda: be.order == ["a0", "a1"])
        jb = asyncio.ensure_future(pool.run(b, "b0"))     # arrives later than a2, a3
        await asyncio.sleep(0.05)
        be.gate("a0").set()
        await _until(lambda: len(be.order) == 3)
        assert be.order[2] == "b0"                           # b has 0 running, a has 1: b first
        for n in ("a1", "a2", "a3", "b0"):
            be.gate(n).set()
        await asyncio.gather(*ja, jb)
        pool.close()
        pool.close_backend()
    asyncio.run(go())


def test_pool_queue_limit_and_cancellation():
    async def go():
        be = GatedBackend()
        pool = DecodePool(be, workers=1, per_request=1, max_waiting=2, time_budget=0)
        g1, g2, g3, g4 = (ImageGroup(10**9) for _ in range(4))
        j1 = asyncio.ensure_future(pool.run(g1, "x1"))
        j2 = asyncio.ensure_future(pool.run(g2, "x2"))
        j3 = asyncio.ensure_future(pool.run(g3, "x3"))
        await _until(lambda: pool.waiting == 2)
        with pytest.raises(DecodeQueueFullError) as ei:
            await pool.run(g4, "x4")
        assert ei.value.status == 503 and ei.value.to_openai()["error"]["type"] == "server_busy"
        assert ei.value.to_openai()["error"]["code"] == "decode_queue_full"
        j2.cancel()                                          # a waiting job that goes away frees its place
        await _until(lambda: pool.waiting == 1)
        for n in ("x1", "x3"):
            be.gate(n).set()
        assert await j1 == "done:x1" and await j3 == "done:x3"
        assert "x2" not in be.order
        pool.close()
        pool.close_backend()
    asyncio.run(go())


def test_pool_time_budget_stops_later_images():
    async def go():
        be = GatedBackend(seconds=0.3)
        pool = DecodePool(be, workers=1, per_request=1, max_waiting=100, time_budget=0.2)
        g = ImageGroup(10**9)
        jobs = [asyncio.ensure_future(pool.run(g, f"t{i}")) for i in range(3)]
        res = await asyncio.gather(*jobs, return_exceptions=True)
        assert res[0] == "done:t0"
        assert all(isinstance(r, RequestDecodeTimeError) and r.status == 413 for r in res[1:]), res
        assert be.order == ["t0"]                            # the later images never ran
        other = ImageGroup(10**9)                            # another request is not affected
        assert await pool.run(other, "o0") == "done:o0"
        pool.close()
        pool.close_backend()
    asyncio.run(go())


class SlowStartBackend(GatedBackend):
    """Each slot's first job waits `startup` s for its worker (a process pool's first use, or a
    worker restarted after a kill) before the worker has it."""

    def __init__(self, startup: float, seconds: float):
        super().__init__(seconds=seconds)
        self.startup, self.warm = startup, set()

    def call(self, slot, args, timeout, started=None):
        if slot not in self.warm:
            time.sleep(self.startup)
            self.warm.add(slot)
        return super().call(slot, args, timeout, started)


def test_pool_time_budget_does_not_charge_start_up_or_queueing():
    """A request's decode-time budget counts its images' decoding only: not a worker's start-up
    (the first image request after a start got 413 `request_decode_time_exceeded: images used
    35.9s` for 3 s of decoding) nor time spent waiting behind another request."""
    async def go():
        be = SlowStartBackend(startup=1.0, seconds=0.1)
        pool = DecodePool(be, workers=1, per_request=1, max_waiting=100, time_budget=0.5)
        g = ImageGroup(10**9)
        res = await asyncio.gather(*[pool.run(g, f"t{i}") for i in range(4)], return_exceptions=True)
        assert res == [f"done:t{i}" for i in range(4)], res         # 0.4 s of decoding, 1.4 s of wall
        pool.close()
        pool.close_backend()

        be = GatedBackend()
        pool = DecodePool(be, workers=1, per_request=1, max_waiting=100, time_budget=0.5)
        other, g = ImageGroup(10**9), ImageGroup(10**9)
        first = asyncio.ensure_future(pool.run(other, "x"))
        jobs = [asyncio.ensure_future(pool.run(g, f"q{i}")) for i in range(3)]
        await asyncio.sleep(1.0)                                      # g waits behind x for 1 s
        for n in ["x", "q0", "q1", "q2"]:
            be.gate(n).set()
        assert await asyncio.gather(first, *jobs, return_exceptions=True) == ["done:x", "done:q0", "done:q1",
                                                                               "done:q2"]
        pool.close()
        pool.close_backend()
    asyncio.run(go())


def test_image_group_pixel_budget():
    async def go():
        g = ImageGroup(pixel_budget=100)
        idx = [g.add(f"messages[0].content[{i}].image_url") for i in range(3)]
        g.seal()
        g.report(idx[0], (5, 10))                            # 50
        w = asyncio.ensure_future(g.wait_headers())
        await asyncio.sleep(0.01)
        assert not w.done()                                  # waits for every header
        g.report(idx[2], (8, 10))                            # 130 known: over before image 1 is read
        with pytest.raises(RequestPixelBudgetError) as ei:
            await w
        e = ei.value
        assert e.status == 413 and e.code == "request_pixel_budget_exceeded"
        assert e.param == "messages[0].content[2].image_url" and "at least 130" in e.message

        ok = ImageGroup(pixel_budget=100)
        for i in range(2):
            ok.report(ok.add(f"p{i}"), (10, 5))
        ok.seal()
        await ok.wait_headers()                              # exactly 100: fits
    asyncio.run(go())


# ---- a server ---------------------------------------------------------------------------------------

def heavy_png(side: int = 6324) -> bytes:
    """side x side black PNG: ~40 MP (inside the 40 MP limit), ~40 KB, slow to decode and resize."""
    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (side, side)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def heavy_uri():
    return "data:image/png;base64," + base64.b64encode(heavy_png()).decode()


@pytest.fixture(scope="module")
def server(llava_dirs):
    """2 decode worker processes, 1 per request, a pixel budget that lets 8 heavy images through."""
    import mmjax
    vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=4, max_model_len=256)
    s = Server(vlm, ServerConfig(served_model_name="tiny", limit_images=8, decode_workers=2,
                                 decode_workers_per_request=1, max_request_image_pixels=400_000_000,
                                 max_decode_queue=64, log_stats_interval=0))
    s.fetcher = s.state.fetcher
    s.fetcher.start_workers()        # time the decodes, not the worker start-up
    yield s
    s.close()


def chat(content, max_tokens=4):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


def test_request_pixel_budget_refused_before_any_decode(server, heavy_uri):
    pool = server.fetcher.pool
    cfg = server.fetcher.cfg
    cfg.max_request_pixels = 80_000_000                 # 2 x 40 MP
    try:
        started = pool.stats()["started"]
        t = time.monotonic()
        r = server.post("/v1/chat/completions", chat([img_part(heavy_uri)] * 3 + [{"type": "text", "text": "x"}]))
        dt = time.monotonic() - t
    finally:
        cfg.max_request_pixels = 400_000_000
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_pixel_budget_exceeded" and err["type"] == "invalid_request_error"
    assert err["param"].startswith("messages[0].content[") and "80,000,000" in err["message"]
    assert pool.stats()["started"] == started           # not one image was decoded
    assert dt < 5.0, dt                                  # headers only (decoding 3 x 40 MP takes longer)
    # two of them fit the budget (decode time unlimited: this is about pixels, and a loaded machine
    # can take longer than the default 30 s for 2 x 40 MP in one worker)
    cfg.max_request_pixels, pool.time_budget = 80_000_000, 0
    try:
        r = server.post("/v1/chat/completions", chat([img_part(heavy_uri)] * 2))
    finally:
        cfg.max_request_pixels, pool.time_budget = 400_000_000, 30.0
    assert r.status_code == 200, r.text


def test_heavy_request_does_not_delay_light_ones(server, heavy_uri):
    """One request with 8 heavy-but-legal images (40 MP each) decodes while a text-only request and
    a one-small-image request are served in bounded time, with the answers they get when idle."""
    text_body = chat("hi")
    small_body = chat([img_part(data_uri(3)), {"type": "text", "text": "what?"}])
    want_text = server.post("/v1/chat/completions", text_body).json()["choices"][0]["message"]["content"]
    want_small = server.post("/v1/chat/completions", small_body).json()["choices"][0]["message"]["content"]

    res = {}

    def heavy():
        t = time.monotonic()
        res["heavy"] = server.post("/v1/chat/completions", chat([img_part(heavy_uri)] * 8))
        res["heavy_s"] = time.monotonic() - t
        res["heavy_end"] = time.monotonic()
    th = threading.Thread(target=heavy)
    th.start()
    pool = server.fetcher.pool
    end = time.monotonic() + 20
    while pool.stats()["running"] < 1:                  # the heavy request is decoding
        assert time.monotonic() < end
        time.sleep(0.01)

    light = {}

    def send(name, body):
        t = time.monotonic()
        light[name] = server.post("/v1/chat/completions", body)
        light[name + "_s"] = time.monotonic() - t
        light[name + "_end"] = time.monotonic()
    ts = [threading.Thread(target=send, args=a) for a in (("text", text_body), ("small", small_body))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    th.join(120)
    print(f"heavy {res['heavy_s']:.2f}s, text-only {light['text_s']:.3f}s, one small image {light['small_s']:.3f}s")
    assert res["heavy"].status_code == 200, res["heavy"].text
    assert res["heavy"].json()["usage"]["prompt_tokens"] > 8 * 16
    for name, want in (("text", want_text), ("small", want_small)):
        r = light[name]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        assert light[name + "_end"] < res["heavy_end"], (name, light[name + "_s"], res["heavy_s"])
        assert light[name + "_s"] < max(3.0, res["heavy_s"] / 3), (name, light[name + "_s"], res["heavy_s"])


def test_decode_queue_full_is_a_503_with_an_openai_error(server):
    pool = server.fetcher.pool
    real_backend, real_waiting = pool.backend, pool.max_waiting
    be = GatedBackend(inner=real_backend)
    pool.backend, pool.max_waiting = be, 0
    try:
        out = {}

        def send(name, seed):
            out[name] = server.post("/v1/chat/completions", chat([img_part(data_uri(seed))]))
        busy = [threading.Thread(target=send, args=(f"busy{i}", 20 + i)) for i in range(2)]
        for t in busy:
            t.start()
        end = time.monotonic() + 20
        while len(be.order) < 2:                          # both workers taken
            assert time.monotonic() < end
            time.sleep(0.01)
        r = server.post("/v1/chat/completions", chat([img_part(data_uri(30))]))
        text = server.post("/v1/chat/completions", chat("hi"))   # text never touches the decode pool
    finally:
        pool.backend, pool.max_waiting = real_backend, real_waiting
        be.close()
    for t in busy:
        t.join(30)
    assert r.status_code == 503
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "server_busy", "param": None,
                                  "code": "decode_queue_full"}}
    assert "--max-decode-queue" in r.json()["error"]["message"]
    assert text.status_code == 200
    assert [out[f"busy{i}"].status_code for i in range(2)] == [200, 200]   # released: decoded for real
    ok = server.post("/v1/chat/completions", chat([img_part(data_uri(31))]))
    assert ok.status_code == 200, ok.text
    assert pool.stats()["running"] == 0 and pool.stats()["waiting"] == 0


def test_worker_over_the_time_budget_is_killed_and_replaced(server, heavy_uri):
    pool = server.fetcher.pool
    assert pool.backend.kind == "processes"
    pool.time_budget = 0.05                               # a 40 MP decode takes longer
    try:
        t = time.monotonic()
        r = server.post("/v1/chat/completions", chat([img_part(heavy_uri)]))
        dt = time.monotonic() - t
    finally:
        pool.time_budget = 30.0
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_decode_time_exceeded" and err["param"] == "messages[0].content[0].image_url"
    assert "stopped after" in err["message"]
    ok = server.post("/v1/chat/completions", chat([img_part(data_uri(5))]))   # a fresh worker serves it
    assert ok.status_code == 200, ok.text
    assert dt < 30


def test_worker_start_up_is_not_charged_to_the_request(server):
    """The real process backend: a worker that takes 1.2 s to be ready for each job (as on first
    use on a loaded machine) does not use up a 1 s decode budget of tiny images."""
    pool = server.fetcher.pool
    be = pool.backend
    assert be.kind == "processes"
    real = be._ensure

    def slow_ensure(slot):
        time.sleep(1.2)
        return real(slot)
    be._ensure = slow_ensure
    pool.time_budget = 1.0
    try:
        r = server.post("/v1/chat/completions", chat([img_part(data_uri(40 + i)) for i in range(2)] +
                                                     [{"type": "text", "text": "x"}]))
    finally:
        del be._ensure
        pool.time_budget = 30.0
    assert r.status_code == 200, r.text


def test_crashed_worker_fails_only_its_image(server, heavy_uri):
    pool = server.fetcher.pool
    res = {}

    def heavy():
        res["r"] = server.post("/v1/chat/completions", chat([img_part(heavy_uri)]))
    th = threading.Thread(target=heavy)
    th.start()
    end = time.monotonic() + 20
    while pool.stats()["running"] < 1:
        assert time.monotonic() < end
        time.sleep(0.005)
    pids = [p for p in pool.backend.pids() if p is not None]
    for pid in pids:                                      # one of them decodes the heavy image
        os.kill(pid, signal.SIGKILL)
    th.join(60)
    r = res["r"]
    if r.status_code != 200:                              # (the kill may land after it finished)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "image_decoder_crashed"
    ok = server.post("/v1/chat/completions", chat([img_part(data_uri(6))]))
    assert ok.status_code == 200, ok.text


def test_ssrf_6to4_loopback_url_is_refused(server):
    r = server.post("/v1/chat/completions", chat([img_part("http://[2002:7f00:1::]/a.png")]))
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_url_forbidden"


def test_thread_backend_serves_images_too(llava_dirs):
    """decode_processes=False (or a family that cannot be pickled): same results from threads."""
    from types import SimpleNamespace

    import mmjax
    from mmjax.image.decode import load_image
    cfg = MediaConfig(decode_processes=False, decode_workers=1)
    vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=1, max_model_len=256)

    async def go():
        f = MediaFetcher(cfg, vlm.family)
        try:
            ims = await f.load_all([SimpleNamespace(url=data_uri(i), detail="auto", param=f"images[{i}]")
                                    for i in (1, 2)])
            assert isinstance(f.pool.backend, _ThreadBackend)
            return ims
        finally:
            await f.close()
    ims = asyncio.run(go())
    direct = vlm.family.prepare_image(load_image(data_uri(1)))
    assert ims[0].key == direct.key and ims[0].num_tokens == direct.num_tokens
    assert ims[0].key != ims[1].key


def test_cli_flags_reach_the_media_config():
    from serve.cli import build_parser, config_from_args
    args = build_parser().parse_args(["--decode-workers", "3", "--decode-workers-per-request", "1",
                                      "--max-decode-queue", "5", "--max-request-image-pixels", "1000",
                                      "--max-request-decode-seconds", "2.5", "--decode-threads"])
    c = config_from_args(args, "x")
    assert (c.decode_workers, c.decode_workers_per_request, c.max_decode_queue, c.max_request_image_pixels,
            c.max_request_decode_seconds, c.decode_processes) == (3, 1, 5, 1000, 2.5, False)
    d = config_from_args(build_parser().parse_args([]), "x")
    assert d.max_request_image_pixels is None and d.decode_processes
    assert MediaConfig().request_pixel_budget == 4 * MediaConfig().limits.max_pixels
    with pytest.raises(ValueError):
        MediaConfig(decode_workers=0)
