"""`python -m benchmarks.soak`: a bounded, local-only soak of `mmjax serve`.

    python -m benchmarks.soak                                  # starts `mmjax serve` (shipped model), 600 s, 16 clients
    python -m benchmarks.soak --duration 60 --server-args "--warmup"
    python -m benchmarks.soak --model DIR --server-args "--max-num-seqs 4 --max-model-len 512"
    python -m benchmarks.soak --url http://127.0.0.1:8000 --pid 12345   # an existing server (loopback only)
    python -m benchmarks.soak --mix clean   --concurrency 32          # good requests only: the latency baseline
    python -m benchmarks.soak --mix hostile --concurrency 32          # 40% bad requests of every hostile kind

Without `--url` the script starts `mmjax serve --host 127.0.0.1 --port P` itself (P a free port,
the environment inherited, its output in `--server-log`), waits for GET /health to be 200, and at
the end stops it with SIGTERM (then SIGKILL after `--stop-timeout`). `--url` must name a loopback
host (127.0.0.0/8, localhost or ::1); anything else is refused. `--pid` gives the server's process
id there, for the memory readings.

After one warm-up image chat and one completion (the first request compiles), `--concurrency`
aiohttp client workers loop for `--duration` seconds (at most `--max-requests` requests in all),
each request drawn from a seeded RNG (`--seed`) among these kinds (the first requests send every
kind of the mix once, so that a short or slow run still covers each):

  chat_image    non-streaming chat with 1-2 base64 PNG images (random non-square noise, plus a few
                reused images so the encoder / prefix caches are hit)
  chat_stream   streaming chat (with or without an image), `stream_options.include_usage`
  completion    text-only /v1/completions (streaming or not)
  abort_stream  a long streaming request the client abandons: closes the response after a random
                number of SSE chunks, or cancels the request after a random delay (maybe before
                the first byte)
  disconnect    a raw socket (asyncio.open_connection): sends a valid request, reads 0-100 bytes,
                closes (or resets) the socket without reading the rest
  structured    chat / completion under an output constraint (JSON schema, json_object, regex,
                choice, a GBNF and a Lark grammar; now and then a new 1,024-string choice, which
                the grammar cache must hold within its byte bound), streaming or not: a finished
                answer ("stop") must satisfy its constraint
  tools         chat with tools (one with Pydantic-style $defs / $ref), tool_choice auto, required
                or a named function: required / named answers must be tool calls of the named tools
                whose arguments parse (or run out of max_tokens)
  embeddings    /v1/embeddings of 1-8 texts (or chat messages with an image): one vector each
  abort_embed   a heavy /v1/embeddings request (64-128 inputs of 300-1,000 characters) the client
                abandons after 0.1-1 s (the server must drop its work)
  prompt_logprobs  completion or chat with prompt_logprobs (0-5, sometimes echo + logprobs, an
                image): one entry per prompt token
  invalid       bad JSON, bad field values, too many tokens, too many images, unknown model: must
                get a 4xx

All requests use temperature 0 and small max_tokens (8-32; 64-256 with ignore_eos for the
abandoned kinds, so that they are still running when abandoned). Every request has a timeout.

Reported: requests by kind, HTTP status counts by kind, 5xx / SSE `error` events / client-side
exceptions, latency p50 / p99 per kind, tokens received; then, once the server is idle (GET
/metrics polled for up to `--idle-timeout` s), the engine's slot usage and running / waiting /
in-flight counts ("leaked slots" = slots still used when nothing is in flight; with a paged KV
cache "leaked pages" = pages still held by requests, and the preemptions for pages), the server's own
status counts and abort / disconnect counters, and the server's resident memory (VmRSS of
/proc/PID/status) after warm-up, at the end and the peak over samples every `--sample-interval` s.

Output: a human table, then exactly one JSON line with every figure (the last line of stdout;
progress goes to stderr). Exit status 1 when a valid request got a 5xx, a good stream carried an
SSE error or ended without [DONE], a good request failed with a client-side exception, an invalid
request got anything but a 4xx, a slot or a KV page leaked, the server did not become idle, or the server died
(or exited non-zero on SIGTERM); 2 when the server could not be started / reached; else 0.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import ipaddress
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from PIL import Image

# Request mixes (`--mix`): default = the issue-19 soak (good, aborted, disconnected, invalid);
# clean = good requests only (the latency baseline); hostile = 60% good, 40% bad of every kind the
# hostile-client campaign used (issue "No request can hurt another").
# Every mix has structured-output, tools, embeddings and prompt_logprobs traffic (issue 56).
MIXES: dict[str, dict[str, float]] = {
    "default": {"chat_image": 0.20, "chat_stream": 0.16, "completion": 0.12, "structured": 0.08, "tools": 0.05,
                "embeddings": 0.06, "abort_embed": 0.03, "prompt_logprobs": 0.06,
                "abort_stream": 0.08, "disconnect": 0.08, "invalid": 0.08},
    "clean": {"chat_image": 0.30, "chat_stream": 0.25, "completion": 0.15, "structured": 0.10, "tools": 0.05,
              "embeddings": 0.07, "prompt_logprobs": 0.08},
    "hostile": {"chat_image": 0.18, "chat_stream": 0.14, "completion": 0.10, "structured": 0.06, "tools": 0.04,
                "embeddings": 0.05, "abort_embed": 0.02, "prompt_logprobs": 0.05,
                "abort_stream": 0.05, "disconnect": 0.05, "invalid": 0.08, "hostile": 0.13, "hostile_raw": 0.05},
}
KIND_WEIGHTS: dict[str, float] = dict(MIXES["default"])
KINDS = ("chat_image", "chat_stream", "completion", "structured", "tools", "embeddings", "prompt_logprobs",
         "abort_stream", "abort_embed", "disconnect", "invalid", "hostile", "hostile_raw")
GOOD_KINDS = ("chat_image", "chat_stream", "completion", "structured", "tools", "embeddings",
              "prompt_logprobs")                                 # must complete normally
VALID_KINDS = GOOD_KINDS + ("abort_stream", "abort_embed", "disconnect")   # valid bodies: never a 5xx
BAD_KINDS = ("invalid", "hostile")                                # must get a 4xx
QUESTIONS = ("What shape is this?", "What color is the shape?", "How many shapes are there?",
             "Is there a red circle?", "Is there a blue square?", "Describe the image.")
TEXTS = ("hello", "a red circle and a blue square", "Describe the image.", "How many shapes",
         "yellow triangle", "USER: What color is the shape? ASSISTANT:", "one two three four five")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LOG_PROBLEM = re.compile(r"Traceback|\bERROR\b|CRITICAL|Unclosed|never retrieved|unhandled", re.I)


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# ---- arguments / safety ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="an existing server (loopback only); default: start one")
    p.add_argument("--pid", type=int, default=None, help="that server's process id (memory readings)")
    p.add_argument("--model", default=None, help="model dir passed to `mmjax serve --model` (default: shipped)")
    p.add_argument("--server-args", default="", help="extra `mmjax serve` flags, one shell-quoted string")
    p.add_argument("--server-log", default=None, help="file for the started server's output (default: a temp file)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (after warm-up)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="requests in all, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for /health + warm-up")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for the server to go idle")
    p.add_argument("--stop-timeout", type=float, default=45.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between memory samples")
    p.add_argument("--mix", choices=sorted(MIXES), default="default",
                   help="request mix: default (issue 19), clean (good only: the latency baseline), hostile "
                        "(40%% bad requests of every kind the hostile-client campaign found)")
    a = p.parse_args(_join_server_args(sys.argv[1:] if argv is None else list(argv)))
    if a.url and (a.model or a.server_args):
        p.error("--model / --server-args start a server; they cannot be used with --url")
    if a.concurrency < 1 or a.duration <= 0 or a.max_requests < 1:
        p.error("--concurrency, --duration and --max-requests must be positive")
    return a


def _join_server_args(argv: list[str]) -> list[str]:
    """`--server-args "--warmup"` -> `--server-args=--warmup` (argparse reads a value that starts
    with '--' as an option)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--server-args" and i + 1 < len(argv):
            out.append("--server-args=" + argv[i + 1])
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def loopback_host_port(url: str) -> tuple[str, int]:
    """(host, port) of an http:// URL whose host is 127.0.0.0/8, localhost or ::1; else ValueError."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    if u.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    if host != "localhost":
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"refusing non-loopback host {host!r}: only 127.0.0.0/8, localhost and ::1")
    return host, u.port or 80


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the server process ------------------------------------------------------------------------------

class ServerProcess:
    """`mmjax serve` as a child process (own session, output to a log file)."""

    def __init__(self, model: str | None, server_args: str, log_path: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "mmjax.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if model:
            self.cmd += ["--model", model]
        self.cmd += shlex.split(server_args)
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"mmjax-soak-server-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def start(self) -> None:
        log(f"starting: {shlex.join(self.cmd)} (log {self.log_path})")
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ), start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` s. Returns the exit code (negative: killed by a signal)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"server did not exit {timeout:.0f}s after SIGTERM; killing it")
                self.proc.kill()
                self.proc.wait(10)
        self.exit_code = self.proc.returncode
        return self.exit_code

    def log_problems(self, limit: int = 10) -> tuple[int, list[str]]:
        try:
            with open(self.log_path, errors="replace") as fh:
                bad = [ln.rstrip() for ln in fh if LOG_PROBLEM.search(ln)]
        except OSError:
            return 0, []
        return len(bad), [ln[:300] for ln in bad[:limit]]

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


def pid_alive(pid: int | None) -> bool | None:
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) is gone for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_rss_kb(pid: int | None) -> int | None:
    """VmRSS of /proc/PID/status in kB (None when unknown / gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---- metrics -------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def server_status_counts(metrics: dict[str, float]) -> dict[str, int]:
    """HTTP status -> count over the generation routes, from mmjax_http_requests_total."""
    out: Counter = Counter()
    for k, v in metrics.items():
        if k.startswith("mmjax_http_requests_total{") and '"/v1/' in k:
            m = re.search(r'status="(\d+)"', k)
            if m:
                out[m.group(1)] += int(v)
    return dict(sorted(out.items()))


async def get_metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return parse_metrics(await r.text())


async def wait_idle(session: aiohttp.ClientSession, base: str, timeout: float) -> dict[str, Any]:
    """Poll /metrics until nothing is in flight / waiting / running and no slot is used, for up to
    `timeout` s. Returns the last reading's gauges, `idle` and `leaked_slots`."""
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    while True:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            m = await get_metrics(session, base)
        g = {k: m.get(f"mmjax_{k}") for k in ("http_requests_in_flight", "num_requests_running",
                                               "num_requests_waiting", "queue_depth", "slots_used", "slots_total",
                                               "kv_pages_used", "kv_pages_total")}
        idle = bool(m) and all((g[k] or 0) == 0 for k in ("http_requests_in_flight", "num_requests_waiting",
                                                         "queue_depth"))
        if (idle and not g["slots_used"] and not g["num_requests_running"]) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {"metrics": m, "gauges": g, "idle": idle,
            "leaked_slots": int(g["slots_used"]) if g["slots_used"] is not None else None,
            "leaked_pages": int(g["kv_pages_used"]) if g["kv_pages_used"] is not None else None}


# ---- request bodies ------------------------------------------------------------------------------------

def png_data_uri(seed: int, width: int, height: int) -> str:
    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def random_size(rng: random.Random) -> tuple[int, int]:
    w, h = rng.randint(40, 256), rng.randint(40, 256)
    return (w, h + 7) if w == h else (w, h)


class ImagePool:
    """Fresh random images (never seen before) and a few reused ones (encoder / prefix cache hits)."""

    def __init__(self, seed: int, n_reused: int = 4):
        rng = random.Random(seed)
        self.reused = [png_data_uri(seed * 1000 + i, *random_size(rng)) for i in range(n_reused)]
        self.tiny = png_data_uri(seed, 8, 6)

    def pick(self, rng: random.Random) -> str:
        if rng.random() < 0.35:
            return rng.choice(self.reused)
        return png_data_uri(rng.getrandbits(48), *random_size(rng))


def chat_body(model: str | None, rng: random.Random, images: list[str], *, stream: bool, max_tokens: int,
              ignore_eos: bool = False) -> dict:
    content: list[dict] = [{"type": "text", "text": rng.choice(QUESTIONS)}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    messages: list[dict] = [{"role": "user", "content": content}]
    if rng.random() < 0.1:
        messages.insert(0, {"role": "system", "content": "Answer briefly."})
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    return _common(body, model, stream, ignore_eos)


def completion_body(model: str | None, rng: random.Random, *, stream: bool, max_tokens: int,
                    ignore_eos: bool = False) -> dict:
    prompt = " ".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 4)))
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    return _common(body, model, stream, ignore_eos)


def _common(body: dict, model: str | None, stream: bool, ignore_eos: bool) -> dict:
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def invalid_request(model: str | None, rng: random.Random, tiny_image: str) -> tuple[str, str, bytes]:
    """(name, path, raw body) of a request that must get a 4xx."""
    msgs = [{"role": "user", "content": "hi"}]
    m = {"model": model} if model else {}
    cases: list[tuple[str, str, Any]] = [
        ("bad_json", CHAT, b'{"messages": [{"role": "user", "content": "hi"'),
        ("empty_body", CHAT, b""),
        ("not_object", COMPLETIONS, b"[1, 2, 3]"),
        ("no_messages", CHAT, {**m, "messages": []}),
        ("bad_role", CHAT, {**m, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("neg_temperature", CHAT, {**m, "messages": msgs, "temperature": -1}),
        ("top_p_2", COMPLETIONS, {**m, "prompt": "hi", "top_p": 2.0}),
        ("max_tokens_0", CHAT, {**m, "messages": msgs, "max_tokens": 0}),
        ("max_tokens_str", COMPLETIONS, {**m, "prompt": "hi", "max_tokens": "ten"}),
        ("too_many_tokens", CHAT, {**m, "messages": msgs, "max_tokens": 1_000_000}),
        ("prompt_too_long", COMPLETIONS, {**m, "prompt": "red circle " * 3000, "max_tokens": 8}),
        ("empty_prompt", COMPLETIONS, {**m, "prompt": "", "max_tokens": 8}),
        ("n_17", CHAT, {**m, "messages": msgs, "n": 17}),   # over the server's n limit (16)
        ("bad_image", CHAT, {**m, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        ("too_many_images", CHAT, {**m, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] + [
            {"type": "image_url", "image_url": {"url": tiny_image}}] * 65}]}),
        ("unknown_model", CHAT, {"model": "no-such-model-soak", "messages": msgs}),
    ]
    name, path, body = rng.choice(cases)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return name, path, raw


# ---- outcomes / statistics -------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: int | None = None
    ok: bool = False             # behaved as expected for its kind
    tokens: int = 0
    sse_error: bool = False
    done: bool = False           # a stream ended with [DONE]
    aborted: bool = False        # the client left before the end
    incomplete: bool = False     # a good stream ended without [DONE] (and without an SSE error)
    violation: bool = False      # a 200 answer that breaks its request's contract (constraint, tool calls, shape)
    note: str | None = None      # what went wrong, for the samples


@dataclass
class Stats:
    done: Counter = field(default_factory=Counter)
    ok: Counter = field(default_factory=Counter)
    status: dict = field(default_factory=lambda: defaultdict(Counter))
    sse_errors: Counter = field(default_factory=Counter)
    exceptions: Counter = field(default_factory=Counter)
    incomplete: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    violations: Counter = field(default_factory=Counter)
    latencies: dict = field(default_factory=lambda: defaultdict(list))
    tokens: int = 0
    aborted_mid_stream: int = 0
    samples: list = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.samples) < 20:
            self.samples.append(text[:300])

    def record(self, kind: str, o: Outcome, latency: float) -> None:
        self.done[kind] += 1
        self.ok[kind] += o.ok
        self.tokens += o.tokens
        self.latencies[kind].append(latency)
        if o.status is not None:
            self.status[kind][str(o.status)] += 1
        self.sse_errors[kind] += o.sse_error
        self.aborted_mid_stream += kind == "abort_stream" and o.aborted
        self.incomplete[kind] += o.incomplete
        self.violations[kind] += o.violation
        if not o.ok:
            self.unexpected[kind] += 1
            if o.note:
                self.note(f"{kind}: {o.note}")

    def exception(self, kind: str, e: BaseException) -> None:
        self.done[kind] += 1
        self.exceptions[f"{kind}:{type(e).__name__}"] += 1
        if kind in GOOD_KINDS:
            self.note(f"{kind}: client exception {type(e).__name__}: {e}")

    def count_5xx(self, kinds: tuple[str, ...]) -> int:
        return sum(n for k in kinds for s, n in self.status[k].items() if s.startswith("5"))


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except Exception:
        return text[:200]


# ---- one request of each kind -----------------------------------------------------------------------------

@dataclass
class Ctx:
    base: str
    host: str
    port: int
    model: str | None
    session: aiohttp.ClientSession
    images: ImagePool
    stats: Stats
    deadline: float
    max_requests: int
    request_timeout: float
    stop: asyncio.Event
    alive_fn: Any = None         # () -> False once the server process is gone (None: unknown)
    issued: int = 0
    first_round: list = field(default_factory=list)   # kinds still owed their first request


def first_round(seed: int) -> list[str]:
    """Every kind of the mix once, in a seeded order (popped from the end): the load's first
    requests, so that a short or slow run still sends each kind; later kinds are drawn by weight."""
    kinds = [k for k in KINDS if KIND_WEIGHTS.get(k, 0.0) > 0]
    random.Random(seed).shuffle(kinds)
    return kinds


async def post_json(ctx: Ctx, path: str, body: dict) -> Outcome:
    async with ctx.session.post(ctx.base + path, json=body) as r:
        text = await r.text()
        if r.status != 200:
            return Outcome(status=r.status, note=f"HTTP {r.status} {path}: {_error_message(text)}")
        usage = json.loads(text).get("usage") or {}
        return Outcome(status=200, ok=True, tokens=int(usage.get("completion_tokens") or 0))


async def read_stream(r: aiohttp.ClientResponse, o: Outcome, stop_after: int | None) -> Outcome:
    """Read SSE events into `o`; with `stop_after`, close the response after that many events."""
    events = 0
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            o.done = True
            break
        events += 1
        obj = json.loads(payload)
        if "error" in obj:
            o.sse_error = True
            o.note = f"SSE error: {obj['error'].get('message')}"
        elif obj.get("usage"):
            o.tokens = int(obj["usage"].get("completion_tokens") or 0)
        elif obj.get("choices"):
            c = obj["choices"][0]
            o.tokens += bool(c.get("text") or (c.get("delta") or {}).get("content"))
        if stop_after is not None and events >= stop_after:
            r.close()
            o.aborted = True
            break
    return o


async def post_stream(ctx: Ctx, path: str, body: dict, stop_after: int | None = None) -> Outcome:
    async with ctx.session.post(ctx.base + path, json=body) as r:
        if r.status != 200:
            return Outcome(status=r.status, note=f"HTTP {r.status} {path}: {_error_message(await r.text())}")
        o = Outcome(status=200)
        try:
            await read_stream(r, o, stop_after)
        except asyncio.CancelledError:
            r.close()
            raise
        if stop_after is None:
            o.ok = o.done and not o.sse_error
            if not o.done and not o.sse_error:
                o.incomplete, o.note = True, f"stream from {path} ended without [DONE]"
        else:
            o.ok = not o.sse_error
            o.aborted = not o.done
        return o


async def req_chat_image(ctx: Ctx, rng: random.Random) -> Outcome:
    imgs = [ctx.images.pick(rng) for _ in range(2 if rng.random() < 0.15 else 1)]
    return await post_json(ctx, CHAT, chat_body(ctx.model, rng, imgs, stream=False, max_tokens=rng.randint(8, 32)))


async def req_chat_stream(ctx: Ctx, rng: random.Random) -> Outcome:
    imgs = [ctx.images.pick(rng)] if rng.random() < 0.6 else []
    return await post_stream(ctx, CHAT, chat_body(ctx.model, rng, imgs, stream=True, max_tokens=rng.randint(8, 32)))


async def req_completion(ctx: Ctx, rng: random.Random) -> Outcome:
    stream = rng.random() < 0.3
    body = completion_body(ctx.model, rng, stream=stream, max_tokens=rng.randint(8, 32))
    return await (post_stream(ctx, COMPLETIONS, body) if stream else post_json(ctx, COMPLETIONS, body))


# ---- structured output, tools, embeddings, prompt_logprobs (issue 56) ------------------------------------

SHAPE_SCHEMA = {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                                                 "color": {"enum": ["red", "green", "blue", "yellow"]},
                                                 "count": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["shape", "color", "count"], "additionalProperties": False}


def _shape_ok(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"shape", "color", "count"} and obj["shape"] in SHAPE_SCHEMA["properties"]["shape"]["enum"]
            and obj["color"] in SHAPE_SCHEMA["properties"]["color"]["enum"] and obj["count"] in range(10))


def _json_object_ok(text: str) -> bool:
    return isinstance(json.loads(text), dict)


def structured_case(rng: random.Random) -> tuple[str, dict, Any]:
    """(name, request fields, check(text) -> bool for a finished answer) of one constraint."""
    if rng.random() < 0.05:       # a new big choice: ~3 MiB compiled, for the grammar cache's byte bound
        choices = ["".join(rng.choice("abcdefghijklmnop") for _ in range(200)) for _ in range(1024)]
        return "big_choice", {"guided_choice": choices}, lambda t: t in choices
    cases = [
        ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "shape", "strict": True,
                                                                                    "schema": SHAPE_SCHEMA}}},
         _shape_ok),
        ("json_object", {"response_format": {"type": "json_object"}}, _json_object_ok),
        ("regex", {"guided_regex": "(yes|no), [a-z]{1,8}"}, lambda t: re.fullmatch("(yes|no), [a-z]{1,8}", t)),
        ("choice", {"structured_outputs": {"choice": ["red", "green", "blue", "yellow"]}},
         lambda t: t in ("red", "green", "blue", "yellow")),
        ("gbnf", {"guided_grammar": 'root ::= count " " shape\ncount ::= [1-9]\nshape ::= "circle" | "square"'},
         lambda t: re.fullmatch("[1-9] (circle|square)", t)),
        ("lark", {"structured_outputs": {"grammar": 'start: "it is " COLOR\nCOLOR: "red" | "blue" | "green"'}},
         lambda t: re.fullmatch("it is (red|blue|green)", t)),
    ]
    return rng.choice(cases)


def _checked(o: Outcome, name: str, text: str, finish: str | None, check) -> Outcome:
    """A 200 answer: a finished ("stop") one must pass `check`; one cut by max_tokens cannot be judged."""
    if finish == "stop":
        try:
            good = bool(check(text))
        except (ValueError, KeyError, TypeError):
            good = False
        if not good:
            o.ok, o.violation, o.note = False, True, f"{name}: finished answer breaks its constraint: {text[:120]!r}"
    return o


async def _post_obj(ctx: Ctx, path: str, body: dict) -> tuple[Outcome, dict | None]:
    async with ctx.session.post(ctx.base + path, json=body) as r:
        text = await r.text()
        if r.status != 200:
            return Outcome(status=r.status, note=f"HTTP {r.status} {path}: {_error_message(text)}"), None
        obj = json.loads(text)
        usage = obj.get("usage") or {}
        return Outcome(status=200, ok=True, tokens=int(usage.get("completion_tokens") or 0)), obj


async def _post_stream_text(ctx: Ctx, path: str, body: dict) -> tuple[Outcome, str, str | None]:
    """A streamed request's outcome, its text and finish_reason."""
    async with ctx.session.post(ctx.base + path, json=body) as r:
        if r.status != 200:
            return Outcome(status=r.status, note=f"HTTP {r.status} {path}: {_error_message(await r.text())}"), "", None
        o, parts, finish = Outcome(status=200), [], None
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                o.done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                o.sse_error, o.note = True, f"SSE error: {obj['error'].get('message')}"
                continue
            for c in obj.get("choices") or []:
                parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                finish = c.get("finish_reason") or finish
                o.tokens += 1
        o.ok = o.done and not o.sse_error
        if not o.done and not o.sse_error:
            o.incomplete, o.note = True, f"stream from {path} ended without [DONE]"
        return o, "".join(parts), finish


async def req_structured(ctx: Ctx, rng: random.Random) -> Outcome:
    name, fields, check = structured_case(rng)
    chat = rng.random() < 0.7
    max_tokens = rng.randint(24, 48)
    if chat:
        imgs = [ctx.images.pick(rng)] if rng.random() < 0.4 else []
        body = chat_body(ctx.model, rng, imgs, stream=False, max_tokens=max_tokens)
    else:
        body = completion_body(ctx.model, rng, stream=False, max_tokens=max_tokens)
    body.update(fields)
    path = CHAT if chat else COMPLETIONS
    if rng.random() < 0.3:
        body["stream"] = True
        o, text, finish = await _post_stream_text(ctx, path, body)
        return _checked(o, name, text, finish, check) if o.ok else o
    o, obj = await _post_obj(ctx, path, body)
    if obj is None:
        return o
    c = obj["choices"][0]
    return _checked(o, name, c["message"]["content"] if chat else c["text"], c["finish_reason"], check)


SOAK_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "forecast", "parameters": {     # as Pydantic writes it
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}},
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
        "additionalProperties": False}}},
]


async def req_tools(ctx: Ctx, rng: random.Random) -> Outcome:
    tools = rng.sample(SOAK_TOOLS, rng.randint(1, len(SOAK_TOOLS)))
    names = [t["function"]["name"] for t in tools]
    choice = rng.choice(["auto", "required", "named"])
    body = chat_body(ctx.model, rng, [], stream=False, max_tokens=96)
    body.update(tools=tools, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": rng.choice(names)}} if choice == "named"
                else choice)
    o, obj = await _post_obj(ctx, CHAT, body)
    if obj is None or choice == "auto":
        return o
    c = obj["choices"][0]
    if c["finish_reason"] == "length":
        return o
    calls = c["message"].get("tool_calls") or []
    want = {body["tool_choice"]["function"]["name"]} if choice == "named" else set(names)
    try:
        good = (c["finish_reason"] == "tool_calls" and len(calls) == 1 and calls[0]["function"]["name"] in want
                and isinstance(json.loads(calls[0]["function"]["arguments"]), dict))
    except ValueError:
        good = False
    if not good:
        o.ok, o.violation = False, True
        o.note = f"tools ({choice}): not a call of {sorted(want)}: {json.dumps(c['message'])[:160]}"
    return o


async def req_embeddings(ctx: Ctx, rng: random.Random) -> Outcome:
    m = {"model": ctx.model} if ctx.model else {}
    if rng.random() < 0.2:
        body = {**m, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": ctx.images.pick(rng)}}, {"type": "text", "text": rng.choice(QUESTIONS)}]}]}
        n = 1
    else:
        n = rng.randint(1, 8)
        body = {**m, "input": [" ".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 6))) for _ in range(n)],
                "encoding_format": rng.choice(["float", "base64"])}
    o, obj = await _post_obj(ctx, "/v1/embeddings", body)
    if obj is not None and len(obj.get("data") or []) != n:
        o.ok, o.violation, o.note = False, True, f"embeddings: {len(obj.get('data') or [])} vectors for {n} inputs"
    return o


async def req_abort_embed(ctx: Ctx, rng: random.Random) -> Outcome:
    """A heavy embeddings request whose client leaves after 0.1-1 s."""
    m = {"model": ctx.model} if ctx.model else {}
    body = {**m, "input": [" ".join(rng.choice(TEXTS) for _ in range(rng.randint(20, 60)))
                           for _ in range(rng.randint(64, 128))]}
    task = asyncio.ensure_future(_post_obj(ctx, "/v1/embeddings", body))
    await asyncio.sleep(rng.uniform(0.1, 1.0))
    if task.done():
        o, _ = task.result()
        return o if o.status != 200 else Outcome(status=200, ok=True)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Outcome(ok=True, aborted=True)


async def req_prompt_logprobs(ctx: Ctx, rng: random.Random) -> Outcome:
    k = rng.choice([0, 1, 5])
    if rng.random() < 0.5:
        imgs = [ctx.images.pick(rng)] if rng.random() < 0.5 else []
        body = chat_body(ctx.model, rng, imgs, stream=False, max_tokens=rng.randint(2, 8))
        path = CHAT
    else:
        body = completion_body(ctx.model, rng, stream=False, max_tokens=rng.randint(2, 8))
        if rng.random() < 0.3:
            body.update(echo=True, logprobs=2)
        path = COMPLETIONS
    body["prompt_logprobs"] = k
    o, obj = await _post_obj(ctx, path, body)
    if obj is None:
        return o
    plp = obj.get("prompt_logprobs")
    n = (obj.get("usage") or {}).get("prompt_tokens")
    if not (isinstance(plp, list) and len(plp) == n and plp[0] is None and all(len(d) >= 1 for d in plp[1:])):
        o.ok, o.violation = False, True
        o.note = f"prompt_logprobs: {len(plp) if isinstance(plp, list) else plp!r} entries for {n} prompt tokens"
    return o


def long_body(ctx: Ctx, rng: random.Random, stream: bool) -> tuple[str, dict]:
    """A valid request that runs a while (ignore_eos, 64-256 tokens): the kind clients abandon."""
    n = rng.randint(64, 256)
    if rng.random() < 0.5:
        imgs = [ctx.images.pick(rng)] if rng.random() < 0.7 else []
        return CHAT, chat_body(ctx.model, rng, imgs, stream=stream, max_tokens=n, ignore_eos=True)
    return COMPLETIONS, completion_body(ctx.model, rng, stream=stream, max_tokens=n, ignore_eos=True)


async def req_abort_stream(ctx: Ctx, rng: random.Random) -> Outcome:
    path, body = long_body(ctx, rng, stream=True)
    if rng.random() < 0.5:  # read a few SSE chunks, then close the response
        return await post_stream(ctx, path, body, stop_after=rng.randint(1, 8))
    task = asyncio.ensure_future(post_stream(ctx, path, body))  # or cancel after a random delay
    await asyncio.sleep(rng.uniform(0.0, 0.6))
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Outcome(ok=True, aborted=True)


def raw_outcome(got: bytes, what: str) -> Outcome:
    """A raw-socket request is fine when it got no answer (closed) or anything but a 5xx."""
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    status = int(m.group(1)) if m else None
    ok = status is None or status < 500
    return Outcome(status=status, ok=ok, aborted=True, note=None if ok else f"{what} -> HTTP {status}")


async def req_disconnect(ctx: Ctx, rng: random.Random) -> Outcome:
    path, body = long_body(ctx, rng, stream=rng.random() < 0.6)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {ctx.host}:{ctx.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
    got = b""
    try:
        writer.write(head + data)
        await writer.drain()
        want = rng.choice((0, 1, 12, 100))
        if want:
            got = await reader.read(want)
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # RST-like: drop unread data
        else:
            writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return raw_outcome(got, "raw request")


def hostile_request(model: str | None, rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(name, path, raw body, extra headers) of an attack from the hostile-client campaign that
    must get a 4xx: broken text, schema abuse, oversized text and lists, heavy images, SSRF."""
    m = {"model": model} if model else {}
    msgs = [{"role": "user", "content": "hi"}]
    heavy = _heavy_png_uri()
    cases: list[tuple[str, str, Any, dict]] = [
        # JSON "\ud800": a lone surrogate (json.dumps cannot write one from a str)
        ("lone_surrogate_chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800 hi"}], "max_tokens": 4}', {}),
        ("lone_surrogate_prompt", COMPLETIONS, b'{"prompt": "a \\udfff b", "max_tokens": 4}', {}),
        ("huge_text", CHAT, {**m, "messages": [{"role": "user", "content": "a" * (2 << 20)}], "max_tokens": 4}, {}),
        ("top_k_int32_overflow", CHAT, {**m, "messages": msgs, "top_k": 2**31, "max_tokens": 4}, {}),
        ("top_k_overflow_completion", COMPLETIONS, {**m, "prompt": "hi", "top_k": 2**31, "max_tokens": 4}, {}),
        ("stop_token_ids_100k", CHAT, {**m, "messages": msgs, "stop_token_ids": list(range(100_000)),
                                       "max_tokens": 4}, {}),
        ("n_true", CHAT, {**m, "messages": msgs, "n": True}, {}),
        ("best_of_true", COMPLETIONS, {**m, "prompt": "hi", "best_of": True}, {}),
        ("max_tokens_true", CHAT, {**m, "messages": msgs, "max_tokens": True}, {}),
        ("deflate_garbage", CHAT, b"\x00\x01garbage-not-deflate" * 10, {"Content-Encoding": "deflate"}),
        ("heavy_images", CHAT, {**m, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}] + [{"type": "image_url", "image_url": {"url": heavy}}] * 8}]}, {}),
        ("ssrf_6to4_loopback", CHAT, {**m, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://[2002:7f00:1::]/a.png"}}]}]}, {}),
        ("too_many_messages", CHAT, {**m, "messages": msgs * 20_000, "max_tokens": 4}, {}),
        # structured output and tools (issue 56)
        ("lone_surrogate_regex", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_regex": "\\ud800"}',
         {}),
        ("lone_surrogate_grammar", COMPLETIONS, b'{"prompt": "hi", "guided_grammar": "root ::= \\"\\udc00\\""}', {}),
        ("unsatisfiable_regex", CHAT, {**m, "messages": msgs, "guided_regex": "[^\\s\\S]", "max_tokens": 8}, {}),
        ("recursive_schema", CHAT, {**m, "messages": msgs, "max_tokens": 8, "guided_json": {
            "$defs": {"R": {"type": "object", "properties": {"c": {"$ref": "#/$defs/R"}}, "required": ["c"]}},
            "$ref": "#/$defs/R"}}, {}),
        ("choice_vs_bad_words", CHAT, {**m, "messages": msgs, "guided_choice": ["a", "b"], "bad_words": ["a", "b"],
                                       "max_tokens": 8}, {}),
        ("too_many_choices", CHAT, {**m, "messages": msgs, "guided_choice": ["x"] * 1025}, {}),
        ("bad_gbnf", CHAT, {**m, "messages": msgs, "guided_grammar": 'root ::= ("a"'}, {}),
        ("huge_regex", CHAT, {**m, "messages": msgs, "guided_regex": "a" * 100_001}, {}),
        ("duplicate_tools", CHAT, {**m, "messages": msgs, "tools": SOAK_TOOLS[:1] * 2}, {}),
        ("embeddings_dimensions", "/v1/embeddings", {**m, "input": "hi", "dimensions": 8}, {}),
    ]
    name, path, body, headers = rng.choice(cases)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return name, path, raw, headers


_HEAVY: list[str] = []


def _heavy_png_uri() -> str:
    """A 1 x 40,000,000-pixel PNG (~40 KB compressed, inside a 40 MP limit): cheap to send, slow to decode."""
    if not _HEAVY:
        buf = io.BytesIO()
        Image.new("L", (40_000_000, 1)).save(buf, format="PNG")
        _HEAVY.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return _HEAVY[0]


async def req_hostile(ctx: Ctx, rng: random.Random) -> Outcome:
    name, path, raw, headers = hostile_request(ctx.model, rng)
    async with ctx.session.post(ctx.base + path, data=raw,
                                headers={"Content-Type": "application/json", **headers}) as r:
        text = await r.text()
        ok = 400 <= r.status < 500 and _is_openai_error(text)
        return Outcome(status=r.status, ok=ok, note=None if ok else f"{name} -> HTTP {r.status}: {text[:200]}")


def _is_openai_error(text: str) -> bool:
    try:
        e = json.loads(text)["error"]
        return isinstance(e, dict) and {"message", "type", "param", "code"} <= set(e)
    except Exception:
        return False


async def req_hostile_raw(ctx: Ctx, rng: random.Random) -> Outcome:
    """Protocol abuse on a raw socket: partial headers, a partial body, an impossible
    Content-Length, a non-UTF-8 Authorization header. The server must answer with a 4xx or
    close the connection (never a 5xx, never hold it forever: the read is bounded)."""
    case = rng.choice(("partial_headers", "partial_body", "huge_content_length", "bad_auth_bytes"))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: {ctx.host}:{ctx.port}\r\nContent-Type: application/json\r\n".encode()
    if case == "partial_headers":
        data = head
    elif case == "partial_body":
        data = head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2]
    elif case == "huge_content_length":
        data = head + b"Content-Length: 1000000000000\r\n\r\n" + body
    else:
        data = head + b"Authorization: Bearer \xff\xfe\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
    got = b""
    try:
        writer.write(data)
        await writer.drain()
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            got = await asyncio.wait_for(reader.read(4096), 2.0 if case.startswith("partial") else 30.0)
    finally:
        writer.transport.abort()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return raw_outcome(got, case)


async def req_invalid(ctx: Ctx, rng: random.Random) -> Outcome:
    name, path, raw = invalid_request(ctx.model, rng, ctx.images.tiny)
    async with ctx.session.post(ctx.base + path, data=raw, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        ok = 400 <= r.status < 500
        return Outcome(status=r.status, ok=ok, note=None if ok else f"{name} -> HTTP {r.status}: {text[:200]}")


RUNNERS = {"chat_image": req_chat_image, "chat_stream": req_chat_stream, "completion": req_completion,
           "structured": req_structured, "tools": req_tools, "embeddings": req_embeddings,
           "prompt_logprobs": req_prompt_logprobs, "abort_embed": req_abort_embed,
           "abort_stream": req_abort_stream, "disconnect": req_disconnect, "invalid": req_invalid,
           "hostile": req_hostile, "hostile_raw": req_hostile_raw}


# ---- the load ------------------------------------------------------------------------------------------------

async def worker(ctx: Ctx, wid: int, seed: int) -> None:
    rng = random.Random(seed * 1_000_003 + wid)
    weights = [KIND_WEIGHTS.get(k, 0.0) for k in KINDS]
    while not ctx.stop.is_set() and time.monotonic() < ctx.deadline and ctx.issued < ctx.max_requests:
        ctx.issued += 1
        kind = ctx.first_round.pop() if ctx.first_round else rng.choices(KINDS, weights)[0]
        t0 = time.monotonic()
        try:
            o = await asyncio.wait_for(RUNNERS[kind](ctx, rng), ctx.request_timeout)
        except Exception as e:  # noqa: BLE001 (counted and reported per kind)
            ctx.stats.exception(kind, e)
            if isinstance(e, (aiohttp.ClientConnectionError, ConnectionError)) and ctx.alive_fn() is False:
                ctx.stop.set()  # the server is gone: no point hammering a closed port until the next sample
            continue
        ctx.stats.record(kind, o, time.monotonic() - t0)


@dataclass
class Watch:
    """Memory samples and liveness of the server while the load runs."""
    pid: int | None
    alive_fn: Any
    rss_start_kb: int | None = None
    rss_peak_kb: int | None = None
    samples: int = 0
    t0: float = field(default_factory=time.monotonic)
    timeline: list = field(default_factory=list)   # (seconds since start, RSS MiB) every ~30 s
    died_at: float | None = None

    def sample(self) -> int | None:
        rss = read_rss_kb(self.pid)
        if rss is not None:
            self.samples += 1
            self.rss_peak_kb = max(self.rss_peak_kb or 0, rss)
            t = time.monotonic() - self.t0
            if not self.timeline or t - self.timeline[-1][0] >= 30:
                self.timeline.append((round(t), round(rss / 1024, 1)))
        return rss


async def sampler(ctx: Ctx, watch: Watch, interval: float, t_start: float) -> None:
    last_log = time.monotonic()
    while not ctx.stop.is_set():
        watch.sample()
        if watch.alive_fn() is False:
            watch.died_at = time.monotonic() - t_start
            log(f"server died after {watch.died_at:.1f}s; stopping the load")
            ctx.stop.set()
            return
        if time.monotonic() - last_log >= 10:
            last_log = time.monotonic()
            s = ctx.stats
            log(f"t={time.monotonic() - t_start:5.0f}s requests={sum(s.done.values())} "
                f"5xx={s.count_5xx(KINDS)} exceptions={sum(s.exceptions.values())} "
                f"rss={(watch.rss_peak_kb or 0) / 1024:.0f}MiB(peak)")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ctx.stop.wait(), interval)


async def run_load(ctx: Ctx, args: argparse.Namespace, watch: Watch) -> float:
    """Run the workers until the deadline / request budget (hard stop a request timeout later)."""
    t0 = time.monotonic()
    mon = asyncio.ensure_future(sampler(ctx, watch, args.sample_interval, t0))
    tasks = [asyncio.ensure_future(worker(ctx, i, args.seed)) for i in range(args.concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=args.duration + args.request_timeout + 10)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    ctx.stop.set()
    await mon
    if watch.died_at is None and watch.alive_fn() is False:  # noticed by a worker first
        watch.died_at = time.monotonic() - t0
    return time.monotonic() - t0


async def wait_health(session: aiohttp.ClientSession, base: str, timeout: float, alive_fn) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive_fn() is False:
            return False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    return True
        await asyncio.sleep(0.5)
    return False


async def served_model(session: aiohttp.ClientSession, base: str) -> str | None:
    with contextlib.suppress(Exception):
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return (await r.json())["data"][0]["id"]
    return None


async def warm_up(ctx: Ctx, timeout: float) -> dict:
    """One image chat and one completion, sequential (the first requests compile)."""
    rng = random.Random(-1)
    t0 = time.monotonic()
    out = []
    for coro in (post_json(ctx, CHAT, chat_body(ctx.model, rng, [ctx.images.reused[0]], stream=False, max_tokens=8)),
                 post_json(ctx, COMPLETIONS, completion_body(ctx.model, rng, stream=False, max_tokens=8))):
        try:
            o = await asyncio.wait_for(coro, timeout)
            out.append(o.status)
            if not o.ok:
                ctx.stats.note(f"warm-up: {o.note}")
        except Exception as e:  # noqa: BLE001 (reported)
            out.append(f"{type(e).__name__}: {e}")
    return {"warmup_s": round(time.monotonic() - t0, 2), "warmup_status": out}


async def soak(args: argparse.Namespace, base: str, pid: int | None, alive_fn) -> dict:
    """Everything after the server is reachable: warm-up, load, idle wait, final readings."""
    host, port = loopback_host_port(base)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    conn = aiohttp.TCPConnector(limit=args.concurrency * 2 + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        if not await wait_health(session, base, args.startup_timeout, alive_fn):
            return {"startup_error": f"GET {base}/health never returned 200 within {args.startup_timeout:.0f}s"}
        ctx = Ctx(base, host, port, await served_model(session, base), session, ImagePool(args.seed), Stats(),
                  0.0, args.max_requests, args.request_timeout, asyncio.Event(), alive_fn)
        r: dict[str, Any] = {"model": ctx.model, **await warm_up(ctx, args.startup_timeout)}
        watch = Watch(pid, alive_fn)
        watch.rss_start_kb = watch.sample()
        ctx.deadline = time.monotonic() + args.duration
        ctx.first_round = first_round(args.seed)
        r["load_s"] = round(await run_load(ctx, args, watch), 2)
        idle = await wait_idle(session, base, args.idle_timeout) if watch.died_at is None else \
            {"metrics": {}, "gauges": {}, "idle": False, "leaked_slots": None, "leaked_pages": None}
        rss_end = watch.sample()
        health_ok = await wait_health(session, base, 5, alive_fn)
    return {**r, "stats": ctx.stats, "watch": watch, "idle": idle, "rss_end_kb": rss_end,
            "server_alive": alive_fn() is not False and health_ok and watch.died_at is None}


# ---- report --------------------------------------------------------------------------------------------------

def _pct(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "p50": None, "p99": None}
    a = np.asarray(xs, np.float64)
    return {"n": len(xs), "p50": round(float(np.percentile(a, 50)), 4), "p99": round(float(np.percentile(a, 99)), 4)}


def _mib(kb: int | None) -> float | None:
    return None if kb is None else round(kb / 1024, 1)


def build_report(args: argparse.Namespace, res: dict, server: ServerProcess | None) -> dict:
    s: Stats = res["stats"]
    w: Watch = res["watch"]
    idle = res["idle"]
    m = idle["metrics"]
    g = idle["gauges"]
    r = {
        "url": res["base"], "model": res["model"], "mix": args.mix, "seed": args.seed, "concurrency": args.concurrency,
        "duration_s": args.duration, "load_s": res["load_s"], "warmup_s": res["warmup_s"],
        "warmup_status": res["warmup_status"],
        "requests_total": sum(s.done.values()),
        "requests_by_kind": {k: s.done[k] for k in KINDS},
        "ok_by_kind": {k: s.ok[k] for k in KINDS},
        "status_by_kind": {k: dict(sorted(s.status[k].items())) for k in KINDS},
        "good_completed": sum(s.ok[k] for k in GOOD_KINDS),
        "good_5xx": s.count_5xx(VALID_KINDS),
        "total_5xx": s.count_5xx(KINDS),
        "sse_errors": sum(s.sse_errors[k] for k in GOOD_KINDS),
        "sse_errors_by_kind": {k: s.sse_errors[k] for k in KINDS if s.sse_errors[k]},
        "incomplete_streams": sum(s.incomplete.values()),
        "violations": sum(s.violations.values()),
        "violations_by_kind": {k: s.violations[k] for k in KINDS if s.violations[k]},
        "invalid_not_4xx": s.unexpected["invalid"],
        "hostile_not_4xx": s.unexpected["hostile"],
        "hostile_raw_5xx": s.count_5xx(("hostile_raw",)),
        "bad_requests": sum(s.done[k] for k in BAD_KINDS + ("hostile_raw",)),
        "client_exceptions": dict(sorted(s.exceptions.items())),
        "good_exceptions": sum(n for k, n in s.exceptions.items() if k.split(":")[0] in GOOD_KINDS),
        "aborted_mid_stream": s.aborted_mid_stream,
        "tokens_received": s.tokens,
        "requests_per_s": round(sum(s.done.values()) / max(res["load_s"], 1e-9), 2),
        "latency_s": {k: _pct(s.latencies[k]) for k in KINDS},
        "idle": idle["idle"], "leaked_slots": idle["leaked_slots"],
        "slots_total": g.get("slots_total"), "slots_used": g.get("slots_used"),
        "leaked_pages": idle["leaked_pages"], "kv_pages_total": g.get("kv_pages_total"),
        "engine_preemptions": m.get("mmjax_engine_preemptions_total"),
        "requests_running": g.get("num_requests_running"), "requests_waiting": g.get("num_requests_waiting"),
        "http_in_flight": g.get("http_requests_in_flight"), "queue_depth": g.get("queue_depth"),
        "engine_requests_finished": m.get("mmjax_engine_requests_finished_total"),
        "engine_requests_aborted": m.get("mmjax_engine_requests_aborted_total"),
        "server_client_disconnects": m.get("mmjax_client_disconnects_total"),
        "grammar_cache_mib": (round(m["mmjax_grammar_cache_bytes"] / 2**20, 1)
                              if "mmjax_grammar_cache_bytes" in m else None),
        "grammar_cache_bound_mib": (round(m["mmjax_grammar_cache_bytes_bound"] / 2**20, 1)
                                    if "mmjax_grammar_cache_bytes_bound" in m else None),
        "grammar_cache_entries": m.get("mmjax_grammar_cache_entries"),
        "compiled_shapes": {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("mmjax_compiled_shapes{")},
        "encoder_cache_hits": m.get("mmjax_encoder_cache_hits_total"),
        "encoder_cache_misses": m.get("mmjax_encoder_cache_misses_total"),
        "encoder_cache_entries": m.get("mmjax_encoder_cache_entries"),
        "encoder_cache_mib": _mib(int(m["mmjax_encoder_cache_bytes"]) // 1024) if "mmjax_encoder_cache_bytes" in m else None,
        "server_status_counts": server_status_counts(m),
        "server_pid": w.pid, "server_alive": res["server_alive"], "server_died_at_s": w.died_at,
        "rss_start_mib": _mib(w.rss_start_kb), "rss_end_mib": _mib(res["rss_end_kb"]),
        "rss_peak_mib": _mib(w.rss_peak_kb), "rss_samples": w.samples, "rss_timeline_mib": w.timeline,
        "rss_growth_mib": (_mib(res["rss_end_kb"] - w.rss_start_kb)
                           if res["rss_end_kb"] is not None and w.rss_start_kb is not None else None),
        "error_samples": s.samples,
    }
    if server is not None:
        r["server_log"] = server.log_path
    return r


def failures(r: dict) -> list[str]:
    out = []
    checks = [(r["good_5xx"], "valid requests got a 5xx"), (r["sse_errors"], "good streams carried an SSE error"),
              (r["incomplete_streams"], "good streams ended without [DONE]"),
              (r["violations"], "good requests got a 200 answer that breaks their constraint / contract"),
              (r["good_exceptions"], "good requests failed with a client-side exception"),
              (r["invalid_not_4xx"], "invalid requests got something other than a 4xx"),
              (r["hostile_not_4xx"], "hostile requests got something other than a 4xx with an OpenAI error body"),
              (r["hostile_raw_5xx"], "raw protocol abuse got a 5xx")]
    out += [f"{n} {what}" for n, what in checks if n]
    if r["good_completed"] == 0:
        out.append("no good request completed")
    if not r["server_alive"]:
        out.append("the server died" + (f" after {r['server_died_at_s']:.1f}s" if r["server_died_at_s"] else ""))
    elif not r["idle"]:
        out.append(f"the server was not idle after the load (in flight {r['http_in_flight']}, running "
                   f"{r['requests_running']}, waiting {r['requests_waiting']})")
    if r["server_alive"] and r["leaked_slots"] is None:
        out.append("/metrics has no mmjax_slots_used: leaked slots cannot be checked")
    elif r["server_alive"] and r["leaked_slots"] != 0:
        out.append(f"leaked slots: {r['leaked_slots']}")
    if r["server_alive"] and r.get("leaked_pages"):      # None: the cache is not paged
        out.append(f"leaked KV pages: {r['leaked_pages']} held by requests after the load")
    if r.get("server_exit_code") not in (None, 0):
        out.append(f"the server exited with code {r['server_exit_code']} on SIGTERM")
    return out


def format_table(r: dict) -> str:
    lines = [f"mmjax soak: {r['url']} model={r['model']} concurrency={r['concurrency']} "
             f"load={r['load_s']}s (warm-up {r['warmup_s']}s) seed={r['seed']}",
             f"{'kind':<13}{'done':>7}{'ok':>7}{'5xx':>6}{'sse_err':>8}{'exc':>6}{'p50 s':>9}{'p99 s':>9}  statuses"]
    for k in KINDS:
        if not r["requests_by_kind"][k]:
            continue
        lat = r["latency_s"][k]
        exc = sum(n for key, n in r["client_exceptions"].items() if key.split(":")[0] == k)
        n5 = sum(n for st, n in r["status_by_kind"][k].items() if st.startswith("5"))
        def fmt(v: float | None) -> str:
            return f"{v:9.3f}" if v is not None else f"{'-':>9}"
        sts = " ".join(f"{st}:{n}" for st, n in r["status_by_kind"][k].items())
        lines.append(f"{k:<13}{r['requests_by_kind'][k]:>7}{r['ok_by_kind'][k]:>7}{n5:>6}"
                     f"{r['sse_errors_by_kind'].get(k, 0):>8}{exc:>6}{fmt(lat['p50'])}{fmt(lat['p99'])}  {sts}")
    lines += [
        f"requests {r['requests_total']} ({r['requests_per_s']}/s), good completed {r['good_completed']}, "
        f"tokens received {r['tokens_received']}, aborted mid-stream {r['aborted_mid_stream']}",
        f"client exceptions: {r['client_exceptions'] or 'none'}",
        f"server statuses (/v1): {r['server_status_counts']}, client disconnects seen by server "
        f"{r['server_client_disconnects']}, engine finished {r['engine_requests_finished']} / aborted "
        f"{r['engine_requests_aborted']}",
        f"after load: idle={r['idle']} slots used {r['slots_used']}/{r['slots_total']} (leaked {r['leaked_slots']}), "
        f"running {r['requests_running']}, waiting {r['requests_waiting']}, in flight {r['http_in_flight']}"
        + (f"; KV pages held {r['leaked_pages']}/{r['kv_pages_total']} (leaked), preemptions {r['engine_preemptions']}"
           if r.get("kv_pages_total") else ""),
        f"server RSS MiB: start {r['rss_start_mib']}, end {r['rss_end_mib']}, peak {r['rss_peak_mib']} "
        f"(growth {r['rss_growth_mib']}, {r['rss_samples']} samples; encoder cache {r['encoder_cache_entries']} "
        f"images, {r['encoder_cache_mib']} MiB; grammar cache {r['grammar_cache_entries']} matchers, "
        f"{r['grammar_cache_mib']} of {r['grammar_cache_bound_mib']} MiB); alive={r['server_alive']}"
        + (f", exit code {r['server_exit_code']}" if "server_exit_code" in r else ""),
    ]
    lines.append("server RSS over time (s, MiB): " + " ".join(f"{t}:{m}" for t, m in r["rss_timeline_mib"]))
    if r.get("server_log_problems"):
        lines.append(f"server log: {r['server_log_problems']} problem line(s) in {r['server_log']}")
    for e in r["error_samples"][:10]:
        lines.append(f"  ! {e}")
    lines.append("RESULT: " + ("PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])))
    return "\n".join(lines)


# ---- entry point -----------------------------------------------------------------------------------------------

def _target(args: argparse.Namespace) -> tuple[str, int | None, ServerProcess | None]:
    if args.url:
        loopback_host_port(args.url)
        return args.url.rstrip("/"), args.pid, None
    server = ServerProcess(args.model, args.server_args, args.server_log)
    server.start()
    return server.url, server.pid, server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    KIND_WEIGHTS.clear()
    KIND_WEIGHTS.update(MIXES[args.mix])
    try:
        base, pid, server = _target(args)
    except ValueError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    alive_fn = server.alive if server else (lambda: pid_alive(pid))
    try:
        res = asyncio.run(soak(args, base, pid, alive_fn))
    finally:
        exit_code = server.stop(args.stop_timeout) if server else None
    if "startup_error" in res:
        msg = res["startup_error"] + (f"; server log tail:\n{server.log_tail()}" if server else "")
        print(f"soak: {msg}", file=sys.stderr)
        print(json.dumps({"url": base, "startup_error": res["startup_error"], "server_exit_code": exit_code}))
        return 2
    r = build_report(args, {**res, "base": base}, server)
    if server is not None:
        r["server_exit_code"] = exit_code
        r["server_log_problems"], r["server_log_samples"] = server.log_problems()
    r["failures"] = failures(r)
    r["passed"] = not r["failures"]
    print(format_table(r))
    print(json.dumps(r), flush=True)
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
