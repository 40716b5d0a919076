"""mmjax-shapes (issue 7) data contract: scenes, questions, tokenizer, HF-layout export."""
from __future__ import annotations

import collections
import io
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from mmjax.demo import config as C
from mmjax.demo import export as E
from mmjax.demo import shapes as S
from mmjax.demo import tokenizer as T

N_SCENES = 400


@pytest.fixture(scope="module")
def scenes():
    rng = np.random.default_rng(1234)
    out = [S.draw_scene(rng) for _ in range(N_SCENES)]
    # the extremes of the canvas range, both orientations
    for w, h in [(96, 96), (512, 512), (96, 512), (512, 96)]:
        for n in (1, 2, 3):
            out.append(S.draw_scene(rng, n_shapes=n, width=w, height=h))
    return out


@pytest.fixture(scope="module")
def tok():
    return T.train_tokenizer()


# ----------------------------------------------------------------------------- scenes

def test_scene_contract(scenes):
    counts = collections.Counter()
    kinds, colors = collections.Counter(), collections.Counter()
    for img, sc in scenes:
        assert img.mode == "RGB" and img.size == (sc.width, sc.height)
        assert S.MIN_SIDE <= sc.width <= S.MAX_SIDE and S.MIN_SIDE <= sc.height <= S.MAX_SIDE
        assert 1 <= sc.count <= 3
        counts[sc.count] += 1
        short = min(sc.width, sc.height)
        for s in sc.shapes:
            kinds[s.kind] += 1
            colors[s.color] += 1
            assert s.kind in S.SHAPES and s.color in S.COLORS
            assert 0.15 * short - 1e-6 <= s.size <= 0.35 * short + 1e-6
            x0, y0, x1, y1 = s.bbox
            assert x0 >= -1e-6 and y0 >= -1e-6 and x1 <= sc.width + 1e-6 and y1 <= sc.height + 1e-6
        for i, a in enumerate(sc.shapes):        # non-overlapping (bounding boxes disjoint)
            for b in sc.shapes[i + 1:]:
                assert S._boxes_disjoint(a.bbox, b.bbox, 0.0), (a, b)
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 0.25 * N_SCENES
    assert set(kinds) == set(S.SHAPES) and set(colors) == set(S.COLORS)
    assert max(kinds.values()) < 1.3 * min(kinds.values())
    assert max(colors.values()) < 1.4 * min(colors.values())
    sides = np.array([[sc.width, sc.height] for _, sc in scenes[:N_SCENES]])
    assert (sides[:, 0] != sides[:, 1]).mean() > 0.9          # mostly not square
    assert sides.min() < 130 and sides.max() > 480               # covers the range


def test_scene_pixels(scenes):
    """White background outside the shapes; each shape painted in its own color."""
    for img, sc in scenes[:150]:
        a = np.asarray(img).astype(int)
        outside = np.ones(a.shape[:2], bool)
        for s in sc.shapes:
            x0, y0, x1, y1 = s.bbox
            outside[max(0, int(y0) - 1):int(np.ceil(y1)) + 1,
                    max(0, int(x0) - 1):int(np.ceil(x1)) + 1] = False
            # center of the bounding box is inside all three shapes (triangle: mid-height)
            px = a[int(s.cy), int(s.cx)]
            assert np.abs(px - np.array(s.rgb)).max() <= 2, (s, px)
            # color class is recoverable from the painted pixel
            assert _nearest_color(px) == s.color
        assert (a[outside] == 255).all()


def _nearest_color(px):
    r, g, b = px
    if r > 150 and g > 150:
        return "yellow"
    return {0: "red", 1: "green", 2: "blue"}[int(np.argmax(px))]


def test_shape_area_matches_kind():
    """Filled fraction of the bounding box: square ~1, circle ~pi/4, triangle ~1/2."""
    rng = np.random.default_rng(7)
    want = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}
    for _ in range(60):
        img, sc = S.draw_scene(rng, n_shapes=1, antialias=False)
        s = sc.shapes[0]
        ink = (np.asarray(img).astype(int).min(-1) < 250).sum()
        assert abs(ink / s.size ** 2 - want[s.kind]) < 0.12 + 4 / s.size, (s, ink / s.size ** 2)


def test_min_center_gap_makes_order_well_defined(scenes):
    for _, sc in scenes:
        xs = sorted(s.cx for s in sc.shapes)
        assert all(b - a >= 0.04 * sc.width - 1e-6 for a, b in zip(xs, xs[1:]))


def test_describe_format_and_order(scenes):
    pat = re.compile(r"^a (red|green|blue|yellow) (circle|square|triangle)"
                     r"((, a \w+ \w+)? and a (red|green|blue|yellow) (circle|square|triangle))?$")
    for _, sc in scenes:
        d = S.describe(sc)
        assert pat.match(d), d
        assert d.count(" a ") + 1 == sc.count if sc.count > 1 else d.startswith("a ")
        ordered = sorted(sc.shapes, key=lambda s: s.cx)
        assert d == S.describe(S.Scene(sc.width, sc.height, tuple(ordered[::-1])))
        phrases = re.split(r", | and ", d)
        assert phrases == [f"a {s.color} {s.kind}" for s in ordered]
    one = S.Scene(100, 100, (S.Shape("circle", "red", 50, 50, 20),))
    two = S.Scene(100, 100, (S.Shape("square", "blue", 80, 50, 20), S.Shape("circle", "red", 20, 50, 20)))
    three = S.Scene(100, 100, two.shapes + (S.Shape("triangle", "green", 95, 10, 15),))
    assert S.describe(one) == "a red circle"
    assert S.describe(two) == "a red circle and a blue square"
    assert S.describe(three) == "a red circle, a blue square and a green triangle"


# ----------------------------------------------------------------------------- questions

ALLOWED = {
    "shape": set(S.SHAPES), "color": set(S.COLORS), "count": {"1", "2", "3"},
    "exists": {"yes", "no"},
}


def test_questions_answers_are_correct(scenes):
    rng = np.random.default_rng(5)
    for _, sc in scenes:
        for qt in S.QUESTION_TYPES:
            if qt in ("shape", "color") and sc.count != 1:
                with pytest.raises(ValueError):
                    S.make_question(rng, sc, qt)
                continue
            q, a = S.make_question(rng, sc, qt)
            assert S.question_type(q) == qt
            assert a == a.strip().lower() and not a.endswith(".")
            if qt in ALLOWED:
                assert a in ALLOWED[qt]
            if qt == "shape":
                assert q == "What shape is this?" and a == sc.shapes[0].kind
            elif qt == "color":
                assert q == "What color is the shape?" and a == sc.shapes[0].color
            elif qt == "count":
                assert q == "How many shapes are there?" and a == str(sc.count)
            elif qt == "describe":
                assert q == "Describe the image." and a == S.describe(sc)
            else:
                m = re.match(r"^Is there a (\w+) (\w+)\?$", q)
                assert m and m.group(1) in S.COLORS and m.group(2) in S.SHAPES
                assert a == ("yes" if sc.has(m.group(1), m.group(2)) else "no")


def test_exists_balance_and_hard_negatives():
    rng = np.random.default_rng(11)
    yes = hard = no = 0
    for _ in range(2000):
        sc = S.sample_scene(rng)
        q, a = S.make_question(rng, sc, "exists")
        if a == "yes":
            yes += 1
            continue
        no += 1
        c, k = re.match(r"^Is there a (\w+) (\w+)\?$", q).groups()
        hard += any(s.color == c or s.kind == k for s in sc.shapes)
    assert 0.45 < yes / 2000 < 0.55
    assert hard / no > 0.75


def test_question_type_mix():
    rng = np.random.default_rng(3)
    exs = [S.make_example(rng, client_roundtrip=False) for _ in range(1000)]
    c = collections.Counter(e["qtype"] for e in exs)
    assert set(c) == set(S.QUESTION_TYPES)
    assert min(c.values()) > 150
    for e in exs:
        assert S.make_question(np.random.default_rng(0), e["scene"], e["qtype"])[0] == e["question"] \
            or e["qtype"] == "exists"
        if e["qtype"] in ("shape", "color"):
            assert e["scene"].count == 1
    counts = collections.Counter(e["answer"] for e in exs if e["qtype"] == "count")
    assert set(counts) == {"1", "2", "3"}


def test_encode_like_client():
    rng = np.random.default_rng(0)
    img, _ = S.draw_scene(rng)
    data, fmt = S.encode_bytes(img, rng, "PNG")
    assert fmt == "PNG" and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(S.encode_like_client(img, rng, "PNG")), np.asarray(img))
    data, fmt = S.encode_bytes(img, rng, "JPEG")
    assert data[:2] == b"\xff\xd8"
    back = S.encode_like_client(img, rng, "JPEG")
    assert back.mode == "RGB" and back.size == img.size
    err = np.abs(np.asarray(back).astype(int) - np.asarray(img).astype(int))
    assert 0 < err.mean() < 3                       # quality >= 85: small, nonzero error
    fmts = collections.Counter(S.encode_bytes(img, rng)[1] for _ in range(200))
    assert 60 < fmts["PNG"] < 140 and fmts["PNG"] + fmts["JPEG"] == 200
    with Image.open(io.BytesIO(S.encode_bytes(img, rng, "JPEG")[0])) as im:
        assert im.format == "JPEG"


def test_answer_matches():
    assert S.answer_matches("circle", "circle")
    assert S.answer_matches("  Circle.\n", "circle")
    assert S.answer_matches("A red circle and a blue square.", "a red circle and a blue square")
    assert S.answer_matches("a red  circle", "a red circle")
    assert not S.answer_matches("circles", "circle")
    assert not S.answer_matches("a blue square and a red circle", "a red circle and a blue square")
    assert not S.answer_matches("yes, there is", "yes")
    assert not S.answer_matches("", "no")


def test_preprocess_matches_hf_clip_processor():
    from transformers import CLIPImageProcessor

    cfg = C.shipped_config()
    kw = {k: v for k, v in C.preprocessor_config(cfg).items()
          if k not in ("image_processor_type", "processor_class")}
    ip = CLIPImageProcessor(**kw)
    rng = np.random.default_rng(2)
    for w, h in [(96, 512), (512, 96), (300, 200)]:
        img, _ = S.draw_scene(rng, width=w, height=h)
        img = S.encode_like_client(img, rng)
        ref = ip(images=img, return_tensors="np")["pixel_values"][0]
        r = cfg["vision_config"]["image_size"]
        ours = S.preprocess(img, r)
        assert ours.shape == ref.shape == (3, r, r)
        np.testing.assert_allclose(ours, ref, atol=1e-5)


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_specials_and_vocab(tok):
    assert [tok.token_to_id(t) for t in T.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() == T.DEFAULT_VOCAB_SIZE
    assert tok.encode("hi").ids[0] == T.BOS_ID                  # post-processor adds BOS
    assert T.train_tokenizer().to_str() == tok.to_str()         # deterministic


def test_answer_words_are_single_tokens(tok):
    words = list(S.SHAPES) + list(S.COLORS) + ["1", "2", "3", "yes", "no"]
    for w in words:
        assert len(tok.encode(w, add_special_tokens=False).ids) == 1, w
    # inside descriptions every word is one token (with its trailing space) and commas are one
    d = "a red circle, a blue square and a green triangle"
    toks = tok.encode(d, add_special_tokens=False).tokens
    assert len(toks) == 11, toks


def test_tokenizer_round_trip_any_text(tok):
    texts = ["What shape is this?", "Héllo wörld 🙂 \u4e2d\u6587 123!", "", "  a  b\n\tc\r\n",
             "\x00\x7f~`|\\", "Is there a yellow triangle?"]
    for t in texts:
        e = tok.encode(t, add_special_tokens=False)
        assert T.UNK_ID not in e.ids
        assert tok.decode(e.ids, skip_special_tokens=False) == t


def test_chat_template_prefix_property(tok):
    """The generation prompt's ids are a prefix of prompt+answer ids, for every answer."""
    rng = np.random.default_rng(9)
    for _ in range(200):
        ex = S.make_example(rng, client_roundtrip=False)
        p = T.encode_chat(tok, T.vqa_messages(ex["question"]), add_generation_prompt=True)
        full = T.encode_chat(tok, T.vqa_messages(ex["question"], ex["answer"]))
        assert full[:len(p)] == p and full[-1] == T.EOS_ID
        assert p[0] == T.BOS_ID and p.count(T.IMAGE_ID) == 1
        assert tok.decode(full[len(p):-1]) == ex["answer"]     # no leading space to strip


def test_chat_template_format():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]},
            {"role": "assistant", "content": "circle"},
            {"role": "user", "content": [{"type": "text", "text": "Compare."}, {"type": "image"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert T.render_chat(msgs, add_generation_prompt=True) == (
        "<s>Be brief. USER: What shape is this? <image>\nASSISTANT: circle</s>"
        "USER: Compare. <image>\n<image>\nASSISTANT: ")
    assert T.render_chat([{"role": "user", "content": "hi"}]) == "<s>USER: hi "


def test_tokenizer_hf_and_tokenizers_agree(tok, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    T.save_tokenizer(tok, str(tmp_path))
    ht = AutoTokenizer.from_pretrained(str(tmp_path))
    rt = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert (ht.bos_token_id, ht.eos_token_id, ht.pad_token_id, ht.unk_token_id) == (1, 2, 3, 0)
    assert len(ht) == tok.get_vocab_size()
    assert ht.convert_tokens_to_ids("<image>") == T.IMAGE_ID
    rng = np.random.default_rng(4)
    texts = ["Héllo wörld 🙂 123!", "  a  b\n\tc", "Is there a red square?"]
    texts += [S.make_example(rng, client_roundtrip=False)["answer"] for _ in range(30)]
    for t in texts:
        assert ht(t)["input_ids"] == rt.encode(t).ids, t
        assert ht.decode(ht(t)["input_ids"], skip_special_tokens=True) == t
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes are there?"}]}]
    for gen in (False, True):
        assert ht.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            T.render_chat(msgs, gen)
        ids = ht.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert list(ids) == T.encode_chat(rt, msgs, gen)


# ----------------------------------------------------------------------------- config/export

def test_config_budget_and_resolution(tok):
    shipped = C.shipped_config()
    for cfg in (shipped, C.notebook_config(), C.proposal_config()):
        assert cfg["text_config"]["vocab_size"] == tok.get_vocab_size()
        assert cfg["image_token_index"] == tok.token_to_id("<image>")
        assert C.num_image_tokens(cfg) == cfg["image_seq_length"]
        assert C.num_image_tokens(cfg) == 64
        assert C.param_count(cfg)["float32_bytes"] <= 25_000_000
    small = C.smallest_shape_model_px(C.shipped_config())
    assert small["short_side_px"] >= 9.6 - 1e-6 and small["long_side_px"] >= 1.8 - 1e-6
    assert small["short_side_patches"] >= 1.2 - 1e-6


def test_export_loads_in_transformers(tok, tmp_path):
    """write_hf_checkpoint (numpy only) -> transformers loads every tensor, processes an image
    into 64 <image> tokens and generates."""
    import torch
    from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

    cfg = C.notebook_config()
    state = E.random_state(cfg, seed=1)
    files = E.write_hf_checkpoint(str(tmp_path), cfg, tok, state)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
              "chat_template.jinja"):
        assert f in files
    assert "chat_template" in json.load(open(tmp_path / "tokenizer_config.json"))

    # our names/shapes are exactly what transformers itself writes
    torch.manual_seed(0)
    ref = LlavaForConditionalGeneration(LlavaConfig(**cfg))
    ref.save_pretrained(str(tmp_path / "ref"))
    from safetensors.numpy import load_file
    hf = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert {k: v.shape for k, v in hf.items()} == {k: v.shape for k, v in state.items()}
    assert sum(v.size for v in hf.values()) == C.param_count(cfg)["total"]

    model, info = LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    for name, arr in state.items():                 # every tensor arrives unchanged
        np.testing.assert_array_equal(sd[_hf_module_name(name)], arr, err_msg=name)

    proc = AutoProcessor.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(0)
    img, _ = S.draw_scene(rng, width=500, height=120)
    prompt = proc.apply_chat_template(T.vqa_messages("Describe the image."), add_generation_prompt=True)
    assert prompt == T.render_chat(T.vqa_messages("Describe the image."), True)
    inp = proc(images=img, text=prompt, return_tensors="pt")
    assert int((inp["input_ids"] == T.IMAGE_ID).sum()) == 64
    assert inp["pixel_values"].shape == (1, 3, 128, 128)
    np.testing.assert_allclose(inp["pixel_values"][0].numpy(), S.preprocess(img), atol=1e-5)
    out = model.generate(**inp, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inp["input_ids"].shape[1] + 4 or int(out[0, -1]) == T.EOS_ID


def _hf_module_name(saved: str) -> str:
    """Saved LLaVA name -> transformers 5 in-memory module name."""
    if saved == "language_model.lm_head.weight":
        return "lm_head.weight"
    if saved.startswith("language_model.model."):
        return "model.language_model." + saved[len("language_model.model."):]
    return "model." + saved


def test_export_rejects_bad_state(tok, tmp_path):
    cfg = C.notebook_config()
    state = E.random_state(cfg)
    del state["language_model.lm_head.weight"]
    with pytest.raises(ValueError, match="missing"):
        E.write_hf_checkpoint(str(tmp_path), cfg, tok, state)
    state = E.random_state(cfg)
    state["multi_modal_projector.linear_1.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="bad shapes"):
        E.write_hf_checkpoint(str(tmp_path), cfg, tok, state)


def test_describe_mistake_kinds():
    from mmjax.demo.evaluate import describe_mistake
    gold = "a red circle, a blue square and a green triangle"
    assert describe_mistake("a blue square, a red circle and a green triangle", gold) == "order"
    assert describe_mistake("a red circle, a blue circle and a green triangle", gold) == "naming"
    assert describe_mistake("a red circle and a blue square", gold) == "count"
    assert describe_mistake("a red square and a red circle.", "a red circle and a red square") == "order"


def test_hard_describe_draws_shared_colors_and_close_centers(tok):
    """--hard-describe 1.0: every describe question comes from a scene where two shapes of
    different kinds share a color, or whose closest pair of centers is < 15% of the width apart;
    other question types and 0.0 keep the uniform draw."""
    from mmjax.demo import train as TR

    rng = np.random.default_rng(3)
    scenes = [S.sample_scene(rng) for _ in range(300)]
    imgs = np.zeros((len(scenes), 4, 4, 3), np.uint8)
    enc = TR.Encoder(tok, 4)
    pairs = lambda s: [(a, b) for a in s.shapes for b in s.shapes if a is not b]
    shared = {i for i, s in enumerate(scenes)
              if any(a.color == b.color and a.kind != b.kind for a, b in pairs(s))}
    close = {i for i, s in enumerate(scenes)
             if any(abs(a.cx - b.cx) < 0.15 * s.width for a, b in pairs(s))}
    assert shared - close and close - shared and len(shared | close) < len(scenes) // 2
    hard = TR.Sampler(imgs, scenes, enc, 64, hard_describe=1.0)
    assert set(hard.hard.tolist()) == shared | close
    assert all(hard.example(rng, "describe")[0] in shared | close for _ in range(100))
    plain = TR.Sampler(imgs, scenes, enc, 64)
    drawn = [plain.example(rng, "describe")[0] for _ in range(300)]
    assert any(i not in shared | close for i in drawn)


def test_json_question_types(tok):
    """The "<type>_json" training questions: a one-shape scene for shape / color, the system
    prompt before the question, the one-key JSON answer (an integer count, quoted names) and a
    loss mask over exactly the answer's tokens and </s>; the chat template renders the same
    prompt the engine builds for a system + user chat; only shape / color / count have one."""
    from mmjax.demo import train as TR

    rng = np.random.default_rng(5)
    scenes = [S.sample_scene(rng) for _ in range(60)]
    enc = TR.Encoder(tok, 4)
    sampler = TR.Sampler(np.zeros((len(scenes), 4, 4, 3), np.uint8), scenes, enc, 64,
                         weights={"count_json": 1.0, "shape_json": 1.0, "color_json": 1.0})
    seen = set()
    for _ in range(30):
        i, q, a, qtype = sampler.example(rng)
        seen.add(qtype)
        field = qtype.removesuffix("_json")
        assert q[0] == S.JSON_SYSTEM and S.question_type(q[1]) == field
        gold = {"shape": scenes[i].shapes[0].kind, "color": scenes[i].shapes[0].color,
                "count": str(scenes[i].count)}[field]
        assert json.loads(a) == {field: int(gold) if field == "count" else gold} and S.json_matches(a, field, gold)
        if field != "count":
            assert scenes[i].count == 1
        _, ids, mask, _, _ = sampler.batch(None, 1, [(i, q, a, qtype)])
        full, p = enc(q, a)
        assert tok.decode(full[p:].tolist(), skip_special_tokens=False) == a + T.EOS
        assert (np.flatnonzero(mask[0]) == np.arange(p - 1, len(full) - 1)).all()
    assert seen == {"count_json", "shape_json", "color_json"}
    prompt = T.render_chat([{"role": "system", "content": S.JSON_SYSTEM},
                            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": S.Q_COUNT}]}], True)
    assert prompt == f"<s>{S.JSON_SYSTEM} USER: {S.Q_COUNT} <image>\nASSISTANT: "
    with pytest.raises(ValueError):
        S.json_answer("describe", "a red circle")
    with pytest.raises(ValueError):
        TR.Sampler(np.zeros((1, 4, 4, 3), np.uint8), scenes[:1], enc, 64, weights={"exists_json": 1.0})


def test_describe_phrase_targets(tok):
    """The attention aux's targets: each color / kind token of a description is labelled with
    its shape's place left to right (1-3), everything else 0; Sampler.batch puts at position t
    the label of token t + 1 (what position t predicts), after the patch / slot / query labels."""
    from mmjax.demo import train as TR

    enc = TR.Encoder(tok, 4)
    answer = "a red circle, a blue square and a green triangle"
    full, p = enc(S.Q_DESCRIBE, answer)
    ph = enc.phrases(S.Q_DESCRIBE, answer)
    labelled = [(tok.decode([int(i)]).strip(), int(k)) for i, k in zip(full, ph) if k]
    assert labelled == [("red", 1), ("circle", 1), ("blue", 2), ("square", 2), ("green", 3),
                        ("triangle", 3)]
    assert not ph[:p].any()
    assert not enc.phrases(S.Q_COUNT, "3").any()
    assert not enc.phrases(S.exists_question("red", "circle"), "yes").any()

    rng = np.random.default_rng(4)
    scenes = [S.sample_scene(rng, n_shapes=3) for _ in range(8)]
    sampler = TR.Sampler(np.zeros((8, 16, 16, 3), np.uint8), scenes, enc, 64, grid=4)
    examples = [(i, *S.make_question(rng, sc, "describe"), "describe") for i, sc in enumerate(scenes)]
    examples[-1] = (7, *S.make_question(rng, scenes[7], "count"), "count")
    _, ids, _, labels, _ = sampler.batch(None, 8, examples)
    assert labels.shape == (8, 2 * 16 + S.MAX_SHAPES + 1 + 64)
    phrase = labels[:, -64:]
    for r, (_, q, a, _) in enumerate(examples):
        want = enc.phrases(q, a)
        assert (phrase[r, :len(want) - 1] == want[1:]).all() and not phrase[r, len(want) - 1:].any()
    assert sorted(set(phrase[:7].ravel())) == [0, 1, 2, 3] and not phrase[7].any()


def test_vision_step_trains_only_the_image_side(tok):
    """--vision-frac's step: the image aux losses fall on a batch it keeps seeing, the ViT,
    projector and aux heads move, and the decoder stays bit-identical (weight decay included)."""
    import jax
    from flax import nnx

    from mmjax.demo import train as TR

    cfg_dict = C.notebook_config()
    cfg, model = TR.init_model(cfg_dict, tok, 0)
    tx, train_step, _ = TR.make_steps(cfg, aux_weight=1.0)
    p0 = nnx.state(TR.Trainee(model, TR.AuxHeads(cfg, 0)))
    imgs, scenes = TR.make_pool(8, 128, 5, workers=1)
    enc = TR.Encoder(tok, C.num_image_tokens(cfg_dict))
    sampler = TR.Sampler(imgs, scenes, enc, TR.max_seq_len(enc), grid=8)
    rng = np.random.default_rng(0)
    examples = [(i, *S.make_question(rng, sc, "count"), "count") for i, sc in enumerate(scenes)]
    pix, _, _, plab, _ = sampler.batch(None, 8, examples)
    p, o, losses = p0, tx.init(p0), []
    for _ in range(12):
        p, o, loss = train_step.vision(p, o, pix, plab, np.float32(2e-3))
        losses.append(float(loss[1]))
    assert losses[-1] < 0.8 * losses[0], losses
    moved = lambda a, b: any(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x != y).any()), a, b)))
    assert not moved(p0["model"]["language_model"], p["model"]["language_model"])
    assert moved(p0["model"]["vision_tower"], p["model"]["vision_tower"])
    assert moved(p0["model"]["multi_modal_projector"], p["model"]["multi_modal_projector"])
    assert moved(p0["aux"], p["aux"])


def test_bf16_train_step_matches_f32(tok):
    """--bf16 (the default recipe's matmuls in bf16, f32 accumulation and master weights): from
    one state, the full and the image-only step give the f32 steps' losses and updates up to
    bf16 rounding, and the trained params stay f32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmjax.demo import train as TR

    cfg_dict = C.notebook_config()
    cfg, model = TR.init_model(cfg_dict, tok, 0)
    p0 = nnx.state(TR.Trainee(model, TR.AuxHeads(cfg, 0)))
    imgs, scenes = TR.make_pool(8, 128, 5, workers=1)
    enc = TR.Encoder(tok, C.num_image_tokens(cfg_dict))
    sampler = TR.Sampler(imgs, scenes, enc, TR.max_seq_len(enc), grid=8)
    rng = np.random.default_rng(3)
    examples = [(i, *S.make_question(rng, sc, t), t)
                for i, (sc, t) in enumerate(zip(scenes, ["describe", "exists", "count"] * 3))]
    pix, ids, mask, plab, _ = sampler.batch(None, 8, examples)
    out = {}
    for bf16 in (False, True):
        tx, train_step, _ = TR.make_steps(cfg, aux_weight=1.0, bf16=bf16)
        o = tx.init(p0)
        full = train_step(p0, o, pix, ids, mask, plab, np.float32(1e-3))
        vision = train_step.vision(p0, o, pix, plab, np.float32(1e-3))
        out[bf16] = full, vision
    for (p32, _, l32), (p16, _, l16) in zip(out[False], out[True]):
        np.testing.assert_allclose(np.asarray(l16), np.asarray(l32), rtol=1e-2)
        # Adam's first step moves every weight by ~lr * sign(grad): compare the moves
        d32 = jax.tree.map(lambda a, b: np.asarray(a - b), p32, p0)
        d16 = jax.tree.map(lambda a, b: np.asarray(a - b), p16, p0)
        a, b = (np.concatenate([x.ravel() for x in jax.tree.leaves(d)]) for d in (d32, d16))
        assert np.corrcoef(a, b)[0, 1] > 0.95
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p16))
