"""Feed-forward blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.nn.linear import FusedLinear, Linear, Part, activation


class GatedMLP(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), gate and up fused as `gate_up_proj`. `axis`: the
    logical axis of the intermediate ("mlp"; a vision tower's "vision_mlp")."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, act: str = "silu", bias: bool = False,
                 axis: str = "mlp", dtype=jnp.float32):
        self.act = act
        self.gate_up_proj = FusedLinear(hidden_size, (Part("gate_proj", intermediate_size, axis),
                                                      Part("up_proj", intermediate_size, axis)), bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, axes=(axis, "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(activation(self.act)(gate) * up)

    def hf_weights(self, w, name: str) -> None:
        self.gate_up_proj.hf_weights(w, f"{name}.")
        self.down_proj.hf_weights(w, f"{name}.down_proj")


class MLP(nnx.Module):
    """fc2(act(fc1(x))): the ViT / projector MLP. `names`: the HF names of the two layers."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, *, act: str, bias: bool = True,
                 names: tuple[str, str] = ("fc1", "fc2"), dtype=jnp.float32, axes: tuple = (None, None, None)):
        self.act, self.names = act, names
        self.fc1 = Linear(d_in, d_hidden, bias=bias, dtype=dtype, axes=axes[:2])
        self.fc2 = Linear(d_hidden, d_out, bias=bias, dtype=dtype, axes=axes[1:])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(activation(self.act)(self.fc1(x)))

    def hf_weights(self, w, name: str) -> None:
        self.fc1.hf_weights(w, f"{name}.{self.names[0]}")
        self.fc2.hf_weights(w, f"{name}.{self.names[1]}")
