import contextlib
import os
import sys

# Tests run on CPU, offline, with a private compilation cache.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MMJAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "mmjax-test-jax-cache"))
sys.path.insert(0, os.path.dirname(__file__))

# The suite compiles hundreds of tiny-model steps and runs most for milliseconds, so compiling
# is most of its time: XLA's LLVM backend at -O0 compiles ~35% faster (one sharding worker 135 ->
# 88 CPU seconds; a notebook test 47 -> 35 s, run time included; the suite 34 -> 25 minutes on
# CI's 2 cores) from the same optimized HLO, so every HLO assertion (collectives, dtypes,
# fusions) still sees what users run. What -O0 changes is the machine code: LLVM no longer
# contracts a fusion's multiply-adds into FMAs, an ulp at most, inside every parity tolerance.
# Subprocesses that replace XLA_FLAGS add it back (test_sharding, multihost_worker).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mmjax.api import enable_compilation_cache  # noqa: E402

# JAX's persistent compilation cache from the session's first compile on (mmjax.load turns it on
# too, but only at its first call): a program compiled again by another jit object (a new runner
# of the same checkpoint and shapes, another xdist worker, a worker subprocess) loads from it.
# CI points MMJAX_COMPILATION_CACHE_DIR at a fresh directory, so it only helps within one run.
enable_compilation_cache()

# CI runs the suite over its 2 cores (`-n 2`, README; whole files per worker, pyproject addopts):
# the files that take longest go first so that no long file starts last and runs alone. Order
# by CI seconds; the other files follow in their usual order.
LONGEST_FIRST = ("test_sharding.py", "test_demo_model.py", "test_cuda_lowering.py", "test_engine.py",
                 "test_gemma4.py", "test_benchmarks.py", "test_gemma3.py", "test_demo_data.py",
                 "test_research.py", "test_serve.py", "test_openai_surface.py", "test_errors_and_loading.py",
                 "test_media_guards.py", "test_soak.py")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):     # one process: the usual (file name) order
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))    # stable: within a file unchanged


@pytest.fixture(scope="session")
def llava_dirs(tmp_path_factory):
    """Two tiny LLaVA checkpoints: {"gqa": path, "mha": path} (see tiny_checkpoints.build_llava)."""
    from tiny_checkpoints import build_llava
    root = tmp_path_factory.mktemp("llava")
    return {v: build_llava(root / v, variant=v, seed=i) for i, v in enumerate(("gqa", "mha"))}


@pytest.fixture(scope="session")
def qwen_dirs(tmp_path_factory):
    """Tiny Qwen2-VL and Qwen2.5-VL checkpoints: {"qwen2_vl": path, "qwen2_5_vl": path}."""
    from tiny_qwen import build_qwen
    root = tmp_path_factory.mktemp("qwen")
    return {f: build_qwen(root / f, family=f, seed=i) for i, f in enumerate(("qwen2_vl", "qwen2_5_vl"))}


@pytest.fixture(scope="session")
def qwen3_dirs(tmp_path_factory):
    """Tiny Qwen3-VL checkpoints: {"dense": path, "moe": path} (see tiny_qwen3.build_qwen3)."""
    from tiny_qwen3 import build_qwen3
    root = tmp_path_factory.mktemp("qwen3")
    # seeds whose greedy continuations vary (a tied tiny head otherwise repeats one token)
    return {k: build_qwen3(root / k, kind=k, seed=s) for k, s in (("dense", 0), ("moe", 2))}


@pytest.fixture(scope="session")
def qwen35_dirs(tmp_path_factory):
    """Tiny Qwen3.5 checkpoints: {"dense": path, "moe": path} (see tiny_qwen35.build_qwen35)."""
    from tiny_qwen35 import build_qwen35
    root = tmp_path_factory.mktemp("qwen35")
    return {k: build_qwen35(root / k, kind=k, seed=s) for k, s in (("dense", 0), ("moe", 0))}


@pytest.fixture(scope="session")
def gemma3_dirs(tmp_path_factory):
    """Tiny Gemma 3 checkpoints: {"window": path, "softcap": path} (see tiny_gemma.build_gemma3)."""
    from tiny_gemma import build_gemma3
    root = tmp_path_factory.mktemp("gemma3")
    return {v: build_gemma3(root / v, variant=v, seed=i) for i, v in enumerate(("window", "softcap"))}


@pytest.fixture(scope="session")
def gemma4_dirs(tmp_path_factory):
    """Tiny Gemma 4 checkpoints: {"dense": path, "moe": path} (see tiny_gemma4.build_gemma4)."""
    from tiny_gemma4 import build_gemma4
    root = tmp_path_factory.mktemp("gemma4")
    return {v: build_gemma4(root / v, variant=v, seed=i) for i, v in enumerate(("dense", "moe"))}


@pytest.fixture(scope="session")
def llava_next_dirs(tmp_path_factory):
    """Tiny LLaVA-NeXT and LLaVA-OneVision checkpoints: {"next": path, "onevision": path}
    (see tiny_llava_next.build_llava_next)."""
    from tiny_llava_next import build_llava_next
    root = tmp_path_factory.mktemp("llava_next")
    return {v: build_llava_next(root / v, variant=v, seed=i) for i, v in enumerate(("next", "onevision"))}


@pytest.fixture(scope="session")
def idefics3_dirs(tmp_path_factory):
    """Tiny Idefics3 and SmolVLM checkpoints: {"idefics3": path, "smolvlm": path} (see
    tiny_idefics3.build_idefics3)."""
    from tiny_idefics3 import build_idefics3
    root = tmp_path_factory.mktemp("idefics3")
    return {v: build_idefics3(root / v, variant=v, seed=i) for i, v in enumerate(("idefics3", "smolvlm"))}


@pytest.fixture(scope="session")
def mistral3_dirs(tmp_path_factory):
    """Tiny Mistral 3 / Pixtral checkpoints: {"merge2", "merge1", "llava"} (see tiny_mistral3.build_mistral3)."""
    from tiny_mistral3 import build_mistral3
    root = tmp_path_factory.mktemp("mistral3")
    return {v: build_mistral3(root / v, variant=v, seed=i) for i, v in enumerate(("merge2", "merge1", "llava"))}


@pytest.fixture(scope="session")
def mllama_dirs(tmp_path_factory):
    """Tiny Llama 3.2 Vision checkpoints: {"tiles4", "tiles2"} (see tiny_mllama.build_mllama)."""
    from tiny_mllama import build_mllama
    root = tmp_path_factory.mktemp("mllama")
    return {v: build_mllama(root / v, variant=v, seed=i) for i, v in enumerate(("tiles4", "tiles2"))}


@pytest.fixture(scope="session")
def internvl_dirs(tmp_path_factory):
    """Tiny InternVL checkpoints: {"qwen2": InternVL 3's layout, "qwen3": 3.5's} (see tiny_internvl.build_internvl)."""
    from tiny_internvl import build_internvl
    root = tmp_path_factory.mktemp("internvl")
    return {v: build_internvl(root / v, variant=v, seed=i) for i, v in enumerate(("qwen2", "qwen3"))}


@pytest.fixture(scope="session")
def llama4_dirs(tmp_path_factory):
    """Tiny Llama 4 checkpoints: {"qk", "plain"} (see tiny_llama4.build_llama4)."""
    from tiny_llama4 import build_llama4
    root = tmp_path_factory.mktemp("llama4")
    return {v: build_llama4(root / v, variant=v, seed=i) for i, v in enumerate(("qk", "plain"))}


@pytest.fixture(scope="session")
def glm4v_dirs(tmp_path_factory):
    """Tiny GLM-4.xV checkpoints: {"dense", "moe", "46v"} (see tiny_glm4v.build_glm4v)."""
    from tiny_glm4v import build_glm4v
    root = tmp_path_factory.mktemp("glm4v")
    return {v: build_glm4v(root / v, kind=v, seed=i) for i, v in enumerate(("dense", "moe", "46v"))}


@pytest.fixture(scope="session")
def minicpmv_dirs(tmp_path_factory):
    """Tiny MiniCPM-V checkpoints: {"4.6": path, "4.7": path} (see tiny_minicpmv.build_minicpmv)."""
    from tiny_minicpmv import build_minicpmv
    root = tmp_path_factory.mktemp("minicpmv")
    return {v: build_minicpmv(root / v, version=v, seed=s) for v, s in (("4.6", 0), ("4.7", 1))}


def noise_image(seed: int, width: int, height: int):
    """Random RGB noise (never constant) as a PIL image."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def page_floor(vlm, n: int) -> int:
    """The cached tokens a prefix hit of n tokens gives on vlm's engine: n on a cache with a row
    per slot (the token-exact prefix cache), its whole pages on a paged cache (prefixes are
    shared by page, serving/pages.py)."""
    r = vlm.engine.runner
    return n // r.page_size * r.page_size if r.paged else n


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: the relative error used throughout the parity tests."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@contextlib.contextmanager
def kernel_path(name: str):
    """mmjax's CPU kernels on their code path `name` ("generic", "avx2", "avx512": one this CPU
    runs, `cpu_library.isas()`) inside the block, the CPU's best after it."""
    from mmjax.kernels import cpu_library
    assert cpu_library.set_isa(name) == name
    try:
        yield
    finally:
        cpu_library.set_isa(None)
