"""A sparse mixture-of-experts feed-forward block: router + top-k + grouped expert matmuls.

Token-expert assignments are sorted by expert so that each expert's rows are contiguous, and the
expert MLPs run as two grouped matmuls (`jax.lax.ragged_dot`: one [rows, d] x [experts, d, f]
product whose row groups use their own expert's weights). The work is tokens * top_k rows, not
tokens * experts (a dense all-experts matmul) and not a Python loop over experts.

XLA:CPU has no grouped matmul: JAX lowers ragged_dot there to a masked product over every
expert, slower than a dense all-experts MLP (benchmarks/moe_block.py: 49x a dense MLP of the
active width at decode batch 1). So when compiling for CPU with few rows (decode), the experts
run in a compiled loop that skips (`lax.cond`) every expert no row routes to: each active
expert's weights are read once, idle experts cost nothing (`impl="skip"`).

Routers (each returns weights [n, k] and expert ids [n, k], what `experts_forward` takes):
- `gemma4_route` (transformers Gemma4TextRouter): RMSNorm without scale, times a learned scale and
  hidden**-0.5, linear to expert logits, softmax in float32, top-k, the k weights renormalised to
  sum to 1, then multiplied by a learned per-expert scale.
- `softmax_topk_route` (Qwen3-MoE / Qwen3-VL-MoE / Mixtral's TopKRouter): linear to expert
  logits, softmax in float32, top-k, renormalised when `norm_topk_prob`.

`MoeConfig` + `SparseMoeBlock` are the whole sparse-MoE feed-forward layer of the Qwen MoE line
(softmax router, SiLU-gated experts, optional sigmoid-gated shared expert, HF module names), which
a decoder drops in for its dense MLP (models/text/llama.py does, for Qwen3-VL-MoE). The expert
stacks are replicated under tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.linear import Linear, matmul, param
from mmjax.models.nn.mlp import GatedMLP


def gemma4_route(p: dict, x: jax.Array, top_k: int, eps: float) -> tuple[jax.Array, jax.Array]:
    """x [n, d] -> (weights [n, k] float32, expert ids [n, k] int32).

    p: {"scale": [d], "proj": [d, experts] (an array or a `Linear`), "per_expert_scale": [experts]}."""
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    h = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    h = ((h * p["scale"]).astype(jnp.float32) * np.float32(d ** -0.5)).astype(x.dtype)   # torch: scalar in f32
    proj = p["proj"]
    logits = proj(h) if isinstance(proj, Linear) else matmul(h, proj)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / w.sum(-1, keepdims=True)
    return w * p["per_expert_scale"][idx].astype(jnp.float32), idx.astype(jnp.int32)


def softmax_topk_route(router, x: jax.Array, top_k: int, normalize: bool = True
                       ) -> tuple[jax.Array, jax.Array]:
    """x [n, d], router (a `Linear` [d, experts], or any x -> logits) -> (weights [n, k] in x's
    dtype, expert ids [n, k] int32):
    softmax over the experts in float32, the top k, renormalised to sum to 1 when `normalize`
    (HF's norm_topk_prob), then cast to the logits' dtype as HF does."""
    logits = router(x)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    if normalize:
        top = top / top.sum(-1, keepdims=True)
    return top.astype(logits.dtype), idx.astype(jnp.int32)


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """ragged_dot, bf16 x bf16 with an f32 result cast back (see linear.matmul); quantized
    expert stacks (mmjax.quant.QArray) take their 8-bit ragged dot."""
    from mmjax.quant import QArray, qragged_dot
    if isinstance(w, QArray):
        return qragged_dot(x, w, sizes)
    if x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16:
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return jax.lax.ragged_dot(x, w, sizes)


SKIP_MAX_ROWS = 64   # CPU: token-expert assignments up to which impl "auto" takes the skip loop


def experts_forward(p: dict, x: jax.Array, weights: jax.Array, idx: jax.Array, act, *,
                    impl: str = "auto") -> jax.Array:
    """Weighted sum of each token's top-k expert MLPs.

    x [n, d]; weights / idx [n, k]; p: {"gate_up": [experts, d, 2f], "down": [experts, f, d]}
    (gate and up halves as HF's fused gate_up_proj). Returns [n, d] in x's dtype.
    impl: "ragged" (grouped matmuls), "skip" (loop over active experts), "auto": skip when
    compiling for CPU with at most SKIP_MAX_ROWS assignments, else ragged.
    """
    if impl == "auto":
        from mmjax.backend import current_platform
        small = idx.shape[0] * idx.shape[1] <= SKIP_MAX_ROWS
        impl = "skip" if current_platform() == "cpu" and small else "ragged"
    if impl == "skip":
        return _skip_idle_experts(p, x, weights, idx, act)
    if impl != "ragged":
        raise ValueError(f"unknown MoE impl {impl!r}")
    n, d = x.shape
    k = idx.shape[1]
    e = p["gate_up"].shape[0]
    flat = idx.reshape(-1)                                           # [n*k] expert of each assignment
    order = jnp.argsort(flat, stable=True)                           # assignments grouped by expert
    rows = x[order // k]                                             # [n*k, d]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)           # rows per expert
    gu = _ragged(rows, p["gate_up"], sizes)               # [n*k, 2f]
    f = gu.shape[-1] // 2
    h = _ragged(act(gu[:, :f]) * gu[:, f:], p["down"], sizes)   # [n*k, d]
    h = h * weights.reshape(-1)[order][:, None].astype(h.dtype)
    # back to (token, slot) order, then sum each token's k expert outputs
    out = jnp.zeros_like(h).at[order].set(h, unique_indices=True)
    return out.reshape(n, k, d).sum(axis=1).astype(x.dtype)


def _skip_idle_experts(p: dict, x: jax.Array, weights: jax.Array, idx: jax.Array, act) -> jax.Array:
    """experts_forward for few rows on CPU: a compiled loop over experts, each either skipped
    (no row routed to it) or run on all n*k assignment rows with the others masked out (rows are
    few: the cost is reading the expert's weights once)."""
    n, d = x.shape
    k = idx.shape[1]
    e, f = p["down"].shape[0], p["down"].shape[1]
    flat = idx.reshape(-1)                                           # [n*k]
    rows = jnp.repeat(x, k, axis=0)                                  # assignment order (token, slot)
    sizes = jnp.bincount(flat, length=e)

    def body(j, acc):
        def run(acc):
            gu = matmul(rows, p["gate_up"][j])
            y = matmul(act(gu[:, :f]) * gu[:, f:], p["down"][j])
            return acc + jnp.where((flat == j)[:, None], y, 0)
        return jax.lax.cond(sizes[j] > 0, run, lambda a: a, acc)

    out = jax.lax.fori_loop(0, e, body, jnp.zeros((n * k, d), x.dtype))
    out = out * weights.reshape(-1)[:, None].astype(out.dtype)
    return out.reshape(n, k, d).sum(axis=1).astype(x.dtype)


@dataclass(frozen=True)
class MoeConfig:
    """Sparse-MoE feed-forward (Qwen2-MoE / Qwen3-MoE / Qwen3-VL-MoE): in `layers` the MLP is
    `num_experts` gated experts of width `intermediate_size`, `top_k` per token (softmax router,
    renormalised when `norm_topk_prob`), plus, when `shared_intermediate_size` > 0, a shared
    expert (a gated MLP of that width every token takes, scaled by a sigmoid gate: Qwen2-MoE);
    the other layers keep the dense MLP."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict, where: str, num_layers: int) -> "MoeConfig | None":
        """HF's num_experts (num_local_experts) / num_experts_per_tok / moe_intermediate_size /
        decoder_sparse_step / mlp_only_layers / norm_topk_prob / shared_expert_intermediate_size;
        None without experts."""
        # transformers 5 saves num_experts as num_local_experts (its attribute_map)
        e = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if e <= 0:
            return None
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(int(i) for i in (cfg.get("mlp_only_layers") or ()))
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        k = int(require(cfg, "num_experts_per_tok", where))
        if not 0 < k <= e:
            raise UnsupportedModelError(f"config.json: {where}.num_experts_per_tok={k} must be in 1..{e}",
                                        param=f"{where}.num_experts_per_tok")
        return cls(num_experts=e, top_k=k, intermediate_size=int(require(cfg, "moe_intermediate_size", where)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), layers=layers,
                   shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


class Experts(nnx.Module):
    """`num_experts` SwiGLU experts as stacks: gate_up_proj [E, d, 2f] (gate and up halves, HF's
    fused layout), down_proj [E, f, d]; `__call__` = `experts_forward` (replicated under TP)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, act: str = "silu", dtype=jnp.float32):
        self.num_experts, self.hidden, self.intermediate, self.act = num_experts, hidden, intermediate, act
        self.gate_up_proj = nnx.Param(jnp.zeros((num_experts, hidden, 2 * intermediate), dtype), axes=(None,) * 3)
        self.down_proj = nnx.Param(jnp.zeros((num_experts, intermediate, hidden), dtype), axes=(None,) * 3)

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        from mmjax.models.nn.linear import activation
        return experts_forward({"gate_up": self.gate_up_proj.get_value(), "down": self.down_proj.get_value()},
                               x, weights, idx, activation(self.act))

    def hf_weights(self, w, name: str) -> None:
        """Hub files keep experts as [E, d, 2f] / [E, f, d]; transformers 5's in-memory layout is
        transposed ([E, 2f, d] / [E, d, f]): both are read (the hub shape first), as is one
        gate_proj / up_proj / down_proj Linear per expert (`{name}.{j}.*`)."""
        e, d, f = self.num_experts, self.hidden, self.intermediate
        if w.has(f"{name}.0.gate_proj.weight"):   # one HF Linear per expert (Qwen3.5-MoE's saved layout)
            def each(proj: str, shape: tuple) -> np.ndarray:
                return np.stack([np.asarray(w.take(f"{name}.{j}.{proj}.weight", shape)).T for j in range(e)])
            gate_up = np.concatenate([each("gate_proj", (f, d)), each("up_proj", (f, d))], axis=-1)
            w.set(self.gate_up_proj, gate_up, matmul=True)
            w.set(self.down_proj, each("down_proj", (d, f)), matmul=True)
            return

        def take(n: str, hub: tuple, v5: tuple) -> np.ndarray:
            try:
                return w.take(n, hub)
            except CheckpointError:
                if hub == v5:
                    raise
                return w.take(n, v5).transpose(0, 2, 1)
        w.set(self.gate_up_proj, take(f"{name}.gate_up_proj", (e, d, 2 * f), (e, 2 * f, d)), matmul=True)
        w.set(self.down_proj, take(f"{name}.down_proj", (e, f, d), (e, d, f)), matmul=True)


class SparseMoeBlock(nnx.Module):
    """The Qwen-MoE feed-forward layer: `gate` (the router, [d, E]), `experts`, and where the
    config has one a `shared_expert` (a gated MLP every token takes) scaled by
    sigmoid(`shared_expert_gate`)."""

    def __init__(self, hidden: int, moe: MoeConfig, *, dtype=jnp.float32):
        self.moe = moe
        self.gate = Linear(hidden, moe.num_experts, dtype=dtype, quantize=False)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, dtype=dtype)
        s = moe.shared_intermediate_size
        self.shared_expert = GatedMLP(hidden, s, dtype=dtype) if s else None
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype) if s else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [b, t, hidden] -> [b, t, hidden]."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        w, idx = softmax_topk_route(self.gate, flat, self.moe.top_k, self.moe.norm_topk_prob)
        out = self.experts(flat, w, idx)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(b, t, d)

    def hf_weights(self, w, name: str) -> None:
        self.gate.hf_weights(w, f"{name}.gate")
        self.experts.hf_weights(w, f"{name}.experts")
        if self.shared_expert is not None:
            self.shared_expert.hf_weights(w, f"{name}.shared_expert")
            self.shared_expert_gate.hf_weights(w, f"{name}.shared_expert_gate")
