"""Engine: continuous batching equals one-at-a-time, caches, aborts, compile bounds, streaming
details (stop strings, UTF-8-safe incremental detokenisation), failure isolation."""
import asyncio

import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image
from mmjax.serving import AsyncEngine
from mmjax.models.nn import kv_cache as decoder
from tiny_checkpoints import WORDS

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_prompt(rng, n_words: int, n_images: int) -> str:
    words = " ".join(rng.choice(WORDS[:60], n_words))
    return "USER: " + "<image>\n" * n_images + words + " ASSISTANT:"


@pytest.fixture(scope="module")
def path(llava_dirs):
    return llava_dirs["gqa"]


def run_with_arrivals(engine, reqs, arrivals):
    """Add request i at engine step arrivals[i]; step until all finish."""
    ids = [None] * len(reqs)
    step = 0
    while any(i is None for i in ids) or any(engine.requests[r].finish_reason is None for r in ids):
        for i, (r, a) in enumerate(zip(reqs, arrivals)):
            if ids[i] is None and a <= step:
                ids[i] = engine.add_request(r["prompt"], r["images"], r["sampling"])
        engine.step()
        step += 1
    return [engine.output(r) for r in ids]


def test_concurrent_random_arrivals_equal_one_at_a_time(path, monkeypatch):
    """Also crosses decode attention's two formulations: the concurrent run's decode steps use
    broadcast-multiply-reduce (forced; 6 slots x 2 KV heads is under the size where the model
    picks it), the one-at-a-time run uses dots."""
    rng = np.random.default_rng(0)
    # pages of 2 positions: the prompts' short common openings are shared (whole pages only)
    base = mmjax.load(path, max_num_seqs=6, max_model_len=1024, prefill_chunk=128, page_size=2)
    reqs = []
    for i in range(16):
        n_img = [0, 2][i] if i < 2 else int(rng.integers(0, 3))
        n_words = [1, 260][i] if i < 2 else int(rng.choice([3, 20, 80, 250]))
        imgs = base.prepare_images([noise_image(1000 + 10 * i + j, int(rng.integers(20, 90)), int(rng.integers(20, 90)))
                                    for j in range(n_img)])
        reqs.append({"prompt": make_prompt(rng, n_words, n_img), "images": imgs,
                     "sampling": mmjax.SamplingParams(max_tokens=int(rng.integers(1, 65)), logprobs=1, **GREEDY)})
    lens = [len(base.tokenizer.encode_prompt(r["prompt"], [im.num_tokens for im in r["images"]])) for r in reqs]
    assert min(lens) <= 12 and max(lens) >= 500  # prompt lengths span ~5..600 tokens
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", 0)
    together = run_with_arrivals(base.engine, reqs, rng.integers(0, 40, len(reqs)))
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", 10 ** 9)
    alone_vlm = mmjax.load(path, max_num_seqs=1, max_model_len=1024, prefill_chunk=128, enable_prefix_cache=False)
    alone = [alone_vlm.engine.run_until_done([alone_vlm.engine.add_request(r["prompt"], r["images"], r["sampling"])])[0]
             for r in reqs]
    for t, a, r in zip(together, alone, reqs):
        assert t.token_ids == a.token_ids
        assert len(t.token_ids) == r["sampling"].max_tokens
        assert max(abs(x[i] - y[i]) for x, y, i in zip(t.logprobs, a.logprobs, t.token_ids)) <= 1e-4
    # prefills were packed (several requests' chunks in one call), some of them after prefix hits,
    # and running requests' decode steps rode in prefill calls (mixed steps; alone: never)
    assert base.engine.counters["prefill_chunks"] > base.engine.counters["prefill_calls"]
    assert base.engine.counters["mixed_steps"] > 0 and alone_vlm.engine.counters["mixed_steps"] == 0
    assert base.engine.stats()["tokens_cached"] > 0


def test_alternating_long_and_short_rounds(path):
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=1024, prefill_chunk=64)
    rng = np.random.default_rng(1)
    for rnd in range(4):
        n = 300 if rnd % 2 == 0 else 2
        reqs = [{"prompt": make_prompt(rng, n, 1), "images": [noise_image(rnd * 7 + k, 40, 40)]} for k in range(3)]
        outs = vlm.generate(reqs, mmjax.SamplingParams(max_tokens=5, **GREEDY))
        assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert vlm.engine.stats()["requests_running"] == 0


def test_twelve_images_in_one_request_match_transformers(path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    imgs = [noise_image(300 + i, 30 + 5 * i, 60 - 2 * i) for i in range(12)]
    prompt = "USER: " + "".join(f"image {i}: <image>\n" for i in range(12)) + "compare them ASSISTANT:"
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=512, prefill_chunk=64)
    ours = vlm.generate([{"prompt": prompt, "images": imgs}], mmjax.SamplingParams(max_tokens=8, **GREEDY))[0]
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    inputs = proc(text=prompt, images=imgs, return_tensors="pt")
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        seq = hf.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=3)
    assert ours.token_ids == seq[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours.num_image_tokens == 12 * 16
    assert vlm.engine.stats()["encoder_calls"] == 2  # 12 images in bucketed batches of <= 8


def test_encoder_cache_and_prefix_cache(path):
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=256, page_size=4)   # the prefix is shared by page
    img, other = noise_image(42, 64, 48), noise_image(43, 64, 48)  # same size, different pixels
    sp = mmjax.SamplingParams(max_tokens=6, **GREEDY)
    first = vlm.generate([{"prompt": f"USER: <image>\nquestion {i} ASSISTANT:", "images": [img]} for i in range(5)], sp)
    assert vlm.engine.stats()["images_encoded"] == 1
    # Without the prefix cache the embeddings come from the encoder cache instead.
    nopc = mmjax.load(path, max_num_seqs=2, max_model_len=256, enable_prefix_cache=False)
    again = nopc.generate([{"prompt": f"USER: <image>\nquestion {i} ASSISTANT:", "images": [img]} for i in range(5)], sp)
    st = nopc.engine.stats()
    assert st["images_encoded"] == 1 and st["encoder_cache_hits"] >= 3
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    # A different image of the same size is encoded, never served from the cache.
    vlm.generate([{"prompt": "USER: <image>\nquestion 0 ASSISTANT:", "images": [other]}], sp)
    assert vlm.engine.stats()["images_encoded"] == 2

    # Same image, different question: KV reused up to the question, same output as no caching.
    cold = mmjax.load(path, max_num_seqs=2, max_model_len=256, enable_prefix_cache=False)
    q2 = {"prompt": "USER: <image>\nwhat color is the sky ASSISTANT:", "images": [img]}
    warm = vlm.generate([q2], sp)[0]
    ref = cold.generate([q2], sp)[0]
    n_prefix = len(vlm.tokenizer.encode_prompt("USER: <image>\n", [16]))
    assert warm.cached_tokens >= n_prefix // 4 * 4 > 0 and warm.cached_tokens % 4 == 0
    assert warm.token_ids == ref.token_ids and ref.cached_tokens == 0
    # A new image of the same size with the same question: the cache stops before the image.
    q3 = {"prompt": "USER: <image>\nwhat color is the sky ASSISTANT:", "images": [noise_image(44, 64, 48)]}
    warm3, ref3 = vlm.generate([q3], sp)[0], cold.generate([q3], sp)[0]
    image_start = vlm.tokenizer.encode_prompt("USER: <image>", [16]).index(vlm.family.image_token_id)
    assert warm3.cached_tokens <= image_start
    assert warm3.token_ids == ref3.token_ids


def test_abort_frees_slot_and_many_requests_finish(path):
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256)
    eng = vlm.engine
    rid = eng.add_request("USER: tell me a long story ASSISTANT:", [], mmjax.SamplingParams(max_tokens=60, **GREEDY))
    for _ in range(5):
        eng.step()
    assert eng.stats()["slots_used"] == 1
    assert eng.abort(rid)
    assert eng.stats()["slots_used"] == 0 and eng.output(rid).finish_reason == "abort"
    rng = np.random.default_rng(5)
    ids = [eng.add_request(make_prompt(rng, int(rng.integers(1, 30)), 0), [],
                           mmjax.SamplingParams(max_tokens=int(rng.integers(1, 6)), **GREEDY)) for _ in range(100)]
    outs = eng.run_until_done(ids)
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.stats()["requests_finished"] == 100 and eng.stats()["slots_used"] == 0


def test_compiled_shapes_bounded_after_random_requests(path):
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=512, prefill_chunk=64, max_encode_batch=4)
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(50):
        n_img = int(rng.integers(0, 4))
        reqs.append({"prompt": make_prompt(rng, int(rng.integers(1, 150)), n_img),
                     "images": [noise_image(2000 + 5 * i + j, 30, 30) for j in range(n_img)],
                     "sampling": mmjax.SamplingParams(max_tokens=int(rng.integers(1, 20)), **GREEDY)})
    vlm.generate(reqs)
    st = vlm.engine.stats()
    for kind, n in st["compiled_shapes"].items():
        assert 1 <= n <= st["compiled_shapes_bound"][kind], (kind, n, st["compiled_shapes_bound"])
    bound, seen = st["compiled_shapes_bound"], []
    assert vlm.engine.warmup(progress=lambda *a: seen.append(a)) == bound
    # warmup's progress: each shape it compiles (those the requests did not), n of N counting them
    total, before = sum(bound.values()), sum(st["compiled_shapes"].values())
    assert [s[:2] for s in seen] == [(n, total) for n in range(before + 1, total + 1)]
    assert all(kind in bound and sec > 0 for _, _, kind, _, sec in seen)
    # warmup covers every shape a request can reach but FastV's: prompt_logprobs of any length
    # (its prefill_scores step, chunk by chunk) compiles nothing more (issue 56)
    runner = vlm.engine.runner
    compiled = {k: set(v) for k, v in runner.compiled.items()}
    assert bound["prefill_scores"] == len(compiled["prefill_scores"]) > 0
    sp = mmjax.SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)
    outs = vlm.generate([{"prompt": make_prompt(rng, n, 0), "sampling": sp} for n in (5, 40, 100, 150)])
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    assert {k: set(v) for k, v in runner.compiled.items()} == compiled


def test_warmup_progress_lines(path, capsys):
    """A fresh engine's warmup says what it compiles, one line per shape on the mmjax.progress
    logger (n of N, the shape, seconds: here mostly loads from the persistent compilation cache),
    quiet in the offline API until asked: mmjax.load(verbose=True) prints them to stderr."""
    import logging
    import re

    from mmjax import progress

    assert not progress.log.isEnabledFor(logging.INFO)        # quiet unless asked
    try:
        vlm = mmjax.load(path, max_num_seqs=2, max_model_len=256, prefill_chunk=64, max_encode_batch=2,
                         verbose=True)
        capsys.readouterr()
        counts = vlm.engine.warmup()
        err = capsys.readouterr().err
    finally:                                                   # back to quiet for the other tests
        for h in [h for h in progress.log.handlers if getattr(h, "_mmjax_progress", False)]:
            progress.log.removeHandler(h)
        progress.log.setLevel(logging.NOTSET)
        progress.log.propagate = True
    total = sum(vlm.engine.stats()["compiled_shapes_bound"].values())
    lines = [x[len("mmjax: "):] for x in err.splitlines() if x.startswith("mmjax: warmup")]
    assert sum(counts.values()) == total == len(lines) > 5
    for i, line in enumerate(lines):
        assert re.fullmatch(rf"warmup: compiled shape {i + 1}/{total}, [a-z_]+ "
                            r"\([0-9, ]+\), in \d+\.\d s", line), line
    kinds = [line.split(", ")[1].split(" ")[0] for line in lines]
    assert {"encode", "prefill", "decode"} <= set(kinds)


def test_decode_rows_follow_busy_slots(path):
    """One running request decodes a 1-row step, not max_num_seqs rows; with three running the
    step covers the lowest 4 slots; a request admitted while others run takes a free slot that
    does not grow the step (slot 1 or 3 of 0..3, never 4..7); results equal the same requests run
    one at a time."""
    vlm = mmjax.load(path, max_num_seqs=8, max_model_len=256, prefill_chunk=64,
                     enable_prefix_cache=False)
    eng = vlm.engine
    rng = np.random.default_rng(11)
    prompts = [make_prompt(rng, int(rng.integers(3, 30)), 0) for _ in range(4)]
    sp = mmjax.SamplingParams(max_tokens=12, **GREEDY)
    alone = [eng.run_until_done([eng.add_request(p, [], sp)])[0].token_ids for p in prompts]
    assert eng.runner.compiled["decode"] == {(1, 1)}           # (rows, steps a call)
    rids = [eng.add_request(p, [], sp) for p in prompts[:3]]
    for _ in range(3):
        eng.step()
    assert sorted(eng.requests[r].slot for r in rids) == [0, 1, 2]
    eng.abort(rids[1])
    late = eng.add_request(prompts[3], [], sp)
    eng.step()
    assert eng.requests[late].slot in (1, 3)
    outs = eng.run_until_done([rids[0], rids[2], late])
    assert [o.token_ids for o in outs] == [alone[0], alone[2], alone[3]]
    assert eng.runner.compiled["decode"] == {(1, 1), (2, 1), (4, 1)}


def test_prefill_budget_packs_requests_into_one_call(path):
    """Per step at most prefill_chunk prompt tokens in one call. The first prefilling request
    takes what it needs (a long prompt spreads over steps); after it, a prompt starts only if
    the rest of it fits, packed into the same call, and a short prompt behind one that does not
    fit goes first. Without packing (one call per request) the first prompt that does not
    fit ends the plan."""
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=512, prefill_chunk=64,
                     enable_prefix_cache=False)
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=4, **GREEDY)

    def steps(n):
        ids = [eng.add_request(list(range(5, 5 + n)), [], sp) for n in (150, 30, 40, 10)]
        seen = []
        for _ in range(n):
            calls = eng.counters["prefill_calls"]
            eng.step()
            seen.append(([eng.requests[i].prefilled for i in ids], eng.counters["prefill_calls"] - calls))
        assert all(o.finish_reason == "length" for o in eng.run_until_done(ids))
        return seen
    assert steps(4) == [([64, 0, 0, 0], 1),      # the long prompt takes the whole budget
                        ([128, 0, 0, 0], 1),
                        ([150, 30, 0, 10], 1),   # its tail (22) + 30 whole; 40 > 12 left, 10 fits
                        ([150, 30, 40, 10], 1)]
    assert eng.counters["prefill_chunks"] - eng.counters["prefill_calls"] == 2      # 1 + 1 + 3 + 1 chunks
    assert {s for _, s in eng.runner.compiled["prefill"]} == {4}      # one segment count: no extra shapes
    eng.scheduler.max_segments = 1              # the plan without packing (Engine(pack_prefill=False))
    seen = [p for p, _ in steps(3)]
    # 40 > 12 left never starts (the 10-token prompt does if its slot comes before the 40's:
    # the plan walks the slots, which the first round left in another order)
    assert seen[:2] == [[64, 0, 0, 0], [128, 0, 0, 0]] and seen[2][:3] == [150, 30, 0], seen
    # images are encoded for the step whose prefill takes them, not all on admission (three
    # ~45-token image prompts: one per step)
    prompt = "USER: <image>\nsay one two three four five ASSISTANT:"
    ids = [eng.add_request(prompt, vlm.prepare_images([noise_image(70 + i, 30, 30)]), sp) for i in range(3)]
    seen = []
    for _ in range(3):
        eng.step()
        seen.append((eng.stats()["images_encoded"], sum(eng.requests[i].prefilled > 0 for i in ids)))
    assert seen == [(1, 1), (2, 2), (3, 3)], seen
    assert all(o.finish_reason == "length" for o in eng.run_until_done(ids))


def test_stop_strings_and_streamed_text(path):
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=256)
    img = noise_image(50, 40, 40)
    prompt = {"prompt": "USER: <image>\nsay something ASSISTANT:", "images": [img]}
    full = vlm.generate([prompt], mmjax.SamplingParams(max_tokens=24, **GREEDY))[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert len(stop) == 2 and "\ufffd" not in stop
    eng = vlm.engine
    rid = eng.add_request(prompt["prompt"], vlm.prepare_images([img]), mmjax.SamplingParams(max_tokens=24, stop=[stop], **GREEDY))
    streamed = ""
    while eng.has_work():
        for d in eng.step():
            streamed += d.text
    out = eng.output(rid)
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.find(stop)]
    assert streamed == out.text


def test_incremental_detokenizer_never_splits_utf8(path):
    from mmjax.tokenizer import IncrementalDetokenizer
    vlm = mmjax.load(path)
    text = "café naïve 東京 😀 ok"
    ids = vlm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    det = IncrementalDetokenizer(vlm.tokenizer)
    deltas = [det.add(i) for i in ids] + [det.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("kv_cache_dtype,page_size", [("auto", 0), ("int8", 0), ("auto", 16)])
def test_gpu_decode_path_equals_the_cpu_one(path, monkeypatch, kv_cache_dtype, page_size):
    """The GPU decode path end to end, here with its Pallas kernels interpreted: a runner whose
    tuning takes the ragged decode kernel (one call per layer over the GPU ladder's 512-position
    segments: 1024 positions are 2 segments) generates the CPU path's greedy tokens and logprobs
    under continuous batching: rows of different lengths, decode crossing the segment boundary,
    rows parked as their requests end while others go on; over an int8 cache too (the kernel
    applies the per-key scales; the CPU path's kernel does the same with its own arithmetic).
    page_size 16: a paged cache, whose decode rows, packed prefill chunks and riders all take
    the paged Pallas kernel (mmjax.attention.paged) over pages of 16 positions."""
    from mmjax import backend
    rng = np.random.default_rng(3)
    kw = dict(max_num_seqs=4, max_model_len=1024, prefill_chunk=128, kv_cache_dtype=kv_cache_dtype)
    base = mmjax.load(path, page_size=64, **kw)       # the CPU path over a paged cache
    reqs = []
    for i, (n_words, n_img, n_new) in enumerate([(250, 1, 40), (3, 0, 9), (80, 2, 25), (20, 1, 3)]):
        imgs = base.prepare_images([noise_image(500 + 10 * i + j, 40 + 7 * j, 64) for j in range(n_img)])
        reqs.append((make_prompt(rng, n_words, n_img), imgs, mmjax.SamplingParams(max_tokens=n_new, logprobs=1,
                                                                                  **GREEDY)))
    lens = [len(base.tokenizer.encode_prompt(p, [im.num_tokens for im in imgs])) for p, imgs, _ in reqs]
    assert lens[0] < 512 < lens[0] + 40          # its decode crosses into the second GPU segment

    def generate(vlm):
        return vlm.engine.run_until_done([vlm.engine.add_request(*r) for r in reqs])

    cpu = generate(base)
    monkeypatch.setattr(backend.Tuning, "pallas_kernels", property(lambda self: True))
    monkeypatch.setattr(backend.Tuning, "cpu_kernels", property(lambda self: False))
    monkeypatch.setattr(backend.Tuning, "kv_segment_ladder", property(lambda self: (512, 1)))
    gpu = mmjax.load(path, page_size=page_size, **kw)     # slot rows: GPUs' default (the CPU run above is paged)
    r = gpu.engine.runner
    assert {tuple(v.shape[2] for v in layer["v"]) for layer in r.cache} == {(16,) if page_size else (512, 512)}
    jaxpr = str(r._decode.trace(r.lm_leaves, r.cache, r.state, np.full(2, 5, np.int32), r.all_allowed(2),
                                rows=2).jaxpr)
    kernel = "mmjax_paged_attention" if page_size else "mmjax_ragged_decode_attention"
    assert jaxpr.count(f"name={kernel}") == 2      # one per layer (2 layers)
    for c, g in zip(cpu, generate(gpu)):
        assert c.token_ids == g.token_ids
        assert max(abs(x[i] - y[i]) for x, y, i in zip(c.logprobs, g.logprobs, c.token_ids)) <= 1e-4


def _decoding_tokenizers():
    """tokenizers.Tokenizer objects with the decoders families use: byte-level BPE (LLaVA / Qwen),
    Llama 2's byte-fallback Metaspace sequence, bare Metaspace (both prepend schemes) and
    WordPiece with space cleanup (it rewrites text before the newest token)."""
    from tokenizers import Tokenizer, decoders, models
    from tiny_checkpoints import train_tokenizer
    out = {"byte-level": train_tokenizer([]).backend_tokenizer}
    pieces = ["▁the", "▁cat", "s", "▁", "a", "é", "東", "▁naïve", "."]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})

    def with_special(model, decoder):
        t = Tokenizer(model)
        t.add_special_tokens(["<s>", "</s>"])
        t.decoder = decoder
        return t
    out["llama2"] = with_special(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True), decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]))
    for scheme in ("always", "first"):
        out[f"metaspace-{scheme}"] = with_special(models.BPE(vocab, [], unk_token="<unk>"),
                                                  decoders.Metaspace(prepend_scheme=scheme))
    wp = {"[UNK]": 0, "<s>": 1, "</s>": 2, "the": 3, "##s": 4, ".": 5, ",": 6, "cat": 7, "##at": 8, "'": 9, "s": 10}
    out["wordpiece"] = with_special(models.WordPiece(wp, unk_token="[UNK]"), decoders.WordPiece(cleanup=True))
    return out


def _prefix_stable(tok, ids, skip) -> bool:
    """Does every prefix of `ids` that decodes to whole characters decode to a prefix of the
    whole decode? (Not so where a later token rewrites earlier text: WordPiece's space cleanup
    around an apostrophe, a byte-fallback run that turns invalid. No stream can take text back,
    so there the stream cannot equal the whole decode.)"""
    full = tok.decode(ids, skip)
    parts = (tok.decode(ids[:i], skip) for i in range(1, len(ids)))
    return all(p.endswith("\ufffd") or full.startswith(p) for p in parts)


def _draw_ids(rng, t, n: int) -> list[int]:
    """n units of a tokenizer's vocabulary: a token, or the byte tokens (<0x..>) of one random
    character's UTF-8 encoding where the vocabulary has them (what a byte-fallback model emits)."""
    vocab = t.get_vocab()
    byte_ids = {int(k[3:5], 16): v for k, v in vocab.items() if len(k) == 6 and k.startswith("<0x")}
    plain = [v for k, v in vocab.items() if not (len(k) == 6 and k.startswith("<0x"))]
    out = []
    for _ in range(n):
        if byte_ids and rng.random() < 0.3:
            out += [byte_ids[b] for b in chr(int(rng.choice([0xE9, 0x6771, 0x1F600, 0x4E2D]))).encode()]
        else:
            out.append(int(rng.choice(plain)))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_streams_the_whole_decode(skip):
    """The windowed incremental decode (a few ids per token) streams exactly the whole list's
    decode for every decoder kind, over random sequences (specials, multi-token characters,
    word-initial pieces) whose text no later token rewrites; and never ends a delta inside a
    character either way."""
    from mmjax.tokenizer import IncrementalDetokenizer

    class Tok:        # the one method IncrementalDetokenizer uses
        def __init__(self, t):
            self.t = t

        def decode(self, ids, skip_special_tokens=True):
            return self.t.decode(list(ids), skip_special_tokens=skip_special_tokens)

    rng = np.random.default_rng(0)
    for name, t in _decoding_tokenizers().items():
        tok, stable = Tok(t), 0
        for trial in range(40):
            ids = _draw_ids(rng, t, int(rng.integers(1, 60)))
            det = IncrementalDetokenizer(tok, skip)
            deltas = [det.add(i) for i in ids]
            assert not any(d.endswith("\ufffd") for d in deltas), (name, trial, ids)
            if _prefix_stable(tok, ids, skip):
                stable += 1
                assert "".join(deltas) + det.flush() == tok.decode(ids, skip), (name, trial, ids)
        assert stable >= 20, (name, stable)


def test_async_engine_isolates_bad_requests(path):
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=256)
    ae = AsyncEngine(vlm.engine)

    async def run(req):
        toks = []
        async for d in ae.stream(req):
            if d.error is not None:
                return d.error
            toks += d.token_ids
        return toks

    async def main():
        good = [vlm.engine.make_request("USER: hi there ASSISTANT:", [], mmjax.SamplingParams(max_tokens=4, **GREEDY))
                for _ in range(3)]
        dup = vlm.engine.make_request("USER: hi ASSISTANT:", [], mmjax.SamplingParams(max_tokens=4), request_id=good[0].id)
        return await asyncio.gather(*(run(r) for r in good), run(dup))

    try:
        *goods, bad = asyncio.run(main())
    finally:
        ae.shutdown()
    assert all(len(g) == 4 for g in goods)
    assert isinstance(bad, mmjax.InvalidRequestError)


def _step_all(eng, ids):
    """Step until every request is done; returns {request id: [deltas]}."""
    seen = {i: [] for i in ids}
    while any(eng.requests[i].finish_reason is None for i in ids):
        for d in eng.step():
            seen.setdefault(d.request_id, []).append(d)
    return seen


def test_an_image_that_fails_to_encode_fails_only_its_request(path):
    """Three requests encoded in one step; the encoder raises for one image (a joint call fails,
    then per-request calls find the culprit): that request ends with an error delta, the other
    two finish with the same tokens as when they run alone; the engine keeps serving."""
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=128)
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=6, **GREEDY)
    imgs = [vlm.prepare_images([noise_image(300 + i, 50 + 7 * i, 40)]) for i in range(3)]
    prompt = "USER: <image>\nwhat is it? ASSISTANT:"
    alone = [eng.run_until_done([eng.add_request(prompt, im, sp)])[0].token_ids for im in (imgs[0], imgs[2])]
    eng.encoder_cache = type(eng.encoder_cache)(eng.encoder_cache.max_bytes)   # encode again below
    poisoned = imgs[1][0].key
    real = eng.runner.encode_images

    def encode_images(images, adapter=-1):
        if any(im.key == poisoned for im in images):
            raise RuntimeError("simulated encoder failure")
        return real(images, adapter)
    eng.runner.encode_images = encode_images
    ids = [eng.add_request(prompt, im, sp) for im in imgs]
    seen = _step_all(eng, ids)
    bad = eng.requests[ids[1]]
    assert bad.finish_reason == "error" and "simulated encoder failure" in bad.error.message
    assert seen[ids[1]][-1].error is bad.error and not any(d.token_ids for d in seen[ids[1]])
    assert [eng.output(i).token_ids for i in (ids[0], ids[2])] == alone
    assert eng.stats()["slots_used"] == 0 and eng.stats()["requests_failed"] == 1
    with pytest.raises(mmjax.MMJaxError, match="simulated encoder failure"):
        eng.run_until_done([eng.add_request(prompt, imgs[1], sp)])
    eng.runner.encode_images = real
    assert eng.run_until_done([eng.add_request(prompt, imgs[1], sp)])[0].finish_reason == "length"


def test_a_failing_prefill_fails_only_its_request(path):
    """A prefill call that raises before it ran (the donated cache is intact) fails its request
    only; a decode-time failure that consumed the cache sends requests with no output back to
    the queue and fails those that had output."""
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=32)
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=5, **GREEDY)
    prompts = ["USER: hello ASSISTANT:", "USER: " + "tell me about the red circle and the blue square " * 3 + "ASSISTANT:"]
    alone = [eng.run_until_done([eng.add_request(p, [], sp)])[0].token_ids for p in prompts]
    real = eng.runner.prefill
    ids = [eng.add_request(p, [], sp) for p in prompts]

    def prefill(chunks, *a, **kw):
        if any(eng.slots[c.slot] is not None and eng.slots[c.slot].id == ids[1] for c in chunks):
            raise ValueError("simulated bad input")
        return real(chunks, *a, **kw)
    eng.runner.prefill = prefill
    _step_all(eng, ids)
    eng.runner.prefill = real
    assert eng.requests[ids[1]].finish_reason == "error"
    assert eng.output(ids[0]).token_ids == alone[0]

    # the cache consumed mid-run: request 0 has output (fails); request 1, halfway through its
    # prefill (16-token chunks), has none: lost in a decode call (mixed steps off: every decode
    # a call of its own), it goes back to the queue and reruns from its prompt; lost in a mixed
    # call (its chunk with request 0's decode riding), it is the culprit as in a prefill call of
    # its own (a prompt that takes the device down must not be rerun forever), and request 0
    # fails with the lost state
    for mixed in (False, True):
        eng2 = mmjax.load(path, max_num_seqs=2, max_model_len=256, prefill_chunk=16).engine
        if not mixed:
            eng2._riders = lambda group: []
        a, b = (eng2.add_request(p, [], sp) for p in prompts)
        kind = "prefill" if mixed else "decode"
        real_call = getattr(eng2.runner, kind)
        calls = {"n": 0}

        def call(*args, **kw):
            if mixed and not kw.get("riders"):
                return real_call(*args, **kw)
            calls["n"] += 1
            if calls["n"] == 2:
                for x in __import__("jax").tree.leaves(eng2.runner.cache):
                    x.delete()
                raise RuntimeError("simulated device loss")
            return real_call(*args, **kw)
        setattr(eng2.runner, kind, call)
        seen = _step_all(eng2, [a, b])
        assert eng2.requests[a].finish_reason == "error"
        if mixed:
            assert calls["n"] == 2 and eng2.counters["mixed_steps"] == 1
            assert "simulated device loss" in eng2.requests[b].error.message
            assert "device state was lost while running request " + b in eng2.requests[a].error.message
            continue
        assert eng2.counters["mixed_steps"] == 0
        assert len(eng2.requests[b].prompt_ids) > 32 and not any(d.error for d in seen[b])
        assert "simulated device loss" in eng2.requests[a].error.message
        assert eng2.output(b).token_ids == alone[1]


def test_generate_takes_one_sampling_params_per_request(path):
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=256)
    outs = vlm.generate(["USER: hi ASSISTANT:", "USER: hello ASSISTANT:"],
                        [mmjax.SamplingParams(max_tokens=2, **GREEDY), mmjax.SamplingParams(max_tokens=5, **GREEDY)])
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(mmjax.InvalidRequestError, match="one per request"):
        vlm.generate(["a", "b"], [mmjax.SamplingParams()])
    with pytest.raises(mmjax.InvalidRequestError, match="SamplingParams"):
        vlm.generate(["a"], [{"max_tokens": 3}])


def test_bare_image_token_ids_are_a_prompt_error(path):
    vlm = mmjax.load(path, max_num_seqs=1, max_model_len=256)
    image_id = vlm.family.image_token_id
    with pytest.raises(mmjax.PromptError, match="image tokens"):
        vlm.engine.add_request([1, 5, image_id, 7], [], mmjax.SamplingParams(max_tokens=2))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3", "gemma4_dense", "gemma4_moe"])
def test_mixed_steps_equal_separate_steps(family, llava_dirs, qwen_dirs, gemma3_dirs, gemma4_dirs):
    """A running request's decode step riding in a prefill call (a mixed step: its token in the
    packed row's padding, attending as a decode step does) gives what a decode step of its own
    gives: greedy ids and logprobs, seeded sampling with penalties (the decode state's history),
    n = 2 siblings, a prompt chunked over several calls, images, and M-RoPE
    positions past an image (Qwen2-VL's rope_delta), Gemma 3's ring-buffer sliding-window
    layers (a window smaller than the prompts), Gemma 4's KV-shared layers and per-layer input
    embeddings (dense) and its mixture of experts (moe)."""
    path = {"llava": llava_dirs["gqa"], "qwen2_vl": qwen_dirs["qwen2_vl"], "gemma3": gemma3_dirs["window"],
            "gemma4_dense": gemma4_dirs["dense"], "gemma4_moe": gemma4_dirs["moe"]}[family]
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=512, prefill_chunk=64, enable_prefix_cache=False)
    eng = vlm.engine
    assert eng.runner.mixes and eng.runner.rider_rows() == 4

    def chat(seed, text, w, h):
        content = ([{"type": "image", "image": noise_image(seed, w, h)}] if seed is not None else []) + \
            [{"type": "text", "text": text}]
        prompt, images = vlm.render_chat([{"role": "user", "content": content}])
        return prompt, vlm.prepare_images(images)
    lp = lambda n, **kw: mmjax.SamplingParams(logprobs=n, **{**GREEDY, **kw})  # noqa: E731
    long = " ".join(WORDS[i % 60] for i in range(110))            # chunked over several calls
    script = [  # (arrival step, (prompt, images), sampling)
        (0, chat(3, "describe it", 37, 52), lp(3, max_tokens=14)),
        (1, chat(None, long, 0, 0), lp(1, max_tokens=9)),
        (2, chat(None, "count to ten", 0, 0), mmjax.SamplingParams(
            max_tokens=16, temperature=0.9, seed=7, repetition_penalty=1.3, presence_penalty=0.4,
            frequency_penalty=0.2, logprobs=2)),
        (3, chat(5, "what colour", 50, 29), mmjax.SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=2)),
        (6, chat(None, long[:200], 0, 0), lp(0, max_tokens=7)),
    ]

    def run():
        eng.reset_device_state()
        before = eng.counters["mixed_steps"]
        ids, step = [None] * len(script), 0
        while any(i is None for i in ids) or any(eng.requests[r].finish_reason is None for g in ids for r in g):
            for k, (at, (prompt, images), sp) in enumerate(script):
                if ids[k] is None and at <= step:
                    ids[k] = [eng.submit(q) for q in eng.siblings(eng.make_request(prompt, images, sp), sp.n)]
            eng.step()
            step += 1
        outs = [eng.output(r) for g in ids for r in g]
        for g in ids:
            for r in g:
                eng.release(r)
        return outs, eng.counters["mixed_steps"] - before

    mixed, rode = run()
    eng._riders = lambda group: []        # the same compiled steps, every decode step a call of its own
    apart, none = run()
    assert rode >= 3 and none == 0
    assert [len(o.token_ids) for o in apart] == [14, 9, 16, 10, 10, 7]
    for a, b in zip(mixed, apart):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) <= 1e-4
    assert apart[3].token_ids != apart[4].token_ids       # n = 2: two sampled choices
    assert len(set(apart[2].token_ids)) > 4               # penalties spread the sampled tokens


def test_chunked_prompt_leaves_room_for_riders(path):
    """A prompt chunked anyway takes budget - riders tokens a call, so that the running
    requests' decode rides in each of its calls (no decode call of their own); a prompt that
    fits whole is not split for them."""
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=512, prefill_chunk=64, enable_prefix_cache=False)
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=40, **GREEDY)
    running = [eng.add_request(list(range(5, 5 + n)), [], sp) for n in (7, 9)]
    eng.step()                                      # both prompts in one call; then they decode
    long = eng.add_request(list(range(5, 155)), [], sp)
    seen = []
    for _ in range(3):
        mixed, decodes = eng.counters["mixed_steps"], eng.runner.calls["decode"]
        eng.step()
        seen.append((eng.requests[long].prefilled, eng.counters["mixed_steps"] - mixed,
                     eng.runner.calls["decode"] - decodes))
    assert seen == [(62, 1, 0), (124, 1, 0), (150, 1, 0)]      # 64 - 2 riders a chunk, its tail whole
    short = eng.add_request(list(range(5, 68)), [], sp)        # 63 tokens: fits whole, not split
    eng.step()
    assert eng.requests[short].prefilled == 63
    outs = eng.run_until_done(running + [long, short])
    assert [len(o.token_ids) for o in outs] == [40] * 4


def test_overlapped_steps_equal_synchronous_steps(path):
    """Overlapped steps (the host reads step N's tokens after queuing step N + 1) give the same
    outputs as waiting for every step: greedy ids and logprobs, a stop string, a stop id,
    max_tokens, n = 2 sampled with a seed, a grammar-constrained request (its steps run
    synchronously: nothing is left in flight while it decodes) and an abort mid-stream (at most
    one token fewer, a prefix of the synchronous run's; the freed slot serves a new request)."""
    from mmjax.serving.structured import StructuredSpec
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=512, prefill_chunk=64, enable_prefix_cache=False)
    eng = vlm.engine
    img = vlm.prepare_images([noise_image(61, 45, 30)])
    # p1: 250 tokens, so that decoding crosses the cache's first KV segment (256 positions on the
    # CPU: a kv_len one short there skips the segment holding the new token)
    p0, p1 = "USER: <image>\ndescribe it ASSISTANT:", [5 + i % 120 for i in range(250)]
    lp = lambda n, **kw: mmjax.SamplingParams(logprobs=n, **{**GREEDY, **kw})  # noqa: E731
    full = eng.run_until_done([eng.add_request(p0, img, lp(3, max_tokens=20)), eng.add_request(p1, [], lp(0, max_tokens=9))])
    stop = full[0].text[len(full[0].text) // 2:][:2]
    assert len(stop) == 2 and "\ufffd" not in stop
    script = [  # (arrival step, prompt, images, sampling)
        (0, p0, img, lp(3, max_tokens=20, stop=[stop])),
        (0, p1, [], lp(0, max_tokens=9, stop_token_ids=[full[1].token_ids[4]])),
        (1, "USER: count to ten ASSISTANT:", [], lp(None, max_tokens=40)),           # aborted at step 8
        (2, p1, [], mmjax.SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2, logprobs=1)),
        (3, "USER: pick ASSISTANT:", [], mmjax.SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                              structured=StructuredSpec("regex", "[a-c]{4,9}"))),
        (9, p0, img, lp(2, max_tokens=6)),
    ]

    def run(overlap):
        eng.overlap = overlap
        ids, step, in_flight = [None] * len(script), 0, []
        while any(i is None for i in ids) or any(eng.requests[r].finish_reason is None for g in ids for r in g):
            for k, (at, prompt, images, sp) in enumerate(script):
                if ids[k] is None and at <= step:
                    ids[k] = [eng.submit(q) for q in eng.siblings(eng.make_request(prompt, images, sp), sp.n)]
            if step == 8:
                assert eng.abort(ids[2][0])
            eng.step()
            step += 1
            grammar = any(r.constraints for r in eng.scheduler.decoding())
            in_flight.append((grammar, len(eng._pending)))
        assert eng.stats()["slots_used"] == 0
        outs = [[eng.output(r) for r in g] for g in ids]
        for g in ids:
            for r in g:
                eng.release(r)
        return [o for g in outs for o in g], in_flight

    ov, flight = run(True)
    sync, sync_flight = run(False)
    assert any(n for g, n in flight if not g) and not any(n for g, n in flight if g)  # overlapped; grammar: not
    assert not any(n for _, n in sync_flight)
    reasons = [o.finish_reason for o in sync]
    assert reasons == ["stop", "stop", "abort", "length", "length", "stop", "length"], reasons
    assert sync[1].token_ids == full[1].token_ids[:5] and sync[0].text == full[0].text[:full[0].text.find(stop)]
    for a, b in zip(ov, sync):
        if b.finish_reason == "abort":   # the overlapped run had read at most one step less
            assert b.token_ids[:len(a.token_ids)] == a.token_ids and len(b.token_ids) - len(a.token_ids) in (0, 1)
            continue
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) <= 1e-5
    assert sync[3].token_ids != sync[4].token_ids     # n = 2: two sampled choices


def test_multi_step_decode_equals_one_step(path):
    """decode_steps=4 (four tokens a row per decode call) gives the one-step engine's outputs:
    greedy ids and logprobs, a stop string and a stop id ending a request inside a call (the
    call's later tokens discarded), max_tokens that are not multiples of 4, n = 2 sampled with
    a seed, a grammar-constrained request (calls while it decodes take one step) and a request
    running into the context end (the calls near it take one step); the four-step calls ran
    (fewer decode calls than decode steps), within the compile bound (one- and four-step
    shapes)."""
    from mmjax.serving.structured import StructuredSpec
    kw = dict(max_num_seqs=4, max_model_len=512, prefill_chunk=64, enable_prefix_cache=False)
    one, four = mmjax.load(path, **kw), mmjax.load(path, decode_steps=4, **kw)
    img = one.prepare_images([noise_image(71, 38, 52)])
    p0, p1 = "USER: <image>\ndescribe it ASSISTANT:", [5 + i % 120 for i in range(250)]
    lp = lambda n, **k: mmjax.SamplingParams(logprobs=n, **{**GREEDY, **k})  # noqa: E731
    ref, ref1 = one.engine.run_until_done([one.engine.add_request(p0, img, lp(3, max_tokens=21)),
                                           one.engine.add_request(p1, [], lp(0, max_tokens=11))])
    stop = ref.text[len(ref.text) // 2:][:2]
    assert len(stop) == 2 and "\ufffd" not in stop
    script = [  # (arrival step, prompt, images, sampling)
        (0, p0, img, lp(3, max_tokens=21, stop=[stop])),
        (0, p1, [], lp(0, max_tokens=11, stop_token_ids=[ref1.token_ids[6]])),
        (1, [7 + i % 90 for i in range(502)], [], lp(1, max_tokens=30)),                # 10 tokens to the end
        (2, p1, [], mmjax.SamplingParams(max_tokens=13, temperature=0.8, seed=5, n=2, logprobs=1)),
        (6, "USER: pick ASSISTANT:", [], mmjax.SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                              structured=StructuredSpec("regex", "[a-c]{4,9}"))),
        (7, p0, img, lp(2, max_tokens=7)),
    ]

    def run(eng):
        ids, step = [None] * len(script), 0
        while any(i is None for i in ids) or any(eng.requests[r].finish_reason is None for g in ids for r in g):
            for k, (at, prompt, images, sp) in enumerate(script):
                if ids[k] is None and at <= step:
                    ids[k] = [eng.submit(q) for q in eng.siblings(eng.make_request(prompt, images, sp), sp.n)]
            eng.step()
            step += 1
        assert eng.stats()["slots_used"] == 0
        return [eng.output(r) for g in ids for r in g]

    a, b = run(one.engine), run(four.engine)
    reasons = [o.finish_reason for o in a]
    assert reasons == ["stop", "stop", "length", "length", "length", "stop", "length"], reasons
    assert len(a[2].token_ids) == 10                  # the context end, not max_tokens
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        for u, v in zip(x.logprobs or [], y.logprobs or []):
            assert u.keys() == v.keys() and max(abs(u[t] - v[t]) for t in u) <= 1e-5
    assert a[3].token_ids != a[4].token_ids           # n = 2: two sampled choices
    st = four.engine.stats()
    assert four.engine.runner.calls["decode"] < four.engine.counters["decode_steps"]
    # (a mixed step's decode rides in a prefill call)
    assert one.engine.runner.calls["decode"] + one.engine.counters["mixed_steps"] == one.engine.counters["decode_steps"]
    assert 1 <= st["compiled_shapes"]["decode"] <= st["compiled_shapes_bound"]["decode"]
    assert {s for _, s in four.engine.runner.compiled["decode"]} == {1, 4}
