"""LLaVA's multimodal projector: linear_1 -> act -> linear_2."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.nn.linear import Linear, activation


class LlavaMultiModalProjector(nnx.Module):
    """x [..., vision_hidden] -> [..., lm_hidden]."""

    def __init__(self, d_in: int, d_out: int, *, act: str = "gelu", bias: bool = True, dtype=jnp.float32):
        self.act = act
        self.linear_1 = Linear(d_in, d_out, bias=bias, dtype=dtype, axes=("embed", "vision_mlp"))
        self.linear_2 = Linear(d_out, d_out, bias=bias, dtype=dtype, axes=("vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(activation(self.act)(self.linear_1(x)))
