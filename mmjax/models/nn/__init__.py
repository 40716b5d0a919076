"""The Flax NNX building blocks every model is made of: `Linear` / `FusedLinear` / `Embed` (the
precision policy and weight formats), norms, MLPs, rotary embeddings, MoE, `Attention` over the KV
cache and the `AttentionMetadata` it reads, the `Decoder` base with its shared layer loop, captured
intermediates (`Capture`, sow), and the abstract-build / direct-load of HF weights (`Weights`)."""
from mmjax.models.nn.attention import Attention
from mmjax.models.nn.capture import Capture, captured, sow
from mmjax.models.nn.decoder import Decoder
from mmjax.models.nn.linear import Embed, FusedLinear, Linear, Part, activation, matmul
from mmjax.models.nn.metadata import AttentionMetadata, Dropped, MaskSpec, Prune
from mmjax.models.nn.mlp import MLP, GatedMLP
from mmjax.models.nn.norm import LayerNorm, RMSNorm
from mmjax.models.nn.weights import Weights, build, load_children, load_module

__all__ = ["Attention", "AttentionMetadata", "Capture", "Decoder", "Dropped", "Embed", "FusedLinear", "GatedMLP",
           "LayerNorm", "Linear", "MLP", "MaskSpec", "Part", "Prune", "RMSNorm", "Weights", "activation", "build",
           "captured", "load_children", "load_module", "matmul", "sow"]
