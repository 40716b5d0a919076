"""Tensor- and data-parallel serving on 8 fake CPU devices (issue 24).

The pytest process already runs jax on one device, so each test runs tests/sharding_worker.py in
a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 and asserts on the JSON it
prints. The checkpoints are the tiny LLaVA and Qwen2.5-VL builders with 8 query heads over 2 KV
heads, so TP 8 splits the heads and replicates each KV head 4 times, and TP 2 splits KV heads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAST_COMPILE_FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))


def _kv_segments_at(platform: str, positions: int = 256) -> int:
    """KV cache segments of one layer at the workers' 256 positions (backend.Tuning.kv_segment_ladder)."""
    from mmjax.backend import compiling_for
    from mmjax.models.nn.kv_cache import kv_segments
    with compiling_for(platform):
        return len(kv_segments(positions))


SEG_CPU, SEG_GPU = _kv_segments_at("cpu"), _kv_segments_at("cuda")     # 1 and 1
EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    from tiny_checkpoints import build_llava
    from tiny_qwen import build_qwen
    root = tmp_path_factory.mktemp("tp")
    llava = build_llava(root / "llava", variant="gqa", seed=11, text_overrides={**EIGHT_HEADS, "head_dim": 8})
    qwen = build_qwen(root / "qwen", family="qwen2_5_vl", seed=12, text_overrides={
        **EIGHT_HEADS, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}})
    return str(llava), str(qwen)


def run_worker(mode: str, paths: tuple[str, str], timeout: int = 600) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS     # the worker adds its own device count
    p = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), mode, *paths],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=os.path.dirname(HERE))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"worker failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_tensor_and_data_parallel_serving_match_one_device(tp_checkpoints):
    """TP 2/4/8 and DP 2 x TP 4 on LLaVA and Qwen2.5-VL: greedy ids identical to one device for 32
    tokens over a mixed batch (images and text only), logits rel <= 1e-4, every model-sharded
    weight and cache array 1/TP per device, Megatron's collectives in the decode HLO (one
    all-reduce per layer after the o-projection and one after the down-projection, one for the
    vocab-parallel embedding, one all-gather of the logits, no weight gathered), and the prefix
    and encoder caches working under TP and DP; the same with the tensor-parallel ViT option;
    Qwen's packed encode split into one packed group of whole images per device."""
    res = run_worker("parity", tp_checkpoints)
    assert set(res) == {"llava", "qwen2_5_vl"}
    assert set(res["llava"]) == {"ids_1dev", "tp2", "tp4", "tp8", "dp2xtp4", "tp4-vit"}
    assert set(res["qwen2_5_vl"]) == {"ids_1dev", "tp2", "tp4", "tp8", "dp2xtp4"}
    for fam, by_mesh in res.items():
        assert len(by_mesh["ids_1dev"]) == 4 and all(len(ids) == 32 for ids in by_mesh["ids_1dev"]), fam
        assert len({tuple(ids) for ids in by_mesh["ids_1dev"]}) == 4, f"{fam}: requests should differ"
        for mesh, r in by_mesh.items():
            if mesh == "ids_1dev":
                continue
            where = f"{fam} {mesh}"
            tp, dp = {"tp2": (2, 1), "tp4": (4, 1), "tp8": (8, 1), "dp2xtp4": (4, 2), "tp4-vit": (4, 1)}[mesh]
            assert r["mesh"]["axes"] == {"data": dp, "model": tp} and r["mesh"]["devices"] == tp * dp, where
            assert r["ids_equal"] and r["ids_again_equal"] and r["ids_enc_equal"], where
            assert r["tokens_cached"] > 0, f"{where}: the prefix cache served nothing"
            assert r["encoder_cache_hits"] >= 1, f"{where}: the encoder cache served nothing"
            # every array sharded over the model axis holds exactly 1/tp of it on each device:
            # all the decoder's matmul weights (qkv, o, gate_up, down per layer; embed; lm_head)
            layers = 2
            # (+ Qwen's q|k|v bias per layer; the vision tower and projector stay replicated)
            assert r["params"]["sharded"] == 4 * layers + 2 + (layers if fam == "qwen2_5_vl" else 0), where
            assert r["params"]["bad"] == [] and r["cache"]["bad"] == [] and r["vision"]["bad"] == [], where
            # the vision tower: replicated (data parallel over images) unless the TP-ViT option
            assert (r["vision"]["sharded"] > 0) == mesh.endswith("-vit"), f"{where}: {r['vision']}"
            assert r["cache"]["sharded"] == 2 * layers, where     # k and v: one segment (256 positions)
            assert r["replicas"] == dp, where
            if fam == "qwen2_5_vl":   # each packed encode call split into one group per device of a replica
                assert r["encode_buckets"] == [tp], f"{where}: {r['encode_buckets']}"
            devices = [d for rep in r["replica_devices"] for d in rep]
            assert len(devices) == len(set(devices)) == tp * dp, f"{where}: replicas must not share devices"
            if dp > 1:
                assert r["async_ids_equal"], f"{where}: AsyncEngine over the replicas"
            if dp == 1:
                assert r["logits_rel"] <= 1e-4, where
                counts = r["decode"]["counts"]
                assert counts == {"all-reduce": 2 * r["num_layers"] + 1, "all-gather": 1}, f"{where}: {counts}"
                assert r["decode"]["weight_gathers"] == [], where
                assert len(r["decode"]["gathers"]) == 1 and r["decode"]["gathers"][0].startswith("f32[4,"), where
        # weights per device shrink with TP (the vision tower stays replicated)
        w = [by_mesh[m]["weight_bytes_max_device"] for m in ("tp2", "tp4", "tp8")]
        assert w[0] > w[1] > w[2], f"{fam}: {w}"


def test_int8_kv_cache_and_weights_under_tensor_parallel(tp_checkpoints):
    """An int8 KV cache (models/text/kv_quant) at TP 2: the mixed batch's greedy ids equal one
    device's int8 cache (text requests), again from the prefix cache; every K / V segment and its
    scales split over the model axis (1/TP per device). int8 weights (mmjax.quant) over DP 2 x
    TP 2: greedy ids equal one device's int8 weights, logits rel <= 1e-5 (the s8 x s8 dot is
    exact, its s32 partial sums all-reduce exactly; only the per-token activation scale's f32
    rounding may differ), the int8 values and their per-channel scales split with their float
    weights' layout, no weight gathered; the TP 2 int8 prefill / decode steps export for CUDA
    with s8 x s8 -> s32 dots and model-sharded weights (fp8: a decode step, e4m3 dots; the
    TP 8 bf16 export is test_sharded_steps_lower_for_cuda); group scales under TP are refused."""
    out = run_worker("quant", tp_checkpoints)
    r = out["kv_int8"]
    assert r["ids_equal"] and r["ids_again_equal"] and r["tokens_cached"] > 0, r
    layers = 2       # k, v, k_scale, v_scale per layer: one segment
    assert r["cache"] == {"sharded": 4 * layers, "bad": []} and r["dtypes"] == ["bfloat16", "int8"], r
    w = out["weights_int8"]
    assert w["ids_equal"] and w["ids_again_equal"] and w["replicas"] == 2, w
    assert w["mesh"]["axes"] == {"data": 2, "model": 2}, w
    assert w["logits_rel"] <= 1e-5, w
    assert w["group_size_refused"].startswith("InvalidRequestError: quantize_group_size is not supported"), w
    assert "int8" in w["weight_dtypes"], w
    # per layer: qkv, gate_up (values + column scales), o, down (values; their scales follow the
    # replicated output axis); + embed, lm_head values and scales
    assert w["params"] == {"sharded": 6 * layers + 3, "bad": []}, w
    assert w["decode"]["weight_gathers"] == [], w
    assert {k.split(",")[0].rstrip("]") for k in w["export"]} == {"prefill[64", "decode[4"}, w["export"]
    for step, s in w["export"].items():
        assert s["platforms"] == ["cuda"] and s["nr_devices"] == 2 and s["s8_dot"], (step, s)
        # the sharded int8 weights and scales, and k / v (the GPU ladder's segments at 256
        # positions) in and out
        assert s["model_sharded_args"] == 6 * layers + 3 + 2 * (2 * layers * SEG_GPU), (step, s)
    s = w["export_fp8"]["decode[4]"]     # fp8 weights: the same layout, e4m3 x e4m3 -> f32 dots
    assert s["nr_devices"] == 2 and s["f8_dot"] and s["model_sharded_args"] == 6 * layers + 3 + 2 * (2 * layers * SEG_GPU), s


@pytest.mark.slow
def test_sharded_steps_lower_for_cuda(tp_checkpoints):
    """Every compiled step of a TP 8 runner exports for CUDA (bf16) with the 8-device mesh's
    shardings on its arguments and results."""
    res = run_worker("export", tp_checkpoints)
    for fam, steps in res.items():
        kinds = {k.split("[")[0].split("(")[0] for k in steps}
        # + one FastV prefill, + the cache-row copy of n > 1 siblings, + prompt_logprobs' prefill
        assert kinds == {"encode", "prefill", "decode", "prefill_pruned", "copy_slot", "prefill_scores"}, fam
        for step, s in steps.items():
            assert s["platforms"] == ["cuda"] and s["nr_devices"] == 8, (fam, step)
            if step == "copy_slot":       # the KV cache in and out, sharded over "model"; no matmul
                assert s["model_sharded_args"] == 2 * 2 * 2 * SEG_GPU, (fam, s)
                continue
            assert s["bf16_dot"], (fam, step)
            # SPMD cannot split a Pallas custom call: a sharded step keeps XLA's attention
            assert s["pallas_calls"] == 0, (fam, step)
            # prefill / decode: the decoder's weights and the KV cache arrive sharded over "model"
            # (encode reads only the replicated vision tower)
            if not step.startswith("encode"):
                n_layers = 2
                weights = 4 * n_layers + 2 + (n_layers if fam == "qwen2_5_vl" else 0)
                cache = 2 * n_layers * SEG_GPU         # k and v per layer, in the GPU ladder's segments
                # counted over main's signature: the cache is an argument and a result
                assert s["model_sharded_args"] == weights + 2 * cache, (fam, step, s)


def test_tp_layout_keeps_the_math(tmp_path):
    """tp_layout + the grouped forward (run on one device) give the same logits as the fused
    single-device weights, including KV-head replication (tp 8 > 2 KV heads) and a vocab
    padded to a multiple of tp (401 -> 408)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmjax.models.nn import AttentionMetadata
    from mmjax.models.nn.rope import RopeConfig
    from mmjax.models.text.llama import LlamaConfig, LlamaModel
    from mmjax.serving.placed_model import tp_layout

    cfg = LlamaConfig(vocab_size=401, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256,
                      rope=RopeConfig.from_hf({"rope_theta": 10000.0}, "t"), attention_bias=True)
    rng = np.random.default_rng(0)
    lm = LlamaModel(cfg)
    flat = nnx.to_flat_state(nnx.state(lm))     # random weights (norm scales around 1), host arrays
    nnx.update(lm, nnx.from_flat_state([(p, v.replace(rng.standard_normal(v.get_value().shape).astype(np.float32)
                                                       * 0.1 + (p[-1] == "scale"))) for p, v in flat]))
    ids = jnp.asarray(rng.integers(0, 401, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5)[None, None], (1, 2, 5))

    def run(lm, tp=1):
        graphdef, state = nnx.split(lm)

        @jax.jit
        def logits(state):
            lm = nnx.merge(graphdef, state)
            hidden, _ = lm(lm.embed(ids), AttentionMetadata(pos, jnp.zeros(2, jnp.int32), 5),
                           lm.init_cache(2, 16, jnp.float32, tp=tp))
            return lm.logits(hidden)
        return np.asarray(logits(state))
    base = run(lm)
    for tp in (2, 8):
        laid = nnx.clone(lm)
        tp_layout(laid, tp)
        assert laid.layers[0].self_attn.qkv_proj.kernel.get_value().shape[:2] == (64, tp)
        assert laid.embed_tokens.embedding.get_value().shape[0] % tp == 0
        assert laid.lm_head.kernel.get_value().shape[1] % tp == 0
        got = run(laid, tp)
        assert got.shape == base.shape
        np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gemma_tensor_parallel_matches_one_device(gemma3_dirs, gemma4_dirs):
    """Gemma 3 (sliding-window rings + segmented full layers, QK-norm, tied embeddings scaled by
    sqrt(hidden)) and Gemma 4 (per-layer input embeddings, KV-shared layers, k_eq_v global layers
    with 1 KV head, double-wide MLP) at TP 2 and 4 (4 query heads over 2 KV heads: TP 2 splits
    the KV heads, TP 4 replicates them; Gemma 4's single global KV head is replicated at both):
    greedy ids identical to one device over the mixed batch, again from the prefix cache
    (resuming retained ring rows), logits rel <= 1e-4, every model-sharded weight and cache array
    1/TP per device, no weight gathered in decode and one all-gather (the logits); every step of
    a TP 4 runner exports for CUDA in bf16 with the model-sharded weights and caches."""
    out = run_worker("gemma", (str(gemma3_dirs["window"]), str(gemma4_dirs["dense"])))
    res = out["parity"]
    # per-layer matmul weights (qkv, o, gate_up, down in 5 layers; Gemma 4's fused qkv_proj is
    # q|k|v, q|k (k_eq_v) or q alone (KV-shared layers)), embed, lm_head (+ Gemma 4's per-layer
    # embedding)
    weights = {"gemma3": 4 * 5 + 2, "gemma4": 4 * 5 + 3}
    # Gemma 3: 3 sliding layers' K/V rings + 2 full layers' K/V in segments (256 positions: 2 on
    # the CPU, 1 in the GPU ladder the CUDA exports use); Gemma 4: 3 cache-owning layers' K/V
    cache = {"gemma3": 3 * 2 + 2 * 2 * SEG_CPU, "gemma4": 3 * 2 * SEG_CPU}
    cache_gpu = {"gemma3": 3 * 2 + 2 * 2 * SEG_GPU, "gemma4": 3 * 2 * SEG_GPU}
    for fam in ("gemma3", "gemma4"):
        by_mesh = res[fam]
        assert set(by_mesh) == {"ids_1dev", "tp2", "tp4"}, fam
        assert len({tuple(ids) for ids in by_mesh["ids_1dev"]}) == 4, f"{fam}: requests should differ"
        for tp in (2, 4):
            r, where = by_mesh[f"tp{tp}"], f"{fam} tp{tp}"
            assert r["mesh"]["axes"] == {"data": 1, "model": tp}, where
            assert r["ids_equal"] and r["ids_again_equal"] and r["tokens_cached"] > 0, where
            assert r["logits_rel"] <= 1e-4, where
            assert r["params"] == {"sharded": weights[fam], "bad": []}, where
            assert r["cache"] == {"sharded": cache[fam], "bad": []} and r["cache_leaves"] == cache[fam], where
            counts = r["decode"]["counts"]
            assert counts["all-gather"] == 1 and r["decode"]["weight_gathers"] == [], f"{where}: {counts}"
            assert r["decode"]["gathers"][0].startswith("f32[4,"), where
            # Megatron: an all-reduce after each layer's o- and down-projection and one per
            # vocab-parallel table lookup (Gemma 4: token and per-layer embeddings; XLA's combiner
            # may merge two into one tuple all-reduce, so count the reduced arrays)
            lookups = {"gemma3": 1, "gemma4": 2}[fam]
            assert r["decode"]["all_reduced"] == 2 * r["num_layers"] + lookups, f"{where}: {r['decode']}"
            assert set(counts) == {"all-reduce", "all-gather"}, f"{where}: {counts}"
        assert by_mesh["tp2"]["weight_bytes_max_device"] > by_mesh["tp4"]["weight_bytes_max_device"], fam
        for step, s in out["export"][fam].items():
            assert s["platforms"] == ["cuda"] and s["nr_devices"] == 4, (fam, step)
            if step == "copy_slot":             # n > 1 cache-row copy: the cache in and out, no matmul
                assert s["model_sharded_args"] == 2 * cache_gpu[fam], (fam, step, s)
                continue
            assert s["bf16_dot"], (fam, step)
            if not step.startswith("encode"):   # cache: an argument and a result (256 positions)
                assert s["model_sharded_args"] == weights[fam] + 2 * cache_gpu[fam], (fam, step, s)


def test_gemma_tp_layout_keeps_the_math(gemma3_dirs, gemma4_dirs):
    """Gemma 3 (window, softcap) and Gemma 4 (dense, MoE) text models: tensor_parallel(tp) +
    tp_layout run on one device give the one-device logits (tp 2 and 4, KV heads split and
    replicated, vocab padded), and Gemma 4 with int8 weights at tp 2 the one-device int8 logits;
    a tp that does not divide the heads is refused."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmjax.api import load_model
    from mmjax.errors import UnsupportedModelError
    from mmjax.models.nn import AttentionMetadata
    from mmjax.serving.placed_model import tp_layout

    ids = jnp.asarray(np.random.default_rng(0).integers(5, 300, (2, 14)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(14)[None, None], (1, 2, 14))

    def run(lm, tp=1):
        graphdef, state = nnx.split(lm)

        @jax.jit
        def logits(state):
            lm = nnx.merge(graphdef, state)
            cache = lm.init_cache(2, 32, jnp.float32, max_chunk=14, tp=tp)
            embeds, extra = lm.token_inputs(ids)
            hidden, _ = lm(embeds, AttentionMetadata(pos, jnp.zeros(2, jnp.int32), 14), cache, **extra)
            return lm.logits(hidden)
        return np.asarray(logits(state))

    def laid_out(lm, tp):   # a copy in the tp-shard layout (tp_layout works in place)
        lm = nnx.clone(lm)
        tp_layout(lm, tp)
        return lm
    for path in (*gemma3_dirs.values(), *gemma4_dirs.values()):
        lm = load_model(path, on_device=False).module.language_model    # host [in, out] weights
        base = run(lm)
        for tp in (2, 4):
            got = run(laid_out(lm, tp), tp)
            np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-5, err_msg=f"{path} tp{tp}")
        with pytest.raises(UnsupportedModelError, match="tensor_parallel=3"):
            laid_out(lm, 3)
        if path in gemma4_dirs.values():   # int8 weights (mmjax.quant): values and scales laid out alike
            q = load_model(path, on_device=False, quantize="int8").module.language_model
            got = run(laid_out(q, 2), 2)
            np.testing.assert_allclose(got, run(q), rtol=1e-5, atol=1e-5, err_msg=f"{path} int8 tp2")


@pytest.mark.slow
def test_two_processes_serve_one_mesh(tp_checkpoints):
    """Multi-host on CPU: 2 local processes x 2 fake devices joined by jax.distributed (gloo);
    process 0 schedules and serves a TP 4 engine over all 4 devices, process 1 follows the same
    compiled steps; greedy ids equal process 0's single-device run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS     # the worker adds its own device count
    cmd = [sys.executable, os.path.join(HERE, "multihost_worker.py")]
    follower = subprocess.Popen(cmd + ["1", port, tp_checkpoints[0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=os.path.dirname(HERE))
    try:
        leader = subprocess.run(cmd + ["0", port, tp_checkpoints[0]], capture_output=True, text=True, timeout=400,
                                env=env, cwd=os.path.dirname(HERE))
        f_out, f_err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    lines = [ln for ln in leader.stdout.splitlines() if ln.startswith("RESULT ")]
    assert leader.returncode == 0 and lines, f"leader failed:\n{leader.stdout[-2000:]}\n{leader.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["processes"] == 2 and res["devices"] == 4
    assert res["mesh"]["axes"] == {"data": 1, "model": 4}
    assert len(res["weight_bytes_per_device"]) == 2          # the leader sees its own 2 devices' shards
    assert res["ids_equal"], res["ids"]
    followed = [ln for ln in f_out.splitlines() if ln.startswith("FOLLOWED ")]
    assert follower.returncode == 0 and followed, f"follower failed:\n{f_out[-2000:]}\n{f_err[-4000:]}"
    assert json.loads(followed[-1][len("FOLLOWED "):])["calls"] > 32   # encode + prefills + >= 32 decodes


def test_one_device_stats_and_metrics_report_the_mesh(llava_dirs):
    """engine.stats() and /metrics carry the mesh and every device's weight and KV-cache bytes
    (one device here: the totals)."""
    import jax

    from flax import nnx

    from mmjax.api import load_model
    from mmjax.serving.engine import Engine
    from serve.metrics import ServerMetrics

    model = load_model(llava_dirs["gqa"])
    eng = Engine(model, max_num_seqs=2, max_model_len=128, prefill_chunk=32)
    st = eng.stats()
    assert st["mesh"]["devices"] == 1
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.module)))
    cache = sum(x.nbytes for x in jax.tree.leaves(eng.runner.cache))
    assert list(st["weight_bytes_per_device"].values()) == [weights] == [st["weight_bytes_max_device"]]
    assert list(st["kv_cache_bytes_per_device"].values()) == [cache] == [st["kv_cache_bytes_max_device"]]
    text = ServerMetrics(eng.stats, lambda: 0).render().decode()
    dev = next(iter(st["weight_bytes_per_device"]))
    assert f'mmjax_weight_bytes{{device="{dev}"}} {float(weights)}' in text
    assert f'mmjax_kv_cache_bytes{{device="{dev}"}} {float(cache)}' in text


def test_data_parallel_routing_keeps_cache_affinity():
    """A repeat of the same first image (or prompt prefix) goes where it went before, unless that
    replica is more than `affinity_slack` requests busier than the least loaded one."""
    from types import SimpleNamespace

    from mmjax.serving.data_parallel import DataParallelEngine

    class Replica:
        def __init__(self):
            self.waiting, self.running = [], []
            self.scheduler = SimpleNamespace(active=lambda: self.running)

    dp = DataParallelEngine.__new__(DataParallelEngine)
    dp.replicas = [Replica(), Replica()]
    dp.affinity_slack = 2
    dp._affinity, dp._max_keys = __import__("collections").OrderedDict(), 100
    dp.routed = {"affinity": 0, "least_loaded": 0}

    def req(image=None, prompt=(1, 2, 3)):
        images = [SimpleNamespace(key=image)] if image else []
        return SimpleNamespace(images=images, prompt_ids=np.asarray(prompt))

    def submit(r):
        i = dp.route(r)
        dp.replicas[i].waiting.append(r)
        return i

    assert submit(req("cat")) == 0                 # new key: least loaded (tie -> 0)      loads 1, 0
    assert submit(req("dog")) == 1                 # new key: least loaded                 loads 1, 1
    assert submit(req("dog")) == 1                 # affinity beats the tie-break to 0     loads 1, 2
    assert submit(req("dog")) == 1                 # 2 <= 1 + slack                        loads 1, 3
    assert submit(req("dog")) == 1                 # 3 <= 1 + slack                        loads 1, 4
    assert submit(req("dog")) == 0                 # 4 > 1 + slack: the hot key moves      loads 2, 4
    assert submit(req("dog")) == 0                 # and stays with its new replica        loads 3, 4
    assert submit(req(prompt=(9, 9))) == 0         # text prefix: new key, least loaded    loads 4, 4
    assert submit(req(prompt=(9, 9))) == 0         # same prefix: affinity (tie-break agrees)
    dp.replicas[0].waiting.clear()
    assert submit(req(prompt=(7, 7))) == 0         # least loaded after 0 drained
    assert dp.routed == {"affinity": 5, "least_loaded": 5}


@pytest.mark.slow
def test_serve_flags_tensor_and_data_parallel(tp_checkpoints):
    """`python -m serve --tensor-parallel-size 2 --data-parallel-size 2` on fake CPU devices: a
    chat completion works and /metrics shows the 2 x 2 mesh and four devices' weight bytes."""
    import re
    import signal
    import time
    import urllib.request

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_FLAGS}"}
    p = subprocess.Popen([sys.executable, "-m", "serve", "--model", tp_checkpoints[0], "--port", "0",
                          "--served-model-name", "tiny", "--max-num-seqs", "2", "--max-model-len", "128",
                          "--tensor-parallel-size", "2", "--data-parallel-size", "2"],
                         cwd=os.path.dirname(HERE), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    try:
        port, deadline = None, time.monotonic() + 180
        while port is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "".join(lines)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "hello world"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 8
        # /v1/embeddings: the inputs in one call, split over the two replicas, == one device
        texts = ["USER: hi ASSISTANT:", "USER: describe the red circle ASSISTANT:", "hello world"]
        body = json.dumps({"model": "tiny", "input": texts, "normalize": False}).encode()
        req = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = np.asarray([d["embedding"] for d in json.loads(r.read())["data"]])
        import mmjax
        want = mmjax.load(tp_checkpoints[0], max_num_seqs=1, max_model_len=128).embed(texts, normalize=False)
        assert got.shape == want.shape and np.abs(got - want).max() / np.abs(want).max() < 1e-4
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert 'mmjax_mesh_axis_size{axis="data"} 2.0' in metrics
        assert 'mmjax_mesh_axis_size{axis="model"} 2.0' in metrics
        assert len(re.findall(r"^mmjax_weight_bytes\{device=", metrics, re.M)) == 4
        assert len(re.findall(r"^mmjax_kv_cache_bytes\{device=", metrics, re.M)) == 4
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_bench_sharding_smoke():
    """`mmjax bench sharding --smoke`: per-device decoder bytes fall as 1/TP, a TP decode step has
    2 all-reduces per layer + 1 and one all-gather, and the 72B-shaped row is Qwen2.5-VL-72B's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS     # the benchmark adds its own device count
    p = subprocess.run([sys.executable, "-m", "mmjax.cli", "bench", "sharding", "--smoke"], capture_output=True,
                       text=True, timeout=600, env=env, cwd=os.path.dirname(HERE))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith('{"bench": "sharding"')][-1])
    bench = {r["tp"]: r for r in out["rows"] if r["model"] == "bench"}
    assert sorted(bench) == [1, 2, 4]
    assert bench[1]["comm"]["count"] == 0
    for tp in (2, 4):
        assert bench[tp]["weight_bytes"] < bench[1]["weight_bytes"] / tp * 1.1   # norms stay replicated
        assert bench[tp]["comm"]["by_op"] == {"all-reduce": 2 * 2 + 1, "all-gather": 1}
    big = [r for r in out["rows"] if r["model"].startswith("qwen2.5-vl-72b")]
    assert [r["tp"] for r in big] == [8]
    assert big[0]["comm"]["by_op"] == {"all-reduce": 2 * 80 + 1, "all-gather": 1}
    assert 17e9 < big[0]["weight_bytes"] < 19e9          # ~72.7B bf16 params / 8
