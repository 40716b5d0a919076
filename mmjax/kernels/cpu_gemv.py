"""A CPU kernel for decode's skinny matmuls: x [M, K] @ W [K, N] for M <= 16 rows, W f32, bf16 or
int8, read as stored at memory bandwidth (cpu_gemv.cc; issues 25 and 28).

Why: XLA:CPU's own one-row dot converts a bf16 / int8 weight to f32 / s32 on every call, and
YNNPACK's library dot (reached with two or more rows) reads bf16 at ~7-15 GB/s and s8 at ~5 GB/s,
against ~35 GB/s the machine can read: a decode step, which streams every weight once, was
slower in bf16 and barely faster in int8 than in f32. In f32, XLA's dots at 2-16 rows read at
13-22 GB/s. The kernel (AVX-512 FMA / BF16 / VNNI, plain C++ on other CPUs) streams the weight
once, its rows split over XLA's intra-op threads.

Built at first use with the system C++ compiler (`$CXX`, else g++ / c++ / clang++) into
`$MMJAX_KERNEL_CACHE` (default `$XDG_CACHE_HOME/mmjax/kernels`, i.e. ~/.cache/mmjax/kernels),
the file name keyed by a hash of the source, the flags, the compiler and the XLA FFI headers;
registered with XLA once per process. No compiler, a failed build or `MMJAX_CPU_KERNELS=0`: one
warning (none for the variable) and `available()` is False, so callers keep XLA's dots.

Only the CPU: callers ask `enabled()` at trace time (the platform compiled for is the CPU and the
step is not SPMD-partitioned over a mesh, which cannot split a custom call), so CUDA lowerings
never contain it.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

MAX_ROWS = 16                 # rows one call handles (the .cc's kMaxRows)
_SOURCE = Path(__file__).with_name("cpu_gemv.cc")
_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off",
          "-Wno-attributes", "-Wno-return-type"]
_TARGETS = {"mmjax_gemv_bf16": "mmjax_gemv_bf16", "mmjax_gemv_f32": "mmjax_gemv_f32", "mmjax_gemv_s8": "mmjax_gemv_s8"}

_lock = threading.Lock()
_state: dict = {}             # "lib": the loaded library, or "error": why there is none


def cache_dir() -> Path:
    """Where built kernels are kept: $MMJAX_KERNEL_CACHE, else $XDG_CACHE_HOME/mmjax/kernels,
    else ~/.cache/mmjax/kernels."""
    if os.environ.get("MMJAX_KERNEL_CACHE"):
        return Path(os.environ["MMJAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmjax" / "kernels"


def _compiler() -> str | None:
    """$CXX when set (and only it), else the first of g++ / c++ / clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"] if shutil.which(os.environ["CXX"]) else None
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def _build() -> Path:
    """The compiled library's path, compiling it first if no cached copy exists."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX', '')!r}, g++, c++, clang++)")
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(), jax.__version__.encode(),
                 (Path(include) / "xla/ffi/api/c_api.h").read_bytes()):
        h.update(part)
    out = cache_dir() / f"cpu_gemv-{h.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: concurrent processes (pytest -n 2) never load a
    # half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    """The registered library (compiled and registered once per process), or None."""
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    with _lock:
        if "lib" in _state or "error" in _state:
            return _state.get("lib")
        if os.environ.get("MMJAX_CPU_KERNELS", "1") == "0":
            _state["error"] = "disabled by MMJAX_CPU_KERNELS=0"
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
            for name, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            lib.mmjax_gemv_set_generic.argtypes = [ctypes.c_int]
            _state["lib"] = lib
        except Exception as e:       # no compiler, a compile error, a missing symbol: XLA's dots
            _state["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"mmjax's CPU matmul kernel is unavailable, using XLA's dots: {_state['error'][:500]}",
                          RuntimeWarning, stacklevel=2)
        return _state.get("lib")


def available() -> bool:
    """Is the kernel built and registered (building it on first call)?"""
    return _load() is not None


def set_generic(generic: bool) -> bool:
    """Force the plain C++ loops (True) or let the CPU's features choose (False), for tests;
    returns whether the AVX-512 path is in use afterwards. Takes effect at the next call."""
    lib = _load()
    if lib is None:
        raise RuntimeError(_state.get("error", "CPU kernel unavailable"))
    return bool(lib.mmjax_gemv_set_generic(int(generic)))


def enabled() -> bool:
    """May the code being traced use the kernel? (trace time: compiling for the CPU, outside an
    SPMD-partitioned step, and the kernel builds). See `mmjax.backend.cpu_kernels_enabled`."""
    from mmjax.backend import cpu_kernels_enabled
    return cpu_kernels_enabled() and available()


# vmap (research code, per-example transforms): one kernel call per batch element
_VMAP = "sequential"


def _ffi_dot(target: str):
    """[M, K] @ [K, N] -> f32 [M, N] through `target`, differentiable: the derivative is the
    same product through XLA's dots (linear in each operand, so reverse mode transposes it), for
    research code that takes gradients of a served model's steps (saliency)."""
    @jax.custom_jvp
    def f(x, w):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                                vmap_method=_VMAP)(x, w)
    f.defjvps(lambda dx, y, x, w: jnp.matmul(dx, w, preferred_element_type=jnp.float32),
              lambda dw, y, x, w: jnp.matmul(x, dw, preferred_element_type=jnp.float32))
    return f


_dot_bf16, _dot_f32 = _ffi_dot("mmjax_gemv_bf16"), _ffi_dot("mmjax_gemv_f32")


def gemv_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """x bf16 [..., K] (at most MAX_ROWS rows) @ w bf16 [K, N] -> f32 [..., N]: f32 sums of the
    exact bf16 products (jnp.matmul(x, w, preferred_element_type=f32) up to summation order)."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    return _dot_bf16(x.reshape(m, k), w).reshape(*x.shape[:-1], n)


def gemv_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32 [..., K] (at most MAX_ROWS rows) @ w f32 [K, N] -> f32 [..., N] (x @ w up to
    summation order)."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    return _dot_f32(x.reshape(m, k), w).reshape(*x.shape[:-1], n)


def gemv_s8(xq: jax.Array, w: jax.Array, groups: int = 1) -> jax.Array:
    """xq int8 [..., K] (at most MAX_ROWS rows) @ w int8 [K, N], one dot per block of K / groups
    rows -> int32 [..., groups, N]: exact integer sums, what an s8 x s8 -> s32 dot of each row
    block gives (wrapping the same way on overflow)."""
    m, k, n = math.prod(xq.shape[:-1]), xq.shape[-1], w.shape[1]
    y = jax.ffi.ffi_call("mmjax_gemv_s8", jax.ShapeDtypeStruct((m, groups, n), jnp.int32), vmap_method=_VMAP)(
        xq.reshape(m, k), w, groups=int(groups))
    return y.reshape(*xq.shape[:-1], groups, n)


def covers(x: jax.Array, w) -> bool:
    """Does the kernel take x [..., K] @ w here? Trace-time answer: `enabled()`, 1..MAX_ROWS rows,
    and w a 2-D f32 / bf16 array with x of its dtype, or a 2-D int8 `mmjax.quant.QArray` (the int8
    dot inside qmatmul). Measured (2 cores, [1..16, 1024..2048] x [.., 8192..32000]): it beats
    both XLA's one-row dot and YNNPACK's library dot at every such row count, in bf16 and int8;
    in f32, on the bench model's layer shapes, 1.1-2.0x XLA's dot at 1-8 rows, level at 16
    (benchmarks/README.md, "Decode matmuls in f32")."""
    from mmjax.quant import QArray
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if not 1 <= rows <= MAX_ROWS or getattr(w, "ndim", 0) != 2:
        return False
    if isinstance(w, QArray):
        ok = w.q.dtype == jnp.int8
    else:
        ok = x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float32)
    return ok and enabled()
