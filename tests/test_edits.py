"""Edits served live (issue 57): `vlm.model` is the live Flax NNX module tree. Change its weights or
replace a submodule, call `vlm.refresh()`, and the offline API, the engine and a server on that
engine use the edited model; a value edit recompiles nothing, a replaced submodule recompiles
only the steps of its part, and what the old weights produced (encoder / prefix caches) is
dropped. Undoing the edit gives the original outputs back, bit for bit."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmjax
from mmjax.packed_weights import unpacked
from test_serve import Server, data_uri


class ZeroMLP(nnx.Module):
    """A replacement MLP that contributes nothing to the residual stream."""

    def __call__(self, x):
        return jnp.zeros_like(x)


def _ask(vlm, img, question, **kw):
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}]
    sp = mmjax.SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True, **kw)
    out = vlm.chat(msgs, sp)
    return out.token_ids, [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module")
def vlm():
    return mmjax.load(max_num_seqs=4, max_model_len=256, prefill_chunk=128)


def test_value_edits_and_replaced_modules_are_served(vlm):
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (200, 150), "white")
    ImageDraw.Draw(img).ellipse((60, 30, 140, 110), fill="red")
    base = _ask(vlm, img, "What shape is this?")
    runner, engine = vlm.engine.runner, vlm.engine
    compiled = {k: set(v) for k, v in runner.compiled.items()}
    lm = vlm.model.language_model

    # 1. a value edit: layer 0's MLP output projection zeroed (assigned as a plain [in, out] array)
    down = lm.layers[0].mlp.down_proj.kernel
    original = down.get_value()
    down.set_value(jnp.zeros(np.asarray(unpacked(original)).shape, jnp.float32))
    assert vlm.refresh() == {"language_model"}
    assert vlm.refresh() == set()                                  # nothing left to do
    assert not any(len(k) for k in engine.prefix_cache.keys)      # the old weights' KV is forgotten
    zeroed = _ask(vlm, img, "What shape is this?")
    assert zeroed[1] != base[1]
    # a value edit compiles no new shape (same graph, same shapes: the placed weight is re-packed)
    assert {k: set(v) for k, v in runner.compiled.items()} == compiled

    # 2. a replaced submodule: the same function as the zeroed projection (the MLP has no bias)
    down.set_value(original)
    mlp = lm.layers[0].mlp
    lm.layers[0].mlp = ZeroMLP()
    assert vlm.refresh() == {"language_model"}
    replaced = _ask(vlm, img, "What shape is this?")
    assert replaced[0] == zeroed[0]
    np.testing.assert_allclose(replaced[1], zeroed[1], atol=1e-5)
    # only the decoder's steps were rebuilt: the encode shape compiled before is still there
    assert runner.compiled["encode"] == compiled["encode"]
    lm.layers[0].mlp = mlp
    assert vlm.refresh() == {"language_model"}

    # 3. a vision-side edit drops the encoder cache (features of the old weights) and changes answers
    assert engine.encoder_cache.bytes > 0
    proj = vlm.model.multi_modal_projector.linear_2.bias
    bias = proj.get_value()
    proj.set_value(bias + 1.0)
    assert vlm.refresh() == {"vision"}
    assert engine.encoder_cache.bytes == 0
    assert _ask(vlm, img, "What shape is this?")[1] != base[1]

    # 4. undone: the original outputs, bit for bit
    proj.set_value(bias)
    assert vlm.refresh() == {"vision"}
    assert _ask(vlm, img, "What shape is this?") == base


def test_a_server_on_the_engine_serves_the_edit(vlm):
    from serve.app import ServerConfig
    s = Server(vlm, ServerConfig(served_model_name="shapes"))
    try:
        body = {"model": "shapes", "max_tokens": 4, "temperature": 0, "logprobs": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(5, w=64, h=48)}},
                    {"type": "text", "text": "How many shapes are there?"}]}]}
        before = s.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
        head = vlm.model.language_model.lm_head.kernel
        original = head.get_value()
        w = np.asarray(unpacked(original))
        head.set_value(jnp.asarray(w * 0.5))                       # the server's engine refreshes between steps
        assert vlm.refresh() == {"language_model"}
        after = s.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
        assert [t["logprob"] for t in after] != [t["logprob"] for t in before]
        head.set_value(original)
        vlm.refresh()
        again = s.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
        assert again == before
    finally:
        s.close()
