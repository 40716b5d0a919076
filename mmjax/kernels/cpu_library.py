"""Builds and registers mmjax's CPU kernels (cpu_gemv.cc: decode matmuls; cpu_amx.cc: the packed
products' AMX path; cpu_attention.cc: decode attention; cpu_parallel.h: what they share) as one
library through the XLA FFI.

Built at first use with the system C++ compiler (`$CXX`, else g++ / c++ / clang++) into
`$MMJAX_KERNEL_CACHE` (default `$XDG_CACHE_HOME/mmjax/kernels`, i.e. ~/.cache/mmjax/kernels),
the file name keyed by a hash of the sources, the flags, the compiler and the XLA FFI headers;
registered with XLA once per process. No compiler, a failed build or `MMJAX_CPU_KERNELS=0`: one
warning (none for the variable) and `available()` is False, so callers keep XLA's ops. A build
says so in one line on the `mmjax.progress` logger (the compiler, the cache directory; INFO:
shown by the command line and the server log, quiet in the offline API unless asked).

Only the CPU: callers ask `enabled()` at trace time (the platform compiled for is the CPU and the
step is not SPMD-partitioned over a mesh, which cannot split a custom call), so CUDA lowerings
never contain a kernel call.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax

from mmjax import progress

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "cpu_gemv.cc", _DIR / "cpu_attention.cc", _DIR / "cpu_amx.cc"]
_HEADERS = [_DIR / "cpu_parallel.h", _DIR / "cpu_amx.h"]
_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off",
          "-Wno-attributes", "-Wno-return-type"]
_TARGETS = ["mmjax_gemv_bf16", "mmjax_matmul_bf16p", "mmjax_matmul_f32p", "mmjax_gemv_f32", "mmjax_gemv_s8", "mmjax_qmatmul_s8p",
            "mmjax_decode_attention_f32", "mmjax_decode_attention_bf16", "mmjax_decode_attention_s8",
            "mmjax_decode_attention_f8e4m3fn", "mmjax_decode_attention_write_f32", "mmjax_decode_attention_write_bf16",
            "mmjax_decode_attention_write_s8", "mmjax_decode_attention_write_f8e4m3fn",
            "mmjax_prefill_attention_f32", "mmjax_prefill_attention_bf16", "mmjax_prefill_attention_s8",
            "mmjax_prefill_attention_f8e4m3fn", "mmjax_dense_attention_f32", "mmjax_kv_write"]

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
    for part in ([f.read_bytes() for f in _SOURCES + _HEADERS] +
                 [" ".join(_FLAGS).encode(), version.encode(), jax.__version__.encode(),
                  (Path(include) / "xla/ffi/api/c_api.h").read_bytes()]):
        h.update(part)
    out = cache_dir() / f"cpu_kernels-{h.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # the one line a first run gets (the build takes about a minute on 2 cores; later runs load
    # the cached library): on the mmjax.progress logger, so the offline API stays quiet
    progress.log.info("building mmjax's CPU kernels with %s (once for this machine and version, about a minute); "
                      "cached in %s", cxx, out.parent)
    t0 = time.perf_counter()
    # compile to a private name, then rename: concurrent processes (pytest -n 2) never load a
    # half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *_FLAGS, f"-I{include}", f"-I{_DIR}", *map(str, _SOURCES), "-o", tmp],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
        progress.log.debug("built %s in %.1f s", out, time.perf_counter() - t0)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load():
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
            for name in _TARGETS:
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
            lib.mmjax_cpu_set_isa.argtypes = [ctypes.c_int]
            lib.mmjax_cpu_set_amx.argtypes = [ctypes.c_int]
            lib.mmjax_amx_tile_flops.argtypes = [ctypes.c_long]
            lib.mmjax_amx_tile_flops.restype = ctypes.c_double
            _state["lib"] = lib
        except Exception as e:       # no compiler, a compile error, a missing symbol: XLA's ops
            _state["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"mmjax's CPU kernels are unavailable, using XLA's ops: {_state['error'][:500]}",
                          RuntimeWarning, stacklevel=2)
        return _state.get("lib")


def available() -> bool:
    """Are the kernels built and registered (building them on first call)?"""
    return load() is not None


ISAS = ("generic", "avx2", "avx512")
"""The kernels' code paths, lowest first (cpu_parallel.h): plain C++ loops, AVX2 + FMA, AVX-512
F/BW/VL/VNNI/BF16."""


def isa() -> str:
    """The code path the kernels take now: the CPU's best, unless a test capped it (`set_isa`)."""
    lib = load()
    if lib is None:
        raise RuntimeError(_state.get("error", "CPU kernels unavailable"))
    return ISAS[lib.mmjax_cpu_set_isa(-1)]


def isas() -> tuple[str, ...]:
    """The code paths this CPU can run, lowest first (what tests compare against each other)."""
    lib = load()
    if lib is None:
        raise RuntimeError(_state.get("error", "CPU kernels unavailable"))
    return ISAS[:lib.mmjax_cpu_detected_isa() + 1]


def set_isa(name: str | None) -> str:
    """Cap the kernels' code path at `name` (tests: "generic" runs the plain loops even where
    AVX-512 is there), or lift the cap (None); returns the path in use afterwards. Takes effect at
    the next call."""
    lib = load()
    if lib is None:
        raise RuntimeError(_state.get("error", "CPU kernels unavailable"))
    return ISAS[lib.mmjax_cpu_set_isa(ISAS.index(name) if name is not None else len(ISAS) - 1)]


def amx() -> bool:
    """Do the packed f32 / bf16 products run their AMX path here (cpu_amx.cc: AMX-BF16 tile dots,
    f32 at f32 accuracy, for the rows the caller gives them; the CPU, the OS's leave and the
    AVX-512 path, unless a test turned it off with `set_amx`)?"""
    lib = load()
    return lib is not None and bool(lib.mmjax_cpu_set_amx(-1))


def set_amx(on: bool) -> bool:
    """Allow (True) or forbid (False) the AMX path of the packed products (tests and A/Bs; at the
    next call); returns `amx()` afterwards."""
    lib = load()
    if lib is None:
        raise RuntimeError(_state.get("error", "CPU kernels unavailable"))
    return bool(lib.mmjax_cpu_set_amx(1 if on else 0))


def simd() -> bool:
    """Do the kernels run one of their SIMD paths here (built, and an AVX2 or AVX-512 CPU)? The
    plain C++ loops are slower than XLA's own ops, so without a SIMD path nothing calls a kernel
    and no weight is packed for one (aarch64, x86 before AVX2): XLA's ops throughout."""
    return available() and isa() != "generic"


def enabled() -> bool:
    """May the code being traced call a kernel? (trace time: compiling for the CPU, outside an
    SPMD-partitioned step, and the kernels build and run a SIMD path here). See
    `mmjax.backend.cpu_kernels_enabled`."""
    from mmjax.backend import cpu_kernels_enabled
    return cpu_kernels_enabled() and simd()


# vmap (research code, per-example transforms): one kernel call per batch element
VMAP = "sequential"
