"""Every compiled step of every family lowers for CUDA (DESIGN.md: users run on GPUs, CI has none).

For each family's tiny checkpoints (LLaVA GQA and MHA, Qwen2-VL, Qwen2.5-VL, Gemma 3 with and
without tied embeddings / softcapping config, Gemma 4 dense and MoE, Idefics3, SmolVLM, Qwen3-VL dense
and MoE, Mistral 3 with spatial merge 2 and 1, Llama 3.2 Vision with 4 and 2 tiles, LLaVA-NeXT,
LLaVA-OneVision, InternVL with Qwen2 and Qwen3 text, Llama 4 with and without QK-norm,
GLM-4.xV dense and MoE, Qwen3.5 dense and MoE, MiniCPM-V 4.7) and the shipped
mmjax-shapes model, in bfloat16 (and float32 for one checkpoint per family), a runner built for platform "cuda" lists every
compiled shape it can produce (`ModelRunner.step_signatures`: every encode bucket of the family's
plan, every prefill chunk bucket (the packed prefill: up to 4 sequences per call),
every decode row bucket, the cache-row copy, and the hybrid decoders' state-snapshot copies) and
each one is exported with
`jax.export(..., platforms=("cuda",))` while tracing for CUDA (so impl="auto" attention picks the
GPU kernels, decode attention the ragged Pallas kernel, a paged cache's attention the paged
Pallas kernel, and Pallas kernels take the Triton lowering, not the interpreter). Nothing runs; a step that uses an op or a kernel shape the CUDA lowering rejects
fails here, on CPU.
"""
import jax
import pytest

from hlo_dots import bf16_dot_violations, dots, elem
from mmjax.api import load_model
from mmjax.backend import compiling_for
from mmjax.serving.runner import ModelRunner

# Pallas kernels (the ViT's flash attention, the ragged decode attention) lower to this call
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@pytest.fixture(scope="module")
def checkpoints(llava_dirs, qwen_dirs, gemma3_dirs, gemma4_dirs, idefics3_dirs, qwen3_dirs, mistral3_dirs, mllama_dirs,
                llava_next_dirs, internvl_dirs, llama4_dirs, glm4v_dirs, qwen35_dirs, minicpmv_dirs):
    return {"llava-gqa": llava_dirs["gqa"], "llava-mha": llava_dirs["mha"], "mmjax-shapes": None, **qwen_dirs,
            "gemma3-window": gemma3_dirs["window"], "gemma3-softcap": gemma3_dirs["softcap"],
            "gemma4-dense": gemma4_dirs["dense"], "gemma4-moe": gemma4_dirs["moe"], **idefics3_dirs,
            "qwen3-dense": qwen3_dirs["dense"], "qwen3-moe": qwen3_dirs["moe"],
            "mistral3-merge2": mistral3_dirs["merge2"], "mistral3-merge1": mistral3_dirs["merge1"],
            "mllama-tiles4": mllama_dirs["tiles4"], "mllama-tiles2": mllama_dirs["tiles2"],
            "llava-next": llava_next_dirs["next"], "llava-onevision": llava_next_dirs["onevision"],
            "internvl-qwen2": internvl_dirs["qwen2"], "internvl-qwen3": internvl_dirs["qwen3"],
            "llama4-qk": llama4_dirs["qk"], "llama4-plain": llama4_dirs["plain"],
            "glm4v-dense": glm4v_dirs["dense"], "glm4v-moe": glm4v_dirs["moe"],
            "qwen35-dense": qwen35_dirs["dense"], "qwen35-moe": qwen35_dirs["moe"],
            "minicpmv": minicpmv_dirs["4.7"]}     # 4.6's steps are the same graphs (positions are host-side)


def _export_all(path, dtype: str, kv_cache_dtype: str = "auto", runner_out: list | None = None,
                skip: tuple[str, ...] = (), quantize: str | None = None) -> dict[str, jax.export.Exported]:
    model = load_model(path, dtype, quantize=quantize)
    if hasattr(model.family, "limits"):   # keep the Qwen / Pixtral patch ladder short: every rung is the same graph
        model.family.configure(max_encode_patches=1024, image_max_tokens=256)
    runner = ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                         max_encode_batch=2, dtype=model.dtype, platform="cuda", kv_cache_dtype=kv_cache_dtype)
    if runner_out is not None:
        runner_out.append(runner)
    out = {}
    with compiling_for("cuda"):
        for name, fn, args, kw in runner.step_signatures():
            if name.startswith(skip):
                continue
            out[name] = jax.export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(*args, **kw)
    return out


CHECKPOINTS = ["llava-gqa", "llava-mha", "mmjax-shapes", "qwen2_vl", "qwen2_5_vl", "gemma3-window", "gemma3-softcap",
               "gemma4-dense", "gemma4-moe", "idefics3", "smolvlm", "qwen3-dense", "qwen3-moe",
               "mistral3-merge2", "mistral3-merge1", "mllama-tiles4", "mllama-tiles2", "llava-next", "llava-onevision",
               "internvl-qwen2", "internvl-qwen3", "llama4-qk", "llama4-plain", "glm4v-dense", "glm4v-moe",
               "qwen35-dense", "qwen35-moe", "minicpmv"]
# bfloat16 (what GPUs serve) for every checkpoint; float32 for one checkpoint of each family (CI time)
FLOAT32 = ["llava-gqa", "qwen2_5_vl", "gemma3-window", "gemma4-dense", "idefics3", "qwen3-dense", "mistral3-merge2",
           "mllama-tiles4", "llava-next", "internvl-qwen2", "llama4-qk", "glm4v-dense", "qwen35-dense", "minicpmv"]


@pytest.mark.parametrize("name,dtype", [(n, "bfloat16") for n in CHECKPOINTS] + [(n, "float32") for n in FLOAT32])
def test_every_step_lowers_for_cuda(checkpoints, name, dtype):
    # prompt_logprobs' prefill (the prefill + the LM head over every row): once per family, in bf16
    scores = dtype == "bfloat16" and name in FLOAT32
    runners = []
    exported = _export_all(checkpoints[name], dtype, runner_out=runners, skip=() if scores else ("prefill_scores",))
    layers = runners[0].text_model.num_layers
    kinds = {k.split("[")[0].split("(")[0] for k in exported}
    # one FastV prefill (every decoder but DeepStack's per-layer image features and cross-attention)
    fastv = set() if name.startswith(("qwen3", "mllama", "minicpmv")) else {"prefill_pruned"}
    cross = {"fill_cross"} if name.startswith("mllama") else set()      # the per-slot cross-attention K/V
    # hybrid recurrent decoders: their states to / from the snapshot pool (serving/state_snapshots.py)
    states = {"copy_state"} if name.startswith(("qwen35", "minicpmv")) else set()
    # copy_slot: n > 1 siblings copy the prompt's cache row; prefill_scores: prompt_logprobs
    want = {"encode", "prefill", "decode", "copy_slot"} | fastv | cross | states
    assert kinds == (want | {"prefill_scores"} if scores else want)
    assert sum(k.startswith("decode") for k in exported) == 3          # rows 1, 2, 4
    # chunks 16, 32, 64 (packed: 4 sequences per call, the slot count; every family, Mllama included)
    assert sum(k.startswith("prefill[") for k in exported) == 3
    assert all(k.endswith(",4]") for k in exported if k.startswith("prefill["))
    for step, exp in exported.items():
        assert exp.platforms == ("cuda",), step
        if step.startswith(("copy_slot", "copy_state")):                 # a cache-row copy: no matmul
            continue
        if step.startswith("decode"):   # decode attention: the ragged Pallas kernel on GPUs, except
            # for head_dim 12 (llava-mha), no Triton tile: the XLA segments there
            # one kernel per self-attention layer whatever the cache's segment count (an H200 step
            # with a kernel per segment and layer ran at 8% of its roofline)
            calls = exp.mlir_module().count("__gpu$xla.gpu.triton")
            assert (calls > 0) == (name != "llava-mha"), step
            assert calls <= layers, (step, calls, layers)
        dots = [ln for ln in exp.mlir_module().splitlines() if "stablehlo.dot_general" in ln]
        assert dots, step
        # the weights' dtype reaches the matmuls: bf16 operands in a bf16 model, none in f32
        assert any("bf16>" in ln for ln in dots) == (dtype == "bfloat16"), step
        # ... as bf16 x bf16 dots with f32 results (issue 25: tensor cores / AMX accumulate in f32)
        assert bf16_dot_violations(exp.mlir_module()) == [], step


# int8 / fp8 KV caches (models/text/kv_quant), bf16 models: Gemma 3 (sliding rings + segmented full
# layers) in int8, Llama 3.2 Vision (segmented self-attention + the per-slot cross-attention
# cache) in fp8; both decode through the ragged Pallas kernel with the scales applied inside it
@pytest.mark.parametrize("name,kv", [("gemma3-window", "int8"), ("mllama-tiles4", "fp8")])
def test_quantized_kv_cache_steps_lower_for_cuda(checkpoints, name, kv):
    import numpy as np
    runners = []
    # the encode steps never see the cache (and lower above)
    exported = _export_all(checkpoints[name], "bfloat16", kv, runners, skip=("encode", "prefill_scores"))
    cache = runners[0].cache
    stored = {np.dtype(x.dtype).name for x in jax.tree.leaves(cache) if x.ndim >= 3}
    assert stored == {"int8" if kv == "int8" else "float8_e4m3fn", "bfloat16"}      # data + bf16 scales
    elem = "i8" if kv == "int8" else "f8E4M3FN"
    # (that no step multiplies a dequantized copy of the cache is checked on the jaxpr, where the
    # shapes can be told apart: test_kv_cache's quantized ragged decode cases)
    assert {k.split("[")[0].split("(")[0] for k in exported} >= {"prefill", "decode", "copy_slot"}
    for step, exp in exported.items():
        mlir = exp.mlir_module()
        assert f"x{elem}>" in mlir, step                                     # the cache enters quantized
        if step.startswith("decode"):
            assert "__gpu$xla.gpu.triton" in mlir, step


# int8 is the same graph on every backend (mmjax.quant; its CPU compile is checked in
# tests/test_precision.py): CUDA exports it too, as s8 x s8 -> s32 dots (cuBLAS's int8 gemm)
@pytest.mark.parametrize("quantize,elem_t,acc_t", [("fp8", "f8E4M3FN", "f32"), ("int8", "i8", "i32")])
def test_quantized_steps_lower_for_cuda(checkpoints, quantize, elem_t, acc_t):
    """fp8 / int8 weights (mmjax.quant) in a bf16 LLaVA: every encode / prefill / decode step
    lowers for CUDA with its linear layers as e4m3 x e4m3 -> f32 dots (per-token quantized
    activations; the form XLA:GPU rewrites to an FP8 cuBLASLt gemm on Hopper), or s8 x s8 -> s32."""
    exported = _export_all(checkpoints["llava-gqa"], "bfloat16", quantize=quantize, skip=("prefill_scores",))
    for step, exp in exported.items():
        if step == "copy_slot":
            continue
        ds = dots(exp.mlir_module())
        q = [d for d in ds if elem(d[1]) == elem_t]
        # encode: ViT q/k/v/o/fc1/fc2 x 2 layers + projector fc1/fc2 (patch embedding stays float);
        # prefill/decode: qkv/o/gate_up/down x 2 layers + the LM head
        assert len(q) == (14 if step.startswith("encode") else 9), (step, len(q))
        assert all(elem(d[0]) == elem_t and elem(d[2]) == acc_t for d in q), step
        assert bf16_dot_violations(exp.mlir_module()) == [], step


@pytest.mark.parametrize("name", ["llava-gqa", "gemma3-window", "gemma4-dense"])
def test_gpu_runner_ladders(checkpoints, name):
    """A GPU runner's prefill chunks are powers of two (each rung is a compile, 20-40 s a step on an
    H200) and its KV cache has 512-position segments (fewer cache leaves, scatters and conds);
    the CPU keeps eight chunk rungs per octave and 256-position segments (it pays for padding
    and for the cache in use in those steps). Whichever platform the caller's thread is on."""
    model = load_model(checkpoints[name], "bfloat16")
    runners = {p: ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=2048, prefill_chunk=1024,
                              max_encode_batch=1, dtype=model.dtype, platform=p, page_size=0)    # slot rows
               for p in ("cpu", "cuda")}
    ladders = {p: r.buckets.prefill for p, r in runners.items()}
    assert ladders["cuda"] == (16, 32, 64, 128, 256, 512, 1024)
    assert len(ladders["cpu"]) == 24 and set(ladders["cuda"]) < set(ladders["cpu"])
    # full-attention layers' V segments (a sliding layer's ring is one segment on both)
    cuts = {p: {tuple(v.shape[2] for v in layer["v"]) for layer in r.cache if len(layer["v"]) > 1}
            for p, r in runners.items()}
    assert cuts == {"cpu": {(256,) * 4 + (1024,)}, "cuda": {(512, 512, 1024)}}
    # the multi-segment GPU decode step lowers, one ragged kernel per self-attention layer
    # (the exports above use 256 positions: one GPU segment)
    name_, fn, args, kw = next(x for x in runners["cuda"].step_signatures() if x[0].startswith("decode"))
    with compiling_for("cuda"):
        mlir = jax.export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(*args, **kw).mlir_module()
    # at most one call per attention layer (per segment would be 3x the segmented caches), at least
    # one per segmented cache (Gemma 3's ring layers take XLA; Gemma 4's later layers share caches)
    segmented = sum(len(layer["v"]) > 1 for layer in runners["cuda"].cache)
    calls = mlir.count("__gpu$xla.gpu.triton")
    assert 0 < segmented <= calls <= runners["cuda"].text_model.num_layers, (name_, segmented, calls)
    with compiling_for("cuda"):     # the thread's platform does not leak into a CPU runner's cache
        again = ModelRunner(model.family, model.module, max_num_seqs=2, max_model_len=2048, prefill_chunk=64,
                            max_encode_batch=1, dtype=model.dtype, platform="cpu", page_size=0)
    assert {len(layer["v"]) for layer in again.cache} >= {5}


@pytest.mark.parametrize("name", ["llava-gqa", "qwen2_5_vl"])
def test_multi_step_decode_lowers_for_cuda(checkpoints, name):
    """A runner with decode_steps=4 (the engine's multi-step decode, meant for GPUs) adds a
    four-step decode shape per row bucket: it exports for CUDA as one loop over the one-step
    body (one ragged attention kernel per layer in it, not four), outputs stacked per step."""
    model = load_model(checkpoints[name], "bfloat16")
    runner = ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                         max_encode_batch=1, dtype=model.dtype, platform="cuda", decode_steps=4)
    sigs = {n: (fn, args, kw) for n, fn, args, kw in runner.step_signatures() if n.startswith("decode")}
    assert sorted(sigs) == ["decode[1]", "decode[1]x4", "decode[2]", "decode[2]x4", "decode[4]", "decode[4]x4"]
    fn, args, kw = sigs["decode[4]x4"]
    with compiling_for("cuda"):
        exp = jax.export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(*args, **kw)
    mlir = exp.mlir_module()
    layers = runner.text_model.num_layers
    assert "stablehlo.while" in mlir and mlir.count("__gpu$xla.gpu.triton") == layers
    tokens = exp.out_avals[-4]
    assert tokens.shape == (4, 4), tokens


@pytest.mark.parametrize("name,kv", [("llava-gqa", "auto"), ("qwen2_5_vl", "auto"), ("llava-gqa", "int8")])
def test_paged_steps_lower_for_cuda(checkpoints, name, kv):
    """A paged KV cache (serving/pages.py) in a bf16 model: every step of a paged runner lowers
    for CUDA, the cache a pool of pages, the page table in the decode state, and attention
    through the paged Pallas kernel (mmjax.attention.paged) in decode (one call per layer) and
    in the packed prefill (per layer: the one-sequence row and the query-block groups), over
    an int8 pool too (its scales applied inside the kernel)."""
    model = load_model(checkpoints[name], "bfloat16")
    runner = ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                         max_encode_batch=1, dtype=model.dtype, platform="cuda", page_size=16, kv_cache_dtype=kv)
    layers = runner.text_model.num_layers
    assert runner.paged and runner.state.pages.shape == (4, 16)
    assert {layer["v"][0].shape[:1] + layer["v"][0].shape[2:3] for layer in runner.cache} == {(runner.num_pages, 16)}
    kinds = set()
    with compiling_for("cuda"):
        for step, fn, args, kw in runner.step_signatures():
            if step.startswith(("encode", "prefill_scores")):
                continue
            mlir = jax.export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(*args, **kw).mlir_module()
            kind = step.split("[")[0].split("(")[0]
            kinds.add(kind)
            calls = mlir.count("__gpu$xla.gpu.triton")
            if kind == "decode":
                assert calls == layers, (step, calls)
            elif kind == "prefill":
                assert calls == 2 * layers, (step, calls)
            if kv == "int8" and kind != "copy_slot":
                assert "xi8>" in mlir, step                                 # the pool enters quantized
    assert kinds >= {"prefill", "decode", "copy_slot"}
