"""Rotary position embeddings: the config (`rope_parameters` / legacy `rope_scaling`), inverse
frequencies with default / linear / llama3 scaling, cos/sin tables (1-D or M-RoPE sections) and
HF's rotate-half application."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.errors import UnsupportedModelError
from mmjax.backend import current_platform


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding. `rope_type` in {default, linear, llama3}; M-RoPE sections for Qwen2-VL."""
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: frequency j takes the height row if j % 3 == 1, the width row if j % 3 == 2
    # (within 3 * section), else the temporal row; False: contiguous sections (Qwen2-VL)
    mrope_interleaved: bool = False

    @classmethod
    def from_hf(cls, cfg: dict, where: str) -> "RopeConfig":
        # transformers v5 keeps RoPE settings in `rope_parameters`; v4 used rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        for k, v in legacy.items():
            params.setdefault(k, v)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params["type"]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", "default")
        if rope_type == "mrope":  # Qwen2-VL v4 configs name M-RoPE this way; it is default RoPE per section
            rope_type = "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"config.json: {where}.rope_parameters.rope_type={rope_type!r} is not supported "
                "(supported: default, linear, llama3)", param=f"{where}.rope_parameters.rope_type")
        section = params.get("mrope_section")
        return cls(theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(params.get(
                       "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
                   mrope_section=tuple(section) if section else None,
                   mrope_interleaved=bool(params.get("mrope_interleaved", False)))



def rope_inv_freq(r: RopeConfig, dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), with the config's rope scaling applied."""
    inv = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    if r.rope_type == "linear":
        inv = inv / r.factor
    elif r.rope_type == "llama3":
        low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
        high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
            r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def mrope_rows(mrope_section, half: int) -> np.ndarray:
    """[half] int: the position row (0 temporal, 1 height, 2 width) of each frequency in
    Qwen3-VL's interleaved M-RoPE (transformers' Qwen3VLTextRotaryEmbedding): row r in 1, 2 takes
    frequencies r, r + 3, ... below 3 * mrope_section[r]; the rest stay temporal."""
    rows = np.zeros(half, np.int32)
    for r in (1, 2):
        rows[r:3 * mrope_section[r]:3] = r
    return rows


def rope_cos_sin(inv_freq: jax.Array, positions: jax.Array, mrope_section=None, interleaved: bool = False):
    """positions [rows, b, t] -> cos, sin [b, t, head_dim] in float32. One row: plain RoPE.

    M-RoPE (three rows, `mrope_section` set): frequency band i of the section takes its angle
    from the temporal, height or width position row (Qwen2-VL), each section repeated for both
    rotated halves; `interleaved`: the rows alternate over the frequencies (`mrope_rows`, Qwen3-VL).
    """
    if mrope_section is None:
        positions = positions[0]
    pos = positions.astype(jnp.float32)
    freqs = pos[..., None] * inv_freq  # [..., b, t, hd/2]
    if mrope_section is not None and interleaved:
        rows = mrope_rows(mrope_section, freqs.shape[-1])
        freqs = jnp.where(rows == 1, freqs[1], jnp.where(rows == 2, freqs[2], freqs[0]))
    elif mrope_section is not None:
        bands, start = [], 0
        for axis, width in enumerate(mrope_section):
            bands.append(freqs[axis, ..., start:start + width])
            start += width
        freqs = jnp.concatenate(bands, axis=-1)
    return cos_sin(jnp.concatenate([freqs, freqs], axis=-1))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, t, heads, hd]; HF's rotate_half convention (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


def cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of RoPE angles [..., head_dim], each evaluated once per element of `angles`.

    XLA:CPU fuses the transcendentals into every consumer and re-evaluates them there per
    head and layer (it drops optimization barriers before fusing), so on the CPU the tables
    come out of a lax.cond whose two branches are the same: a conditional's results are
    computed once, whichever branch runs. Elsewhere plain ops (a GPU's conditional syncs with
    the host, its sin / cos are cheap)."""
    def tables(a):
        return jnp.cos(a), jnp.sin(a)
    if current_platform() != "cpu" or angles.size == 0:
        return tables(angles)
    return jax.lax.cond(angles.reshape(-1)[0] < 0, tables, tables, angles)
