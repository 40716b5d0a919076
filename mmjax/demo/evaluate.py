"""Held-out accuracy of an mmjax-shapes checkpoint through the offline chat API.

    python -m mmjax.demo.evaluate [--model DIR] [--n 300] [--seed S]

Fresh scenes (random canvas size, 1-3 shapes), balanced over the five question types, each image
encoded as PNG or JPEG (q85-95) bytes like a client would send, answered greedily by
`mmjax.load(model).chat(...)`, scored by exact match (`shapes.answer_matches`).
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

from mmjax.demo import shapes as S


def make_questions(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        qtype = S.QUESTION_TYPES[i % len(S.QUESTION_TYPES)]
        ex = S.make_example(rng, qtype, client_roundtrip=False)
        data, fmt = S.encode_bytes(ex["image"], rng)
        out.append({"bytes": data, "fmt": fmt, "question": ex["question"],
                    "answer": ex["answer"], "qtype": qtype, "scene": ex["scene"]})
    return out


def evaluate(vlm, questions: list[dict], max_tokens: int = 24) -> dict:
    import mmjax

    sp = mmjax.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    hits, tot = collections.Counter(), collections.Counter()
    wrong = []
    for q in questions:
        msgs = [{"role": "user", "content": [{"type": "image", "image": q["bytes"]},
                                             {"type": "text", "text": q["question"]}]}]
        pred = vlm.chat(msgs, sp).text
        ok = S.answer_matches(pred, q["answer"])
        hits[q["qtype"]] += ok
        tot[q["qtype"]] += 1
        if not ok:
            wrong.append((q["qtype"], q["question"], q["answer"], pred))
    acc = {t: hits[t] / tot[t] for t in S.QUESTION_TYPES if tot[t]}
    acc["all"] = sum(hits.values()) / max(1, len(questions))
    return {"accuracy": acc, "n": len(questions), "wrong": wrong}


def main(argv=None) -> int:
    import mmjax
    from mmjax.demo import default_model_path

    ap = argparse.ArgumentParser(prog="python -m mmjax.demo.evaluate")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the shipped one)")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    model = args.model or str(default_model_path())
    vlm = mmjax.load(model, max_num_seqs=4, max_model_len=256)
    t0 = time.perf_counter()
    res = evaluate(vlm, make_questions(args.n, seed))
    print(f"model {model}  seed {seed}  n {res['n']}  ({time.perf_counter() - t0:.0f}s)")
    print("  ".join(f"{k} {v:.3f}" for k, v in res["accuracy"].items()))
    for w in res["wrong"][:15]:
        print("  wrong:", w)
    print("JSON " + json.dumps({"seed": seed, **res["accuracy"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
