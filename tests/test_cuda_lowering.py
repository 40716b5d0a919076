"""Every compiled step of every family lowers for CUDA (DESIGN.md: users run on GPUs, CI has none).

For each family's tiny checkpoints (LLaVA GQA and MHA, Qwen2-VL, Qwen2.5-VL, Gemma 3 with and
without tied embeddings / softcapping config, Gemma 4 dense and MoE) and the shipped
mmjax-shapes model, in float32 and bfloat16, a runner built for platform "cuda" lists every
compiled shape it can produce (`ModelRunner.step_signatures`: every encode bucket of the family's
plan, every prefill chunk bucket, every decode row bucket) and each one is exported with
`jax.export(..., platforms=("cuda",))` while tracing for CUDA (so impl="auto" attention picks the
GPU kernels). Nothing runs; a step that uses an op or a kernel shape the CUDA lowering rejects
fails here, on CPU.
"""
import jax
import pytest

from mmjax.api import load_model
from mmjax.backend import compiling_for
from mmjax.serving.runner import ModelRunner


@pytest.fixture(scope="module")
def checkpoints(llava_dirs, qwen_dirs, gemma3_dirs, gemma4_dirs):
    return {"llava-gqa": llava_dirs["gqa"], "llava-mha": llava_dirs["mha"], "mmjax-shapes": None, **qwen_dirs,
            "gemma3-window": gemma3_dirs["window"], "gemma3-softcap": gemma3_dirs["softcap"],
            "gemma4-dense": gemma4_dirs["dense"], "gemma4-moe": gemma4_dirs["moe"]}


def _export_all(path, dtype: str) -> dict[str, jax.export.Exported]:
    model = load_model(path, dtype)
    if hasattr(model.family, "limits"):   # keep the Qwen patch ladder short: every rung is the same graph
        model.family.configure(max_encode_patches=1024, image_max_tokens=256)
    runner = ModelRunner(model.family, model.params, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                         max_encode_batch=2, dtype=model.dtype, platform="cuda")
    out = {}
    with compiling_for("cuda"):
        for name, fn, args, kw in runner.step_signatures():
            out[name] = jax.export.export(fn, platforms=("cuda",))(*args, **kw)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llava-gqa", "llava-mha", "mmjax-shapes", "qwen2_vl", "qwen2_5_vl",
                                  "gemma3-window", "gemma3-softcap", "gemma4-dense", "gemma4-moe"])
def test_every_step_lowers_for_cuda(checkpoints, name, dtype):
    exported = _export_all(checkpoints[name], dtype)
    kinds = {k.split("[")[0].split("(")[0] for k in exported}
    fastv = set() if name.startswith("gemma") else {"prefill_pruned"}  # one FastV prefill (Llama-style only)
    assert kinds == {"encode", "prefill", "decode", "copy_slot"} | fastv   # copy_slot: n > 1 siblings
    assert sum(k.startswith("decode") for k in exported) == 3          # rows 1, 2, 4
    assert sum(k.startswith("prefill[") for k in exported) == 3        # chunks 16, 32, 64
    for step, exp in exported.items():
        assert exp.platforms == ("cuda",), step
        if step == "copy_slot":                                          # a cache-row copy: no matmul
            continue
        dots = [ln for ln in exp.mlir_module().splitlines() if "stablehlo.dot_general" in ln]
        assert dots, step
        # the weights' dtype reaches the matmuls: bf16 operands in a bf16 model, none in f32
        assert any("bf16>" in ln for ln in dots) == (dtype == "bfloat16"), step
