"""LLaVA-1.5 parity with transformers on tiny random checkpoints (float32).

Tolerances: pixels max abs 1e-5; image features and logits relative error (max|a-b|/max|b|)
<= 1e-4; greedy generation identical ids for 32 tokens; logprobs within 1e-4 of transformers'
log_softmax.
"""
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


@pytest.fixture(scope="module", params=["gqa", "mha"])
def pair(request, llava_dirs):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    path = llava_dirs[request.param]
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=64)
    return request.param, hf, proc, vlm


def test_pixels_match(pair):
    _, _, proc, vlm = pair
    for seed, (w, h) in enumerate([(45, 61), (80, 33), (300, 200)]):
        img = noise_image(seed, w, h)
        ours = vlm.family.policy(img)
        theirs = proc.image_processor(img, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() <= 1e-5


def test_image_features_match(pair):
    _, hf, proc, vlm = pair
    imgs = [noise_image(10 + i, 50 + 17 * i, 40 + 9 * i) for i in range(3)]
    ours = vlm.encode(imgs)
    pv = proc.image_processor(imgs, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = hf.model.get_image_features(pixel_values=pv)
    theirs = theirs.pooler_output if hasattr(theirs, "pooler_output") else theirs
    theirs = torch.stack(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
    theirs = theirs.reshape(len(imgs), -1, theirs.shape[-1]).numpy()
    assert np.stack(ours).shape == theirs.shape
    assert rel_err(np.stack(ours), theirs) <= 1e-4


def test_prompt_ids_and_logits_match(pair):
    _, hf, proc, vlm = pair
    img = noise_image(3, 70, 52)
    inputs = proc(text=PROMPT, images=img, return_tensors="pt")
    ids = vlm.tokenizer.encode_prompt(PROMPT, [vlm.family.cfg.image_tokens_per_image])
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        theirs = hf(**inputs).logits[0].numpy()
    ours = vlm.logits(PROMPT, [img])
    assert ours.shape == theirs.shape
    assert rel_err(ours, theirs) <= 1e-4


def test_greedy_generation_and_logprobs_match(pair):
    _, hf, proc, vlm = pair
    img = noise_image(4, 64, 48)
    inputs = proc(text=PROMPT, images=img, return_tensors="pt")
    hf.generation_config.eos_token_id = None  # compare a full 32 tokens even if EOS comes up
    with torch.no_grad():
        gen = hf.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=3)
    theirs = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    out = vlm.generate([{"prompt": PROMPT, "images": [img]}],
                       mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(theirs) == 32
    assert out.token_ids == theirs
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in gen.logits]
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp[tok] - hf_lp[step][tok]) <= 1e-4
        for alt, v in lp.items():
            assert abs(v - hf_lp[step][alt]) <= 1e-4
        assert len(lp) >= 3


def test_chat_template_matches_transformers(pair):
    _, hf, proc, vlm = pair
    img = noise_image(5, 33, 77)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                             {"type": "text", "text": "what color?"}]}]
    theirs = proc.apply_chat_template(messages, add_generation_prompt=True)
    ours, _ = vlm.render_chat([{**m, "content": [dict(p, image=img) if p["type"] == "image" else p
                                                for p in m["content"]]} if isinstance(m["content"], list) else m
                               for m in messages])
    assert ours == theirs
    out = vlm.chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                 {"type": "text", "text": "describe"}]}],
                   mmjax.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 5


def test_batched_equals_one_at_a_time(llava_dirs):
    vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=4, max_model_len=256, prefill_chunk=32)
    reqs = []
    for i in range(6):  # more requests than slots, mixed prompt lengths and images
        n_img = i % 3
        prompt = "USER: " + "<image>\n" * n_img + "tell me " * (1 + 7 * i) + "ASSISTANT:"
        reqs.append({"prompt": prompt, "images": [noise_image(100 + 10 * i + j, 30 + 11 * j, 50 - 7 * j)
                                                  for j in range(n_img)]})
    sp = mmjax.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in vlm.generate(reqs, sp)]
    alone = [vlm.generate([r], sp)[0].token_ids for r in reqs]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_seeded_sampling_is_reproducible_and_batch_independent(llava_dirs):
    vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=4, max_model_len=256)
    img = noise_image(7, 40, 40)
    r = {"prompt": PROMPT, "images": [img]}
    sp = mmjax.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = vlm.generate([r], sp)[0].token_ids
    b = vlm.generate([r, {"prompt": "USER: hello ASSISTANT:"}], sp)[0].token_ids
    c = vlm.generate([r], mmjax.SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_tie_flag_only_at_top_level(tmp_path):
    """LlavaConfig(tie_word_embeddings=True) over a text config saying false: transformers ties
    (the file has no lm_head); mmjax follows the top-level flag and matches its logits. The
    other placements are the fixtures: both false ("gqa"), both true ("mha")."""
    import json

    from safetensors import safe_open
    from tiny_checkpoints import build_llava
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = build_llava(tmp_path / "tie", variant="tie-top", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["text_config"].get("tie_word_embeddings") is not True
    with safe_open(str(path / "model.safetensors"), "np") as f:
        assert not any(k.endswith("lm_head.weight") for k in f.keys())
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    vlm = mmjax.load(path, max_num_seqs=1, max_model_len=128, prefill_chunk=64)
    assert vlm.family.cfg.text.tie_word_embeddings
    img = noise_image(9, 61, 47)
    with torch.no_grad():
        theirs = hf(**proc(text=PROMPT, images=img, return_tensors="pt")).logits[0].numpy()
    assert rel_err(vlm.logits(PROMPT, [img]), theirs) <= 1e-4
