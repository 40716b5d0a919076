"""The machine's own limits, measured in the same run as the benchmark it normalises:
float32 GEMM FLOP/s (numpy, torch, jax; on an AMX CPU also the tile units' rate over the six bf16
products of an f32-accurate product, `amx_f32_flops`; peak = the best) and memory bandwidth (read-only
reduction over a buffer far larger than the caches; peak = the best of torch and jax; plus a
copy figure for orientation).

Roofline use: compute-bound work (encode, prefill) is reported as FLOPs / time / gemm peak;
memory-bound work (decode) as bytes read / time / read bandwidth.
"""
from __future__ import annotations

import os
import statistics
import time


def _times(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of each of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _median_time(fn, repeats: int, warmup: int = 1) -> float:
    return statistics.median(_times(fn, repeats, warmup))


def _best_time(fn, repeats: int, warmup: int = 1) -> float:
    """Limits are best-achievable figures: take the fastest repeat (the machine is shared)."""
    return min(_times(fn, repeats, warmup))


def gemm_flops(n: int = 4096, repeats: int = 3) -> dict[str, float]:
    """f32 [n, n] @ [n, n] FLOP/s per library; `peak` is the best of them."""
    import numpy as np

    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out: dict[str, float] = {}
    out["numpy"] = flops / _best_time(lambda: a @ b, repeats)
    try:
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        with torch.no_grad():
            out["torch"] = flops / _best_time(lambda: torch.mm(ta, tb), repeats)
    except ImportError:
        pass
    import jax
    import jax.numpy as jnp

    ja, jb = jnp.asarray(a), jnp.asarray(b)
    mm = jax.jit(jnp.matmul)
    out["jax"] = flops / _best_time(lambda: mm(ja, jb).block_until_ready(), repeats)
    amx = amx_f32_flops()
    if amx:
        out["amx_bf16x6"] = amx
    out["peak"] = max(out.values())
    return out


def amx_f32_flops(iterations: int = 1_000_000) -> float:
    """The f32-accurate matmul rate the AMX tile units allow, on all cores at once: the tile dot's
    bf16 FLOP/s (registers only, one thread a core) over the six bf16 products an f32 product
    takes on mmjax's AMX path (mmjax/kernels/cpu_amx.cc). 0 where the kernels do not use AMX.
    Part of the GEMM peak where it is higher: prefill and encode run there."""
    import threading

    from mmjax.kernels import cpu_library
    if not cpu_library.amx():
        return 0.0
    lib = cpu_library.load()
    lib.mmjax_amx_tile_flops(iterations // 10)        # warm up (the tile state, the clocks)
    rates = [0.0] * (os.cpu_count() or 1)

    def one(i: int) -> None:       # ctypes drops the GIL: the threads run at once
        rates[i] = lib.mmjax_amx_tile_flops(iterations)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(rates) / 6


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Read-only bandwidth (bytes/s) of a full reduction over `nbytes` of float32, per library;
    `read` is the best; `copy` (torch, bytes read + written) for orientation."""
    import numpy as np

    n = nbytes // 4
    x = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    out: dict[str, float] = {}
    try:
        import torch

        tx = torch.from_numpy(x)
        ty = torch.empty_like(tx)
        with torch.no_grad():
            out["torch_read"] = nbytes / _best_time(lambda: tx.sum(), repeats)
            out["torch_copy"] = 2 * nbytes / _best_time(lambda: ty.copy_(tx), repeats)
    except ImportError:
        pass
    import jax
    import jax.numpy as jnp

    jx = jnp.asarray(x)
    red = jax.jit(jnp.sum)
    out["jax_read"] = nbytes / _best_time(lambda: red(jx).block_until_ready(), repeats)
    out["numpy_read"] = nbytes / _best_time(lambda: x.sum(), max(2, repeats // 2))
    out["read"] = max(v for k, v in out.items() if k.endswith("_read"))
    if "torch_copy" in out:
        out["copy"] = out["torch_copy"]
    return out


def others_busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy over `seconds` by everything else (other processes, other VMs' steal time),
    read from /proc/stat while this process sleeps. The load average cannot say this: on 2 cores
    it still counts the benchmark's own threads from the section just before."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]                 # all jiffies, idle + iowait
    try:
        (t0, i0), _, (t1, i1) = snap(), time.sleep(seconds), snap()
    except OSError:                                 # no /proc (macOS): unknown, not contended
        return 0.0
    return round((os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0)), 2)


def measure(smoke: bool = False, quick: bool = False) -> dict:
    """Everything the roofline needs, in one dict (FLOP/s and bytes/s). `quick`: a ~2 s probe
    (3072 GEMM, 512 MiB reads) to take between benchmark sections on a shared machine."""
    if smoke:
        n, reps, nbytes, breps = 512, 2, 64 << 20, 2
    elif quick:
        n, reps, nbytes, breps = 3072, 2, 512 << 20, 3
    else:
        n, reps, nbytes, breps = 4096, 3, 1 << 30, 5
    busy = others_busy_cores(0.3 if smoke else 1.0)
    g = gemm_flops(n, reps)
    m = memory_bandwidth(nbytes, breps)
    return {"cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "others_busy_cores": busy,
            "gemm_flops": g, "bandwidth": m,
            "peak_flops": g["peak"], "read_bw": m["read"]}


if __name__ == "__main__":
    import json

    print(json.dumps(measure()))
