"""Subprocess side of tests/conformance.tensor_parallel_matches: runs with 8 fake CPU devices
(XLA_FLAGS must be set before jax is imported; the pytest process already imported jax with one).

    python tests/tp_worker.py <checkpoint dir> <tp> [<tp> ...]   -> one JSON line of findings

Any family: the batch is chat-template requests (an image and a question; two images; text
only), so the worker needs nothing family-specific. It only measures; the test asserts.
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
from mmjax.sharding import MODEL, make_mesh  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_model_len=512, prefill_chunk=64, max_encode_batch=2)


def noise(seed: int, w: int, h: int):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def requests(vlm) -> list[dict]:
    def chat(images, text):
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        prompt, srcs = vlm.render_chat([{"role": "user", "content": content}])
        return {"prompt": prompt, "images": vlm.prepare_images(srcs)}
    return [chat([noise(1, 70, 41)], "what is this"), chat([noise(2, 33, 60), noise(3, 40, 40)], "compare them"),
            chat([], "just text here")]


def generate(vlm) -> list[list[int]]:
    outs = vlm.generate(requests(vlm), mmjax.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    return [list(map(int, o.token_ids)) for o in outs]


def sharded(values, tp: int) -> tuple[int, list[str]]:
    n, bad = 0, []
    for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
        if MODEL not in jax.tree.leaves(tuple(x.sharding.spec)):
            continue
        n += 1
        if {s.data.nbytes for s in x.addressable_shards} != {x.nbytes // tp}:
            bad.append(jax.tree_util.keystr(path))
    return n, bad


def main(path: str, tps: list[int]) -> dict:
    want = generate(mmjax.load(path, **ENGINE))
    out = {"ids_1dev": want}
    for tp in tps:
        vlm = mmjax.load(path, mesh=make_mesh(tp, 1), **ENGINE)
        got = generate(vlm)
        again = generate(vlm)
        values = jax.tree.map(lambda v: v.get_value(), nnx.state(vlm.model.language_model),
                              is_leaf=lambda x: isinstance(x, nnx.Variable))
        n, bad = sharded(values, tp)
        out[f"tp{tp}"] = {"ids_equal": got == want, "ids_again_equal": again == want, "ids": got,
                          "sharded": n, "bad": bad}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(t) for t in sys.argv[2:]])))
