"""Small shared layers: pure functions of (params, x)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dense(p: dict, x: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b)."""
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm computed in float32 (as torch does for f32 and autocast bf16)."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rms_norm(scale: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """Llama RMSNorm: normalise in float32, cast back, then scale (HF's order of operations)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def activation(name: str):
    acts = {
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "relu": jax.nn.relu,
    }
    if name not in acts:
        from mmjax.errors import UnsupportedModelError
        raise UnsupportedModelError(f"activation {name!r} is not supported", param="hidden_act")
    return acts[name]
