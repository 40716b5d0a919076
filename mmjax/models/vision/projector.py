"""LLaVA multimodal projector: Linear -> act -> Linear."""
from __future__ import annotations

import jax

from mmjax.checkpoint import TensorSource, linear
from mmjax.models.layers import activation, dense


def load_projector_params(src: TensorSource, prefix: str, d_in: int, d_out: int, bias: bool) -> dict:
    return {"fc1": linear(src, prefix + "linear_1", d_in, d_out, bias),
            "fc2": linear(src, prefix + "linear_2", d_out, d_out, bias)}


def project(params: dict, x: jax.Array, act: str) -> jax.Array:
    """x [..., vision_hidden] -> [..., lm_hidden]."""
    return dense(params["fc2"], activation(act)(dense(params["fc1"], x)))
