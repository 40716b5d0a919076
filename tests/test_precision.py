"""Weight precision (issue 25): bf16 as bf16 x bf16 -> f32 dots, int8 / fp8 weights (mmjax.quant).

* a bf16 model's compiled CPU steps (Qwen3-VL-MoE: ViT, DeepStack, MoE skip loop, every step
  kind) lower with every bf16 dot as bf16 x bf16 -> f32 (tests/test_cuda_lowering.py checks the
  same on every checkpoint's CUDA export);
* int8 and bf16 weights: the optimized CPU HLO of the encode / decode steps reads them narrow
  (s8 x s8 -> s32 and bf16 x bf16 -> f32 dots) with no f32 / s32 array of any weight's shape
  (no converted copy per step), at one decode row and at several; a bf16 KV cache is written
  without a float copy; the weight-only form fails the same check (the checker can fail);
* quality on the tiny LLaVA (the bench architecture): greedy-token agreement with float32 and
  mean |logprob diff| of the chosen tokens for bf16, int8 (per channel and grouped) and fp8;
* `mmjax convert --quantize int8` writes an orbax copy that reloads quantized, same tokens;
* an fp8 "compressed-tensors" checkpoint (float8_e4m3fn weights + per-channel weight_scale,
  written here with torch) loads and matches the same weights dequantized in float32.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from unittest.mock import patch

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmjax
from conftest import noise_image, rel_err
from hlo_dots import bf16_dot_violations, dots, elem
from mmjax.api import load_model
from mmjax.kernels import cpu_gemv
from mmjax.packed_weights import PackedWeight, unpacked
from mmjax import quant
from mmjax.quant import QArray, quantize_weight
from mmjax.serving.runner import DecodeState, ModelRunner

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


def _runner(model, **kw) -> ModelRunner:
    return ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                       max_encode_batch=2, dtype=model.dtype, **kw)


def test_bf16_cpu_steps_are_bf16_f32_dots(qwen3_dirs):
    model = load_model(qwen3_dirs["moe"], "bfloat16")
    model.family.configure(max_encode_patches=512, image_max_tokens=128)
    n, kinds = 0, set()
    for step, fn, args, kw in _runner(model).step_signatures():
        kind = step.split("[")[0].split("(")[0]
        if kind in kinds or kind == "copy_slot":    # one shape per step kind: the graphs are the same
            continue
        kinds.add(kind)
        text = fn.lower(*args, **kw).as_text()           # lowered only: nothing compiles
        ds = dots(text)
        n += sum(elem(d[0]) == "bf16" for d in ds)
        assert bf16_dot_violations(text) == [], step
    assert kinds == {"encode", "prefill", "prefill_scores", "decode"} and n > 40   # linear layers, attention, experts


def _wide_copies(hlo: str, shapes: set[tuple[int, ...]], wide=("f32", "f16", "s32", "bf16")) -> list[str]:
    """Materialized instructions of the optimized HLO (outside fusion bodies, whose values stay
    in registers) that produce an array of a `wide` dtype with a weight's (or cache segment's)
    shape: a converted copy made every step. Parameters and get-tuple-element (a conditional
    branch's view of its operands, the LM head's panels behind the mixed step's cond) are views,
    not copies."""
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.-]+)", hlo))
    out, inside = [], False
    for ln in hlo.splitlines():
        head = re.match(r"(ENTRY )?(%[\w.-]+) ", ln)
        if head and ln.rstrip().endswith("{"):
            inside = head.group(2) in fused
            continue
        m = re.search(rf"=\s*({'|'.join(wide)})\[([\d,]+)\]", ln)
        view = "parameter(" in ln or "get-tuple-element(" in ln
        if not inside and m and not view and tuple(int(v) for v in m.group(2).split(",")) in shapes:
            out.append(ln.strip()[:160])
    return out


def _compiled(runner: ModelRunner, *names: str) -> dict[str, str]:
    """Optimized HLO text of the named steps, compiled with the runner's own compiler options."""
    sigs = {name: (fn, args, kw) for name, fn, args, kw in runner.step_signatures()}
    return {n: sigs[n][0].lower(*sigs[n][1], **sigs[n][2]).compile().as_text() for n in names}


def _rows_operands(hlo: str, target: str) -> list[bool]:
    """For each packed-kernel call (`target`) in optimized HLO text: is its last operand, `rows`,
    computed (True) rather than a constant (False)? (f32: s32[2], the rows and the rows for the
    AMX path, `cpu_gemv.matmul_packed`.)"""
    consts = set(re.findall(r"%([\w.\-]+) = s32\[(?:2\]\{0\}|\]) constant\(", hlo))
    # (rows == amx rows, both constant: a broadcast of one scalar constant, left unfolded)
    consts |= set(re.findall(r"%([\w.\-]+) = s32\[2\]\{0\} fusion\(%constant[\w.\-]*\), kind=kLoop", hlo))
    return [op not in consts for op in _last_operands(hlo, target)]


def _last_operands(hlo: str, target: str) -> list[str]:
    return [re.search(r"custom-call\(([^)]*)\)", ln).group(1).split(", ")[-1].lstrip("%")
            for ln in hlo.splitlines() if f'custom_call_target="{target}"' in ln]


def _amx_rows_constants(hlo: str, target: str) -> list[int | None]:
    """For each packed f32 / bf16 call: its constant AMX row count (the operand's second value),
    None where the operand is computed."""
    consts = {m.group(1): int(m.group(3)) for m in
              re.finditer(r"%([\w.\-]+) = s32\[2\]\{0\} constant\(\{(\d+), (\d+)\}\)", hlo)}
    return [consts.get(op) for op in _last_operands(hlo, target)]


def test_narrow_weights_stay_narrow_in_cpu_steps(llava_dirs, qwen3_dirs):
    """int8 and bf16 weights are read as they are stored by the compiled CPU steps: s8 x s8 ->
    s32 / bf16 x bf16 -> f32 dots, and no f32 / s32 array of any weight's shape (XLA:CPU converts
    a whole weight per step for a dot it keeps for itself: a one-row decode dot, or any dot with
    library dots off), at one decode row and at several; f32 and bf16 weights packed at load are
    read by the packed kernel in every step, never unpacked there; a bf16 KV cache is written
    without a float copy of its segments. The checker fails on a weight-only dequantization."""
    model = load_model(llava_dirs["gqa"], "float32", quantize="int8")
    qs = [x for x in jax.tree.leaves(nnx.state(model.module), is_leaf=lambda x: isinstance(x, QArray))
          if isinstance(x, QArray)]
    assert len(qs) == 2 * 6 + 2 + 2 * 4 + 1          # ViT q/k/v/o/fc1/fc2, projector, LM qkv/o/gate_up/down, head
    # loaded on a CPU host, int8 weights are packed for mmjax's kernel (mmjax.quant.pack):
    # uint8 [ceil(out / 64), in / 4, 64, 4] panels, the same bytes (+ 128) in another order
    assert all(q.packed and q.q.ndim == 4 and q.q.shape[2:] == (64, 4) and q.scale.dtype == jnp.float32 for q in qs)
    shapes = {q.shape for q in qs} | {q.shape[::-1] for q in qs}
    for name, hlo in _compiled(_runner(model), "encode(1, 32, 32, 3)", "decode[1]", "decode[2]").items():
        s8 = [ln for ln in hlo.splitlines() if re.search(r"= s32\[[\d,]+\]\{[\d,]*\} dot\(", ln)]
        # every int8 matmul, at any number of rows, is mmjax's CPU kernel over the packed weight
        # (mmjax.kernels.cpu_gemv.qmatmul_s8p): f32 activations, u8 panels, f32 scales and result
        kernel = [ln for ln in hlo.splitlines() if 'custom_call_target="mmjax_qmatmul_s8p"' in ln]
        assert all(re.search(r"= f32\[[\d,]+\]\{[\d,]*\} custom-call\(", ln) and
                   re.search(r"operand_layout_constraints=\{f32\[[\d,]+\]\{[\d,]*\}, u8\[[\d,]+\]\{[\d,]*\}, f32\[", ln)
                   for ln in kernel), name
        assert s8 == [] and len(kernel) >= (14 if name.startswith("encode") else 9), (name, len(s8), len(kernel))
        # nor an unpacked copy of a weight (int8 [in, out]) or a converted one
        assert _wide_copies(hlo, shapes, ("f32", "f16", "s32", "bf16", "s8")) == [], name
    # int8 weights the packing does not take (mmjax.quant.packable: groups of whole row quads)
    # stay [in, out]: few rows take the row-major kernel (mmjax_gemv_s8) on the AVX-512 path, more
    # rows (and an AVX2 CPU: the row-major kernels have no AVX2 path) XLA's s8 dot
    with patch.object(quant, "packable", lambda w: False):
        flat_module = nnx.clone(model.module)
        nnx.update(flat_module, unpacked(nnx.state(flat_module)))
        flat = _runner(dataclasses.replace(model, module=flat_module))
        compiled = _compiled(flat, "encode(1, 32, 32, 3)", "decode[1]", "decode[2]")
    assert not any(q.packed for q in jax.tree.leaves(flat.weights.states, is_leaf=lambda x: isinstance(x, QArray))
                   if isinstance(q, QArray))
    for name, hlo in compiled.items():
        s8 = [ln for ln in hlo.splitlines() if re.search(r"= s32\[[\d,]+\]\{[\d,]*\} dot\(", ln)]
        kernel = [ln for ln in hlo.splitlines() if 'custom_call_target="mmjax_gemv_s8"' in ln]
        assert len(s8) + len(kernel) >= (14 if name.startswith("encode") else 9), (name, len(s8), len(kernel))
        assert name.startswith("encode") or len(kernel) >= (9 if cpu_gemv.isa() == "avx512" else 0), (name, len(kernel))
        assert _wide_copies(hlo, shapes) == [], name
    # bf16 weights: packed at load on a CPU host (mmjax.packed_weights), every linear layer of
    # every step (decode at one and several rows, prefill, encode) one mmjax_matmul_bf16p call
    # over the panels, and no copy of a weight in any layout (an in-graph unpack would be a bf16
    # [in, out] copy); the CPU's "auto" KV cache of a bf16 model is float32 (no bf16 scatter
    # there), an explicit bf16 cache is written as 16-bit integers
    packed = lambda tree: [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PackedWeight))  # noqa: E731
                           if isinstance(x, PackedWeight)]
    # (f32 weights the same way: mmjax_matmul_f32p over f32 panels)
    for dtype, target in (("float32", "mmjax_matmul_f32p"), ("bfloat16", "mmjax_matmul_bf16p")):
        model = load_model(llava_dirs["gqa"], dtype)
        lm = model.module.language_model
        ws = packed(nnx.state(lm))
        assert len(ws) >= 2 * 4 + 1 and packed(nnx.state(model.module.vision_tower))
        assert lm.embed_tokens.embedding.get_value().dtype == jnp.dtype(dtype)   # gathered, not a matmul weight: as stored
        shapes = {w.shape for w in ws} | {w.data.shape for w in ws}
        runner = _runner(model)
        steps = [n for n, *_ in runner.step_signatures()]
        names = ["decode[1]", "decode[2]", next(n for n in steps if n.startswith("prefill")),
                 next(n for n in steps if n.startswith("encode"))]
        for name, hlo in _compiled(runner, *names).items():
            assert hlo.count(f'custom_call_target="{target}"') >= (9 if name != names[-1] else 4), (dtype, name)
            assert name == names[-1] or "mmjax_gemv" not in hlo, (dtype, name)   # (encode: the patch embedding)
            assert _wide_copies(hlo, shapes) == [], (dtype, name)
            # the prefill's decoder matmuls (qkv, o, gate_up, down of each layer) are told how
            # many of the row's leading tokens are real (the rest, the bucket's padding, skipped):
            # their `rows` operand is computed from the segments; the LM head's rows (gathered
            # last tokens) are all real: a constant
            computed = _rows_operands(hlo, target)
            if name.startswith("prefill"):
                assert computed.count(True) == 4 * lm.num_layers, (dtype, computed)
                assert False in computed, (dtype, computed)
            else:
                assert True not in computed, (dtype, name)
            if name.startswith("decode"):
                # the decode step gives the AMX path no row (its rows' bits are the FMA kernel's
                # wherever they run: riders in a prefill take it too)
                assert set(_amx_rows_constants(hlo, target)) == {0}, (name, _amx_rows_constants(hlo, target))
    bf16 = model
    assert runner.kv_cache_dtype == np.dtype(np.float32)
    runner = _runner(bf16, kv_cache_dtype="bfloat16")
    segs = {x.shape for x in jax.tree.leaves(runner.cache) if x.dtype == jnp.bfloat16}
    assert segs and _wide_copies(_compiled(runner, "decode[2]")["decode[2]"], segs, ("f32", "f16")) == []
    # MoE experts (Qwen3-VL-MoE, int8 expert stacks): the CPU decode step reads them as int8 too
    moe = load_model(qwen3_dirs["moe"], "float32", quantize="int8")
    stacks = [x for x in jax.tree.leaves(nnx.state(moe.module), is_leaf=lambda x: isinstance(x, QArray))
              if isinstance(x, QArray) and x.ndim == 3]
    assert len(stacks) == 4                           # gate_up and down of the 2 MoE layers
    hlo = _compiled(_runner(moe), "decode[1]")["decode[1]"]
    assert _wide_copies(hlo, {x.shape[1:] for x in stacks} | {x.shape for x in stacks}) == []
    # the checker catches a weight-only dequantization (XLA:CPU materializes the f32 weight)
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    q = quantize_weight(w, "int8")
    hlo = jax.jit(lambda x, q, s: x @ (q.astype(jnp.float32) * s)).lower(
        jnp.ones((1, 64)), q.q, q.scale).compile().as_text()
    assert _wide_copies(hlo, {(64, 128)})


TEXT = ("USER: <image>\nWhat is in the picture? Describe the colors, the shapes and where they are, "
        "then count them and tell a short story about the picture. ASSISTANT: It shows")


def _teacher_forced(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Logits [tokens, vocab] of the same prompt -> (fraction of positions whose greedy next
    token matches float32's, mean |logprob diff| of float32's greedy tokens)."""
    lr, lg = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
    chosen = np.argmax(ref, -1)
    agree = float(np.mean(chosen == np.argmax(got, -1)))
    rows = np.arange(len(chosen))
    return agree, float(np.mean(np.abs(np.asarray(lr)[rows, chosen] - np.asarray(lg)[rows, chosen])))


def test_qmatmul_error_bounds():
    """int8 (per channel, grouped) and fp8 dots against the float64 product, on weights with a
    few outlier input rows (what groups are for) and activations with an outlier token."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 96)).astype(np.float32)
    w[:8] *= 20.0
    x = rng.standard_normal((2, 5, 128)).astype(np.float32)
    x[0, 0] *= 50.0
    want = x.astype(np.float64) @ w.astype(np.float64)
    from mmjax.quant import qmatmul
    err = {k: rel_err(np.asarray(jax.jit(qmatmul)(jnp.asarray(x), quantize_weight(w, kind, gs))), want)
           for k, kind, gs in (("int8", "int8", None), ("int8-g32", "int8", 32), ("fp8", "fp8", None))}
    # int8: 7 bits of weight and of activation, errors partly cancel over 128 terms; e4m3: 3 bits
    assert err["int8"] < 3e-2 and err["int8-g32"] < err["int8"] and err["fp8"] < 8e-2, err
    assert err["int8"] > 1e-4                     # really quantized
    y = jax.jit(qmatmul)(jnp.asarray(x, jnp.bfloat16), quantize_weight(w, "int8"))
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 5, 96)
    # MoE expert stacks [E, in, out]: the grouped (ragged) dot and one expert (the CPU skip loop)
    from mmjax.quant import qragged_dot
    we = rng.standard_normal((4, 32, 48)).astype(np.float32)
    xe = rng.standard_normal((10, 32)).astype(np.float32)
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)
    qe = quantize_weight(we, "int8")
    assert qe.q.shape == (4, 32, 48) and qe.scale.shape == (4, 1, 48)
    want = jax.lax.ragged_dot(jnp.asarray(xe), jnp.asarray(we), sizes)
    assert 1e-4 < rel_err(jax.jit(qragged_dot)(jnp.asarray(xe), qe, sizes), want) < 3e-2
    assert rel_err(qmatmul(jnp.asarray(xe), qe[2]), xe @ we[2]) < 3e-2


def test_quality_vs_float32_and_int8_convert_roundtrip(llava_dirs, tmp_path):
    """Teacher-forced over one 40-token prompt with an image (one forward per precision)."""
    path = llava_dirs["gqa"]
    img = noise_image(40, 61, 47)
    kw = dict(max_num_seqs=1, max_model_len=128)
    ref = np.asarray(mmjax.load(path, **kw).logits(TEXT, [img]))
    figures, int8_logits = {}, None
    for label, dtype, quant in (("bf16", "bfloat16", None), ("int8", "float32", "int8")):
        got = np.asarray(mmjax.load(path, dtype, quantize=quant, **kw).logits(TEXT, [img]), np.float32)
        figures[label] = _teacher_forced(ref, got)
        int8_logits = got if label == "int8" else int8_logits
    print(f"\nprecision vs float32 (tiny LLaVA, {len(ref)} positions, teacher forced): "
          + "  ".join(f"{k}: agree {a:.3f} |dlogp| {d:.2e}" for k, (a, d) in figures.items()))
    # a random tiny model's logits are nearly flat (top-2 gaps ~1e-3): agreement is the weak
    # figure here (mmjax-shapes, trained, has the real one: test_demo_model.py); |dlogp| the strong
    assert figures["bf16"][0] >= 0.9 and figures["bf16"][1] < 5e-3, figures
    assert figures["int8"][0] >= 0.9 and figures["int8"][1] < 1e-2, figures

    from mmjax.cli import main
    out_dir = tmp_path / "int8"
    assert main(["convert", "--model", str(path), "--out", str(out_dir), "--quantize", "int8"]) == 0
    back = mmjax.load(path, params_dir=out_dir, **kw)
    head = back.model.language_model.lm_head.kernel.get_value()
    assert isinstance(head, QArray) and head.kind == "int8"
    np.testing.assert_array_equal(np.asarray(back.logits(TEXT, [img])), int8_logits)


# block-scaled fp8 test checkpoints: 24 x 24 blocks, partial at the edges of 64 / 128 (real ones: 128 x 128)
BLOCK = 24


def _fp8_checkpoint(src, dst, method: str):
    """src's checkpoint with every decoder Linear as float8_e4m3fn + per-channel weight_scale
    [out, 1] (compressed-tensors' "channel" strategy / FBGEMM fp8), and the same weights
    dequantized to float32 in a plain copy: (fp8 dir, float32 dir)."""
    import torch
    from safetensors.torch import load_file, save_file
    fp8_dir, ref_dir = dst / "fp8", dst / "ref"
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if "language_model" in name and re.search(r"layers\.\d+\..*proj\.weight$", name) and method == "block":
            # DeepSeek-V3 / Qwen3 fp8: one weight_scale_inv (a multiplier) per BLOCK x BLOCK block,
            # the edge blocks partial where a dimension is not a multiple of BLOCK
            nb_o, nb_i = -(-t.shape[0] // BLOCK), -(-t.shape[1] // BLOCK)
            pad = torch.zeros(nb_o * BLOCK, nb_i * BLOCK)
            pad[:t.shape[0], :t.shape[1]] = t
            blocks = pad.reshape(nb_o, BLOCK, nb_i, BLOCK)
            s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0                # [nb_o, nb_i]
            full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:t.shape[0], :t.shape[1]]
            q = (t / full).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = q.to(torch.float32) * full
        elif "language_model" in name and re.search(r"layers\.\d+\..*proj\.weight$", name):
            scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            q = (t / scale).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"] = q, scale.to(torch.bfloat16 if method == "fbgemm_fp8" else torch.float32)
            fp8[name.replace(".weight", ".input_scale")] = torch.ones(1)   # static schemes' input scale
            ref[name] = q.to(torch.float32) * fp8[name + "_scale"].to(torch.float32)
        else:
            fp8[name] = ref[name] = t
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0} if method == "fbgemm_fp8"
                                  else {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                        "weight_block_size": [BLOCK, BLOCK]} if method == "block"
                                  else {"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}})
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


@pytest.mark.parametrize("method", ["compressed-tensors", "fbgemm_fp8", "block"])
def test_fp8_checkpoint_loads(llava_dirs, tmp_path, method):
    """fp8 checkpoints dequantize on load: per channel (compressed-tensors, FBGEMM) or per block
    (`weight_scale_inv`, here 24 x 24 blocks with partial edge blocks): logits equal the same
    weights dequantized by hand; block-scaled with quantize="fp8" requantizes per channel, the
    same as quantizing the dequantized copy."""
    fp8_dir, ref_dir = _fp8_checkpoint(llava_dirs["gqa"], tmp_path, method)
    img = noise_image(7, 52, 44)
    got = mmjax.load(fp8_dir, max_num_seqs=1, max_model_len=128).logits(PROMPT, [img])
    want = mmjax.load(ref_dir, max_num_seqs=1, max_model_len=128).logits(PROMPT, [img])
    assert rel_err(got, want) <= 1e-5
    base = mmjax.load(llava_dirs["gqa"], max_num_seqs=1, max_model_len=128).logits(PROMPT, [img])
    assert rel_err(got, base) > 1e-4          # the fp8 rounding is real: not the original weights
    if method == "block":
        text = "USER: describe a red circle ASSISTANT:"
        got = mmjax.load(fp8_dir, max_num_seqs=1, max_model_len=128, quantize="fp8").logits(text)
        want = mmjax.load(ref_dir, max_num_seqs=1, max_model_len=128, quantize="fp8").logits(text)
        assert rel_err(got, want) <= 1e-5


def test_decode_step_writes_only_the_state_it_changes(llava_dirs):
    """The compiled decode step (1 of 4 slots, and all 4) copies no vocab-sized state row
    (logit_bias / prompt / stop masks, [slots, vocab]) and writes none of them back: it updates
    the tokens, lengths, keys and the penalties' counts only. Writing every leaf back made XLA
    copy the vocab rows twice a step (1 ms of a batch-1 bf16 step on the bench model)."""
    model = load_model(llava_dirs["gqa"], "float32")
    runner = _runner(model)
    vocab = model.module.language_model.vocab_size
    for name, hlo in _compiled(runner, "decode[1]", "decode[4]").items():
        # (the s32 [4, vocab] counts are updated in place by their scatter-add)
        rows = [ln.strip()[:160] for ln in hlo.splitlines()
                if re.search(rf"%\S*(copy|dynamic-update-slice)\S* = (f32|pred)\[4,{vocab}\]", ln)]
        assert rows == [], (name, rows)
    # the checker sees the copies of the old step, which wrote every leaf of the state back
    def write_back_all(self, tokens, keys):
        head = self.head(tokens.shape[0])
        return jax.tree.map(lambda x, y: x.at[:tokens.shape[0]].set(y), self,
                            dataclasses.replace(head, tokens=tokens, keys=keys))
    with patch.object(DecodeState, "advance", write_back_all):
        hlo = _compiled(_runner(model), "decode[1]")["decode[1]"]
    assert re.search(rf"%\S*(copy|dynamic-update-slice)\S* = (f32|pred)\[4,{vocab}\]", hlo)


def _of_shapes(hlo: str, op: str, shapes: set) -> list[str]:
    """The HLO lines of `op` (scatter, copy, ...) whose result has one of `shapes`."""
    return [ln.strip()[:120] for ln in hlo.splitlines() if f" {op}(" in ln and (m := re.search(
        r"= \w+\[([\d,]+)\]", ln)) and tuple(int(d) for d in m.group(1).split(",")) in shapes]


def test_cpu_decode_step_writes_the_cache_in_the_attention_kernel(llava_dirs):
    """On the CPU a decode step's new K / V go into the cache inside the attention kernel, one
    mmjax_decode_attention_write call per layer, in place: no scatter into the cache and no copy of
    any cache segment in the compiled step (f32 and int8 caches)."""
    for kv_dtype, target in (("auto", "mmjax_decode_attention_write_f32"), ("int8", "mmjax_decode_attention_write_s8")):
        model = load_model(llava_dirs["gqa"], "float32")
        runner = _runner(model, kv_cache_dtype=kv_dtype)
        layers = model.module.language_model.num_layers
        seg_shapes = {tuple(x.shape) for x in jax.tree.leaves(runner.cache)}
        for name, hlo in _compiled(runner, "decode[1]", "decode[4]").items():
            calls = re.findall(rf"custom_call_target=\"{target}\"", hlo)
            assert len(calls) == layers, (kv_dtype, name, len(calls))
            assert _of_shapes(hlo, "scatter", seg_shapes) == _of_shapes(hlo, "copy", seg_shapes) == [], (kv_dtype, name)
    # the checker sees the step as it was: the cache scattered by XLA (scatter_kv without its CPU
    # kernel), then the attention kernel
    from mmjax.models.nn import attention, kv_cache

    def scatter_then_attend(q, k, v, kv, q_pos, kv_len, mask, scale=None, pages=None):
        with patch.object(kv_cache.cpu_library, "enabled", lambda: False):
            kv = kv_cache.scatter_kv(kv, k, v, q_pos[:, None], jnp.arange(q.shape[0]), pages)
        return kv_cache.cache_attention(q, kv["k"], kv["v"], q_pos[:, None], kv_len, mask=mask, reduce_small=True,
                                        scale=scale, pages=pages), kv
    runner = _runner(load_model(llava_dirs["gqa"], "float32"))
    seg_shapes = {tuple(x.shape) for x in jax.tree.leaves(runner.cache)}
    with patch.object(attention, "cpu_decode_write", scatter_then_attend):
        hlo = _compiled(runner, "decode[4]")["decode[4]"]
    assert "mmjax_decode_attention_f32" in hlo and len(_of_shapes(hlo, "scatter", seg_shapes)) >= layers


def _transcendentals(hlo: str) -> int:
    """cosine ops anywhere in the optimized HLO, fusion bodies and conditional branches included
    (a fused one is evaluated for every element of its fusion's output)."""
    return len(re.findall(r" cosine\(", hlo))


def test_rope_cos_sin_are_computed_once_per_step(llava_dirs, qwen_dirs):
    """Every compiled CPU step (LLaVA: 1-D RoPE; Qwen2-VL: M-RoPE text and the vision tower's
    2-D RoPE) holds the cos of a RoPE table in one place (both branches of `layers.cos_sin`'s
    conditional), however many layers and heads use it: XLA fused the transcendentals into
    each layer's q and k rotations instead, re-evaluated per head. The plain tables, patched
    back in, show a cosine per layer and rotation, so the count is live."""
    from mmjax.models.nn import rope
    from mmjax.models.vision import qwen2_vl

    def counts(path):
        model = load_model(path, "float32")
        runner = _runner(model)
        layers_n = model.module.language_model.num_layers
        out = {}
        for step, fn, args, kw in runner.step_signatures():
            kind = step.split("[")[0].split("(")[0]
            if kind in out or kind == "copy_slot":
                continue
            out[kind] = _transcendentals(fn.lower(*args, **kw).compile().as_text())
        return out, layers_n

    for path in (llava_dirs["gqa"], qwen_dirs["qwen2_vl"]):
        got, _ = counts(path)
        assert {k: v <= 2 for k, v in got.items()} == {k: True for k in got}, (path, got)
        assert {"prefill", "decode"} <= set(got) and got["prefill"] == got["decode"] == 2, got
    plain = lambda a: (jnp.cos(a), jnp.sin(a))                     # noqa: E731
    with patch.object(rope, "cos_sin", plain), patch.object(qwen2_vl, "cos_sin", plain):
        got, n = counts(qwen_dirs["qwen2_vl"])
    assert got["prefill"] >= 2 * n and got["decode"] >= 2 * n and got["encode"] > 2, got
