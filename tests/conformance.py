"""What every family must pass besides its own parity checks, written once (tests call these with
their own checkpoint): the engine's invariants (one batch == one request at a time == caches off,
a prompt chunked across its image, a repeat resumed from the prefix cache, the image mattering),
the server answering through the openai client, and tensor parallelism at TP 2 (a subprocess
with fake CPU devices, tests/tp_worker.py) giving one device's greedy ids. The CUDA lowering of
every compiled step is tests/test_cuda_lowering.py's (add the checkpoint to its lists).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import mmjax
from conftest import page_floor

GREEDY = dict(temperature=0.0, ignore_eos=True)
HERE = Path(__file__).parent


@contextlib.contextmanager
def caches_off(vlm):
    """The engine with its encoder and prefix caches (a paged engine's: page sharing) disabled
    (restored afterwards)."""
    eng = vlm.engine
    pool = eng.pages.pool if eng.pages is not None else None
    enc, pre = eng.encoder_cache.max_bytes, eng.prefix_cache.enabled
    shared = pool.enable_cache if pool is not None else None
    eng.encoder_cache.max_bytes, eng.prefix_cache.enabled = 0, False
    if pool is not None:
        pool.enable_cache = False
    try:
        yield
    finally:
        eng.encoder_cache.max_bytes, eng.prefix_cache.enabled = enc, pre
        if pool is not None:
            pool.enable_cache = shared


def chat_request(vlm, images: list, text: str) -> dict:
    """A chat-template request with `images` first, then `text` (the family's own template)."""
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    prompt, srcs = vlm.render_chat([{"role": "user", "content": content}])
    return {"prompt": prompt, "images": vlm.prepare_images(srcs)}


def engine_invariants(vlm, requests: list[dict], *, max_tokens: int = 16, atol: float = 1e-4) -> dict:
    """requests (at least two, the first with an image): greedy ids and logprobs of one batch ==
    one request at a time == the caches off; the first request again resumes from the prefix
    cache with the same ids (decoders that cannot resume part-way, min_resume: none cached;
    hybrid recurrent decoders: repeated once more, so that the snapshots of its states the repeat
    took are the pool's newest); replacing its image changes its first logprob. The engine's
    prefill chunk should be shorter than the image prompts (chunked prefill across an image).
    -> figures for the caller's report."""
    sp = mmjax.SamplingParams(max_tokens=max_tokens, logprobs=1, **GREEDY)
    together = vlm.generate(requests, sp)
    alone = [vlm.generate([r], sp)[0] for r in requests]
    with caches_off(vlm):
        cold = [vlm.generate([r], sp)[0] for r in requests]
    worst = 0.0
    for a, b, c in zip(together, alone, cold):
        assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == max_tokens
        for x, y, z in zip(a.logprobs, b.logprobs, c.logprobs):
            worst = max(worst, *(abs(x[t] - y[t]) for t in x), *(abs(x[t] - z[t]) for t in x))
    assert worst <= atol, worst
    chunk = vlm.engine.prefill_chunk
    assert max(len(o.prompt_token_ids) for o in together) > chunk, "no prompt is chunked across its image"
    again = vlm.generate([requests[0]], sp)[0]
    if vlm.engine.snapshots is not None:        # recurrent states resume where a snapshot ends
        assert again.token_ids == together[0].token_ids
        again = vlm.generate([requests[0]], sp)[0]
    held = len(together[0].prompt_token_ids)
    resumes = vlm.engine.scheduler.min_resume(held) <= held     # ring-buffer layers may not
    assert again.token_ids == together[0].token_ids and (again.cached_tokens > 0) == resumes
    if resumes and vlm.engine.snapshots is None:
        # KV rows / pages: all but the last token's (a paged cache shares whole pages); a hybrid
        # decoder resumes where a state snapshot ends (a prefill-chunk boundary) instead
        assert again.cached_tokens == page_floor(vlm, held - 1), (again.cached_tokens, held)
    first = requests[0]
    other = dict(first, images=[noise_input(vlm, im) for im in first["images"]])
    changed = vlm.generate([other], sp)[0]
    lp0 = together[0].logprobs[0][together[0].token_ids[0]]
    assert abs(changed.logprobs[0].get(together[0].token_ids[0], -1e9) - lp0) > 1e-4 or \
        changed.token_ids[0] != together[0].token_ids[0], "the image does not change the output"
    return {"logprob_diff": worst, "cached_tokens": again.cached_tokens}


def noise_input(vlm, image):
    """Another image of the same size as a prepared one's source (new pixels, same token count)."""
    from PIL import Image
    w, h = image.source_size if getattr(image, "source_size", None) else (64, 48)
    arr = np.random.default_rng(12345).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return vlm.prepare_images([Image.fromarray(arr)])[0]


def served_through_openai(vlm, image_png: bytes, question: str, max_tokens: int = 8) -> str:
    """An in-process server on `vlm`: the openai client's chat completion with the image equals
    the offline chat's greedy text -> that text."""
    import base64

    from test_serve import Server
    from serve.app import ServerConfig
    uri = "data:image/png;base64," + base64.b64encode(image_png).decode()
    s = Server(vlm, ServerConfig(served_model_name="m"))
    try:
        r = s.client().chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": question}]}])
        text = r.choices[0].message.content
    finally:
        s.close()
    offline = vlm.chat([{"role": "user", "content": [{"type": "image", "image": image_png},
                                                     {"type": "text", "text": question}]}],
                       mmjax.SamplingParams(max_tokens=max_tokens, temperature=0.0)).text
    assert text == offline, (text, offline)
    return text


def tensor_parallel_matches(path, tps=(2,), timeout: int = 900) -> dict:
    """tests/tp_worker.py in a subprocess with 8 fake CPU devices: at each tp, greedy ids of a
    mixed batch (image chat requests, a text-only one) equal one device's, again from the prefix
    cache, and every weight sharded over the model axis holds 1/tp per device."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(HERE / "tp_worker.py"), str(path), *map(str, tps)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for tp in tps:
        res = out[f"tp{tp}"]
        assert res["ids_equal"] and res["ids_again_equal"], (tp, res)
        assert res["sharded"] > 0 and res["bad"] == [], (tp, res)
    return out
