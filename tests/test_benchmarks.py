"""The benchmark commands at CI size: they run end to end and their JSON line parses with every
field present. No timing assertions (speed targets live in the benchmarks themselves)."""
import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mmjax.kernels import cpu_library

ROOT = Path(__file__).resolve().parents[1]

KERNEL_FIELDS = [
    "encode_b1_mmjax_img_s", "encode_b1_hf_img_s", "encode_b8_mmjax_img_s", "encode_b8_hf_img_s",
    "encode_b1_mmjax_first_call_s", "encode_b8_mmjax_first_call_s",
    "ttft_mmjax_s", "ttft_hf_s", "ttft_mmjax_first_call_s",
    "decode_b1_mmjax_tok_s", "decode_b1_hf_tok_s", "decode_b8_mmjax_tok_s", "decode_b8_hf_tok_s",
    "compile_total_s", "compile_encode_s", "compile_prefill_s", "compile_decode_s",
    "peak_gemm_flops", "read_bw_bytes_s", "copy_bw_bytes_s",
    "encode_flops_per_image", "ttft_flops", "decode_b1_bytes_per_step", "decode_b8_bytes_per_step",
    "encode_b1_mmjax_roofline", "encode_b8_mmjax_roofline", "ttft_mmjax_roofline",
    "decode_b1_mmjax_roofline", "decode_b8_mmjax_roofline", "decode_b1_roofline_tok_s", "decode_b8_roofline_tok_s",
    "encode_b1_hf_roofline", "encode_b8_hf_roofline", "ttft_hf_roofline", "decode_b1_hf_roofline",
    "decode_b8_hf_roofline", "encode_b1_vs_hf", "encode_b8_vs_hf", "ttft_vs_hf", "decode_b1_vs_hf",
    "decode_b8_vs_hf", "prompt_tokens", "image_tokens", "greedy_tokens_agree_b1",
]

SERVE_FIELDS = [
    "requests", "completed", "errors", "duration_s", "request_throughput_rps", "output_tokens",
    "output_tokens_per_s", "error_kinds",
] + [f"{m}_p{p}_ms" for m in ("ttft", "itl", "tpot", "e2e") for p in (50, 90, 99)]


def _env(tmp_path):
    env = dict(os.environ, MMJAX_BENCH_DIR=str(tmp_path / "bench"), JAX_PLATFORMS="cpu",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _last_json(stdout: str) -> dict:
    line = [l for l in stdout.strip().splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_kernel_bench_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel", "--smoke", "--quiet"], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = _last_json(out.stdout)
    missing = [k for k in KERNEL_FIELDS if not _finite(r.get(k))]
    assert not missing, missing
    assert r["compile"] and all({"kind", "shape", "seconds"} <= set(c) for c in r["compile"])
    assert isinstance(r["contended"], bool) and len(r["machine_probes"]) == 5
    assert len(r["loadavg_1m"]) == len(r["others_busy_cores"]) == 5
    assert set(r["section_limits"]) == {"encode", "ttft", "decode_b1", "decode_b8"}
    assert set(r["goals"]) >= {"encode_vs_hf>=1.3", "ttft_vs_hf<=0.75", "decode_b8_vs_hf>=2.5"}
    assert "decode b8 (tok/s)" in out.stdout and "roofline" in out.stdout


def test_kernel_decode_profile_smoke(tmp_path):
    """--profile-only traces the compiled decode step at batch 1 and 8 and attributes XLA op time
    to HLO categories (it once broke silently when the decode step grew a static `rows`)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel", "--smoke", "--quiet", "--profile-only",
                          "--profile-steps", "3"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    profiles = _last_json(out.stdout)["decode_profile"]
    assert [p["batch"] for p in profiles] == [1, 8]
    for p in profiles:
        assert p["step_ms"] > 0 and p["ops_ms_per_step"] > 0
        assert p["categories_ms_per_step"].get("matmul", 0) > 0, p["categories_ms_per_step"]
        if cpu_library.simd():      # the decode attention is mmjax's kernel call, counted as such
            assert p["categories_ms_per_step"].get("attention", 0) > 0, p["categories_ms_per_step"]
        assert p["top_ops"] and all(o["hlo"] for o in p["top_ops"])


def test_engine_bench_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.engine", "--smoke", "--rounds", "2"], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = _last_json(out.stdout)
    # the warmup's progress on stderr: every shape, n of N, the last one N of N
    total = sum(r["compiled_shapes"].values())
    assert f"mmjax: warmup: compiled shape {total}/{total}, " in out.stderr, out.stderr[-2000:]
    assert f"mmjax: warmup: compiled shape 1/{total}, " in out.stderr
    assert [row["concurrency"] for row in r["mmjax"]] == [1, 4]
    for row in r["mmjax"]:
        assert all(_finite(row[k]) and row[k] > 0 for k in
                   ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "vs_hf_sequential", "vs_hf_batched",
                    "wall_s"))
        assert set(row["step_s"]) == {"encode", "prefill", "decode", "prefill_pruned", "prefill_scores", "copy_slot"}
        assert row["step_s"]["decode"] > 0
        assert row["step_s"]["prefill_pruned"] == row["step_s"]["prefill_scores"] == 0   # no FastV / prompt_logprobs
        # the device timeline: every watched call finished inside the run; busy + idle = the last
        # call's ready time
        dev = row["device"]
        assert min(dev["calls"][k] for k in ("encode", "prefill", "decode")) >= 1
        assert all(v > 0 for v in dev["busy_s"].values()) and dev["idle_s"] >= 0
        assert sum(dev["busy_s"].values()) + dev["idle_s"] == pytest.approx(dev["last_ready_s"])
        assert dev["last_ready_s"] <= row["wall_s"] + 0.5
        assert set(dev["rates"]) == {"encode", "prefill", "decode"}
        assert all(_finite(x["rate"]) and 0 < x["fraction"] for x in dev["rates"].values())
    assert _finite(r["hf_sequential"]["output_tok_s"]) and r["hf_sequential"]["output_tok_s"] > 0
    hfb = r["hf_batched"]          # one left-padded batch of the same 4 requests
    assert hfb["batch"] == 4 and all(_finite(hfb[k]) and hfb[k] > 0 for k in ("output_tok_s", "latency_p50_s"))
    assert "transformers (batch 4)" in out.stdout
    # --rounds 2: the main run, then transformers first; each round's ratio is its own two runs'
    first, second = r["rounds"]
    top = r["mmjax"][-1]
    assert first["mmjax_tok_s"] == pytest.approx(top["output_tok_s"]) and first["first"] == "mmjax"
    assert first["hf_batched_tok_s"] == pytest.approx(hfb["output_tok_s"]) and second["first"] == "hf_batched"
    for x in (first, second):
        assert x["ratio"] == pytest.approx(x["mmjax_tok_s"] / x["hf_batched_tok_s"]) and x["mmjax_ttft_p50_s"] > 0
    assert min(first["ratio"], second["ratio"]) <= r["rounds_median_ratio"] <= max(first["ratio"], second["ratio"])
    assert "rounds: median ratio" in out.stdout
    assert {(d["rows"], d["kv_len"]) for d in r["decode_steps"]} == {(1, 128), (1, 256), (4, 128), (4, 256)}
    assert r["compiled_shapes"]["decode"] == 3 and "transformers (seq.)" in out.stdout  # rows 1, 2, 4
    # the f32 roofline of every system's run: probed limits, a floor, its fraction
    assert len(r["machine_probes"]) == 2 and "% roofline" in out.stdout
    for st in r["mmjax"] + [r["hf_sequential"], hfb]:
        roof = st["roofline"]
        assert roof["floor_s"] == max(roof["compute_s"], roof["read_s"]) > 0
        assert roof["fraction"] == pytest.approx(st["output_tok_s"] / roof["ceiling_tok_s"])
    assert r["mmjax"][0]["roofline"]["read_s"] == pytest.approx(4 * r["mmjax"][1]["roofline"]["read_s"])


def test_cpu_attention_bench_smoke(capsys):
    from benchmarks.cpu_attention import main
    r = main(["--chains", "2x40", "1x130", "--repeats", "1"])
    assert [(x["rows"], x["context"], x["cache_dtype"]) for x in r["layers"]] == [
        (2, 40, "float32"), (2, 40, "int8"), (1, 130, "float32"), (1, 130, "int8")]
    for x in r["layers"]:
        assert all(_finite(x[k]) and x[k] > 0 for k in ("kernel_ms", "xla_ms", "kernel_gb_s", "xla_gb_s"))
    assert r["engine"] == [] and "int8    cache,   1 rows x   130 keys: kernel" in capsys.readouterr().out


def test_cpu_attention_paths_bench_smoke(capsys):
    from benchmarks.cpu_attention_paths import main
    from mmjax.kernels import cpu_library
    r = main(["--cases", "decode:2x40", "prefill:1x20", "vision:2x20", "--dtypes", "f32", "int8", "--repeats", "1"])
    assert r["paths"] == list(cpu_library.isas())
    assert [(x["kind"], x["rows"], x["context"], x["dtype"]) for x in r["cases"]] == [
        ("decode", 2, 40, "f32"), ("decode", 2, 40, "int8"), ("prefill", 1, 20, "f32"), ("prefill", 1, 20, "int8"),
        ("vision", 2, 20, "f32")]
    for x in r["cases"]:
        assert all(_finite(x[f"{k}_ms"]) and x[f"{k}_ms"] > 0 for k in (*r["paths"], "xla_model", "xla_ref"))
        assert x["max_abs_diff_vs_ref"] < 1e-4
    assert "prefill  1 x    20 int8" in capsys.readouterr().out


def test_gemv_bench_smoke(capsys):
    from benchmarks.gemv import main
    r = main(["--rows", "1", "3", "--shapes", "64x200", "--repeat", "1", "--chain", "--chain-layers", "1",
              "--blocks-ab"])
    paths = ["f32 xla", "bf16 xla", "f32 kernel", "bf16 kernel", "int8 xla", "int8 kernel", "f32 packed",
             "bf16 packed", "int8 packed"]
    assert [(x["shape"], x["path"]) for x in r["rows"]] == [(s, p) for s in ("[1,64]x[64,200]", "[3,64]x[64,200]")
                                                            for p in paths]
    assert {(x["path"], x["rows"]) for x in r["chain"]} == {
        (p, m) for p in ("f32 xla", "f32 kernel", "f32 packed", "bf16 kernel", "bf16 packed", "int8 kernel",
                         "int8 packed", "f32 packed (no blocks)", "bf16 packed (no blocks)",
                         "int8 packed (no blocks)") for m in (1, 3)}
    assert all(_finite(x["ms"]) and x["ms"] > 0 and x["gb_s"] > 0 for x in r["rows"] + r["chain"])
    assert "chain bf16 packed  rows  3" in capsys.readouterr().out


def test_arch_arithmetic_matches_default_checkpoint():
    """FLOP and byte counts of the default checkpoint, by hand (342M params, ~886 MB/step)."""
    from benchmarks.kernel import Arch

    a = Arch(v_hidden=768, v_inter=3072, v_layers_run=11, v_tokens=197, patch_dim=768, img_tokens=196,
             proj_in=768, hidden=1024, inter=2816, layers=16, heads=16, kv_heads=8, head_dim=64, vocab=32000)
    assert a.layer_params() == 1024 * 2048 + 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024
    weights = 16 * a.layer_params() + 1024 * 32000 + 1024
    assert a.decode_bytes(1, 0) == 4 * (weights + 1024)
    assert a.decode_bytes(8, 100) - a.decode_bytes(8, 0) == 4 * 8 * 100 * 16 * 2 * 8 * 64
    assert 30e9 < a.encode_flops() < 36e9


def test_engine_roofline_arithmetic():
    """bench engine's floor for 16 requests of 230 prompt tokens and 128 new tokens each on the
    default checkpoint: ~2.88 TFLOP (per request 32.9 GFLOP encode + 88.6 prefill + 127 decode
    tokens of ~0.46), and 127 (concurrency 16) or 16 x 127 (one at a time) reads of the weights."""
    from benchmarks.engine import roofline
    from benchmarks.kernel import Arch

    a = Arch(v_hidden=768, v_inter=3072, v_layers_run=11, v_tokens=197, patch_dim=768, img_tokens=196,
             proj_in=768, hidden=1024, inter=2816, layers=16, heads=16, kv_heads=8, head_dim=64, vocab=32000)
    assert a.decode_flops(0) == 2 * (16 * a.layer_params() + 1024 * 32000)
    assert a.decode_flops(100) - a.decode_flops(0) == 16 * 4 * 100 * 16 * 64
    r16 = roofline(a, [230] * 16, 128, 16, 200e9, 30e9)
    assert 2.8e12 < r16["flops"] < 2.95e12 and r16["compute_s"] == pytest.approx(r16["flops"] / 200e9)
    assert r16["read_s"] == pytest.approx(127 * a.decode_bytes(0, 0) / 30e9)
    assert r16["floor_s"] == r16["compute_s"] and r16["ceiling_tok_s"] == pytest.approx(16 * 128 / r16["floor_s"])
    r1 = roofline(a, [230] * 16, 128, 1, 200e9, 30e9)
    assert r1["flops"] == r16["flops"] and r1["read_s"] == pytest.approx(16 * r16["read_s"])
    assert r1["floor_s"] == r1["read_s"]        # one at a time, every token re-reads the weights


# ---- serve bench ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeOpenAI:
    """A minimal OpenAI-compatible streaming chat server (aiohttp) in a background thread.
    Every `fail_every`-th request gets a 400; `stream_error_every`-th errors mid-stream."""

    def __init__(self, tokens: int = 5, delay: float = 0.002, fail_every: int = 0, stream_error_every: int = 0,
                 usage: bool = True):
        self.tokens, self.delay, self.usage = tokens, delay, usage
        self.fail_every, self.stream_error_every = fail_every, stream_error_every
        self.count = 0
        self.bodies = []
        self.port = _free_port()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _models(self, request):
        from aiohttp import web
        return web.json_response({"object": "list", "data": [{"id": "fake-vlm", "object": "model"}]})

    async def _chat(self, request):
        from aiohttp import web
        body = await request.json()
        self.bodies.append(body)
        self.count += 1
        n = self.count
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": {"message": "image too large", "type": "invalid_request_error",
                                                "param": "messages", "code": None}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        k = min(self.tokens, body.get("max_tokens", self.tokens))
        for i in range(k):
            await asyncio.sleep(self.delay)
            if self.stream_error_every and n % self.stream_error_every == 0 and i == 1:
                await resp.write(b'data: {"error": {"message": "engine failed"}}\n\n')
                break
            ev = {"id": f"c{n}", "object": "chat.completion.chunk", "model": "fake-vlm",
                  "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        ev = {"id": f"c{n}", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        if self.usage:
            ev = {"id": f"c{n}", "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": k,
                                                          "total_tokens": 20 + k}}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _run(self):
        from aiohttp import web

        async def main():
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._chat)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            while True:
                await asyncio.sleep(3600)

        asyncio.run(main())

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *a):
        pass  # daemon thread dies with the test process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _run_serve_bench(argv, capsys) -> dict:
    from benchmarks import serve as bench_serve

    rc = bench_serve.main(argv)
    out = capsys.readouterr().out
    r = _last_json(out)
    assert "TTFT" in out and "inter-token" in out
    return rc, r


def test_serve_bench_against_fake_server(capsys):
    with FakeOpenAI(tokens=6) as srv:
        rc, r = _run_serve_bench(["--url", srv.url, "--concurrency", "3", "--requests", "7",
                                  "--image-sizes", "32x32,40x24", "--max-tokens", "6", "--ignore-eos",
                                  "--warmup", "0"], capsys)
    assert rc == 0
    missing = [k for k in SERVE_FIELDS if k not in r]
    assert not missing, missing
    assert r["completed"] == 7 and r["errors"] == 0 and r["output_tokens"] == 42 and r["usage_reported"]
    assert all(_finite(r[k]) for k in SERVE_FIELDS if k.endswith("_ms"))
    assert r["model"] == "fake-vlm"
    body = srv.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    part = body["messages"][0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    # distinct images per request (no cache can help), cycled sizes
    urls = [b["messages"][0]["content"][0]["image_url"]["url"] for b in srv.bodies]
    assert len(set(urls)) == len(urls)


def test_serve_bench_counts_errors(capsys):
    with FakeOpenAI(tokens=4, fail_every=3, stream_error_every=5, usage=False) as srv:
        rc, r = _run_serve_bench(["--url", srv.url + "/v1", "--concurrency", "2", "--requests", "10",
                                  "--image-sizes", "16x16", "--max-tokens", "4", "--warmup", "0"], capsys)
    # requests 3, 6, 9 -> HTTP 400; request 5 and 10 -> error mid-stream
    assert r["errors"] == 5 and r["completed"] == 5
    assert any(k.startswith("HTTP 400: image too large") for k in r["error_kinds"])
    assert any(k.startswith("stream error: engine failed") for k in r["error_kinds"])
    assert r["output_tokens"] == 20 and not r["usage_reported"]  # counted from chunks


def test_serve_bench_connection_refused(capsys, tmp_path, monkeypatch):
    port = _free_port()
    rc, r = _run_serve_bench(["--url", f"http://127.0.0.1:{port}", "--model", "x", "--requests", "2",
                              "--warmup", "0", "--image-sizes", ""], capsys)
    assert rc == 1 and r["errors"] == 2 and r["completed"] == 0 and r["ttft_p50_ms"] is None
    # --llamacpp without a llama.cpp build: its figures recorded on this machine class, labeled so
    from benchmarks import llamacpp
    monkeypatch.setenv("MMJAX_LLAMACPP_DIR", str(tmp_path))
    from benchmarks import serve as bench_serve
    rc = bench_serve.main(["--llamacpp"])
    out = capsys.readouterr().out
    r = _last_json(out)
    assert rc == 0 and r["llamacpp"]["measured"] is False and r["llamacpp"]["recorded"] == llamacpp.RECORDED
    assert "RECORDED figures" in out and "not measured in this run" in out
    # the peer script's layout is found (server binary + converted GGUFs)
    bin_dir = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").write_text("#!/bin/sh\n")
    (bin_dir / "llama-server").chmod(0o755)
    assert llamacpp.find_build() is None                 # no GGUFs yet
    g = tmp_path / "gguf" / "llava-default"
    g.mkdir(parents=True)
    for f in ("text-f32.gguf", "mmproj-f32.gguf"):
        (g / f).write_bytes(b"GGUF")
    b = llamacpp.find_build()
    assert b.server == str(bin_dir / "llama-server") and b.text == str(g / "text-f32.gguf")
    assert llamacpp.find_build(checkpoint="/x/other") is None


@pytest.mark.slow
def test_serve_bench_against_mmjax_server(tmp_path, llava_dirs, capsys):
    """The real thing: `python -m serve --warmup` on a tiny LLaVA (its log shows each warmup shape
    compiled, n of N, before it listens), driven by the load generator."""
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(llava_dirs["gqa"]), "--port", "0",
                             "--max-model-len", "256", "--max-num-seqs", "2", "--log-stats-interval", "0",
                             "--warmup"],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url, seen, deadline = None, [], time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if m:
                url = m.group(1)
        assert url, "server did not start:\n" + "".join(seen[-30:])
        shapes = [m.groups() for m in (re.search(r"mmjax.progress: warmup: compiled shape (\d+)/(\d+), ", x)
                                       for x in seen) if m]
        assert shapes and shapes[-1][0] == shapes[-1][1] and len({t for _, t in shapes}) == 1, seen
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
        rc, r = _run_serve_bench(["--url", url, "--smoke", "--ignore-eos"], capsys)
        assert rc == 0
        missing = [k for k in SERVE_FIELDS if k not in r]
        assert not missing, missing
        assert r["completed"] == 4 and r["errors"] == 0, r["error_kinds"]
        assert r["output_tokens"] == 4 * 8 and r["usage_reported"]
        assert all(_finite(r[k]) for k in SERVE_FIELDS if k.endswith("_ms"))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_gpu_bench_smoke(tmp_path):
    """`mmjax bench gpu` off a GPU: the accuracy, attention, decode and TTFT sections at toy size
    report their fields, and the partial JSON (--out) is the final one (the engine and Qwen 4K
    sections reuse benchmarks/engine.py's clients, smoke-tested above, and the runner's encode;
    the transformers peer and the decode A/Bs load more models: skipped here for CI time)."""
    partial = tmp_path / "partial.json"
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(partial), "--skip",
                          "engine", "qwen4k", "hf", "decode-xla", "decode-fp8", "decode-int8", "decode-paged"],
                         cwd=ROOT, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = _last_json(out.stdout)
    assert json.loads(partial.read_text()) == r and "errors" not in r and "not_run" not in r
    assert r["smoke"] and _finite(r["copy_bw_bytes_s"]) and _finite(r["read_bw_bytes_s"])
    acc = r["kernel_accuracy"]
    assert [a["kernel"] for a in acc] == ["flash", "flash", "ragged_decode", "paged"]
    assert acc[0]["rel_err"] < 1e-5 and acc[1]["rel_err"] < 2e-2 and acc[2]["within_test_tolerance"]
    assert acc[3]["within_test_tolerance"]
    assert {row["impl"] for row in r["attention"]["rows"]} == {"reference", "chunked"}
    assert [d["batch"] for d in r["decode"]] == [1, 2] and all(_finite(d["tok_s"]) for d in r["decode"])
    # the step's time split: 16 steps in one call everywhere, kernel time from a trace on GPUs only
    assert all(_finite(d["loop_step_ms"]) and d["kernel_ms"] is None for d in r["decode"])
    assert _finite(r["ttft_s"]) and "engine" not in r and "qwen_4k_encode" not in r
    assert "SMOKE" in out.stdout


def test_gpu_bench_kernel_time_reads_compute_streams():
    """bench gpu's kernel time per decode step sums the GPU's compute-stream events of a
    profiler trace (as jax.profiler writes it: metadata names processes and threads), not the
    host's threads or the copy streams."""
    from benchmarks.gpu import compute_stream_seconds

    def meta(kind, pid, name, tid=0):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
    events = [meta("process_name", 1, "/host:CPU"), meta("thread_name", 1, "python3", 7),
              meta("process_name", 2, "/device:GPU:0"), meta("thread_name", 2, "Stream #14(Compute)", 14),
              meta("thread_name", 2, "Stream #15(MemcpyH2D)", 15),
              {"ph": "X", "pid": 1, "tid": 7, "name": "PjitFunction(decode)", "ts": 0, "dur": 5000},
              {"ph": "X", "pid": 2, "tid": 14, "name": "gemm_fusion_dot", "ts": 10, "dur": 900},
              {"ph": "X", "pid": 2, "tid": 14, "name": "mmjax_ragged_decode_attention", "ts": 910, "dur": 250},
              {"ph": "X", "pid": 2, "tid": 15, "name": "memcpy", "ts": 0, "dur": 40}]
    assert abs(compute_stream_seconds(events) - 1150e-6) < 1e-12
