"""Held-out accuracy of an mmjax-shapes checkpoint through the offline chat API.

    python -m mmjax.demo.evaluate [--model DIR] [--n 300] [--seed S] [--qtype describe] [--json]

Fresh scenes (random canvas size, 1-3 shapes), balanced over the five question types, each image
encoded as PNG or JPEG (q85-95) bytes like a client would send, answered greedily by
`mmjax.load(model).chat(...)`, scored by exact match (`shapes.answer_matches`).
With --json (or --qtype shape_json / color_json / count_json) the shape / color / count
questions are asked in their JSON form: the system prompt `shapes.JSON_SYSTEM`, the answer
constrained to `shapes.json_schema` (asked key first), scored on the asked key's value.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

from mmjax.demo import shapes as S


JSON_QTYPES = tuple(f"{t}_json" for t in S.JSON_TYPES)


def make_questions(n: int, seed: int, qtypes: tuple = S.QUESTION_TYPES) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        qtype = qtypes[i % len(qtypes)]
        ex = S.make_example(rng, qtype.removesuffix("_json"), client_roundtrip=False)
        data, fmt = S.encode_bytes(ex["image"], rng)
        out.append({"bytes": data, "fmt": fmt, "question": ex["question"],
                    "answer": ex["answer"], "qtype": qtype, "scene": ex["scene"]})
    return out


def describe_mistake(pred: str, gold: str) -> str:
    """'order' (same phrases, wrong left-to-right order), 'count' (wrong number of shapes) or
    'naming' (a shape's color or kind wrong)."""
    def phrases(t):
        return S.normalize_answer(t).replace(", ", " and ").split(" and ")
    p, g = phrases(pred), phrases(gold)
    if len(p) != len(g):
        return "count"
    return "order" if sorted(p) == sorted(g) else "naming"


def evaluate(vlm, questions: list[dict], max_tokens: int = 24) -> dict:
    """Exact-match accuracy per question type; for "describe" also accuracy by number of shapes
    and the kinds of mistakes."""
    import mmjax

    from mmjax.serving.structured import StructuredSpec

    hits, tot = collections.Counter(), collections.Counter()
    by_count, mistakes = collections.defaultdict(lambda: [0, 0]), collections.Counter()
    wrong = []
    for q in questions:
        msgs = [{"role": "user", "content": [{"type": "image", "image": q["bytes"]},
                                             {"type": "text", "text": q["question"]}]}]
        field = q["qtype"].removesuffix("_json")
        if field != q["qtype"]:
            msgs.insert(0, {"role": "system", "content": S.JSON_SYSTEM})
            sp = mmjax.SamplingParams(max_tokens=40, temperature=0.0,
                                      structured=StructuredSpec("json", S.json_schema(field)))
            pred = vlm.chat(msgs, sp).text
            ok = S.json_matches(pred, field, q["answer"])
        else:
            pred = vlm.chat(msgs, mmjax.SamplingParams(max_tokens=max_tokens, temperature=0.0)).text
            ok = S.answer_matches(pred, q["answer"])
        hits[q["qtype"]] += ok
        tot[q["qtype"]] += 1
        if not ok:
            wrong.append((q["qtype"], q["question"], q["answer"], pred))
        if q["qtype"] == "describe":
            by_count[q["scene"].count][0] += ok
            by_count[q["scene"].count][1] += 1
            if not ok:
                mistakes[describe_mistake(pred, q["answer"])] += 1
    acc = {t: hits[t] / tot[t] for t in S.QUESTION_TYPES + JSON_QTYPES if tot[t]}
    acc["all"] = sum(hits.values()) / max(1, len(questions))
    return {"accuracy": acc, "n": len(questions), "wrong": wrong,
            "describe": {"by_shapes": {k: tuple(v) for k, v in sorted(by_count.items())},
                         "mistakes": dict(mistakes)}}


def main(argv=None) -> int:
    import mmjax
    from mmjax.demo import default_model_path

    ap = argparse.ArgumentParser(prog="python -m mmjax.demo.evaluate")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the shipped one)")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--qtype", choices=S.QUESTION_TYPES + JSON_QTYPES, default=None, help="only this question type")
    ap.add_argument("--json", action="store_true", help="the JSON forms of shape / color / count only")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    model = args.model or str(default_model_path())
    vlm = mmjax.load(model, max_num_seqs=4, max_model_len=256)
    t0 = time.perf_counter()
    qtypes = (args.qtype,) if args.qtype else JSON_QTYPES if args.json else S.QUESTION_TYPES
    res = evaluate(vlm, make_questions(args.n, seed, qtypes))
    print(f"model {model}  seed {seed}  n {res['n']}  ({time.perf_counter() - t0:.0f}s)")
    print("  ".join(f"{k} {v:.3f}" for k, v in res["accuracy"].items()))
    d = res["describe"]
    if d["by_shapes"]:
        print("describe by number of shapes (right/total): "
              + "  ".join(f"{k}: {a}/{b}" for k, a, b in ((k, *v) for k, v in d["by_shapes"].items()))
              + f"; mistakes {d['mistakes']}")
    for w in res["wrong"][:15]:
        print("  wrong:", w)
    print("JSON " + json.dumps({"seed": seed, **res["accuracy"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
