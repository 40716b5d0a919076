"""KV cache bytes of a Gemma-3-4B-shaped decoder at one slot: sliding layers as rings of
window + prefill_chunk - 1 positions (mmjax.models.text.gemma3) vs every layer caching the whole
context. Computed from the cache's shapes (jax.eval_shape), nothing is allocated or measured.

    python -m benchmarks.gemma3_kv_cache [--prefill-chunk 256] [--max-len 8192 32768]
"""
from __future__ import annotations

import argparse

# Gemma-3-4B's text config: 34 layers, 5 local : 1 global, window 1024, 8 heads / 4 kv heads, head_dim 256
GEMMA3_4B = dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                 num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 sliding_window=1024, query_pre_attn_scalar=256, max_position_embeddings=131072)


def kv_bytes(max_lens=(8192, 32768), prefill_chunk: int = 256, slots: int = 1) -> dict[int, tuple[int, int]]:
    """{max_len: (bytes with ring caches, bytes with all layers global)} in bfloat16."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mmjax.models.nn.weights import build
    from mmjax.models.text.gemma3 import config_from_hf
    ring = build(lambda: config_from_hf(GEMMA3_4B).build(jnp.bfloat16))     # shapes only: nothing allocated
    full = build(lambda: config_from_hf({**GEMMA3_4B, "layer_types": ["full_attention"] * GEMMA3_4B[
        "num_hidden_layers"]}).build(jnp.bfloat16))

    def cache_bytes(lm, n: int) -> int:
        shapes = jax.eval_shape(lambda: lm.init_cache(slots, n, jnp.bfloat16, max_chunk=prefill_chunk))
        return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
    return {n: (cache_bytes(ring, n), cache_bytes(full, n)) for n in max_lens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--max-len", type=int, nargs="+", default=[8192, 32768])
    args = ap.parse_args()
    print(f"Gemma-3-4B shape, bf16, 1 slot, prefill_chunk {args.prefill_chunk}")
    print(f"{'max_model_len':>13} | {'ring (MiB)':>10} | {'all-global (MiB)':>16} | ratio")
    for n, (r, f) in kv_bytes(tuple(args.max_len), args.prefill_chunk).items():
        print(f"{n:>13} | {r / 2**20:>10.1f} | {f / 2**20:>16.1f} | {f / r:.2f}x")


if __name__ == "__main__":
    main()
