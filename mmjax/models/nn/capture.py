"""Intermediates the Flax way: modules `sow` what a researcher may want (hidden states, attention
probabilities, per-head outputs) and `nnx.capture(fn, nnx.Intermediate)` collects them. Outside a
capture nothing is stored, so the serving steps' graphs hold no captured value."""
from __future__ import annotations

from dataclasses import dataclass

from flax import nnx


def capturing(module: nnx.Module) -> bool:
    """Is `module` inside an `nnx.capture` (which sets `__captures__` on every module it wraps)?"""
    return hasattr(module, "__captures__")


def sow(module: nnx.Module, name: str, value) -> None:
    """module.sow(nnx.Intermediate, name, value) inside an `nnx.capture`; nothing outside one."""
    if capturing(module):
        module.sow(nnx.Intermediate, name, value)


@dataclass(frozen=True)
class Capture:
    """Which intermediates a research forward returns (static: a different capture compiles a
    different function).

    hidden: every layer's residual stream as HF's `hidden_states` ([0] = embeddings, [i] = after
        layer i, the last one final-normed), each [b, t, hidden].
    attn_layers: layers whose attention probabilities [b, heads, t, kv_len] and per-head outputs
        [b, t, heads, head_dim] (before the output projection) are returned; needs a static
        kv_len. Those layers run an explicit-softmax attention (same math).
    """
    hidden: bool = False
    attn_layers: tuple[int, ...] = ()

    @property
    def any(self) -> bool:
        return self.hidden or bool(self.attn_layers)


def captured(decoder_fn, capture: Capture):
    """decoder_fn(decoder, *args) -> out, wrapped to return (out, intermediates): {"hidden":
    [...]} and {"attn": {layer: probs}, "attn_out": {layer: per-head outputs}} as `capture` asks,
    collected from what the decoder's modules sow (`nnx.capture`)."""
    if not capture.any:
        return lambda decoder, *a, **kw: (decoder_fn(decoder, *a, **kw), {})

    def run(decoder, *args, **kw):
        out, state = nnx.capture(decoder_fn, nnx.Intermediate)(decoder, *args, **kw)
        flat = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(state)}
        inter = {}
        if capture.hidden:
            inter["hidden"] = list(flat[("hidden_states",)])
        if capture.attn_layers:
            inter["attn"], inter["attn_out"] = {}, {}
            for path, v in flat.items():
                if len(path) >= 3 and path[0] == "layers" and path[1] in capture.attn_layers:
                    if path[-1] == "attn_probs":
                        inter["attn"][path[1]] = v[0]
                    elif path[-1] == "attn_out":
                        inter["attn_out"][path[1]] = v[0]
        return out, inter
    return run
