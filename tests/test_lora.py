"""PEFT LoRA adapters: parity with transformers + peft, several adapters in one batch, errors, the server.

Adapters are made with peft itself on the tiny checkpoints (tests/tiny_lora.py: B drawn at random,
rank_pattern / alpha_pattern / rsLoRA exercised). Tolerances: greedy ids identical for 32 tokens;
each step's logprobs (the chosen token and the top alternatives) within 1e-4 of transformers'
log_softmax of the PEFT model's logits (float32). A batch mixing adapters and the base gives each
row its ids exactly and its logprobs within 1e-5 of the row run alone. Adapters on the vision tower
and projector too (LLaVA, Qwen2.5-VL): image features and prompt logits within 1e-4 (relative, as
the family parity tests) of transformers + peft.
"""
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import LoRAError, LoRANotFoundError
from mmjax.lora import LoRARequest
from tiny_lora import hf_with_adapter, make_adapter

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = dict(temperature=0.0, ignore_eos=True)
N = 32


def hf_greedy(model, inputs: dict, n: int = N):
    """transformers' greedy ids and per-step log-softmax (float64) for one prompt."""
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ids = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, [torch.log_softmax(x[0].double(), -1).numpy() for x in gen.logits]


def assert_parity(out, ids, lps, atol: float = 1e-4) -> None:
    assert out.token_ids == ids and len(ids) == N
    for tok, ours, theirs in zip(out.token_ids, out.logprobs, lps):
        assert abs(ours[tok] - theirs[tok]) <= atol
        for alt, v in ours.items():
            assert abs(v - theirs[alt]) <= atol


@pytest.fixture(scope="module")
def llava(llava_dirs, tmp_path_factory):
    """(base dir, {name: adapter dir}, a VLM serving two adapter slots of rank <= 8)."""
    base = llava_dirs["gqa"]
    root = tmp_path_factory.mktemp("lora_llava")
    adapters = {
        "a1": make_adapter(base, root / "a1", r=8, alpha=16, targets=("q_proj", "v_proj", "o_proj", "gate_proj",
                                                                     "down_proj"),
                           rank_pattern={"v_proj": 4}, alpha_pattern={"o_proj": 4.0}, seed=1, b_scale=0.05),
        "a2": make_adapter(base, root / "a2", r=4, alpha=8, targets=ALL, rslora=True, seed=2, b_scale=0.05),
    }
    vlm = mmjax.load(base, max_num_seqs=4, max_model_len=256, prefill_chunk=64, max_loras=2, max_lora_rank=8)
    return base, adapters, vlm


def llava_inputs(base, img):
    from transformers import AutoProcessor
    return dict(AutoProcessor.from_pretrained(base)(text=PROMPT, images=img, return_tensors="pt"))


def test_llava_parity_and_mixed_batch(llava):
    base, adapters, vlm = llava
    img = noise_image(4, 64, 48)
    inputs = llava_inputs(base, img)
    sp = mmjax.SamplingParams(max_tokens=N, logprobs=3, **GREEDY)
    req = {"prompt": PROMPT, "images": [img]}
    plain = vlm.generate([req], sp)[0]          # the base first: its KV must not serve an adapter's prompt
    alone, runner = {}, vlm.engine.runner
    base_logits = vlm.logits(PROMPT, [img])
    for name, path in adapters.items():
        peft = hf_with_adapter(base, path)
        ids, lps = hf_greedy(peft, inputs)
        steps, compiled = (runner._prefill, runner._decode), runner.compiled_counts()
        alone[name] = vlm.generate([req], sp, lora=LoRARequest(name, str(path)))[0]
        # loading an adapter writes arrays: the same jitted steps, no new shape
        assert (runner._prefill, runner._decode) == steps and runner.compiled_counts() == compiled
        assert_parity(alone[name], ids, lps)
        assert alone[name].token_ids != plain.token_ids            # the adapter matters
        # the research path too: vlm.logits(lora=) is peft's, and not the base model's
        got, want = vlm.logits(PROMPT, [img], lora=name), peft_logits(peft, inputs)
        assert rel_err(got, want) <= 1e-4 and rel_err(base_logits, want) > 1e-2
    assert sorted(vlm.engine.lora_names) == ["a1", "a2"]
    # one batch: both adapters, the base, and an adapter on a text-only prompt; each row as alone
    text = {"prompt": "USER: Tell me a story. ASSISTANT:"}
    text_alone = vlm.generate([text], sp, lora="a2")[0]
    together = vlm.generate([req, req, req, text], sp, lora=["a1", "a2", None, "a2"])
    for got, want in zip(together, [alone["a1"], alone["a2"], plain, text_alone]):
        assert got.token_ids == want.token_ids
        for x, y in zip(got.logprobs, want.logprobs):
            assert max(abs(x[t] - y[t]) for t in x) <= 1e-5


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "qwen3_moe", "idefics3"])
def test_decoder_parity(family, qwen_dirs, gemma3_dirs, qwen3_dirs, idefics3_dirs, tmp_path):
    """The adapter on other decoders (M-RoPE, Gemma's norms and tied head, an MoE decoder's
    attention, Idefics3's decoder named `text_model`): greedy ids and logprobs of a text prompt
    match transformers + peft."""
    base = {"qwen2_5_vl": qwen_dirs["qwen2_5_vl"], "gemma3": gemma3_dirs["window"], "qwen3_moe": qwen3_dirs["moe"],
            "idefics3": idefics3_dirs["idefics3"]}[family]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj") if family == "qwen3_moe" else ALL
    where = rf".*text_model.*\.({'|'.join(targets)})" if family == "idefics3" else None
    path = make_adapter(base, tmp_path / "a", r=4, alpha=16, targets=targets, seed=3, b_scale=0.05,
                        target_modules=where)
    ids = [int(x) for x in np.random.default_rng(0).integers(5, 200, 12)]
    theirs, lps = hf_greedy(hf_with_adapter(base, path), {"input_ids": torch.tensor([ids])})
    vlm = mmjax.load(base, max_num_seqs=2, max_model_len=128, prefill_chunk=32, max_loras=1, max_lora_rank=4)
    out = vlm.generate([{"prompt": ids}], mmjax.SamplingParams(max_tokens=N, logprobs=3, **GREEDY),
                       lora=LoRARequest("a", str(path)))[0]
    assert_parity(out, theirs, lps)


def test_int8_base_with_float_adapter(llava):
    """An int8 base (mmjax.quant) with the float adapter: its logprobs within int8's error of the
    float32 model with the same adapter (the base alone differs by as much), and the adapter matters."""
    base, adapters, vlm = llava
    req = {"prompt": PROMPT, "images": [noise_image(4, 64, 48)]}
    sp = mmjax.SamplingParams(max_tokens=8, logprobs=1, **GREEDY)
    a1 = LoRARequest("a1", str(adapters["a1"]))
    ref = vlm.generate([req], sp, lora=a1)[0]
    q = mmjax.load(base, max_num_seqs=2, max_model_len=128, prefill_chunk=64, max_loras=1, max_lora_rank=8,
                   quantize="int8")
    plain, out = q.generate([req, req], sp, lora=[None, a1])
    assert out.token_ids != plain.token_ids
    first = ref.token_ids[0]
    assert out.token_ids[0] == first and abs(out.logprobs[0][first] - ref.logprobs[0][first]) <= 0.05


def test_load_errors(llava, tmp_path):
    base, adapters, vlm = llava
    eng = vlm.engine
    with pytest.raises(LoRANotFoundError) as e:
        vlm.generate(["hi"], lora="nope")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    big = make_adapter(base, tmp_path / "big", r=16, alpha=16, seed=4)
    with pytest.raises(LoRAError) as e:
        eng.load_lora("big", big)
    assert e.value.status == 400 and e.value.code == "lora_rank_too_large" and "16" in e.value.message
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match="adapter_config.json"):
        eng.load_lora("x", tmp_path / "empty")
    dora = tmp_path / "dora"
    shutil.copytree(adapters["a1"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        eng.load_lora("x", dora)
    conv = make_adapter(base, tmp_path / "conv", seed=5, target_modules=r".*patch_embedding")
    with pytest.raises(LoRAError, match="patch_embedding.*convolution"):
        eng.load_lora("x", conv)
    from safetensors.numpy import load_file, save_file       # a module mmjax does not adapt (a norm)
    other = tmp_path / "other"
    shutil.copytree(adapters["a1"], other)
    t = load_file(str(other / "adapter_model.safetensors"))
    save_file({k.replace("self_attn.q_proj", "input_layernorm"): v for k, v in t.items()},
              str(other / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="targets '.*layers.0.input_layernorm'"):
        eng.load_lora("x", other)
    with pytest.raises(LoRAError, match="slots"):           # both slots hold a1 and a2
        eng.load_lora("a3", adapters["a1"])
    assert sorted(eng.lora_names) == ["a1", "a2"]            # nothing else affected


def test_cuda_lowering_with_adapters(llava):
    """The steps with adapter slots (decoder and encoder) lower for CUDA (bf16): the encode step,
    one prefill and one decode shape."""
    from mmjax.api import load_model
    from mmjax.backend import compiling_for
    from mmjax.lora import Adapters
    from mmjax.models.nn.lora import LoRASlots
    from mmjax.serving.runner import ModelRunner
    model = load_model(llava[0], "bfloat16")
    Adapters.enable(model.module, 2, 8)
    vision = [m for path, m in nnx.iter_modules(model.module) if isinstance(m, LoRASlots) and path[0] != "language_model"]
    assert len(vision) == 6 * len(model.module.vision_tower.encoder.layers) + 2    # q/k/v/out, fc1/fc2; projector
    runner = ModelRunner(model.family, model.module, max_num_seqs=2, max_model_len=128, prefill_chunk=32,
                         max_encode_batch=1, dtype=model.dtype, platform="cuda")
    sigs = [s for s in runner.step_signatures() if s[0] in ("prefill[32,2]", "decode[2]") or s[0].startswith("encode")]
    assert len(sigs) == 3
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with compiling_for("cuda"):
        for name, fn, args, kw in sigs:
            assert jax.export.export(fn, platforms=("cuda",), disabled_checks=[triton])(*args, **kw).mlir_module()


def test_server(llava, tmp_path):
    """--lora-modules, /v1/models, a request's model picking an adapter, runtime load / unload, errors."""
    from serve.app import ServerConfig
    from test_serve import Server, http_get
    base, adapters, vlm = llava
    for name in vlm.engine.lora_names:      # what the tests before left loaded
        vlm.engine.unload_lora(name)
    s = Server(vlm, ServerConfig(served_model_name="tiny", lora_modules={"a1": str(adapters["a1"])}))
    try:
        ids = [m["id"] for m in http_get(s.url + "/v1/models").json()["data"]]
        assert ids == ["tiny", "a1"]
        body = {"prompt": "USER: Tell me a story. ASSISTANT:", "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        replies = {m: s.post("/v1/completions", {**body, "model": m}).json() for m in ("tiny", "a1")}
        assert [r["model"] for r in replies.values()] == ["tiny", "a1"]
        texts = {m: r["choices"][0]["text"] for m, r in replies.items()}
        assert texts["tiny"] != texts["a1"]
        r = s.post("/v1/completions", {**body, "model": "a2"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        big = make_adapter(base, tmp_path / "big", r=16, alpha=16, seed=4)
        r = s.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_rank_too_large"
        r = s.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        assert s.post("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"])}).status_code == 200
        assert [m["id"] for m in http_get(s.url + "/v1/models").json()["data"]] == ["tiny", "a1", "a2"]
        assert s.post("/v1/completions", {**body, "model": "a2"}).status_code == 200
        assert s.post("/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
        r = s.post("/v1/completions", {**body, "model": "a1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # the base model answers as before
        assert s.post("/v1/completions", {**body, "model": "tiny"}).json()["choices"][0]["text"] == texts["tiny"]
    finally:
        s.close()


def test_bench_lora_smoke(llava):
    """bench lora's run of one engine (mixed adapters) on the tiny checkpoint: it serves every token.
    (The engine is configured as the `llava` fixture's, so its steps come from the compilation cache.)"""
    from benchmarks.lora import run_variant
    r = run_variant(str(llava[0]), "mixed", concurrency=[4], requests=6, new_tokens=4, rank=8, adapters=2,
                    base_share=0.0, max_model_len=256, prefill_chunk=64, warmup=False)
    assert r["max_loras"] == 2 and r["runs"][0]["tokens"] == 24 and r["runs"][0]["output_tok_s"] > 0
    assert all(d["step_s"] > 0 for d in r["decode_steps"])


def test_save_peft_loads_in_peft(llava, tmp_path):
    """An adapter trained on mmjax's modules (mmjax.research.lora: nnx.LoRA) saved with save_peft is
    what peft loads: every tensor lands in the PEFT model unchanged, and mmjax reads it back."""
    from flax import nnx
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import load_file
    from mmjax.api import load_model
    from mmjax.lora import read_adapter
    from mmjax.research.lora import LoRALinear, add_lora, save_peft
    from tiny_lora import hf_model
    base = llava[0]
    lm = load_model(base, on_device=False).module.language_model
    names = add_lora(lm, 4, 8.0, targets=("q_proj", "k_proj", "v_proj", "down_proj"), seed=0)
    assert len(names) == 4 * lm.num_layers
    rng = np.random.default_rng(0)
    for _, m in nnx.iter_modules(lm):
        if isinstance(m, LoRALinear):
            for a in m.adapters:
                a.lora_b[...] = rng.normal(0, 0.1, a.lora_b[...].shape).astype(np.float32)
    path = save_peft(lm, tmp_path / "ours", base_model=base)
    ours = load_file(str(path / "adapter_model.safetensors"))
    peft = PeftModel.from_pretrained(hf_model(base), str(path))
    theirs = {k: v.numpy() for k, v in get_peft_model_state_dict(peft).items()}
    assert sorted(theirs) == sorted(ours)
    assert all(np.array_equal(theirs[k], ours[k]) for k in ours)
    back = read_adapter(path)
    assert back.rank == 4 and len(back.modules) == len(names)


# ---- adapters on the vision tower and projector ---------------------------------------------------
LLAVA_ENCODER = (r".*vision_tower.*\.(q_proj|v_proj|out_proj|fc1|fc2)|.*multi_modal_projector\.linear_1"
                 r"|.*language_model.*\.(q_proj|down_proj)")
QWEN_ENCODER = r".*visual.*\.(qkv|attn\.proj|gate_proj|down_proj|mlp\.0)|.*language_model.*\.(q_proj|o_proj|up_proj)"
QWEN_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
               "<|im_start|>assistant\n")


def peft_features(peft, inputs: dict) -> list[np.ndarray]:
    """transformers + peft image features, one [tokens, hidden] array per image."""
    kw = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    with torch.no_grad():
        f = peft.base_model.model.model.get_image_features(**kw)
    f = f.pooler_output if hasattr(f, "pooler_output") else f
    return [x.reshape(-1, x.shape[-1]).numpy() for x in (f if isinstance(f, (list, tuple)) else list(f))]


def peft_logits(peft, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return peft(**inputs).logits[0].numpy()


def check_encoder_adapter(vlm, base, adapter, inputs, prompt, img, tol: float = 1e-4):
    """An adapter on the encoder, the projector and the decoder, against transformers + peft:
    image features and prompt logits (`vlm.logits(lora=)`) within `tol` (relative), greedy ids
    identical and logprobs within 1e-4; loaded without a new compile; then one batch mixing it,
    an adapter of the decoder alone and the base model gives each row what it gives alone."""
    peft = hf_with_adapter(base, adapter)
    eng, runner = vlm.engine, vlm.engine.runner
    req = {"prompt": prompt, "images": [img]}
    sp = mmjax.SamplingParams(max_tokens=N, logprobs=3, **GREEDY)
    plain = vlm.generate([req], sp)[0]              # base first: its features and KV must serve no adapter
    steps, compiled = (runner._encode, runner._prefill, runner._decode), runner.compiled_counts()
    enc = vlm.generate([req], sp, lora=LoRARequest("enc", str(adapter)))[0]
    assert (runner._encode, runner._prefill, runner._decode) == steps and runner.compiled_counts() == compiled
    assert eng.adapters.encoder_salt("enc")                     # its features are its own
    assert len(eng.encoder_cache) == 2                          # the base model's and the adapter's
    ids, lps = hf_greedy(peft, inputs)
    assert_parity(enc, ids, lps)
    assert enc.token_ids != plain.token_ids
    # features: the adapter's against peft's, the base model's unchanged
    ours = vlm.encode([img], lora="enc")
    theirs = peft_features(peft, inputs)
    assert rel_err(ours[0], theirs[0]) <= tol
    base_feats = vlm.encode([img])[0]
    assert rel_err(base_feats, theirs[0]) > 100 * tol
    with peft.disable_adapter():
        assert rel_err(base_feats, peft_features(peft, inputs)[0]) <= tol
    # logits over the prompt (the research path honours the adapter)
    got = vlm.logits(prompt, [img], lora="enc")
    want = peft_logits(peft, inputs)
    assert got.shape == want.shape and rel_err(got, want) <= tol
    assert rel_err(vlm.logits(prompt, [img]), want) > 100 * tol
    from mmjax.research.trace import trace
    t = trace(vlm, prompt, [img], layers=[0], what=("hidden",), lora="enc")
    assert np.abs(t.logits - got).max() <= 1e-5 * np.abs(got).max()
    # a batch: the encoder adapter, a decoder-only adapter (base image features), the base model
    lm_only = make_adapter(base, adapter.parent / "lm_only", r=4, alpha=8, targets=ALL, seed=7, b_scale=0.05)
    hits = eng.encoder_cache.hits
    lm = vlm.generate([req], sp, lora=LoRARequest("lm", str(lm_only)))[0]
    assert not eng.adapters.encoder_salt("lm")                  # the base model's features serve it
    assert len(eng.encoder_cache) == 2 and eng.encoder_cache.hits == hits + 1
    together = vlm.generate([req, req, req], sp, lora=["enc", "lm", None])
    for got_, want_ in zip(together, [enc, lm, plain]):
        assert got_.token_ids == want_.token_ids
        for x, y in zip(got_.logprobs, want_.logprobs):
            assert max(abs(x[t] - y[t]) for t in x) <= 1e-5


def test_llava_encoder_adapter(llava_dirs, tmp_path):
    """LLaVA: LoRA on CLIP's attention and MLP (its last block, which LLaVA's feature layer -2 never
    reads, dropped as transformers' output never sees it), the projector's linear_1 and the decoder."""
    base = llava_dirs["gqa"]
    path = make_adapter(base, tmp_path / "enc", r=8, alpha=16, seed=6, b_scale=0.05, target_modules=LLAVA_ENCODER,
                        rank_pattern={"fc1": 4})
    img = noise_image(8, 64, 48)
    vlm = mmjax.load(base, max_num_seqs=4, max_model_len=256, prefill_chunk=64, max_loras=2, max_lora_rank=8)
    inputs = llava_inputs(base, img)
    check_encoder_adapter(vlm, base, path, inputs, PROMPT, img)
    # another encoder adapter under the same name in the same slot: the features cached for the
    # first one (and its KV) never serve it
    eng = vlm.engine
    slot = eng.lora_slot("enc")
    eng.unload_lora("enc")
    other = make_adapter(base, tmp_path / "other", r=8, alpha=16, seed=11, b_scale=0.05, target_modules=LLAVA_ENCODER)
    assert eng.load_lora("enc", other) == slot
    out = vlm.generate([{"prompt": PROMPT, "images": [img]}], mmjax.SamplingParams(max_tokens=N, logprobs=3, **GREEDY),
                       lora="enc")[0]
    assert_parity(out, *hf_greedy(hf_with_adapter(base, other), inputs))


def test_qwen2_5_vl_encoder_adapter(qwen_dirs, tmp_path):
    """Qwen2.5-VL: LoRA on the packed vision tower (fused qkv, proj, the gated MLP's gate / down),
    the merger's first linear and the decoder."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    from tiny_qwen import hf_processor_inputs
    base = qwen_dirs["qwen2_5_vl"]
    path = make_adapter(base, tmp_path / "enc", r=4, alpha=8, seed=6, b_scale=0.05, target_modules=QWEN_ENCODER)
    img = noise_image(9, 150, 120)
    inputs = hf_processor_inputs(AutoTokenizer.from_pretrained(base), Qwen2VLImageProcessorPil.from_pretrained(base),
                                 QWEN_PROMPT, [img])
    vlm = mmjax.load(base, max_num_seqs=4, max_model_len=512, prefill_chunk=256, max_loras=2, max_lora_rank=4)
    check_encoder_adapter(vlm, base, path, inputs, QWEN_PROMPT, img)


def test_encoder_module_names():
    """PEFT module names -> the encoder's linear layers: HF wrappers the module tree lacks (`model.`,
    CLIP's `vision_model.`) and containers HF lacks (GLM's merger `mlp.`) are skipped, a layer index
    never; a decoder module never lands on the encoder; two equally good layers are no match."""
    from mmjax.lora import _encoder_match
    names = ["vision_tower.encoder.layers.0.self_attn.q_proj", "vision_tower.encoder.layers.1.self_attn.q_proj",
             "visual.blocks.0.mlp.down_proj", "visual.merger.mlp.down_proj", "multi_modal_projector.linear_1"]
    index = {}
    for n in names:
        index.setdefault(n.rsplit(".", 1)[-1], []).append(n)
    match = lambda mod: _encoder_match(mod, index)        # noqa: E731
    assert match("model.vision_tower.vision_model.encoder.layers.1.self_attn.q_proj") == names[1]
    assert match("model.visual.merger.down_proj") == names[3]
    assert match("model.visual.blocks.0.mlp.down_proj") == names[2]
    assert match("model.multi_modal_projector.linear_1") == names[4]
    assert match("model.vision_tower.vision_model.encoder.layers.2.self_attn.q_proj") is None
    assert match("model.language_model.layers.0.mlp.down_proj") is None
    assert match("model.language_model.layers.0.self_attn.q_proj") is None
    assert _encoder_match("visual.x.proj", {"proj": ["visual.a.x.proj", "visual.x.b.proj"]}) is None
