"""mmjax-shapes (issue 7): the shipped trained checkpoint, end to end.

* held-out accuracy through `vlm.chat` on 300 freshly generated questions (a new random seed
  each run, printed so a failure can be replayed with MMJAX_SHAPES_SEED): the issue's >= 95%
  overall and >= 90% on each question type, describe judged over its 60 questions plus 240
  more fresh ones (see test_heldout_accuracy_through_chat);
* the same first 50 questions through the OpenAI server (in-process aiohttp app, official
  `openai` client, images as PNG/JPEG data URIs) give the same answers as `vlm.chat`;
* transformers loads the shipped directory; prompt ids (apply_chat_template), pixels and
  logits agree with mmjax (rel. err max|a-b|/max|b| <= 1e-4);
* `mmjax generate` (no --model: the embedded default) prints `circle` for a red circle;
* the notebook runs top to bottom (nbclient) in its reduced setting.
"""
from __future__ import annotations

import base64
import collections
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mmjax
from conftest import rel_err
from mmjax.demo import default_model_path
from mmjax.demo import shapes as S
from mmjax.demo import tokenizer as T

REPO = Path(__file__).resolve().parents[1]
N_QUESTIONS = 300
N_SERVER = 50
SP = dict(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def shipped() -> Path:
    p = default_model_path()
    assert p is not None, "the shipped checkpoint mmjax/demo/checkpoint/ is missing"
    return p


@pytest.fixture(scope="module")
def vlm(shipped):
    return mmjax.load(shipped, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def seed() -> int:
    seed = int(os.environ.get("MMJAX_SHAPES_SEED") or np.random.SeedSequence().entropy % 2**32)
    print(f"\nmmjax-shapes held-out seed: {seed} (replay with MMJAX_SHAPES_SEED={seed})")
    return seed


@pytest.fixture(scope="module")
def questions(seed):
    """300 fresh (image bytes, question, answer, type), 60 per type, scenes of random size."""
    return _fresh_questions(np.random.default_rng(seed), N_QUESTIONS, S.QUESTION_TYPES)


def _fresh_questions(rng, n: int, qtypes) -> list[dict]:
    out = []
    for i in range(n):
        qtype = qtypes[i % len(qtypes)]
        ex = S.make_example(rng, qtype, client_roundtrip=False)
        data, fmt = S.encode_bytes(ex["image"], rng)          # PNG or JPEG q85-95, like a client
        out.append({"bytes": data, "fmt": fmt, "question": ex["question"],
                    "answer": ex["answer"], "qtype": qtype, "scene": ex["scene"]})
    return out


def _messages(image, question):
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]


def _chat(vlm, questions) -> list[str]:
    sp = mmjax.SamplingParams(**SP)
    return [vlm.chat(_messages(q["bytes"], q["question"]), sp).text for q in questions]


@pytest.fixture(scope="module")
def chat_answers(vlm, questions):
    return _chat(vlm, questions)


def test_shipped_checkpoint_files(shipped):
    names = {p.name for p in shipped.iterdir()}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "preprocessor_config.json", "processor_config.json", "generation_config.json",
              "chat_template.jinja"):
        assert f in names, f
    size = sum(p.stat().st_size for p in shipped.iterdir() if p.is_file())
    assert size <= 25 * 2**20, f"checkpoint is {size / 2**20:.1f} MiB"


def test_heldout_accuracy_through_chat(vlm, seed, questions, chat_answers):
    # describe is the hardest type (measured 0.933-0.967 per sample of 60): its 60 questions
    # alone would miss 90% in ~9% of runs at a true 0.935, so it is judged over 240 more fresh
    # ones too (sd 0.014 over 300: misses in ~0.8% of runs)
    more = _fresh_questions(np.random.default_rng([seed, 1]), 240, ("describe",))
    hits, tot = collections.Counter(), collections.Counter()
    wrong = []
    for i, (q, pred) in enumerate(zip(questions + more, chat_answers + _chat(vlm, more))):
        ok = S.answer_matches(pred, q["answer"])
        kind = q["qtype"] if i < len(questions) else "describe (extra)"
        hits[kind] += ok
        tot[kind] += 1
        if not ok:
            wrong.append((q["qtype"], q["question"], q["answer"], pred, q["fmt"],
                          (q["scene"].width, q["scene"].height)))
    assert set(tot) == {*S.QUESTION_TYPES, "describe (extra)"}
    overall = sum(hits[t] for t in S.QUESTION_TYPES) / len(questions)
    acc = {t: hits[t] / tot[t] for t in S.QUESTION_TYPES}
    describe = (hits["describe"] + hits["describe (extra)"]) / (tot["describe"] + tot["describe (extra)"])
    report = "  ".join(f"{t} {acc[t]:.3f}" for t in S.QUESTION_TYPES)
    print(f"\nmmjax-shapes accuracy: overall {overall:.3f}  {report}; describe over "
          f"{tot['describe'] + tot['describe (extra)']}: {describe:.3f}")
    for w in wrong[:20]:
        print("  wrong:", w)
    # Issue 7's targets. Measured via chat at seeds 2026 / 777 / 31337: overall 0.990 / 0.980 /
    # 0.993; shape, color, count, exists 0.983-1.000; describe 0.967 / 0.933 / 0.967 (60 each),
    # 0.935 over 1,200 fresh describe questions (mostly 3-shape scenes and thin shapes).
    assert overall >= 0.95, (overall, acc, wrong[:10])
    for t in ("shape", "color", "count", "exists"):
        assert acc[t] >= 0.90, (t, acc, wrong[:10])
    assert describe >= 0.90, (describe, acc, wrong[:10])


@pytest.mark.slow
def test_int8_weights_and_kv_cache_heldout_accuracy(shipped, questions, chat_answers):
    """Issue 25: int8 weights (mmjax.quant, W8A8) and an int8 KV cache (models/text/kv_quant)
    together, on the 300 held-out questions, batched: accuracy >= 95% overall and the same
    answers as float32 `vlm.chat` (greedy) on >= 95%. Measured separately on the 300: int8
    weights 0.990 / 0.980 accuracy (two runs), answers identical 300/300; int8 KV cache 0.983 /
    0.980, identical 300/300."""
    vlm = mmjax.load(shipped, quantize="int8", kv_cache_dtype="int8", max_num_seqs=4, max_model_len=256)
    reqs = []
    for q in questions:
        prompt, images = vlm.render_chat(_messages(q["bytes"], q["question"]))
        reqs.append({"prompt": prompt, "images": images})
    got = [o.text for o in vlm.generate(reqs, mmjax.SamplingParams(**SP))]
    acc = np.mean([S.answer_matches(a, q["answer"]) for a, q in zip(got, questions)])
    same = np.mean([a == b for a, b in zip(got, chat_answers)])
    print(f"\nmmjax-shapes int8 weights + int8 KV cache: accuracy {acc:.3f} on {len(got)}, "
          f"answers identical to float32: {same:.3f}")
    assert acc >= 0.95 and same >= 0.95, (acc, same)


def test_server_openai_client_matches_chat(shipped, questions, chat_answers):
    from test_serve import Server
    from serve.app import ServerConfig

    vlm = mmjax.load(shipped, max_num_seqs=4, max_model_len=256)
    srv = Server(vlm, ServerConfig(served_model_name="mmjax-shapes", log_stats_interval=0))
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["mmjax-shapes"]
        hits = 0
        for q, offline in zip(questions[:N_SERVER], chat_answers[:N_SERVER]):
            mime = "image/png" if q["fmt"] == "PNG" else "image/jpeg"
            url = f"data:{mime};base64," + base64.b64encode(q["bytes"]).decode()
            r = client.chat.completions.create(
                model="mmjax-shapes", temperature=0.0, max_tokens=SP["max_tokens"],
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": q["question"]}]}])
            text = r.choices[0].message.content
            assert text == offline, (q["question"], text, offline)
            assert r.choices[0].finish_reason == "stop"
            hits += S.answer_matches(text, q["answer"])
        print(f"\nserver: {hits}/{N_SERVER} exact")
        assert hits >= 0.90 * N_SERVER  # expected ~49.3/50 at 0.987 overall (sd 0.8)
        # the JSON form (README "JSON answers") through response_format: valid, schema-true, right
        single = [q for q in questions if q["qtype"] in S.JSON_TYPES][:12]
        json_hits = 0
        for q in single:
            mime = "image/png" if q["fmt"] == "PNG" else "image/jpeg"
            url = f"data:{mime};base64," + base64.b64encode(q["bytes"]).decode()
            r = client.chat.completions.create(
                model="mmjax-shapes", temperature=0.0, max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "answer", "strict": True, "schema": S.json_schema(q["qtype"])}},
                messages=[{"role": "system", "content": S.JSON_SYSTEM},
                          {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": q["question"]}]}])
            text = r.choices[0].message.content
            assert list(json.loads(text)) == [q["qtype"]] + [k for k in S.JSON_TYPES if k != q["qtype"]], text
            json_hits += S.json_matches(text, q["qtype"], q["answer"])
        assert len(single) == 12 and json_hits >= 11, (json_hits, len(single))
    finally:
        srv.close()


@pytest.fixture(scope="module")
def hf_pair(shipped):
    import torch
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(shipped, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(shipped)
    tok = AutoTokenizer.from_pretrained(shipped)
    return hf, proc, tok


def test_transformers_prompt_ids_pixels_and_logits(vlm, hf_pair, questions, seed):
    import torch

    hf, proc, tok = hf_pair
    n_img = vlm.family.cfg.image_tokens_per_image
    for i, q in enumerate(questions[:5]):
        from PIL import Image
        img = Image.open(io.BytesIO(q["bytes"])).convert("RGB")
        msgs = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": q["question"]}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True)
        ours_text, _ = vlm.render_chat(_messages(img, q["question"]))
        assert ours_text == text == T.render_chat(T.vqa_messages(q["question"]), True)
        # ids: transformers' tokenizer chat template (one <image>) expanded == mmjax's ids
        hf_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
        ids = vlm.tokenizer.encode_prompt(text, [n_img])
        expanded = [t for x in hf_ids for t in ([x] * n_img if x == T.IMAGE_ID else [x])]
        assert ids == expanded
        # the processor's own chat path (renders with the template's BOS, adds no second one)
        inputs = proc.apply_chat_template(
            [{"role": "user", "content": [{"type": "image", "image": img},
                                          {"type": "text", "text": q["question"]}]}],
            add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask",
                                                          "pixel_values")}
        assert ids == inputs["input_ids"][0].tolist()
        assert ids[0] == T.BOS_ID and ids.count(T.BOS_ID) == 1
        pix = inputs["pixel_values"][0].numpy().transpose(1, 2, 0)
        ours_pix = vlm.family.policy(img)
        assert np.abs(ours_pix - pix).max() <= 1e-5
        # Model parity on identical pixels: the trained ViT amplifies the processors' <= 1e-5
        # resize differences to ~1.6e-4 relative in the logits (measured), which is
        # preprocessing, asserted just above, not the model.
        inputs["pixel_values"] = torch.from_numpy(ours_pix.transpose(2, 0, 1)[None].copy())
        with torch.no_grad():
            theirs = hf(**inputs).logits[0].numpy()
        ours = vlm.logits(text, [img])
        assert ours.shape == theirs.shape
        # (1580 replayed questions, 316 seeds: 6e-7 to 9.4e-6 with the tests' XLA flags; one CI
        # run saw 1.4e-4 and its seed was lost: the message carries it)
        err = rel_err(ours, theirs)
        assert err <= 1e-4, f"question {i} of MMJAX_SHAPES_SEED={seed}: rel err {err:.3g} ({img.size}, {q['question']!r})"
        # and both models answer the same thing greedily
        with torch.no_grad():
            gen = hf.generate(**inputs, max_new_tokens=SP["max_tokens"], do_sample=False,
                              pad_token_id=T.PAD_ID)
        hf_text = tok.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        out = vlm.chat(_messages(img, q["question"]), mmjax.SamplingParams(**SP)).text
        assert hf_text == out


def test_generate_cli_red_circle(tmp_path):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (200, 160), "white")
    ImageDraw.Draw(img).ellipse((60, 40, 120, 100), fill=(220, 30, 30))
    path = tmp_path / "red_circle.png"
    img.save(path)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "mmjax.cli", "generate", "--image", str(path),
                        "--prompt", "What shape is this?"],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "circle", (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("name", ["shapes_ablation", "attention_maps", "saliency", "token_reduction", "module_ablation",
                                  "lora_finetune"])
def test_notebook_runs_top_to_bottom(name):
    import nbformat
    import nbclient
    path = REPO / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("MMJAX_NOTEBOOK_FAST")
    os.environ["MMJAX_NOTEBOOK_FAST"] = "1"      # reduced setting (inherited by the kernel)
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(REPO / "notebooks")}})
        client.execute()
    finally:
        if env_before is None:
            os.environ.pop("MMJAX_NOTEBOOK_FAST", None)
        else:
            os.environ["MMJAX_NOTEBOOK_FAST"] = env_before
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook's plot is missing"


def test_growth_preserves_the_function(shipped, tmp_path):
    """train.py's warm-start growth (more decoder / ViT layers: copies with zero o/down or
    o/fc2; more KV heads: each repeated for its GQA group; 2x image size and patch: each patch
    pixel weight spread over its 2x2 new pixels) starts from exactly the old function (for the image growth:
    on the 2x pixel-replicated image). The old model is the shipped config with 4 query heads
    on 2 KV heads and 2 decoder layers, random weights (so the KV-head growth is exercised,
    including which copy each query head must read)."""
    import copy
    import json

    import jax.numpy as jnp

    from mmjax.demo import train as TR

    old = json.loads((shipped / "config.json").read_text())
    old["text_config"].update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    _, random_model = TR.init_model(old, T.train_tokenizer(), 3)
    TR.export(tmp_path, old, random_model)
    new = copy.deepcopy(old)
    t = new["text_config"]
    t["num_hidden_layers"] += 1
    t["num_key_value_heads"] = t["num_attention_heads"]
    new["vision_config"]["num_hidden_layers"] += 1
    cfg0, p0 = TR.init_model(old, None, 0, str(tmp_path))
    cfg1, p1 = TR.init_model(new, None, 0, str(tmp_path))
    assert len(p1.language_model.layers) == 3 and cfg1.text.num_kv_heads == 4 > cfg0.text.num_kv_heads
    assert len(p1.vision_tower.encoder.layers) == len(p0.vision_tower.encoder.layers) + 1
    rng = np.random.default_rng(5)
    n = cfg0.image_tokens_per_image
    size = old["vision_config"]["image_size"]
    pix = jnp.asarray(rng.integers(0, 256, (2, size, size, 3)), jnp.uint8)
    ids = np.concatenate([np.ones((2, 1)), rng.integers(5, 300, (2, 7)),
                          np.full((2, n), cfg0.image_token_id), rng.integers(5, 300, (2, 9))], 1)
    ids = jnp.asarray(ids.astype(np.int32))
    l0 = np.asarray(TR.make_logits_fn(cfg0)(p0, pix, ids)[0])
    l1 = np.asarray(TR.make_logits_fn(cfg1)(p1, pix, ids)[0])
    assert np.abs(l0).max() > 1.0
    assert rel_err(l1, l0) <= 1e-5
    big = copy.deepcopy(old)
    big["vision_config"].update(image_size=2 * size, patch_size=2 * old["vision_config"]["patch_size"])
    cfg2, p2 = TR.init_model(big, None, 0, str(tmp_path))
    l2 = np.asarray(TR.make_logits_fn(cfg2)(p2, jnp.repeat(jnp.repeat(pix, 2, 1), 2, 2), ids)[0])
    assert rel_err(l2, l0) <= 1e-5
    big["vision_config"].update(image_size=3 * size // 2, patch_size=3 * old["vision_config"]["patch_size"] // 2)
    with pytest.raises(ValueError, match="patch"):
        TR.init_model(big, None, 0, str(tmp_path))
    # training's "reference attention up to 16 GiB of scores" must not leak into later traces
    # (it once made test_qwen2_vl's linear-memory check compile the O(N^2) path)
    import mmjax.attention as A
    assert A.AUTO_REFERENCE_MAX_SCORE_BYTES == 2**20
    for kvh in (3, 8):   # does not divide the query heads / more KV than query heads
        bad = copy.deepcopy(old)
        bad["text_config"]["num_key_value_heads"] = kvh
        with pytest.raises(ValueError, match="KV heads"):
            TR.init_model(bad, None, 0, str(tmp_path))


def test_head0_attention_is_the_layer_attention(shipped):
    """The weights the describe attention aux trains are those of query head 0 in the last
    decoder layer: weights @ V of KV head 0 equals what that layer adds to the residual stream
    when its o projection keeps only head 0 and its MLP is off (random weights, GQA 4 on 2)."""
    import json

    import jax.numpy as jnp
    from flax import nnx

    from mmjax.demo import train as TR
    from mmjax.models.nn.metadata import AttentionMetadata

    cfg_dict = json.loads((shipped / "config.json").read_text())
    cfg_dict["text_config"].update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg, model = TR.init_model(cfg_dict, T.train_tokenizer(), 4)
    rng = np.random.default_rng(6)
    n, size = cfg.image_tokens_per_image, cfg_dict["vision_config"]["image_size"]
    pix = jnp.asarray(rng.integers(0, 256, (2, size, size, 3)), jnp.uint8)
    ids = np.concatenate([np.ones((2, 1)), rng.integers(5, 300, (2, 5)),
                          np.full((2, n), cfg.image_token_id), rng.integers(5, 300, (2, 8))], 1)
    ids = jnp.asarray(ids.astype(np.int32))
    _, _, last_in, attn0, out0 = TR.make_logits_fn(cfg)(model, pix, ids)
    b, t, _ = last_in.shape
    assert np.allclose(np.asarray(attn0).sum(-1), 1.0, atol=1e-5)
    assert not np.triu(np.asarray(attn0), 1).any()

    lm, hd = model.language_model, cfg.text.head_dim
    layer = nnx.clone(lm.layers[-1])
    o = np.zeros(layer.self_attn.o_proj.kernel.get_value().shape, np.float32)
    o[:hd, :hd] = np.eye(hd)                       # head 0's output -> the first hd features
    layer.self_attn.o_proj.kernel.set_value(jnp.asarray(o))
    down = layer.mlp.down_proj
    for var in (down.kernel, down.bias):
        if var is not None:
            var.set_value(jnp.zeros_like(var.get_value()))
    positions = jnp.broadcast_to(jnp.arange(t), (1, b, t))
    meta = AttentionMetadata(positions, jnp.zeros((b,), jnp.int32), t)
    out, _ = layer(last_in, lm.layer_rope(lm.num_layers - 1, lm.rope(positions)), meta,
                   lm.init_cache(b, t, jnp.float32)[-1])
    _, _, v = layer.self_attn.qkv_proj(layer.input_layernorm(last_in))
    v0 = v[..., :hd]
    got = np.asarray(out - last_in)
    assert np.abs(got[..., hd:]).max() == 0.0
    assert rel_err(np.asarray(attn0 @ v0), got[..., :hd]) <= 1e-5
    assert rel_err(np.asarray(out0), got[..., :hd]) <= 1e-5
