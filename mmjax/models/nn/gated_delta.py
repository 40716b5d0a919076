"""Gated DeltaNet linear attention (Qwen3-Next / Qwen3.5's `linear_attn`): a fixed-size recurrent
state per sequence instead of a KV cache.

Per value head the state S [k_dim, v_dim] evolves token by token as
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
(q, k L2-normalised, q scaled by k_dim^-1/2; g_t <= 0 the log decay, beta_t in (0, 1) the write
strength). Two exact forms of it, as transformers' torch reference has:
- `chunk_gated_delta`: the chunked (parallel) form for prefill: within a chunk of C = 64 tokens
  the updates are condensed by a unit-lower-triangular solve (the UT transform) into a few
  matmuls, and a `lax.scan` carries the state from chunk to chunk;
- `recurrent_gated_delta`: the token-by-token form for decode (one step per token).

Why plain XLA (no Pallas kernel): both forms are batched matmuls, a triangular solve and a scan
over chunks, which XLA compiles on the CPU (the tests' backend) and lowers for CUDA as they are
(the solve becomes cuBLAS trsm, the scan a while loop of fused GEMMs); the state is small and
per-sequence, so decode is bound by reading the weights, not by this layer. A fused kernel (FLA's
chunk kernel) would save the per-chunk launches on a GPU; it is an optimisation, not a need.

Serving (`GatedDeltaNet`): the layer's cache entry is {"conv": [slots, K - 1, conv_dim] (the last
K - 1 inputs of the causal depthwise conv), "ssm": [slots, heads, k_dim, v_dim] float32}. A call
reads each row's state from its cache row, starting from zeros where the row starts at cache index
0 (a reused slot is reset by its first prefill chunk), and writes the state after its last valid
token back. Padding and rows past kv_len (parked slots under a decode step) neither change the
state (g = 0, beta = 0 make a token a no-op) nor the conv window. Packed prefill rows are regrouped
into one row per segment for the conv and the recurrence (the projections stay on the packed row),
and decode riders in its padding into one one-token row each (recurrent form).
Every token fed to a row changes its state for good, so two things the KV cache shrugs off matter
here: a decode step over a row whose prompt is between chunks (the engine parks such rows,
`Decoder.state_layers`), and resuming a prefix short of the state's end (a state is only valid at
the exact end of what produced it, and a released row may have taken tokens from decode calls in
flight when its request finished): the engine resumes such decoders' prefixes only from snapshots
of the states taken at prefill-chunk ends (serving/state_snapshots.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.nn.linear import Linear, param
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.packing import NO_INDEX

CHUNK = 64          # transformers' chunk_size (and FLA's)
HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """FLA's / transformers' x * rsqrt(sum(x^2) + eps) over the last axis."""
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def _ein(spec: str, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def chunk_gated_delta(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked form. q, k [b, t, h, dk] (L2-normed, q scaled), v [b, t, h, dv], g, beta [b, t, h],
    state [b, h, dk, dv] (all float32) -> (out [b, t, h, dv], final state). t is padded to whole
    chunks with no-op tokens (g = beta = 0: the state passes them unchanged)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (t + pad) // chunk

    def chunks(x):    # [b, T, h, ...] -> [n, b, h, C, ...]
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)                                           # [n, b, h, C]
    lower = np.tril(np.ones((chunk, chunk), bool))
    pair = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    ut = _ein("...id,...jd->...ij", k_beta, k) * pair
    intra = _ein("...id,...jd->...ij", q, k) * pair
    solve = jax.lax.linalg.triangular_solve
    # (I + strictly-lower(ut))^-1 applied to v_beta and the decayed k_beta (the UT transform)
    new_values = solve(ut, v_beta, left_side=True, lower=True, unit_diagonal=True)
    k_cumdecay = solve(ut, k_beta * jnp.exp(cum)[..., None], left_side=True, lower=True, unit_diagonal=True)
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]                   # [n, b, h, 1, 1]

    def step(s, xs):
        nv, kc, qi, ki, ai, di = xs
        v_new = nv - _ein("...cd,...de->...ce", kc, s)
        out = _ein("...cd,...de->...ce", qi, s) + _ein("...ij,...je->...ie", ai, v_new)
        s = s * di + _ein("...cd,...ce->...de", ki, v_new)
        return s, out
    state, out = jax.lax.scan(step, state, (new_values, k_cumdecay, q, k, intra, chunk_decay))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * chunk, h, dv)  # [b, T, h, dv]
    return out[:, :t], state


def recurrent_gated_delta(q, k, v, g, beta, state):
    """The token-by-token form (same arguments and results as `chunk_gated_delta`)."""
    def step(s, xs):
        qt, kt, vt, gt, bt = xs                                            # [b, h, ...]
        s = s * jnp.exp(gt)[..., None, None]
        kv_mem = _ein("bhde,bhd->bhe", s, kt)
        delta = (vt - kv_mem) * bt[..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        return s, _ein("bhde,bhd->bhe", s, qt)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def causal_conv(x: jax.Array, weight: jax.Array, conv_state: jax.Array, n_valid: jax.Array):
    """Depthwise causal conv + SiLU. x [b, t, c] (valid tokens first), weight [K, c], conv_state
    [b, K - 1, c] (the K - 1 inputs before x) -> (out [b, t, c], the K - 1 inputs ending at each
    row's last valid token: n_valid [b])."""
    kk = weight.shape[0]
    t = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)          # [b, K - 1 + t, c]
    xf = xx.astype(jnp.float32)
    out = sum(xf[:, j:j + t] * weight[j].astype(jnp.float32) for j in range(kk))
    idx = n_valid[:, None] + jnp.arange(kk - 1)[None, :]                   # [b, K - 1]
    new_state = jnp.take_along_axis(xx, idx[..., None], axis=1)
    return jax.nn.silu(out).astype(x.dtype), new_state


class GatedRMSNorm(nnx.Module):
    """Qwen3-Next's RMSNormGated: weight * rmsnorm(x) * silu(gate), over each head's v_dim."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.dim, self.eps = dim, eps
        self.scale = param((dim,), dtype, (None,))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)).astype(x.dtype)
        y = self.scale.get_value() * y
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)

    def hf_weights(self, w, name: str) -> None:
        w.set(self.scale, w.take(f"{name}.weight", (self.dim,)))


def _valid(meta: AttentionMetadata) -> jax.Array:
    """[b, t] the real tokens of an unpacked call that are inside the cache (kv_len): padding
    repeats its predecessor's whole position column (M-RoPE image tokens share the temporal row,
    rows 1 and 2 tell them apart), a parked decode row sits past kv_len."""
    valid = meta.valid
    if valid is None:
        pos = meta.positions
        valid = jnp.concatenate([jnp.ones_like(pos[0, :, :1], bool),
                                 (pos[:, :, 1:] != pos[:, :, :-1]).any(axis=0)], axis=1)
    return valid & (meta.q_index < meta.kv_len)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's `linear_attn`: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d (depthwise,
    no bias), dt_bias, A_log, norm (GatedRMSNorm), out_proj. See the module docstring."""

    def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                 conv_kernel: int, eps: float, dtype=jnp.float32):
        self.hk, self.hv, self.dk, self.dv, self.kernel = num_k_heads, num_v_heads, k_dim, v_dim, conv_kernel
        self.key_dim, self.value_dim = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, dtype=dtype, axes=("embed", None))
        self.in_proj_z = Linear(hidden_size, self.value_dim, dtype=dtype, axes=("embed", None))
        self.in_proj_b = Linear(hidden_size, num_v_heads, dtype=dtype, axes=("embed", None))
        self.in_proj_a = Linear(hidden_size, num_v_heads, dtype=dtype, axes=("embed", None))
        self.conv_weight = param((conv_kernel, self.conv_dim), dtype, (None, None))
        self.dt_bias = param((num_v_heads,), jnp.float32, (None,))
        self.A_log = param((num_v_heads,), jnp.float32, (None,))
        self.norm = GatedRMSNorm(v_dim, eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype=dtype, axes=(None, "embed"))

    def hf_weights(self, w, name: str) -> None:
        for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            getattr(self, n).hf_weights(w, f"{name}.{n}")
        conv = w.take(f"{name}.conv1d.weight", (self.conv_dim, 1, self.kernel))
        w.set(self.conv_weight, np.ascontiguousarray(np.asarray(conv)[:, 0, :].T))
        w.set(self.dt_bias, w.take(f"{name}.dt_bias", (self.hv,)))
        w.set(self.A_log, w.take(f"{name}.A_log", (self.hv,)))
        self.norm.hf_weights(w, f"{name}.norm")

    def init_cache(self, num_slots: int, dtype) -> dict:
        """Zero states: conv [slots, K - 1, conv_dim] in `dtype`, ssm [slots, heads, k_dim, v_dim] f32."""
        return {"conv": jnp.zeros((num_slots, self.kernel - 1, self.conv_dim), dtype),
                "ssm": jnp.zeros((num_slots, self.hv, self.dk, self.dv), jnp.float32)}

    def core(self, mixed: jax.Array, a: jax.Array, b: jax.Array, valid: jax.Array, conv_state, ssm_state):
        """Rows of one sequence each: mixed [R, L, conv_dim], a, b [R, L, hv], valid [R, L] (a
        prefix of each row), the rows' states -> (out [R, L, hv, dv], new conv, new ssm)."""
        r, length = valid.shape
        mixed = jnp.where(valid[..., None], mixed, 0)
        x, conv_state = causal_conv(mixed, self.conv_weight.get_value(), conv_state,
                                    valid.sum(axis=1).astype(jnp.int32))
        q, k, v = jnp.split(x.astype(jnp.float32), [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(r, length, self.hk, self.dk)
        k = k.reshape(r, length, self.hk, self.dk)
        v = v.reshape(r, length, self.hv, self.dv)
        if self.hv != self.hk:      # each q/k head serves hv / hk consecutive value heads
            q, k = (jnp.repeat(y, self.hv // self.hk, axis=2) for y in (q, k))
        q = l2norm(q) * (self.dk ** -0.5)
        k = l2norm(k)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
        g = -jnp.exp(self.A_log.get_value()) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias.get_value())
        g = jnp.where(valid[..., None], g, 0.0)
        rule = recurrent_gated_delta if length == 1 else chunk_gated_delta
        out, ssm_state = rule(q, k, v, g, beta, ssm_state)
        return out, conv_state, ssm_state

    def _run(self, mixed, a, b, valid, cache: dict, read, write, fresh) -> tuple[jax.Array, dict]:
        """`core` over rows of one sequence each, their states read from cache rows `read` (zeros
        where `fresh`) and written to rows `write` (an index past the cache drops the write)."""
        conv0 = jnp.where(fresh[:, None, None], 0, cache["conv"][read])
        ssm0 = jnp.where(fresh[:, None, None, None], 0, cache["ssm"][read])
        out, conv1, ssm1 = self.core(mixed, a, b, valid, conv0, ssm0)
        return out, {"conv": cache["conv"].at[write].set(conv1.astype(cache["conv"].dtype), mode="drop"),
                     "ssm": cache["ssm"].at[write].set(ssm1, mode="drop")}

    def __call__(self, x: jax.Array, meta: AttentionMetadata, cache: dict) -> tuple[jax.Array, dict]:
        """x [b, t, hidden] (normed) -> (out [b, t, hidden], the layer's updated cache entry)."""
        bsz, t, _ = x.shape
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        p = meta.packing
        if p is None:       # row i is one sequence at cache row slots[i] (decode: row i)
            rows = meta.write_rows
            read = rows if meta.slots is not None else slice(0, bsz)
            out, cache = self._run(mixed, a, b, _valid(meta), cache, read, rows, meta.starts == 0)
        else:               # packed: one row per segment, then one per rider, scattered back
            local = jnp.arange(t)[None, :]
            gather = jnp.clip(p.seg_offset[:, None] + local, 0, t - 1)          # [S, t]
            valid = local < p.seg_len[:, None]
            o, cache = self._run(mixed[0][gather], a[0][gather], b[0][gather], valid, cache, p.seg_slot, p.seg_slot,
                                 p.seg_start == 0)
            flat = jnp.zeros((t + 1,) + o.shape[2:], o.dtype).at[jnp.where(valid, gather, t).reshape(-1)].set(
                o.reshape(-1, *o.shape[2:]))
            if p.riders is not None:   # decode tokens in the padding: rider j is cache row j's next token
                r = p.riders
                d = r.index.shape[0]
                rides = r.index < NO_INDEX
                pos = jnp.clip(r.position, 0, t - 1)
                o, cache = self._run(mixed[0][pos][:, None], a[0][pos][:, None], b[0][pos][:, None], rides[:, None],
                                     cache, jnp.arange(d), jnp.where(rides, jnp.arange(d), cache["ssm"].shape[0]),
                                     jnp.zeros((d,), bool))
                flat = flat.at[jnp.where(rides, pos, t)].set(o[:, 0])
            out = flat[:t][None]
        y = self.norm(out.astype(x.dtype), z.reshape(bsz, t, self.hv, self.dv))
        return self.out_proj(y.reshape(bsz, t, self.value_dim)), cache
