"""llama.cpp's server as a peer of `mmjax bench serve --llamacpp`.

The build is the one /work/shared/peers/llamacpp_peer.sh (../shared/peers from the project root)
makes: llama.cpp vendored in PyPI's llama-cpp-python sdist, built for this CPU, and the bench
checkpoint converted to an f32 text GGUF + f32 mmproj, all under
`$MMJAX_LLAMACPP_DIR` (default `~/.cache/mmjax/llamacpp`). Building takes ~4.5 min on 2 quiet
cores and downloads from PyPI, so a benchmark never builds: it uses a build that is there
(`find_build`), and without one it prints the figures recorded on this machine class
(`RECORDED`), labeled as recorded.

The server runs as the peer script runs it: `--parallel N` slots (N = the load's concurrency),
512 context positions per slot, f16 KV cache (llama.cpp's default), no cross-request prompt
cache (`--cache-ram 0`, `cache_prompt: false`), the threads given (default: every core).
"""
from __future__ import annotations

import glob
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass

# Recorded with llamacpp_peer.sh on this machine class (2 cores, f32 GGUF of the bench's default
# 342M LLaVA checkpoint, llama.cpp 0c1e570 from llama-cpp-python 0.3.36; /work/shared/notes/facts.md).
# The class varies: these are the newest box's (Zen 4, AVX-512, 2026-11-25). An earlier box
# (2026-11-21 / 23) gave encode 163-183 ms/img, TTFT 777-933 ms (CLI), decode 25.0-25.5 tok/s,
# tg64 28.1-29.3, server 39.5-46.7 tok/s at 4 clients and 72.5 at 16.
RECORDED = {
    "source": "recorded with llamacpp_peer.sh on this machine class (not measured in this run)",
    "dates": "2026-11-25 (quiet, Zen 4 box)",
    "llama_cpp": "0c1e570 (llama-cpp-python 0.3.36 sdist), f32 GGUF + f32 mmproj, 2 threads",
    "encode_ms_per_image": 265,
    "ttft_ms_cli": 1298,
    "ttft_ms_server": 1054,
    "decode_tok_s_b1": 34.7,
    "llama_bench_tg64_tok_s": 42.1,
    "server_tok_s_total": {"4 clients": [53.8, 54.0], "16 clients": [75.5, 78.0]},
    "server_ttft_p50_s": {"4 clients": 2.9, "16 clients": 15.7},
}


@dataclass
class Build:
    server: str      # llama-server binary
    text: str        # text GGUF (f32)
    mmproj: str      # vision tower + projector GGUF (f32)


def work_dir() -> str:
    return os.environ.get("MMJAX_LLAMACPP_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mmjax", "llamacpp")


def find_build(work: str | None = None, checkpoint: str | None = None) -> Build | None:
    """An existing llama-server build and converted GGUFs under `work` (the peer script's layout:
    llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server, gguf/<checkpoint name>/
    text-f32.gguf + mmproj-f32.gguf; `checkpoint`: which converted checkpoint, default the only
    or newest one). None if any piece is missing."""
    work = work or work_dir()
    servers = sorted(glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp", "build", "bin",
                                            "llama-server")))
    servers = [s for s in servers if os.access(s, os.X_OK)]
    if checkpoint:
        dirs = [os.path.join(work, "gguf", os.path.basename(os.path.normpath(checkpoint)))]
    else:
        dirs = sorted(glob.glob(os.path.join(work, "gguf", "*")), key=os.path.getmtime)
    dirs = [d for d in dirs if all(os.path.getsize(f) > 0 if os.path.exists(f) else False
                                   for f in (os.path.join(d, "text-f32.gguf"), os.path.join(d, "mmproj-f32.gguf")))]
    if not servers or not dirs:
        return None
    return Build(servers[-1], os.path.join(dirs[-1], "text-f32.gguf"), os.path.join(dirs[-1], "mmproj-f32.gguf"))


class Server:
    """llama-server on 127.0.0.1:`port` with `parallel` slots, as a context manager (started by
    Popen, stopped by its PID; its log goes to `log_path`)."""

    def __init__(self, build: Build, parallel: int, port: int, threads: int, log_path: str,
                 ctx_per_slot: int = 512, start_timeout: float = 180.0):
        self.build, self.parallel, self.port, self.threads = build, parallel, port, threads
        self.log_path, self.ctx, self.start_timeout = log_path, ctx_per_slot, start_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        b = self.build
        cmd = [b.server, "-m", b.text, "--mmproj", b.mmproj, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(self.threads), "-tb", str(self.threads), "--parallel", str(self.parallel),
               "-c", str(self.parallel * self.ctx), "--jinja", "--no-webui", "--cache-ram", "0"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in {self.start_timeout:.0f} s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def recorded_table() -> str:
    r = RECORDED
    rng = lambda v: f"{v[0]}-{v[1]}" if isinstance(v, list) else str(v)  # noqa: E731
    return "\n".join([
        f"llama.cpp peer: RECORDED figures, {r['source']}; {r['dates']}; {r['llama_cpp']}",
        f"  encode {rng(r['encode_ms_per_image'])} ms/img, TTFT {rng(r['ttft_ms_cli'])} ms (CLI) / "
        f"{r['ttft_ms_server']} ms (server), decode {rng(r['decode_tok_s_b1'])} tok/s (b1; llama-bench tg64 "
        f"{rng(r['llama_bench_tg64_tok_s'])})",
        "  server total tok/s: " + ", ".join(f"{k} {rng(v)}" for k, v in r["server_tok_s_total"].items())
        + "; TTFT p50: " + ", ".join(f"{k} {v} s" for k, v in r["server_ttft_p50_s"].items()),
        "  (no llama.cpp build under " + work_dir() + ": build one with ../shared/peers/llamacpp_peer.sh,"
        " ~4.5 min, to measure it in the same run)"])
