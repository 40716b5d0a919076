"""Qwen3.5 (dense) and Qwen3.5-MoE parity with transformers on tiny random checkpoints (float32,
tests/tiny_qwen35.py), against the real Qwen3VLProcessor that transformers maps qwen3_5 to.

Checked:
- the Gated DeltaNet kernels (nn/gated_delta.py) against transformers' torch_chunk_gated_delta_rule
  / torch_recurrent_gated_delta_rule over 150 tokens (three 64-token chunks) with an initial state
  and grouped value heads: outputs and final state within 1e-5 absolute (measured ~3e-7);
- the layer against transformers' Qwen3_5GatedDeltaNet: one call, the same tokens in two calls
  (state and conv window carried through the cache), a one-token decode step after them, and two
  prompts packed in one row with a decode rider, all within 1e-5 of the reference (rel);
- pixels (<= 1e-5), grids, token counts, prompt ids and M-RoPE positions exact; image features
  rel <= 1e-4; logits of a two-image prompt (94 tokens: two GatedDeltaNet chunks) rel <= 1e-4
  (measured ~1e-6 dense, ~3e-5 MoE); other images change them;
- 32 greedy tokens identical to transformers' generate and logprobs within 1e-4 through the engine
  with 16-token prefill chunks (every prompt spans several calls); one batch (packed prefill calls,
  the first request's decode riding in the second's prefill) == one at a time (reused slots) ==
  caches off; an n = 2 sibling forked from its parent's row and a state snapshot gives the same
  ids; a prompt prefilled in chunks while decode steps run over its row is unaffected (the row is
  parked between chunks);
- prefix caching (serving/state_snapshots.py): two requests with the same system prompt and image
  and different questions (several chunks each): the second resumes at the last chunk boundary
  inside the shared prefix (cached_tokens exactly that), greedy ids and logprobs (1e-5) equal to
  the caches off; a third with another image in the reused slot equals its cold run too;
  the snapshot index's LRU and longest-prefix lookup on their own;
- a video prompt: ids, positions, logits (rel <= 1e-4) and 32 greedy tokens;
- the server through the openai client (tests/conformance.py);
- benchmarks/qwen35_hybrid.py at its smoke size (cache bytes per sequence from shapes, tok/s).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from conformance import GREEDY, caches_off, served_through_openai
from mmjax.errors import CheckpointError
from mmjax.models import qwen3_5 as Q35
from mmjax.models.nn.gated_delta import chunk_gated_delta, l2norm, recurrent_gated_delta
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.packing import NO_INDEX, DecodeRows, Packing
from mmjax.serving.state_snapshots import ROWS_PER_SLOT
from tiny_qwen35 import hf_processor, torchvision_stand_in
from tiny_video import write_video

KINDS = ("dense", "moe")
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
       "<|im_start|>assistant\n")
TWO = ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
       "<|vision_start|><|image_pad|><|vision_end|>Compare the two images.<|im_end|>\n<|im_start|>assistant\n")
VIDEO = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What is in the picture ?<|im_end|>\n"
         "<|im_start|>assistant\n")
CHUNK = 16
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=CHUNK)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, qwen35_dirs):
    from transformers import AutoModelForImageTextToText
    path = qwen35_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, hf_processor(path), mmjax.load(path, **ENGINE)


def _greedy_matches_hf(hf, x, o) -> None:
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
    expected = g.sequences[0, x["input_ids"].shape[1]:].tolist()
    assert len(set(expected)) > 2 and o.token_ids == expected
    for ours, ref in zip(o.logprobs, g.logits):
        ref = torch.log_softmax(ref[0].double(), -1).numpy()
        assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())


def test_gated_delta_kernels_match_torch():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)
    rng = np.random.default_rng(0)
    b, t, hk, hv, dk, dv = 2, 150, 2, 4, 16, 8
    q, k = (rng.standard_normal((b, t, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((b, t, hv))) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32)
    s0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    T = torch.from_numpy
    jq, jk = (jnp.repeat(jnp.asarray(a), hv // hk, axis=2) for a in (q, k))
    jq, jk = l2norm(jq) * dk ** -0.5, l2norm(jk)
    args = (jq, jk, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0))
    for ours, theirs in ((chunk_gated_delta, torch_chunk_gated_delta_rule),
                         (recurrent_gated_delta, torch_recurrent_gated_delta_rule)):
        out, state = jax.jit(ours)(*args)
        ref_out, ref_state = theirs(T(q), T(k), T(v), T(g), T(beta), initial_state=T(s0), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
        assert np.abs(np.asarray(out) - ref_out.numpy()).max() <= 1e-5
        assert np.abs(np.asarray(state) - ref_state.numpy()).max() <= 1e-5


def _meta(t: int, start: int, slot: int, kv_len: int) -> AttentionMetadata:
    pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (3, 1, t))
    return AttentionMetadata(pos, jnp.array([start], jnp.int32), kv_len, slots=jnp.array([slot], jnp.int32))


def test_gated_delta_layer_chunks_decode_and_packing(pair):
    """Layer 0 (a GatedDeltaNet) == transformers' over 150 tokens: one call; 100 + 49 + one decode
    token through the cache; two prompts packed in one row with a decode rider (each == its own
    call, the rider's state == the decode step's)."""
    _, hf, _, vlm = pair
    ref_layer = hf.model.language_model.layers[0].linear_attn
    module = vlm.model.language_model.layers[0].linear_attn
    layer = jax.jit(lambda x, meta, cache: module(x, meta, cache))
    x = np.random.default_rng(1).standard_normal((1, 150, 64)).astype(np.float32)
    with torch.no_grad():
        ref = ref_layer(torch.from_numpy(x)).numpy()[0]
    cache = module.init_cache(3, jnp.float32)
    whole, _ = layer(jnp.asarray(x), _meta(150, 0, 0, 150), cache)
    assert rel_err(np.asarray(whole)[0], ref) <= 1e-5
    a, cache = layer(jnp.asarray(x[:, :100]), _meta(100, 0, 1, 100), cache)
    b, cache = layer(jnp.asarray(x[:, 100:149]), _meta(49, 100, 1, 149), cache)
    held = cache                                            # slot 1: the state after 149 tokens
    dec = AttentionMetadata(jnp.full((3, 2, 1), 149, jnp.int32), jnp.array([0, 149], jnp.int32), 150)
    c, cache = layer(jnp.asarray(np.stack([x[0, :1], x[0, 149:]])), dec, cache)   # decode rows 0 (fresh), 1
    split = np.concatenate([np.asarray(a)[0], np.asarray(b)[0], np.asarray(c)[1]])
    assert rel_err(split, ref) <= 1e-5
    # packed: sequence A (the first 100 tokens) into slot 0, B (tokens 100..139 as a new prompt)
    # into slot 2, and slot 1's decode token riding at row position 140; each == its own call
    row = np.zeros((1, 160, 64), np.float32)
    row[0, :100], row[0, 100:140], row[0, 140] = x[0, :100], x[0, 100:140], x[0, 149]
    riders = DecodeRows(jnp.array([NO_INDEX, 149], jnp.int32), jnp.array([160, 140], jnp.int32))
    token_seg = jnp.asarray(np.r_[np.zeros(100), np.ones(60)].astype(np.int32))
    packing = Packing(jnp.array([0, 2, 3], jnp.int32), jnp.zeros(3, jnp.int32), jnp.array([0, 100, 140], jnp.int32),
                      jnp.array([100, 40, 0], jnp.int32), token_seg, riders)
    meta = AttentionMetadata(jnp.zeros((3, 1, 160), jnp.int32), packing.seg_start, 150, slots=packing.seg_slot,
                             packing=packing)
    packed, after = layer(jnp.asarray(row), meta, held)
    alone_b, _ = layer(jnp.asarray(x[:, 100:140]), _meta(40, 0, 0, 40), module.init_cache(3, jnp.float32))
    assert rel_err(np.asarray(packed)[0, :100], ref[:100]) <= 1e-5
    assert rel_err(np.asarray(packed)[0, 100:140], np.asarray(alone_b)[0]) <= 1e-5
    assert rel_err(np.asarray(packed)[0, 140], ref[149]) <= 1e-5
    np.testing.assert_allclose(np.asarray(after["ssm"][1]), np.asarray(cache["ssm"][1]), rtol=1e-5, atol=1e-6)


def test_config_and_errors(pair):
    kind, hf, _, vlm = pair
    assert type(hf).__name__ == {"dense": "Qwen3_5ForConditionalGeneration",
                                 "moe": "Qwen3_5MoeForConditionalGeneration"}[kind]
    fam, lm = vlm.family, vlm.model.language_model
    assert fam.name == hf.config.model_type and fam.image_token_id == hf.config.image_token_id
    text = fam.cfg.text
    assert text.layer_types == tuple(hf.config.text_config.layer_types) and lm.state_layers == (0, 1, 2)
    assert text.rotary_dim == 8 and vlm.engine.runner.feature_width == 64       # no DeepStack
    assert not lm.supports_prune and lm.supports_riders
    r = vlm.engine.runner          # the state-snapshot pool: ROWS_PER_SLOT rows a slot, in the memory plan
    assert vlm.engine.snapshots.rows == ROWS_PER_SLOT * r.num_slots
    assert r._plan_for(r.num_slots, {})["state_snapshots"] == r.state_pool.nbytes() > 0
    assert (text.moe is not None) == (kind == "moe") and text.tie_word_embeddings == (kind == "moe")
    cfg = hf.config.to_dict()
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 3, 3]
    with pytest.raises(CheckpointError) as e:
        Q35.Qwen35Config.from_hf(cfg)
    assert "mrope_section" in e.value.param


def test_pixels_features_positions_and_logits(pair):
    _, hf, proc, vlm = pair
    imgs = [noise_image(30, 150, 110), noise_image(31, 260, 190)]
    x = proc(text=[TWO], images=imgs, return_tensors="pt")
    inputs = vlm.prepare_images(imgs)
    assert [im.grid for im in inputs] == [tuple(g) for g in x["image_grid_thw"].tolist()]
    assert np.abs(np.concatenate([im.pixels for im in inputs]) - x["pixel_values"].numpy()).max() <= 1e-5
    counts = [im.num_tokens for im in inputs]
    ids = np.asarray(vlm.tokenizer.encode_prompt(TWO, counts), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist() and len(ids) > 64
    ours, delta = vlm.family.positions(ids, inputs, vlm.family.image_starts(ids, counts))
    theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x["image_grid_thw"])
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(hf_delta[0, 0])
    with torch.no_grad():
        feats = hf.model.get_image_features(pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"])
        ref = hf(**x).logits[0].numpy()
    for f, t in zip(vlm.encode(imgs), feats.pooler_output):
        assert rel_err(f, t.numpy()) <= 1e-4
    got = vlm.logits(TWO, imgs)
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
    other = vlm.logits(TWO, [noise_image(32, 150, 110), noise_image(33, 260, 190)])
    assert rel_err(other, got) > 1e-3


def test_generation_chunks_and_batching(pair):
    _, hf, proc, vlm = pair
    a, b = noise_image(40, 260, 190), noise_image(41, 230, 75)
    reqs = [{"prompt": ONE, "images": [a]}, {"prompt": TWO, "images": [b, a]}]
    sp = mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY)
    mixed = vlm.engine.counters["mixed_steps"]
    together = vlm.generate(reqs, sp)
    assert vlm.engine.counters["mixed_steps"] > mixed       # the first one's decode rode the second's prefill
    alone = [vlm.generate([r], sp)[0] for r in reqs]        # the slots are reused: states reset
    with caches_off(vlm):       # the two-image request (its features encoder-cached above)
        cold = vlm.generate([reqs[1]], sp)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] and cold[0].token_ids == alone[1].token_ids
    assert cold[0].cached_tokens == 0
    for x, y in zip(together + alone[1:], alone + cold):
        np.testing.assert_allclose([x.logprobs[i][t] for i, t in enumerate(x.token_ids)],
                                   [y.logprobs[i][t] for i, t in enumerate(y.token_ids)], atol=1e-5)
    assert all(len(o.prompt_token_ids) > 2 * CHUNK for o in together)
    # n > 1: the sibling copies its parent's row and the states of the prompt's last chunk boundary
    two = vlm.generate([reqs[0]], mmjax.SamplingParams(max_tokens=8, n=2, **GREEDY))[0]
    assert two.token_ids == two.siblings[0].token_ids == together[0].token_ids[:8]
    n = len(two.prompt_token_ids)
    assert two.siblings[0].cached_tokens == (n - 1) // CHUNK * CHUNK > 0
    for r, o in zip(reqs, together):
        x = proc(text=[r["prompt"]], images=r["images"], return_tensors="pt")
        assert x["input_ids"][0].tolist() == list(o.prompt_token_ids)
        _greedy_matches_hf(hf, x, o)


def test_decode_steps_leave_a_prefilling_row_alone(pair):
    """A prompt prefilled in chunks alone (prompt_logprobs: no decode rides in its calls) while
    another request decodes in a higher slot: the decode steps between its chunks cover its row,
    which the engine parks (`Decoder.state_layers`), so its recurrent states take no stray token;
    its logprobs equal a run on an idle engine (1e-5)."""
    _, _, _, vlm = pair
    eng = vlm.engine
    a, b = noise_image(40, 260, 190), noise_image(41, 230, 75)
    sp = mmjax.SamplingParams(max_tokens=8, logprobs=1, prompt_logprobs=0, **GREEDY)
    alone = vlm.generate([{"prompt": TWO, "images": [a, a]}], sp)[0]
    first = eng.add_request("hello there", [], mmjax.SamplingParams(max_tokens=2, **GREEDY))   # takes slot 0
    eng.step()
    busy = eng.add_request(ONE, vlm.prepare_images([b]), mmjax.SamplingParams(max_tokens=40, **GREEDY))   # slot 1
    for _ in range(12):
        eng.step()
    steps = eng.counters["decode_steps"]
    late = eng.add_request(TWO, vlm.prepare_images([a, a]), sp)                               # slot 0, chunked
    o = eng.run_until_done([first, busy, late])[2]
    assert eng.counters["decode_steps"] - steps > len(o.prompt_token_ids) // CHUNK
    assert o.token_ids == alone.token_ids
    assert max(abs(x[t] - y[t]) for x, y in zip(o.logprobs, alone.logprobs) for t in x) <= 1e-5


SYSTEM = "<|im_start|>system\nYou are a careful assistant who looks at every picture closely.<|im_end|>\n"


def _shared(question: str) -> str:
    return (f"{SYSTEM}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def test_prefix_cache_resumes_a_shared_image_prompt(pair):
    """Same system prompt and image, different questions, one after the other: the second
    request's slot holds the first's KV and the snapshot pool its states at each 16-token chunk
    end, so it resumes at the last chunk boundary inside the shared prefix; ids and logprobs equal
    the caches off. A third request with another image then reuses a slot (what it resumes, if
    anything, is the text before the image) and equals its cold run."""
    _, _, _, vlm = pair
    eng = vlm.engine
    img, other = noise_image(60, 260, 190), noise_image(61, 260, 190)
    reqs = [{"prompt": _shared("Describe this image."), "images": [img]},
            {"prompt": _shared("What colours are in the picture, and where?"), "images": [img]},
            {"prompt": _shared("Describe this image."), "images": [other]}]
    sp = mmjax.SamplingParams(max_tokens=16, logprobs=2, **GREEDY)
    hits, cached = eng.stats()["state_snapshot_hits"], eng.counters["tokens_cached"]
    hot = [vlm.generate([r], sp)[0] for r in reqs]
    with caches_off(vlm):
        cold = [vlm.generate([r], sp)[0] for r in reqs]
    a, b = (np.asarray(o.prompt_token_ids) for o in hot[:2])
    shared = int(np.flatnonzero(a[:len(b)] != b[:len(a)])[0])
    assert len(a) > 4 * CHUNK and shared > 3 * CHUNK       # the image is inside the shared prefix
    assert hot[0].cached_tokens == 0 and hot[1].cached_tokens == shared // CHUNK * CHUNK
    assert eng.stats()["state_snapshot_hits"] > hits and eng.counters["tokens_cached"] - cached >= hot[1].cached_tokens
    assert hot[2].cached_tokens % CHUNK == 0 and hot[2].cached_tokens < a.tolist().index(
        vlm.family.image_token_id)
    assert all(o.cached_tokens == 0 for o in cold)
    for x, y in zip(hot, cold):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose([x.logprobs[i][t] for i, t in enumerate(x.token_ids)],
                                   [y.logprobs[i][t] for i, t in enumerate(y.token_ids)], atol=1e-5)


def test_snapshot_index_lru():
    """SnapshotIndex (host side of the state snapshots): a row per distinct prefix, the least
    recently used row reused when full, `longest` the longest held prefix of the keys within n."""
    from mmjax.serving.state_snapshots import SnapshotIndex
    keys = np.arange(100, dtype=np.int64)
    idx = SnapshotIndex(2)
    assert idx.claim(keys[:16]) == 0 and idx.claim(keys[:32]) == 1 and idx.claim(keys[:16]) is None
    assert idx.longest(keys, 99) == 32 and idx.longest(keys, 31) == 16 and idx.longest(keys, 15) == 0
    other = keys.copy()
    other[20] = -1                  # diverges inside the 32-token prefix
    assert idx.longest(other, 99) == 16
    assert idx.row(keys[:32]) == 1  # 32 used last: 16 is evicted next
    assert idx.claim(keys[:48]) == 0 and idx.longest(keys, 40) == 32 and idx.longest(keys, 31) == 0
    assert idx.hits == 1 and len(idx) == 2
    assert SnapshotIndex(0).claim(keys[:16]) is None


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("qwen35_videos") / "a.mp4", 24, 8, 112, 64, seed=0)


def test_video_logits_and_greedy(pair, clip):
    _, hf, proc, vlm = pair
    with torchvision_stand_in():
        x = proc(text=[VIDEO], videos=[clip], return_tensors="pt")
    item = vlm.prepare_videos([clip])[0]
    fam = vlm.family
    ids = np.asarray(vlm.tokenizer.encode_prompt(VIDEO, [item.num_tokens], [fam.image_prompt(item)],
                                                 [fam.token_id_of(item)]), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist()
    ours, _ = fam.positions(ids, [item], fam.image_starts(ids, [item.num_tokens]))
    theirs, _ = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], None, x["video_grid_thw"])
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    o = vlm.generate([{"prompt": VIDEO, "images": [], "videos": [clip]}],
                     mmjax.SamplingParams(max_tokens=32, logprobs=1, **GREEDY))[0]
    assert list(o.prompt_token_ids) == ids.tolist()
    _greedy_matches_hf(hf, x, o)


def test_served_through_openai(pair):
    kind, _, _, vlm = pair
    if kind != "dense":
        return      # one family-level server check (the decoder is the same code)
    import io
    buf = io.BytesIO()
    noise_image(50, 120, 90).save(buf, format="PNG")
    assert isinstance(served_through_openai(vlm, buf.getvalue(), "Describe it."), str)


def test_hybrid_benchmark_smoke(tmp_path, capsys):
    """benchmarks/qwen35_hybrid.py at its smoke size: the table and JSON line; the hybrid's KV is
    its one full-attention layer's of the dense peer's four, plus the linear layers' states."""
    import json

    from benchmarks.qwen35_hybrid import main
    assert main(["--smoke", "--new-tokens", "8", "--out-dir", str(tmp_path)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    h, d = r["models"]["hybrid"], r["models"]["dense"]
    assert h["kv_bytes"] * 4 == d["kv_bytes"] and h["state_bytes"] > 0 == d["state_bytes"]
    assert r["memory_ratio"] == h["total_bytes"] / d["total_bytes"] < 0.26
    assert all(m[f"decode_tok_s_b{b}"] > 0 for m in (h, d) for b in r["batches"])
