"""FastV check shared by the decoder families: pruned serving (one prefill call, then decode steps
with per-layer offsets over ring / segmented caches) against the same decoder run once over the
whole sequence (prompt + generated tokens) with the prune applied at the scoring layer, scored by
the prompt's last token. That reference has no cache reuse, chunking or decode offsets, so it
checks everything the engine adds; `prune_order` itself is checked against an independent FastV
on LLaVA (test_research.py)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mmjax
from mmjax.models.nn.metadata import AttentionMetadata, Prune as PruneSpec
from mmjax.research import Prune
from mmjax.research.prompt import prompt_inputs
from mmjax.serving.runner import step_spans


def whole_sequence_fastv(vlm, prompt, image, layer, keep, generated) -> np.ndarray:
    """Logits [len(generated) + 1, vocab]: the decoder over prompt + generated in one call,
    pruned after `layer` to `keep` image tokens."""
    lm, family = vlm.engine.runner.text_model, vlm.family
    p = prompt_inputs(vlm, prompt, [image])
    t0 = len(p.ids)
    _, rope_delta = family.positions(p.ids, p.images, family.image_starts(p.ids, [p.images[0].num_tokens]))
    ids = np.r_[p.ids, np.asarray(generated, np.int32)]
    T = len(ids)
    gen_pos = np.arange(t0, T) + rope_delta
    positions = np.concatenate([p.positions, np.broadcast_to(gen_pos, (p.positions.shape[0], len(gen_pos)))], 1)
    img = ids == family.image_token_id
    feats = np.zeros((T, lm.feature_width), lm.embed_tokens.embedding.get_value().dtype)
    feats[img] = vlm.encode([image])[0]
    spans = np.r_[p.spans, np.full(len(generated), -1, np.int32)]
    out_len = T - (int(img.sum()) - keep)
    graphdef, state = nnx.split(lm)

    @jax.jit
    def logits(state, ids, feats, img, positions, spans):
        lm = nnx.merge(graphdef, state)
        embeds, extra = lm.inputs(ids[None], feats[None], img[None])
        prune = PruneSpec(layer, keep, out_len, img[None], jnp.asarray([t0 - 1], jnp.int32))
        cache = lm.init_cache(1, T, embeds.dtype, max_chunk=T)
        meta = AttentionMetadata(positions[:, None], jnp.zeros((1,), jnp.int32), T,
                                 spans=step_spans(family, spans[None]))
        hidden, _, _ = lm.forward_pruned(embeds, meta, cache, prune, **extra)
        return lm.logits(hidden[0])
    out = logits(state, *(jnp.asarray(a) for a in (ids, feats, img, positions, spans)))
    return np.asarray(out)[-(len(generated) + 1):]


def check_prune(vlm, prompt: str, image, layer: int, max_tokens: int = 8) -> None:
    """Pruned generation == the whole-sequence reference (greedy ids, logprobs within 1e-4);
    keeping every image token == no intervention; the cache really holds fewer positions."""
    n_img = vlm.prepare_images([image])[0].num_tokens
    keep = max(1, n_img // 3)
    sp = mmjax.SamplingParams(max_tokens=max_tokens, logprobs=1, temperature=0.0, ignore_eos=True)
    base, pruned, every = vlm.generate([
        {"prompt": prompt, "images": [image]},
        {"prompt": prompt, "images": [image], "intervention": Prune(keep=keep, layer=layer)},
        {"prompt": prompt, "images": [image], "intervention": Prune(keep=1.0, layer=layer)}], sp)
    assert pruned.pruned_tokens == n_img - keep and every.pruned_tokens == 0
    assert every.token_ids == base.token_ids
    np.testing.assert_allclose([every.logprobs[i][t] for i, t in enumerate(every.token_ids)],
                               [base.logprobs[i][t] for i, t in enumerate(base.token_ids)], atol=1e-5)
    ref = whole_sequence_fastv(vlm, prompt, image, layer, keep, pruned.token_ids[:-1])
    assert pruned.token_ids == [int(i) for i in ref.argmax(-1)]
    lp = ref - ref.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose([pruned.logprobs[i][t] for i, t in enumerate(pruned.token_ids)],
                               [lp[i, t] for i, t in enumerate(pruned.token_ids)], atol=1e-4)
    assert pruned.logprobs != base.logprobs
