"""Subprocess side of tests/test_sharding.py: runs with 8 fake CPU devices (XLA_FLAGS must be set
before jax is imported, and the pytest process already imported jax with one device).

    python tests/sharding_worker.py parity  <llava dir> <qwen dir>   -> one JSON line of findings
    python tests/sharding_worker.py export  <llava dir> <qwen dir>   -> one JSON line
    python tests/sharding_worker.py gemma   <gemma3 dir> <gemma4 dir> -> one JSON line
    python tests/sharding_worker.py quant   <llava dir> <qwen dir>   -> one JSON line (int8 KV, int8 weights)

The worker only measures; tests/test_sharding.py asserts, so every finding is visible in the
test's failure message.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

if "device_count" not in os.environ.get("XLA_FLAGS", ""):       # multihost_worker sets its own
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import mmjax  # noqa: E402
from mmjax.sharding import MODEL, make_mesh  # noqa: E402
from mmjax.serving.sampling import SamplingParams  # noqa: E402

# pages of 8 positions: the repeated prompts' whole pages are prefix-cache hits (a 64-position page
# would hold most of these short prompts' prefixes)
ENGINE = dict(max_num_seqs=4, max_model_len=128, prefill_chunk=128, max_encode_batch=2, page_size=8)
MESHES = {"tp2": (2, 1), "tp4": (4, 1), "tp8": (8, 1), "dp2xtp4": (4, 2), "tp4-vit": (4, 1)}
COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
# an all-reduce's result, a tuple when XLA's combiner merged several (COLLECTIVE skips those)
ALL_REDUCE = re.compile(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(")


def noise(seed: int, w: int, h: int):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def requests(tok: str) -> list[dict]:
    """A mixed batch: images (one repeated, two in one prompt) and text only."""
    return [{"prompt": f"USER: {tok}\nwhat is in this picture? ASSISTANT:", "images": [noise(1, 40, 40)]},
            {"prompt": "USER: hello world, describe a red circle ASSISTANT:"},
            {"prompt": f"USER: {tok} {tok} compare the two ASSISTANT:", "images": [noise(2, 56, 28), noise(3, 28, 84)]},
            {"prompt": "USER: how many cats are there? ASSISTANT:"}]


def generate(vlm, reqs=None) -> list[list[int]]:
    outs = vlm.generate(reqs or requests(vlm.family.image_token),
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    return [list(map(int, o.token_ids)) for o in outs]


def encoder_cache_request(tok: str) -> list[dict]:
    """Request 0's image behind a different text prefix: the prefix cache cannot cover it, the
    encoder cache can. With the batch's other three requests again (prefix-cache hits), so the
    decode step keeps the batch's 4-row shape: one compilation fewer per mesh (CI time)."""
    return [{"prompt": f"USER: please answer: {tok}\nwhat color? ASSISTANT:", "images": [noise(1, 40, 40)]},
            *requests(tok)[1:]]


def via_async_engine(vlm, reqs: list[dict]) -> list[list[int]]:
    """The same requests streamed concurrently through AsyncEngine (the server's face)."""
    import asyncio

    from mmjax.serving import AsyncEngine

    eng = vlm.engine
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    made = [eng.make_request(r["prompt"], vlm.prepare_images(r.get("images", ())), sp) for r in reqs]

    async def main():
        ae = AsyncEngine(eng)

        async def one(req):
            return [t for d in [d async for d in ae.stream(req)] for t in d.token_ids]
        try:
            return await asyncio.gather(*(one(r) for r in made))
        finally:
            ae.shutdown(5)
    return [list(map(int, ids)) for ids in asyncio.run(main())]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def shard_fractions(tree, tp: int) -> dict:
    """For every array sharded over the model axis: is every addressable shard 1/tp of it?"""
    bad, sharded = [], 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if MODEL not in jax.tree.leaves(tuple(x.sharding.spec)):
            continue
        sharded += 1
        sizes = {s.data.nbytes for s in x.addressable_shards}
        if sizes != {x.nbytes // tp}:
            bad.append(f"{jax.tree_util.keystr(path)}: {sorted(sizes)} of {x.nbytes}")
    return {"sharded": sharded, "bad": bad}


def decode_collectives(runner, rows: int = 4) -> dict:
    """Collectives of the compiled decode step, and whether an all-gather moves a weight-sized
    operand (any all-gather whose result has a parameter's shape)."""
    sig = {n: (f, a, k) for n, f, a, k in runner.step_signatures()}[f"decode[{rows}]"]
    text = sig[0].lower(*sig[1], **sig[2]).compile().as_text()
    found = COLLECTIVE.findall(text)
    param_shapes = {tuple(x.shape) for x in jax.tree.leaves(runner.lm_leaves + runner.weights.split.vision_leaves)}
    gathers = [shape for shape, op in found if op == "all-gather"]
    def dims(s):
        m = re.search(r"\[([\d,]*)\]", s)
        return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()
    reduced = sum(len(re.findall(r"\w+\[[\d,]*\]", shape)) for shape in ALL_REDUCE.findall(text))
    return {"counts": dict(Counter(op for _, op in found)), "gathers": gathers,
            "weight_gathers": [g for g in gathers if dims(g) in param_shapes], "all_reduced": reduced}


def parity(paths: dict) -> dict:
    out = {}
    for name, path in paths.items():
        base = mmjax.load(path, **ENGINE)
        want = generate(base)
        tok = base.family.image_token
        want_enc = generate(base, encoder_cache_request(tok))
        prompt, img = f"USER: {tok}\nwhat is this? ASSISTANT:", [noise(7, 40, 40)]
        want_logits = base.logits(prompt, img)
        res = {"ids_1dev": want}
        for mesh_name, (tp, dp) in MESHES.items():
            if mesh_name.endswith("-vit") and name != "llava":
                continue   # the TP-ViT option once (CI time): CLIP's q/k/v/o/fc split over 4 devices
            vit = {"vision_tensor_parallel": True} if mesh_name.endswith("-vit") else {}
            vlm = mmjax.load(path, mesh=make_mesh(tp, dp), **ENGINE, **vit)
            got = generate(vlm)
            again = generate(vlm)   # the same prompts again: prefix-cache hits
            st0 = vlm.engine.stats()
            enc = generate(vlm, encoder_cache_request(tok))   # an encoder-cache hit
            eng = vlm.engine
            st = eng.stats()
            replicas = eng.replicas
            r = {"ids_equal": got == want, "ids_again_equal": again == want, "ids_enc_equal": enc == want_enc,
                 "tokens_cached": st0["tokens_cached"],
                 "encoder_cache_hits": st["encoder_cache_hits"] - st0["encoder_cache_hits"],
                 "mesh": st["mesh"], "replicas": len(replicas),
                 "replica_devices": [sorted(str(d) for d in e.runner.placement.mesh.devices.flat) for e in replicas],
                 "weight_bytes_max_device": st["weight_bytes_max_device"],
                 "kv_cache_bytes_max_device": st["kv_cache_bytes_max_device"],
                 "params": shard_fractions({"text": replicas[0].runner.lm_leaves}, tp),
                 "vision": shard_fractions({"vision": replicas[0].runner.weights.split.vision_leaves}, tp),
                 "cache": shard_fractions(replicas[0].runner.cache, tp),
                 "encode_buckets": sorted({list(k)[0] if len(k) == 2 else 1
                                           for rep in replicas for k in rep.runner.compiled["encode"]})}
            if dp > 1:   # the server's path: AsyncEngine over the replicas
                r["async_ids_equal"] = via_async_engine(vlm, requests(tok)) == want
            if dp == 1:
                r["logits_rel"] = rel(vlm.logits(prompt, img), want_logits)
                r["decode"] = decode_collectives(eng.runner)
                r["num_layers"] = eng.runner.text_model.num_layers
            res[mesh_name] = r
        out[name] = res
    return out


def export(paths: dict, tp: int = 8, quantize: str | None = None, only: tuple = ()) -> dict:
    """Every compiled step of a TP=tp runner (bf16) exported for CUDA with the mesh's shardings
    (quantize: with 8-bit weights; only: just the steps whose names start so)."""
    from mmjax.api import load_model
    from mmjax.backend import compiling_for
    from mmjax.serving.runner import ModelRunner

    out = {}
    for name, path in paths.items():
        model = load_model(path, "bfloat16", on_device=quantize is None, quantize=quantize)
        if hasattr(model.family, "limits"):
            model.family.configure(max_encode_patches=1024, image_max_tokens=256)
        runner = ModelRunner(model.family, model.module, max_num_seqs=4, max_model_len=256, prefill_chunk=64,
                             max_encode_batch=2, dtype=model.dtype, mesh=make_mesh(tp, 1), platform="cuda")
        steps = {}
        with compiling_for("cuda"):
            for step, fn, args, kw in runner.step_signatures():
                if only and not step.startswith(only):
                    continue
                exp = jax.export.export(fn, platforms=("cuda",))(*args, **kw)
                text = exp.mlir_module()
                main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
                steps[step] = {"platforms": list(exp.platforms), "nr_devices": exp.nr_devices,
                               "model_sharded_args": main.count('{"model"}'),
                               "bf16_dot": any("bf16>" in ln for ln in text.splitlines() if "dot_general" in ln),
                               "s8_dot": any("xi8>" in ln and "xi32>" in ln for ln in text.splitlines()
                                             if "dot_general" in ln),
                               "f8_dot": any("xf8E4M3FN>" in ln for ln in text.splitlines() if "dot_general" in ln),
                               "pallas_calls": text.count("__gpu$xla.gpu.triton")}
        out[name] = steps
    return out


# Gemma decoders: TP sizes per checkpoint, and the context the tiny Gemma 4's images need
GEMMA_TP = {"gemma3": (2, 4), "gemma4": (2, 4)}
GEMMA_ENGINE = dict(max_num_seqs=4, max_model_len=256, prefill_chunk=64, max_encode_batch=2)


def gemma_parity(paths: dict) -> dict:
    """Gemma 3 / Gemma 4 text decoders under TP: greedy ids (twice: the second run hits the
    prefix cache, i.e. resumes from retained ring / segment rows), prompt logits, shard sizes and
    the decode step's collectives, against one device."""
    out = {}
    for name, path in paths.items():
        base = mmjax.load(path, **GEMMA_ENGINE)
        tok = base.family.image_token
        want = generate(base)
        prompt, img = f"USER: {tok}\nwhat is this? ASSISTANT:", [noise(7, 40, 40)]
        want_logits = base.logits(prompt, img)
        res = {"ids_1dev": want}
        for tp in GEMMA_TP[name]:
            vlm = mmjax.load(path, tensor_parallel=tp, **GEMMA_ENGINE)
            got, again = generate(vlm), generate(vlm)
            eng = vlm.engine
            res[f"tp{tp}"] = {
                "ids_equal": got == want, "ids_again_equal": again == want,
                "tokens_cached": eng.stats()["tokens_cached"], "mesh": eng.stats()["mesh"],
                "logits_rel": rel(vlm.logits(prompt, img), want_logits),
                "params": shard_fractions({"text": eng.runner.lm_leaves}, tp),
                "cache": shard_fractions(eng.runner.cache, tp),
                "cache_leaves": len(jax.tree.leaves(eng.runner.cache)),
                "decode": decode_collectives(eng.runner), "num_layers": eng.runner.text_model.num_layers,
                "weight_bytes_max_device": eng.stats()["weight_bytes_max_device"]}
        out[name] = res
    return out


def kv_int8(paths: dict) -> dict:
    """An int8 KV cache (per-token, per-KV-head scales) under TP 2 on LLaVA: greedy ids of the
    batch's text requests (no encode: CI time) equal one device's int8 cache, again from the
    prefix cache; K/V and their scales 1/TP per device."""
    kw = dict(ENGINE, kv_cache_dtype="int8")
    base = mmjax.load(paths["llava"], **kw)
    reqs = [r for r in requests(base.family.image_token) if "images" not in r]
    want = generate(base, reqs)
    vlm = mmjax.load(paths["llava"], mesh=make_mesh(2, 1), **kw)
    got, again = generate(vlm, reqs), generate(vlm, reqs)
    cache = vlm.engine.runner.cache
    return {"ids_equal": got == want, "ids_again_equal": again == want,
            "tokens_cached": vlm.engine.stats()["tokens_cached"], "cache": shard_fractions(cache, 2),
            "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(cache)})}


def weights_int8(paths: dict) -> dict:
    """int8 weights (mmjax.quant: per-channel scales, s8 x s8 dots) over DP 2 x TP 2 on LLaVA
    (one mesh for both: CI time) against one device's int8 weights: greedy ids of the text
    requests (twice: prefix cache), a text prompt's logits, every model-sharded array 1/TP per
    device, no weight gathered in the decode step; and a decode and a prefill step of a TP 2
    int8 runner (a decode step of an fp8 one) exported for CUDA."""
    kw = dict(ENGINE, quantize="int8")
    base = mmjax.load(paths["llava"], **kw)
    reqs = [r for r in requests(base.family.image_token) if "images" not in r]
    want = generate(base, reqs)
    prompt = "USER: what is in a red circle? ASSISTANT:"
    want_logits = base.logits(prompt)
    vlm = mmjax.load(paths["llava"], mesh=make_mesh(2, 2), **kw)
    got, again = generate(vlm, reqs), generate(vlm, reqs)
    replicas = vlm.engine.replicas
    runner = replicas[0].runner
    try:   # group scales under TP: refused before loading
        mmjax.load(paths["llava"], tensor_parallel=2, quantize="int8", quantize_group_size=16)
        refused = None
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        refused = f"{type(e).__name__}: {e}"
    return {"group_size_refused": refused,
            "ids_equal": got == want, "ids_again_equal": again == want, "replicas": len(replicas),
            "mesh": vlm.engine.stats()["mesh"], "logits_rel": rel(vlm.logits(prompt), want_logits),
            "params": shard_fractions({"text": runner.lm_leaves}, 2),
            "weight_dtypes": sorted({str(x.dtype) for x in runner.lm_leaves}),
            "decode": decode_collectives(runner),
            "export": export({"llava": paths["llava"]}, tp=2, quantize="int8",
                             only=("decode[4]", "prefill[64]", "prefill[64,"))["llava"],
            "export_fp8": export({"llava": paths["llava"]}, tp=2, quantize="fp8", only=("decode[4]",))["llava"]}


def quant(paths: dict) -> dict:
    """The 8-bit modes in one process (CI time): int8 KV cache, int8 weights."""
    return {"kv_int8": kv_int8(paths), "weights_int8": weights_int8(paths)}


if __name__ == "__main__":
    mode, first, second = sys.argv[1:4]
    if mode == "gemma":
        paths = {"gemma3": first, "gemma4": second}
        print("RESULT " + json.dumps({"parity": gemma_parity(paths), "export": export(paths, tp=4)}), flush=True)
        sys.exit(0)
    paths = {"llava": first, "qwen2_5_vl": second}
    print("RESULT " + json.dumps({"parity": parity, "export": export, "quant": quant}[mode](paths)), flush=True)
