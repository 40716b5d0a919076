"""benchmarks/soak.py: a 20 s soak of `mmjax serve` (shipped default model) on 127.0.0.1.

The script runs as a subprocess (`python -m benchmarks.soak`), starts the server itself (which
inherits this environment: JAX_PLATFORMS=cpu, offline, the tests' compilation cache from
conftest.py), and its last stdout line is the JSON report asserted on here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_soak_refuses_non_loopback_url():
    from benchmarks.soak import loopback_host_port

    assert loopback_host_port("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert loopback_host_port("http://127.8.9.10:81/") == ("127.8.9.10", 81)
    assert loopback_host_port("http://localhost:8000") == ("localhost", 8000)
    assert loopback_host_port("http://[::1]:8000") == ("::1", 8000)
    for url in ("http://10.0.0.1:8000", "http://example.com:8000", "http://0.0.0.0:8000",
                "http://[::]:8000", "http://localhost.evil.com:80", "https://127.0.0.1:8000"):
        with pytest.raises(ValueError):
            loopback_host_port(url)


@pytest.mark.slow
def test_soak_20s_shipped_model(tmp_path):
    from mmjax.demo import default_model_path

    assert default_model_path() is not None, "the shipped mmjax-shapes checkpoint is package data"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "server.log"
    p = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--duration", "20", "--concurrency", "4",
                        "--seed", "1", "--server-log", str(log), "--idle-timeout", "20", "--stop-timeout", "20"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    diag = f"rc={p.returncode}\nstdout:\n{p.stdout[-6000:]}\nstderr:\n{p.stderr[-3000:]}"
    lines = p.stdout.strip().splitlines()
    assert lines, diag
    r = json.loads(lines[-1])
    assert r["good_completed"] > 0, diag
    assert r["total_5xx"] == 0 and r["good_5xx"] == 0, diag
    assert r["sse_errors"] == 0, diag
    assert r["server_alive"] is True and r["server_exit_code"] == 0, diag
    assert r["idle"] is True and r["leaked_slots"] == 0, diag
    assert r["requests_by_kind"]["abort_stream"] > 0 and r["aborted_mid_stream"] > 0, diag
    assert r["requests_by_kind"]["disconnect"] > 0, diag
    assert r["requests_by_kind"]["invalid"] > 0 and r["invalid_not_4xx"] == 0, diag
    # issue 56: structured output, tools, embeddings (abandoned too) and prompt_logprobs in the mix,
    # no 200 answer breaking its constraint
    for kind in ("structured", "tools", "embeddings", "abort_embed", "prompt_logprobs"):
        assert r["requests_by_kind"][kind] > 0, (kind, diag)
    assert r["violations"] == 0, diag
    assert r["rss_start_mib"] and r["rss_peak_mib"] >= r["rss_start_mib"], diag
    assert p.returncode == 0, diag
