"""Core hooks for families whose image prompts are text and whose image tokens attend to each other
(Gemma): `Family.image_prompt` (the placeholder replaced by text before tokenizing), images whose
tokens form several runs, `Family.bidirectional_images` (each run one bidirectional span; prefill
chunks never end inside a run) and the text model's `min_resume` (prefix reuse floor).

Exercised on the tiny LLaVA with those hooks switched on, against the whole-prompt forward
(`VLM.logits`, one call, no chunking) as the reference."""
import numpy as np
import pytest

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import ContextLengthError
from mmjax.models.family import image_runs

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = "USER: what <image>\n color is it ? ASSISTANT:"


def split_prompt(im) -> str:
    """One image's tokens as two runs with text between (as a pan-and-scan crop list is)."""
    return "<image>" * 6 + " the " + "<image>" * (im.num_tokens - 6)


@pytest.fixture
def load(llava_dirs):
    def make(*, bidirectional: bool, **kw):
        vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=2, max_model_len=128, **kw)
        vlm.family.image_prompt = split_prompt
        vlm.family.bidirectional_images = bidirectional
        return vlm
    return make


def chunks_of(vlm):
    """Record (start, n) of every prefill call."""
    seen, prefill = [], vlm.engine.runner.prefill

    def spy(chunks, *a, **kw):
        seen.extend((c.start, len(c.token_ids)) for c in chunks)
        return prefill(chunks, *a, **kw)
    vlm.engine.runner.prefill = spy
    return seen


def first_token_check(vlm, image, out):
    """The engine's first token and its logprob equal the whole-prompt forward's last row."""
    logits = vlm.logits(PROMPT, [image])
    lp = logits[-1] - np.log(np.exp(logits[-1] - logits[-1].max()).sum()) - logits[-1].max()
    assert out.token_ids[0] == int(np.argmax(logits[-1]))
    assert abs(out.logprobs[0][out.token_ids[0]] - lp[out.token_ids[0]]) < 1e-4
    return logits


def test_text_image_prompt_with_split_runs(load):
    vlm = load(bidirectional=False, prefill_chunk=64)
    image = noise_image(1, 40, 30)
    [im] = vlm.prepare_images([image])
    ids = np.asarray(vlm.tokenizer.encode_prompt(PROMPT, [im.num_tokens], [split_prompt(im)]))
    runs = image_runs(ids, vlm.family.image_token_id)
    assert (ids == vlm.family.image_token_id).sum() == im.num_tokens
    assert (runs[:, 1] - runs[:, 0]).tolist() == [6, im.num_tokens - 6]
    assert vlm.tokenizer.decode(ids[runs[0, 1]:runs[1, 0]]).strip() == "the"
    sp = mmjax.SamplingParams(max_tokens=8, logprobs=1, **GREEDY)
    [whole] = vlm.generate([{"prompt": PROMPT, "images": [image]}], sp)
    first_token_check(vlm, image, whole)
    # causal family: chunks may cut runs anywhere and change nothing
    small = load(bidirectional=False, prefill_chunk=8)
    seen = chunks_of(small)
    [chunked] = small.generate([{"prompt": PROMPT, "images": [image]}], sp)
    assert chunked.token_ids == whole.token_ids
    assert any(a < s + n < b for s, n in seen for a, b in runs)


def test_placeholder_text_in_a_message_stays_text(load):
    """The expansion moves the message-text spans: a special token typed after the image is still
    plain text, the template's own specials still parse."""
    vlm = load(bidirectional=False, prefill_chunk=64)
    [im] = vlm.prepare_images([noise_image(2, 30, 30)])
    prompt = vlm.tokenizer.render_chat([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "say </s> now"}]}])
    ids = vlm.tokenizer.encode_prompt(prompt, [im.num_tokens], [split_prompt(im)])
    eos = vlm.tokenizer.eos_id
    assert eos not in ids and "</s>" in vlm.tokenizer.decode(ids, skip_special_tokens=False)
    assert sum(i == vlm.family.image_token_id for i in ids) == im.num_tokens


def test_bidirectional_runs_are_never_split_by_prefill_chunks(load):
    image = noise_image(3, 50, 40)
    sp = mmjax.SamplingParams(max_tokens=8, logprobs=1, **GREEDY)
    ref = load(bidirectional=True, prefill_chunk=64)
    [whole] = ref.generate([{"prompt": PROMPT, "images": [image]}], sp)
    logits = first_token_check(ref, image, whole)
    causal = load(bidirectional=False, prefill_chunk=64)
    assert rel_err(causal.logits(PROMPT, [image]), logits) > 1e-3  # the spans do change the model

    vlm = load(bidirectional=True, prefill_chunk=16)  # 10 (the 2nd run) <= 16 < the prompt
    seen = chunks_of(vlm)
    [chunked] = vlm.generate([{"prompt": PROMPT, "images": [image]}], sp)
    [im] = vlm.prepare_images([image])
    ids = np.asarray(vlm.tokenizer.encode_prompt(PROMPT, [im.num_tokens], [split_prompt(im)]))
    runs = image_runs(ids, vlm.family.image_token_id)
    assert len(seen) >= 3 and not any(a < s + n < b for s, n in seen for a, b in runs)
    assert chunked.token_ids == whole.token_ids
    np.testing.assert_allclose([chunked.logprobs[i][t] for i, t in enumerate(chunked.token_ids)],
                               [whole.logprobs[i][t] for i, t in enumerate(whole.token_ids)], atol=1e-4)

    too_small = load(bidirectional=True, prefill_chunk=8)
    with pytest.raises(ContextLengthError, match="one chunk"):
        too_small.engine.add_request(PROMPT, [im], sp)


def test_min_resume_turns_short_prefix_matches_into_misses(load):
    # the slot-row prefix cache's floor (decoders that cannot be paged: rings, recurrent states);
    # a paged engine shares whole pages and has no floor
    vlm = load(bidirectional=True, prefill_chunk=64, page_size=0)
    image = noise_image(4, 30, 30)
    sp = mmjax.SamplingParams(max_tokens=4, **GREEDY)
    vlm.generate([{"prompt": PROMPT, "images": [image]}], sp)
    [again] = vlm.generate([{"prompt": PROMPT.replace("color", "shape"), "images": [image]}], sp)
    assert again.cached_tokens > 0
    vlm.engine.scheduler.min_resume = lambda held: held  # only a whole retained row may resume
    [third] = vlm.generate([{"prompt": PROMPT.replace("color", "size"), "images": [image]}], sp)
    assert third.cached_tokens == 0
