"""mmjax.research on tiny LLaVA and Qwen2.5-VL checkpoints: trace equals the serving path,
interventions (off: identical; Pool: fewer tokens end to end; Ablate: what it says), saliency and
loss gradients against finite differences."""
import jax
from flax import nnx
import numpy as np
import pytest

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import InvalidRequestError
from mmjax.packed_weights import PackedWeight, unpacked
from mmjax.research import Ablate, Pool
from mmjax.research.gradients import answer_logprob
from mmjax.research.interventions import pool_grid

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llava", "qwen2_5_vl"])
def vlm(request, llava_dirs, qwen_dirs):
    path = llava_dirs["gqa"] if request.param == "llava" else qwen_dirs["qwen2_5_vl"]
    return mmjax.load(path, max_num_seqs=2, max_model_len=512, prefill_chunk=64)


def chat(image, text="what color is it"):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def test_trace_equals_the_serving_path(vlm):
    img = noise_image(10, 60, 44)
    layers = (1,)
    tr = vlm.trace(chat(img), layers=layers)
    prompt, _ = vlm.render_chat(chat(img))
    [out] = vlm.generate([{"prompt": prompt, "images": [img]}],
                         mmjax.SamplingParams(max_tokens=1, logprobs=1, **GREEDY))
    assert tr.ids.tolist() == out.prompt_token_ids
    last = tr.logits[-1].astype(np.float64)
    lp = last - last.max() - np.log(np.exp(last - last.max()).sum())
    assert out.token_ids[0] == int(np.argmax(last))
    assert abs(out.logprobs[0][out.token_ids[0]] - lp[out.token_ids[0]]) < 1e-4
    assert rel_err(tr.logits, vlm.logits(prompt, [img])) < 1e-5
    # spans and grids: image tokens are exactly the image's positions, on the family's grid
    [im] = tr.images
    t, r, c = im.grid
    assert t * r * c == len(im.positions) == out.num_image_tokens
    assert set(im.positions) | set(tr.text_positions) == set(range(len(tr.ids)))
    assert all(tr.tokens[i] == vlm.family.image_token for i in im.positions)
    # attention rows are distributions over visible keys; the heatmap is that row on the grid
    a = tr.attn[1]
    assert a.shape == (vlm.model.language_model.config.num_heads, len(tr.ids), len(tr.ids))
    np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)
    assert np.abs(np.triu(a[0], 1)).max() == 0                 # causal
    hm = tr.heatmap(1)
    assert hm.shape == (r, c)
    np.testing.assert_allclose(hm.ravel(), a[:, -1, im.positions].mean(0), rtol=1e-6)
    # hidden states: embeddings, after layer 1 (HF numbering), image rows selectable
    assert sorted(tr.hidden) == [0, 2] and tr.image_hidden(2).shape == (len(im.positions), vlm.model.language_model.hidden_size)
    mean = vlm.trace(chat(img), layers=layers, what=("attn",), heads="mean")
    np.testing.assert_allclose(mean.attn[1][0], a.mean(0), rtol=1e-5, atol=1e-7)
    assert not mean.hidden
    with pytest.raises(InvalidRequestError):
        vlm.trace(chat(img), layers=(99,))


def test_interventions_off_identical_pool_shrinks_ablate_acts(vlm):
    img = noise_image(11, 72, 56)
    prompt, _ = vlm.render_chat(chat(img))
    sp = mmjax.SamplingParams(max_tokens=6, logprobs=1, **GREEDY)
    pc = vlm.engine.prefix_cache

    def fresh():                             # both runs: slot 0, nothing cached, same shapes
        pc.clear()
        pc.last_used = [0.0] * len(pc.last_used)
    fresh()
    [base] = vlm.generate([{"prompt": prompt, "images": [img]}], sp)
    fresh()
    [again] = vlm.generate([{"prompt": prompt, "images": [img], "intervention": None}], sp)
    assert base.token_ids == again.token_ids and base.logprobs == again.logprobs     # bit-identical
    [im] = vlm.prepare_images([img])
    t, r, c = vlm.family.token_grid(im)

    pooled, = vlm.generate([{"prompt": prompt, "images": [img], "intervention": Pool(2)}], sp)
    n_pool = t * -(-r // 2) * -(-c // 2)
    assert pooled.num_image_tokens == n_pool < base.num_image_tokens
    assert len(pooled.prompt_token_ids) == len(base.prompt_token_ids) - (base.num_image_tokens - n_pool)
    # the pooled features are what the LLM got: trace with the same intervention sees them
    feats = vlm.encode([img])[0]
    want = pool_grid(feats.reshape(t, r, c, -1), 2).reshape(n_pool, -1)
    [pim] = vlm.prepare_images([img], intervention=Pool(2))
    np.testing.assert_allclose(vlm.engine.runner.encode_images([pim])[0], want, rtol=1e-6)
    assert pim.key != im.key
    tr = vlm.trace(chat(img), layers=(0,), what=("hidden",), intervention=Pool(2))
    np.testing.assert_allclose(tr.image_hidden(0), want, rtol=1e-6)
    [same] = vlm.generate([{"prompt": prompt, "images": [img], "intervention": Pool(1)}], sp)
    assert same.token_ids == base.token_ids                      # pooling by 1 changes nothing

    for mode in ("zero", "mean", "noise"):
        [aim] = vlm.prepare_images([img], intervention=Ablate(tokens=(0, 2), mode=mode, seed=3))
        got = vlm.engine.runner.encode_images([aim])[0]
        np.testing.assert_array_equal(got[[1, 3]], feats[[1, 3]])      # untouched rows
        expect = {"zero": np.zeros_like(feats[[0, 2]]), "mean": np.broadcast_to(feats.mean(0), (2, feats.shape[1]))}
        if mode in expect:
            np.testing.assert_allclose(got[[0, 2]], expect[mode], rtol=1e-6, atol=1e-7)
        else:
            assert np.abs(got[[0, 2]] - feats[[0, 2]]).min() > 0
    ablated, = vlm.generate([{"prompt": prompt, "images": [img], "intervention": Ablate()}], sp)
    assert ablated.logprobs != base.logprobs
    with pytest.raises(InvalidRequestError):
        vlm.prepare_images([img], intervention=Ablate(tokens=(10 ** 6,)))
    with pytest.raises(InvalidRequestError):
        Pool(0)


def test_saliency_and_loss_match_finite_differences(vlm):
    img = noise_image(12, 50, 40)
    sal = vlm.saliency(img, "what color is it", "red")
    assert sal.map.shape == sal.pixels.shape[:-1] and sal.map.ndim == 2 and sal.map.max() > 0
    prompt, _ = vlm.render_chat(chat(img))
    params = nnx.state(vlm.model)          # the live model's weights (packed for the CPU kernels here)
    v = np.random.default_rng(0).standard_normal(sal.pixels.shape).astype(np.float32)

    def f(x):
        return float(answer_logprob(vlm, params, prompt, "red", [img], pixels=[x]))
    assert abs(f(sal.pixels) - sal.logprob) < 1e-5
    eps = 1e-2
    fd = (f(sal.pixels + eps * v) - f(sal.pixels - eps * v)) / (2 * eps)
    assert abs(fd - float((sal.attribution * v).sum())) <= 0.03 * abs(fd) + 1e-6
    # integrated gradients: completeness (attributions sum to f(x) - f(baseline))
    ig = vlm.saliency(img, "what color is it", "red", method="integrated", steps=32)
    gap = sal.logprob - f(np.full_like(sal.pixels, -1.0))
    assert abs(ig.attribution.sum() - gap) <= 0.05 * abs(gap) + 1e-4
    # in the image's own pixels (50 x 40; the model saw a resized / cropped copy): the map and the
    # attribution moved back through the processor's geometry keep their sums (no padding here),
    # so integrated gradients stay complete there; zero where the model saw nothing of the image
    from mmjax.image.geometry import to_image
    assert sal.image_map.shape == (40, 50) and sal.image_attribution.shape == (40, 50, 3)
    assert sal.image_map.sum() == pytest.approx(sal.map.sum(), rel=1e-4)
    assert ig.image_attribution.sum() == pytest.approx(ig.attribution.sum(), rel=1e-3, abs=1e-5)
    views = vlm.family.pixel_views(vlm.prepare_images([img])[0], 40, 50)
    np.testing.assert_allclose(sal.image_map, to_image(sal.map, views, 40, 50), rtol=1e-6)
    t, left, b, r = views[0][1].source_box()
    cols = np.arange(50) + 0.5
    assert (sal.image_map[:, (cols < left - 1) | (cols > r + 1)] == 0).all() and sal.image_map.max() > 0
    # loss: jax.grad over the model's State (unpacked to the [in, out] weights research code edits;
    # the engine's own copy is packed for the CPU kernels), checked along a random direction in
    # the LM head
    live = nnx.state(vlm.model)
    params = unpacked(live)
    packed = lambda tree: [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PackedWeight))  # noqa: E731
                           if isinstance(x, PackedWeight)]
    assert packed(live) and not packed(params)
    head = params["language_model"]["lm_head"]["kernel"]
    assert head.get_value().shape == live["language_model"]["lm_head"]["kernel"].get_value().shape
    g = jax.grad(vlm.loss)(params, prompt, "red", [img])
    d = np.random.default_rng(1).standard_normal(head.get_value().shape).astype(np.float32)

    def lossf(delta):
        p = jax.tree.map(lambda x: x, params)
        p["language_model"]["lm_head"]["kernel"] = head.replace(head.get_value() + delta)
        return float(vlm.loss(p, prompt, "red", [img]))
    fd = (lossf(1e-2 * d) - lossf(-1e-2 * d)) / 2e-2
    assert abs(fd - float((np.asarray(g["language_model"]["lm_head"]["kernel"].get_value()) * d).sum())) \
        <= 0.02 * abs(fd) + 1e-5
    assert float(np.abs(np.asarray(jax.tree.leaves([g[k] for k in g if k != "language_model"])[0])).sum()) > 0


def fastv_reference(vlm, prompt, image, layer, keep, generated):
    """Logits [len(generated) + 1, vocab] of FastV computed directly from the decoder's layer
    functions: layers <= `layer` over the whole sequence (prompt + generated tokens), then the
    `keep` image tokens the prompt's last token attends to most (head mean) and every other token
    through the later layers, at their original RoPE positions."""
    import jax.numpy as jnp
    from mmjax.models.nn.decoder import find_sown
    from mmjax.models.nn.metadata import AttentionMetadata
    from mmjax.research.prompt import prompt_inputs

    lm, family = vlm.engine.runner.text_model, vlm.family
    p = prompt_inputs(vlm, prompt, [image])
    t0 = len(p.ids)
    _, rope_delta = family.positions(p.ids, p.images, family.image_starts(p.ids, [p.images[0].num_tokens]))
    ids = np.r_[p.ids, np.asarray(generated, np.int32)]
    gen_pos = np.arange(t0, len(ids)) + rope_delta
    positions = np.concatenate([p.positions, np.broadcast_to(gen_pos, (p.positions.shape[0], len(gen_pos)))], 1)
    img = ids == family.image_token_id
    x = np.array(lm.embed(jnp.asarray(ids)))
    x[img] = vlm.encode([image])[0]

    def run(x, pos, layers, capture_at=None):
        T = x.shape[0]
        pos = jnp.asarray(pos)[:, None]
        rope = lm.rope(pos)
        meta = AttentionMetadata(pos, jnp.zeros((1,), jnp.int32), T, capture=() if capture_at is None else (capture_at,))
        x, probs = jnp.asarray(x)[None], None
        for i in layers:
            kv = lm.layers[i].self_attn.init_cache(1, T, x.dtype)
            if i == capture_at:
                (x, _), inter = nnx.capture(lm.layers[i], nnx.Intermediate)(x, rope, meta, kv)
                probs = find_sown(inter, "attn_probs")[0]
            else:
                x, _ = lm.layers[i](x, rope, meta, kv)
        return x[0], probs

    x, probs = run(x, positions, range(layer + 1), capture_at=layer)
    score = np.asarray(probs[0]).mean(0)[t0 - 1]
    score[~img] = -np.inf
    kept = ~img
    kept[np.argsort(-score, kind="stable")[:keep]] = True
    x, _ = run(x[kept], positions[:, kept], range(layer + 1, lm.num_layers))
    return np.asarray(lm.logits(lm.norm(x)))[-(len(generated) + 1):]


def test_prune_matches_a_direct_fastv_and_shrinks_the_cache(vlm):
    from mmjax.research import Prune
    img = noise_image(13, 64, 48)
    prompt, _ = vlm.render_chat(chat(img))
    n_img = vlm.prepare_images([img])[0].num_tokens
    sp = mmjax.SamplingParams(max_tokens=10, logprobs=1, **GREEDY)
    keep = max(1, n_img // 4)
    base, pruned, every = vlm.generate([
        {"prompt": prompt, "images": [img]},
        {"prompt": prompt, "images": [img], "intervention": Prune(keep=keep, layer=0)},
        {"prompt": prompt, "images": [img], "intervention": Prune(keep=1.0, layer=0)}], sp)
    assert pruned.pruned_tokens == n_img - keep and every.pruned_tokens == 0 and base.pruned_tokens == 0
    # k = all: the prune path (explicit scoring attention, compaction, decode offsets) changes nothing
    assert every.token_ids == base.token_ids
    np.testing.assert_allclose([every.logprobs[i][t] for i, t in enumerate(every.token_ids)],
                               [base.logprobs[i][t] for i, t in enumerate(base.token_ids)], atol=1e-5)
    ref = fastv_reference(vlm, prompt, img, 0, keep, pruned.token_ids[:-1])
    assert pruned.token_ids == [int(i) for i in ref.argmax(-1)]
    lp = ref - ref.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose([pruned.logprobs[i][t] for i, t in enumerate(pruned.token_ids)],
                               [lp[i, t] for i, t in enumerate(pruned.token_ids)], atol=1e-4)
    assert pruned.logprobs != base.logprobs
    stats = vlm.engine.stats()
    assert stats["tokens_pruned"] >= n_img - keep and stats["compiled_shapes"]["prefill_pruned"] >= 1
    with pytest.raises(InvalidRequestError):
        vlm.generate([{"prompt": prompt, "images": [img], "intervention": Prune(keep=n_img + 1, layer=0)}], sp)
    with pytest.raises(InvalidRequestError):
        vlm.generate([{"prompt": prompt, "images": [img], "intervention": Prune(keep=2, layer=5)}], sp)


def test_tracing_leaves_the_serving_steps_alone(vlm):
    """trace compiles its own whole-prompt function; the serving steps' graphs and compiled
    executables are the same before and after."""
    r = vlm.engine.runner
    prefill_args = next(a for name, _, a, _ in r.step_signatures() if name.startswith("prefill"))
    before = r._prefill.lower(*prefill_args).as_text()
    counts = {k: r.compiled_counts()[k] for k in ("prefill", "decode")}
    vlm.trace(chat(noise_image(14, 40, 40)), layers=(0,))
    assert r._prefill.lower(*prefill_args).as_text() == before
    assert {k: r.compiled_counts()[k] for k in ("prefill", "decode")} == counts   # (encode: trace encodes)
    # a real prefill graph: attention (XLA's softmax, or the CPU prefill kernel) and matmuls (XLA's
    # dots, or the CPU packed-weight kernel)
    assert "exponential" in before or "mmjax_prefill_attention" in before
    assert "dot_general" in before or "mmjax_matmul" in before
