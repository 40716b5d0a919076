"""Subprocess side of tests/test_mllama.py's tensor-parallel test: runs with 8 fake CPU devices
(XLA_FLAGS must be set before jax is imported, and the pytest process already imported jax with
one device), as tests/sharding_worker.py does for the other families.

    python tests/mllama_tp_worker.py <mllama dir> <tp> [<tp> ...]   -> one JSON line of findings

The worker only measures; the test asserts, so every finding is visible in its failure message.
"""
from __future__ import annotations

import json
import os
import sys

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import mmjax  # noqa: E402
from mmjax.serving.sampling import SamplingParams  # noqa: E402
from mmjax.sharding import MODEL, make_mesh  # noqa: E402

# 4 slots and 64-token chunks: the batch's prompts share packed prefill calls
ENGINE = dict(max_num_seqs=4, max_model_len=128, prefill_chunk=64, max_encode_batch=2)


def noise(seed: int, w: int, h: int):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def requests() -> list[dict]:
    """A mixed batch: one image, two images, text only, another image behind the same text."""
    return [{"prompt": "hello <|image|> what is this", "images": [noise(1, 70, 41)]},
            {"prompt": "a b <|image|> first <|image|> second one", "images": [noise(2, 33, 120), noise(3, 20, 20)]},
            {"prompt": "just text here"},
            {"prompt": "hello <|image|> what is this", "images": [noise(4, 300, 20)]}]


def generate(vlm) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy ids and each chosen token's logprob, 32 tokens a request."""
    outs = vlm.generate(requests(), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1))
    return ([list(map(int, o.token_ids)) for o in outs],
            [[float(lp[t]) for t, lp in zip(o.token_ids, o.logprobs)] for o in outs])


def sharded(tree, tp: int) -> dict:
    """Arrays sharded over the model axis (by path) and those whose shards are not 1/tp of them."""
    names, bad = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if MODEL not in jax.tree.leaves(tuple(x.sharding.spec)):
            continue
        names.append(jax.tree_util.keystr(path))
        if {s.data.nbytes for s in x.addressable_shards} != {x.nbytes // tp}:
            bad.append(names[-1])
    return {"names": names, "bad": bad}


def main(path: str, tps: list[int]) -> dict:
    base = mmjax.load(path, **ENGINE)
    want, want_lp = generate(base)
    out = {"ids_1dev": want, "cross_bytes_1dev": base.engine.stats()["cross_attention_cache_bytes"]}
    for tp in tps:
        vlm = mmjax.load(path, mesh=make_mesh(tp, 1), **ENGINE)
        got, lp = generate(vlm)
        again, _ = generate(vlm)        # the same requests again: prefix-cache hits
        runner = vlm.engine.runner
        st = vlm.engine.stats()
        lm_state = nnx.state(vlm.model.language_model)
        values = jax.tree.map(lambda v: v.get_value(), lm_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        weights = sharded(values, tp)
        cross = runner.cache["cross"]
        out[f"tp{tp}"] = {
            "ids_equal": got == want, "ids_again_equal": again == want, "tokens_cached": st["tokens_cached"],
            "logprob_diff": max(abs(a - b) for x, y in zip(lp, want_lp) for a, b in zip(x, y)),
            "mesh": st["mesh"], "packed_prefills": sorted(s for c, s in runner.compiled["prefill"]),
            "weights": weights, "cross_cache": sharded(cross, tp), "self_cache": sharded(runner.cache["self"], tp),
            "cross_k_shape": list(cross["k"][0].shape),
            "cross_bytes": st["cross_attention_cache_bytes"],
            "cross_bytes_held": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cross))}
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], [int(t) for t in sys.argv[2:]])), flush=True)
