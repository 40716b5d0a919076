"""The GLM-4.xV text decoders: GLM-4.1V / GLM-4.6V's dense `Glm4vTextModel` and GLM-4.5V's
`Glm4vMoeTextModel` (shared experts, sigmoid group-limited router).

Both are the Llama decoder (text/llama.py) with M-RoPE over three position rows (contiguous
sections, `mrope_section`) applied to the first `partial_rotary_factor` of each head, and q/k/v
biases. What differs:
- dense (`post_norms`): each block's output is normed before it joins the residual stream
  (`post_self_attn_layernorm`, `post_mlp_layernorm`), the MLP's gate|up is one HF tensor
  (`gate_up_proj`), and the rotary pairs are interleaved (dims 2j, 2j+1: GPT-J style);
- MoE: plain pre-norm layers, the rotary pairs are halves (i, i + rotary_dim / 2: GPT-NeoX
  style), and from layer `first_k_dense_replace` on the MLP is `Glm4vMoeMoE`: a sigmoid router
  with a score-correction bias and group-limited top-k, routed experts (nn/moe.py's `Experts`)
  plus `shared_experts`, a gated MLP every token takes, added without a gate.

Partial, interleaved or half-split rotation is turned into the full-width rotate-half that
nn.Attention applies by permuting each head's q / k dims once at load (`rotary_permutation`): a
rotated pair (a, b) lands at (j, j + head_dim / 2) and the unrotated dims at the slots whose angle
is 0 (cos 1, sin 0). Scores q.k are unchanged by a permutation applied to both, and V and the
output projection are untouched, so the cache and attention are nn.Attention's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import Attention
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.linear import param
from mmjax.models.nn.moe import Experts
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import cos_sin
from mmjax.models.text.llama import LlamaConfig, LlamaModel


@dataclass(frozen=True)
class GlmMoeConfig:
    """GLM-4.5V's MoE layers (Glm4MoeTopkRouter + Glm4MoeMoE): `num_experts` routed experts of
    width `intermediate_size`, `top_k` per token chosen among the `topk_group` best of `n_group`
    expert groups, weights = sigmoid scores renormalised (`norm_topk_prob`) times
    `routed_scaling_factor`; `n_shared` shared experts as one gated MLP; dense MLP before
    `first_k_dense`."""
    num_experts: int
    top_k: int
    intermediate_size: int
    n_shared: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense: int

    @classmethod
    def from_hf(cls, cfg: dict, where: str) -> "GlmMoeConfig":
        e = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
        k = int(require(cfg, "num_experts_per_tok", where))
        g = int(cfg.get("n_group") or 1)
        tg = int(cfg.get("topk_group") or 1)
        if e <= 0 or not 0 < k <= e:
            raise UnsupportedModelError(f"config.json: {where}.num_experts_per_tok={k} must be in 1..{e}",
                                        param=f"{where}.num_experts_per_tok")
        if e % g or not 0 < tg <= g:
            raise UnsupportedModelError(f"config.json: {where}.n_group={g} / topk_group={tg} do not fit {e} experts",
                                        param=f"{where}.n_group")
        return cls(num_experts=e, top_k=k, intermediate_size=int(require(cfg, "moe_intermediate_size", where)),
                   n_shared=int(cfg.get("n_shared_experts") or 0), n_group=g, topk_group=tg,
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                   first_k_dense=int(cfg.get("first_k_dense_replace") or 0))


@dataclass(frozen=True)
class Glm4TextConfig(LlamaConfig):
    """LlamaConfig plus GLM's rotary layout and block shape (module docstring)."""
    rotary_dim: int = 0                   # dims of each head that rotate (head_dim * partial_rotary_factor)
    interleaved_pairs: bool = True        # dense: pairs (2j, 2j+1); MoE: halves of rotary_dim
    post_norms: bool = True               # dense: post_self_attn_layernorm / post_mlp_layernorm
    glm_moe: GlmMoeConfig | None = None

    @classmethod
    def from_glm(cls, tc: dict, *, moe: bool, tie: bool, where: str = "text_config") -> "Glm4TextConfig":
        """A Glm4vTextConfig / Glm4vMoeTextConfig dict (v5 `rope_parameters` or the hub's top-level
        rope_theta / partial_rotary_factor) -> the config."""
        if tc.get("use_qk_norm"):     # GLM-4.5-Air-style text configs; GLM-4.xV's never set it
            raise UnsupportedModelError(f"config.json: {where}.use_qk_norm=true is not supported for GLM-4.xV",
                                        param=f"{where}.use_qk_norm")
        rope = {**(tc.get("rope_scaling") or {}), **(tc.get("rope_parameters") or {})}
        factor = float(rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.5 if moe else 1.0)))
        src = {**tc, "model_type": "glm4v_text", "rope_parameters": {**rope, "rope_type": rope.get("rope_type",
                                                                                                  "default")}}
        if "rope_theta" not in rope and tc.get("rope_theta") is None:
            src["rope_theta"] = 10000.0
        base = LlamaConfig.from_hf(src, where, tie_word_embeddings=tie, attention_bias=bool(
            tc.get("attention_bias", True)), mlp_bias=False, sliding_window=None, qk_norm=False, moe=None)
        if base.rope.rope_type != "default":
            raise UnsupportedModelError(f"config.json: {where}.rope_parameters.rope_type={base.rope.rope_type!r} is "
                                        "not supported for GLM-4.xV (default only)", param=f"{where}.rope_parameters")
        head_dim = base.hidden_size // base.num_heads if not moe else int(tc.get("head_dim") or
                                                                           base.hidden_size // base.num_heads)
        rotary = int(head_dim * factor)
        section = tuple(int(s) for s in (base.rope.mrope_section or (8, 12, 12)))
        if rotary % 2 or rotary > head_dim or len(section) != 3 or sum(section) != rotary // 2:
            raise CheckpointError(f"config.json: {where}.rope_parameters.mrope_section={list(section)} must be three "
                                  f"sections summing to head_dim * partial_rotary_factor / 2 = {rotary // 2}",
                                  param=f"{where}.rope_parameters.mrope_section")
        return cls(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)},
                      "head_dim": head_dim,
                      "rope": dataclasses.replace(base.rope, mrope_section=section, mrope_interleaved=False)},
                   rotary_dim=rotary, interleaved_pairs=not moe, post_norms=not moe,
                   glm_moe=GlmMoeConfig.from_hf(tc, where) if moe else None)

    def build(self, dtype=jnp.float32) -> "Glm4TextModel":
        return Glm4TextModel(self, dtype)


def rotary_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """perm [head_dim]: new dim i holds HF's dim perm[i]. HF's rotated pair j (dims (2j, 2j+1)
    interleaved, (j, j + rotary_dim / 2) half-split) goes to (j, j + head_dim / 2), the dims past
    rotary_dim fill the remaining slots of each half in order."""
    half, r2 = head_dim // 2, rotary_dim // 2
    j = np.arange(r2)
    a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + r2)
    rest = np.arange(rotary_dim, head_dim)
    k = (head_dim - rotary_dim) // 2
    return np.concatenate([a, rest[:k], b, rest[k:]]).astype(np.int64)


class Glm4Attention(Attention):
    """nn.Attention reading HF's q / k / v with each head's dims permuted (`rotary_permutation`)."""

    def __init__(self, cfg: Glm4TextConfig, i: int, dtype=jnp.float32):
        super().__init__(layer_idx=i, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias,
                         dtype=dtype)
        self.perm = tuple(int(p) for p in rotary_permutation(cfg.head_dim, cfg.rotary_dim, cfg.interleaved_pairs))

    def hf_weights(self, w, name: str) -> None:
        perm, hd, d = np.asarray(self.perm), self.head_dim, self.qkv_proj.d_in

        def permuted(a: np.ndarray, heads: int, rotate: bool) -> np.ndarray:
            if not rotate:
                return a
            return a.reshape(heads, hd, *a.shape[1:])[:, perm].reshape(a.shape)
        ws, bs = [], []
        for p, rotate in zip(self.qkv_proj.parts, (True, True, False)):
            heads = p.width // hd
            ws.append(permuted(w.take(f"{name}.{p.name}.weight", (p.width, d)), heads, rotate).T)
            if self.qkv_proj.bias is not None:
                bs.append(permuted(w.take(f"{name}.{p.name}.bias", (p.width,)), heads, rotate))
        w.set(self.qkv_proj.kernel, np.concatenate(ws, axis=1), fused=self.qkv_proj.parts, matmul=True)
        if bs:
            w.set(self.qkv_proj.bias, np.concatenate(bs), fused=self.qkv_proj.parts)
        self.o_proj.hf_weights(w, f"{name}.o_proj")


class FusedGateUpMLP(GatedMLP):
    """Glm4vTextMLP: GatedMLP whose gate|up is one HF tensor `gate_up_proj` [2f, d] (gate first)."""

    def hf_weights(self, w, name: str) -> None:
        f2, d = self.gate_up_proj.d_out, self.gate_up_proj.d_in
        w.set(self.gate_up_proj.kernel, w.take(f"{name}.gate_up_proj.weight", (f2, d)).T,
              fused=self.gate_up_proj.parts, matmul=True)
        self.down_proj.hf_weights(w, f"{name}.down_proj")


def glm_route(x: jax.Array, weight: jax.Array, bias: jax.Array, moe: GlmMoeConfig) -> tuple[jax.Array, jax.Array]:
    """Glm4MoeTopkRouter: x [n, d] -> (weights [n, k] float32, expert ids [n, k] int32).

    Scores sigmoid(x W^T) in float32; the choice adds the correction bias, keeps the topk_group
    groups whose two best biased scores sum highest, takes the top k there; the weights are the
    unbiased scores of the chosen, renormalised (+1e-20) and scaled."""
    e, g = moe.num_experts, moe.n_group
    logits = jnp.matmul(x.astype(jnp.float32), weight.astype(jnp.float32))       # [n, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    if g > 1:
        grouped = choice.reshape(-1, g, e // g)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                     # [n, G]
        _, top_groups = jax.lax.top_k(group_scores, moe.topk_group)
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(group_scores.shape[0])[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, moe.top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if moe.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * np.float32(moe.routed_scaling_factor), idx.astype(jnp.int32)


class Glm4vMoeTopkRouter(nnx.Module):
    """The router's `weight` [d, E] (HF's [E, d] transposed, float32) and `e_score_correction_bias` [E]."""

    def __init__(self, hidden: int, moe: GlmMoeConfig):
        self.hidden, self.moe = hidden, moe
        self.weight = param((hidden, moe.num_experts), jnp.float32, (None, None))
        self.e_score_correction_bias = param((moe.num_experts,), jnp.float32, (None,))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return glm_route(x, self.weight.get_value(), self.e_score_correction_bias.get_value(), self.moe)

    def hf_weights(self, w, name: str) -> None:
        """Both kept in float32 whatever the model's dtype (transformers keeps them so: a bf16
        correction bias would change which experts are chosen)."""
        e = self.moe.num_experts
        for var, value in ((self.weight, w.take(f"{name}.weight", (e, self.hidden)).T),
                           (self.e_score_correction_bias, w.take(f"{name}.e_score_correction_bias", (e,)))):
            var.set_value(w.place(np.ascontiguousarray(value, np.float32), tuple(var.get_metadata()["axes"])))


class GlmExperts(Experts):
    """nn.moe.Experts also reading the hub's per-expert tensors (`experts.{i}.gate_proj` / `up_proj` /
    `down_proj`, GLM-4.5V's released files) besides transformers 5's stacks."""

    def hf_weights(self, w, name: str) -> None:
        if w.has(f"{name}.gate_up_proj") or not w.has(f"{name}.0.gate_proj.weight"):
            return super().hf_weights(w, name)
        e, d, f = self.num_experts, self.hidden, self.intermediate
        gu = np.stack([np.concatenate([w.take(f"{name}.{i}.gate_proj.weight", (f, d)).T,
                                       w.take(f"{name}.{i}.up_proj.weight", (f, d)).T], axis=1) for i in range(e)])
        down = np.stack([w.take(f"{name}.{i}.down_proj.weight", (d, f)).T for i in range(e)])
        w.set(self.gate_up_proj, gu, matmul=True)
        w.set(self.down_proj, down, matmul=True)


class Glm4vMoeMoE(nnx.Module):
    """`gate` (the router), `experts`, `shared_experts` (a gated MLP added to every token)."""

    def __init__(self, hidden: int, moe: GlmMoeConfig, dtype=jnp.float32):
        self.moe = moe
        self.gate = Glm4vMoeTopkRouter(hidden, moe)
        self.experts = GlmExperts(moe.num_experts, hidden, moe.intermediate_size, dtype=dtype)
        self.shared_experts = GatedMLP(hidden, moe.intermediate_size * moe.n_shared, dtype=dtype) \
            if moe.n_shared else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [b, t, hidden] -> [b, t, hidden]."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, idx = self.gate(flat)
        out = self.experts(flat, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, d)


class Glm4DecoderLayer(nnx.Module):
    """Glm4vTextDecoderLayer (post_norms) / Glm4vMoeTextDecoderLayer."""

    def __init__(self, cfg: Glm4TextConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.self_attn = Glm4Attention(cfg, i, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.post_self_attn_layernorm = RMSNorm(d, eps, dtype=dtype) if cfg.post_norms else None
        self.post_mlp_layernorm = RMSNorm(d, eps, dtype=dtype) if cfg.post_norms else None
        moe = cfg.glm_moe
        if moe is not None and i >= moe.first_k_dense:
            self.mlp = Glm4vMoeMoE(d, moe, dtype)
        elif cfg.post_norms:
            self.mlp = FusedGateUpMLP(d, cfg.intermediate_size, dtype=dtype)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, dtype=dtype)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        if self.post_self_attn_layernorm is not None:
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.post_mlp_layernorm is not None:
            h = self.post_mlp_layernorm(h)
        return x + h, kv


class Glm4TextModel(LlamaModel):
    """Glm4vTextModel / Glm4vMoeTextModel (module docstring): LlamaModel's embed / norm / head and
    loop, GLM layers, and M-RoPE tables over the rotated dims only."""

    def __init__(self, cfg: Glm4TextConfig, dtype=jnp.float32):
        super().__init__(dataclasses.replace(cfg, num_layers=0), dtype)
        self.config, self.num_layers = cfg, cfg.num_layers
        self.layers = nnx.List([Glm4DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])

    def check_tensor_parallel(self, tp: int) -> None:
        super().check_tensor_parallel(tp)
        moe = self.config.glm_moe
        if moe is not None and moe.n_shared and (moe.intermediate_size * moe.n_shared) % tp:
            raise UnsupportedModelError(f"tensor_parallel={tp} does not divide the shared experts' width "
                                        f"{moe.intermediate_size * moe.n_shared}", param="tensor_parallel")

    def rope(self, positions: jax.Array):
        """positions [3, b, t] -> cos, sin [b, t, head_dim]: section s of the rotated frequencies
        takes position row s; the slots of the unrotated dims get angle 0."""
        cfg = self.config
        r2, half = cfg.rotary_dim // 2, cfg.head_dim // 2
        inv = 1.0 / (np.float32(cfg.rope.theta) ** (np.arange(0, cfg.rotary_dim, 2, dtype=np.float32)
                                                     / np.float32(cfg.rotary_dim)))
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv.astype(np.float32))   # [3, b, t, r2]
        bands, start = [], 0
        for row, width in enumerate(cfg.rope.mrope_section):
            bands.append(freqs[row, ..., start:start + width])
            start += width
        angles = jnp.concatenate(bands + [jnp.zeros((*freqs.shape[1:-1], half - r2), jnp.float32)], axis=-1)
        return cos_sin(jnp.concatenate([angles, angles], axis=-1))

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        from mmjax.models.nn.weights import ignore_tail
        ignore_tail(w, name, self.config.num_layers)    # GLM-4.5V's MTP layer past the decoder
        super().hf_weights(w, name, lm_head)


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> Glm4TextConfig:
    moe = cfg.get("model_type") == "glm4v_moe_text"
    return dataclasses.replace(Glm4TextConfig.from_glm(cfg, moe=moe, tie=bool(cfg.get("tie_word_embeddings", False)),
                                                       where=where), **overrides)
