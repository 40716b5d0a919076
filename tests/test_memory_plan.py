"""The device memory plan (weights by part, KV cache, decode state, the compiled steps' temporaries
from XLA's memory analysis, the peak), `memory_budget` sizing the decode slots from it, and
`vision_offload` (vision tower + projector in host memory, fetched inside the encode step), on the
tiny LLaVA checkpoint."""
import argparse

import jax
import numpy as np
import pytest

import mmjax
from conftest import noise_image
from mmjax.errors import InvalidRequestError

ENGINE = dict(max_num_seqs=8, max_model_len=256, prefill_chunk=64)


@pytest.fixture(scope="module")
def plain(llava_dirs):
    return mmjax.load(llava_dirs["gqa"], page_size=0, **ENGINE)      # a cache row per slot


def test_memory_budget_sizes_the_slots_from_the_plan(plain, llava_dirs):
    plan = plain.engine.runner.memory_plan()
    r = plain.engine.runner
    kv_leaves = jax.tree.leaves(r.cache)
    assert plan["slots"] == 8 and plan["kv_cache"] == sum(x.nbytes for x in kv_leaves)
    assert plan["weights_text"] == sum(x.nbytes for x in r.lm_leaves)
    assert plan["weights_vision"] == sum(x.nbytes for x in r.weights.split.vision_leaves)
    assert min(plan["temp_encode"], plan["temp_prefill"], plan["temp_decode"]) > 0
    assert plan["peak"] == (plan["weights_text"] + plan["weights_vision"] + plan["kv_cache"] + plan["decode_state"]
                            + max(plan["temp_encode"], plan["temp_prefill"], plan["temp_decode"]))
    assert plain.engine.stats()["memory_plan"] == plan
    from serve.metrics import EngineCollector
    got = {s.labels["part"]: s.value for m in EngineCollector(plain.engine.stats).collect()
           if m.name == "mmjax_memory_plan_bytes" for s in m.samples}
    assert got["peak"] == plan["peak"] and got["kv_cache"] == plan["kv_cache"]

    # room for 4.5 sequences' KV and state below the 8-slot peak: at least 4 slots fit (more where
    # the steps' temporaries shrink with the slots: the packed prefill's segments are min(8, slots)),
    # their plan is under the budget and one more slot's is not
    per_slot = (plan["kv_cache"] + plan["decode_state"]) // 8
    budget = plan["peak"] - int(3.5 * per_slot)
    # paged (page_size 64): the slots stay, the budget sizes the page pool: 3.5 sequences' pages
    # below a 32-page plan's peak leave 18 pages (32 - 14), the plan with them fits, one more would not
    whole = mmjax.load(llava_dirs["gqa"], page_size=64, **ENGINE).engine.runner
    pplan, page = whole.memory_plan(), whole.page_bytes()
    assert whole.paged and pplan["pages"] == 32 == 8 * whole.max_pages and pplan["kv_cache"] == 32 * page
    paged = mmjax.load(llava_dirs["gqa"], memory_budget=pplan["peak"] - int(3.5 * 4 * page), page_size=64,
                       **ENGINE).engine.runner
    fit = paged.memory_plan()
    assert paged.num_slots == 8 and fit["pages"] == paged.num_pages == 18
    assert fit["peak"] <= pplan["peak"] - int(3.5 * 4 * page) < fit["peak"] + page
    assert fit["kv_cache"] == 18 * page == sum(x.nbytes for x in jax.tree.leaves(paged.cache))
    # a cache row per slot (page_size 0): the budget sizes the slots
    vlm = mmjax.load(llava_dirs["gqa"], memory_budget=budget, page_size=0, **ENGINE)
    r = vlm.engine.runner
    fit = r.memory_plan()
    assert 4 <= r.num_slots == fit["slots"] == len(vlm.engine.scheduler.slots) < 8
    assert fit["peak"] <= budget < r._plan_for(r.num_slots + 1, r.step_temp_bytes(r.num_slots + 1))["peak"]
    out = vlm.generate(["USER: hello ASSISTANT:"] * 6, mmjax.SamplingParams(max_tokens=3, temperature=0.0))
    assert all(len(o.token_ids) == 3 for o in out)          # 6 requests through 4 slots
    with pytest.raises(InvalidRequestError, match="memory budget 1,000 bytes is too small"):
        mmjax.load(llava_dirs["gqa"], memory_budget=1000, page_size=0, **ENGINE).engine
    with pytest.raises(InvalidRequestError, match="memory budget 1,000 bytes is too small"):
        mmjax.load(llava_dirs["gqa"], memory_budget=1000, page_size=64, **ENGINE).engine
    with pytest.raises(InvalidRequestError, match="fraction"):
        mmjax.load(llava_dirs["gqa"], memory_budget=1.5, **ENGINE).engine
    with pytest.raises(InvalidRequestError, match="kv_cache_bytes"):
        mmjax.load(llava_dirs["gqa"], kv_cache_bytes=paged.page_bytes(), page_size=64, **ENGINE).engine


def test_vision_offload_keeps_outputs_and_lowers_for_cuda(plain, llava_dirs):
    from mmjax.api import load_model
    from mmjax.backend import compiling_for
    from mmjax.serving.runner import ModelRunner
    vlm = mmjax.load(llava_dirs["gqa"], vision_offload=True, page_size=0, **ENGINE)
    r = vlm.engine.runner
    split = r.weights.split       # the vision side: the tower and the projector
    kinds = {k: {x.sharding.memory_kind for x in v} for k, v in (("text", split.lm_leaves),
                                                                  ("vision", split.vision_leaves))}
    assert kinds == {"text": {"device"}, "vision": {"pinned_host"}}
    img = noise_image(5, 45, 30)
    np.testing.assert_array_equal(vlm.encode([img])[0], plain.encode([img])[0])
    prompt, images = plain.render_chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                                     {"type": "text", "text": "what?"}]}])
    sp = mmjax.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    req = [{"prompt": prompt, "images": images}]
    assert vlm.generate(req, sp)[0].token_ids == plain.generate(req, sp)[0].token_ids
    off, on = vlm.engine.runner.memory_plan(), plain.engine.runner.memory_plan()
    assert off["vision_offloaded"] and off["peak"] == on["peak"] - off["weights_vision"] + max(
        0, off["temp_encode"] + off["weights_vision"] - max(off["temp_prefill"], off["temp_decode"]))

    # bf16 for CUDA: the encode step takes the vision weights from pinned host memory and moves them
    model = load_model(llava_dirs["gqa"], "bfloat16")
    cuda = ModelRunner(model.family, model.module, max_num_seqs=2, max_model_len=128, prefill_chunk=32,
                       max_encode_batch=2, dtype=model.dtype, platform="cuda", vision_offload=True)
    with compiling_for("cuda"):
        name, fn, args, kw = next(s for s in cuda.step_signatures() if s[0].startswith("encode"))
        text = jax.export.export(fn, platforms=("cuda",), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args, **kw).mlir_module()
    n_host = len(cuda.weights.split.vision_leaves)
    main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    assert main.count('mhlo.memory_kind = "pinned_host"') == n_host
    assert text.count("annotate_device_placement") >= n_host


def test_memory_budget_flag_parses_bytes_and_fractions():
    from serve.cli import _memory_budget
    assert _memory_budget("0.9") == 0.9 and _memory_budget("20GiB") == 20 * 2**30
    assert _memory_budget("512MiB") == 512 * 2**20 and _memory_budget("2e10") == 20_000_000_000
    for bad in ("-1", "lots", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            _memory_budget(bad)


def test_kv_cache_dtype_scales_the_planned_slots(plain, monkeypatch):
    """Under one fixed budget the planned slot count follows the KV cache's bytes per token:
    bfloat16 about 2x float32's slots, int8 / fp8 (one bfloat16 scale per token and KV head,
    kv_quant) about 2x bfloat16's (exactly 2 * head_dim / (head_dim + 2) x its cache bytes). The
    plan counts every cache leaf, scales included, against kv_quant.bytes_per_token; the step
    temporaries are held fixed (they do not depend on the cache dtype's accounting, and compiling
    them per dtype is the slow part)."""
    from mmjax.models.nn.kv_quant import bytes_per_token
    from mmjax.serving.runner import ModelRunner
    model, r = plain.loaded, plain.engine.runner
    temp = {k: plain.engine.runner.memory_plan()[f"temp_{k}"] for k in ("encode", "prefill", "decode")}
    monkeypatch.setattr(ModelRunner, "step_temp_bytes", lambda self, num_slots=None: temp)
    cfg = r.text_model.config
    max_len = 2048                                  # KV per slot >> decode state per slot

    def runner(kv, budget=None, slots=4):     # a cache row per slot: the budget sizes the slots
        return ModelRunner(model.family, model.module, max_num_seqs=slots, max_model_len=max_len, prefill_chunk=64,
                           max_encode_batch=2, dtype=model.dtype, kv_cache_dtype=kv, memory_budget=budget,
                           page_size=0)

    one = runner("auto", slots=1).memory_plan()
    fixed = one["peak"] - one["kv_cache"] - one["decode_state"]
    budget = fixed + 4 * (one["kv_cache"] + one["decode_state"]) + 1000      # 4 float32 slots
    got = {}
    for kv, dtype in (("auto", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8", "float8_e4m3fn")):
        run = runner(kv, budget, slots=64)
        plan = run.memory_plan()
        per_token = bytes_per_token(cfg.num_kv_heads, cfg.head_dim, dtype) * cfg.num_layers
        assert plan["kv_cache"] == plan["slots"] * max_len * per_token == sum(x.nbytes for x in jax.tree.leaves(run.cache))
        assert plan["kv_cache_dtype"] == ("fp8" if kv == "fp8" else dtype) and plan["peak"] <= budget
        got[kv] = plan["slots"]
    hd = cfg.head_dim
    assert got["auto"] == 4 and got["int8"] == got["fp8"]
    assert 7 <= got["bfloat16"] <= 8, got                          # the decode state takes a little
    assert int(got["bfloat16"] * 2 * hd / (hd + 2) * 0.95) <= got["int8"] <= 2 * got["bfloat16"], got
    print(f"\nslots under one budget by KV cache dtype (head_dim {hd}): {got}")
