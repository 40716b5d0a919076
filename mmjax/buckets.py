"""Shape ladders: every shape that reaches a compiled step comes from here, so the number of
compilations is bounded by the product of a few short ladders."""
from __future__ import annotations

from dataclasses import dataclass


def pow2_ladder(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to hi, always ending exactly at hi."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= 2
    out.append(hi)
    return tuple(out)


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    """Smallest rung >= n."""
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


@dataclass(frozen=True)
class Buckets:
    """The ladders of one engine.

    prefill: chunk lengths (tokens per prefill call), up to `prefill_chunk`.
    window:  cache prefix lengths attended to (decode and prefill), up to `max_model_len`;
             decode pays for the longest active sequence's rung, not for max_model_len.
    encode:  images per encode call (fixed-size families) up to `max_encode_batch`.
    decode:  slots advanced per decode call (the first `rows` cache rows), up to `max_num_seqs`;
             one running request pays for a 1-row step, not for every slot.
    """
    prefill: tuple[int, ...]
    window: tuple[int, ...]
    encode: tuple[int, ...]
    decode: tuple[int, ...]

    @classmethod
    def make(cls, *, max_model_len: int, prefill_chunk: int, max_encode_batch: int,
             max_num_seqs: int) -> "Buckets":
        return cls(prefill=pow2_ladder(min(16, prefill_chunk), prefill_chunk),
                   window=pow2_ladder(min(128, max_model_len), max_model_len),
                   encode=pow2_ladder(1, max_encode_batch),
                   decode=pow2_ladder(1, max_num_seqs))

    def max_compilations(self) -> dict[str, int]:
        """Upper bound on distinct compiled shapes per step kind."""
        return {"encode": len(self.encode), "prefill": len(self.prefill_pairs()),
                "decode": len(self.decode_pairs())}

    def kv_segments(self) -> tuple[int, ...]:
        """KV cache pieces along the sequence axis, one per window rung, so that every window
        is a whole number of pieces (models/decoder.py)."""
        edges = (0,) + self.window
        return tuple(hi - lo for lo, hi in zip(edges, edges[1:]))

    def decode_pairs(self) -> list[tuple[int, int]]:
        """Every (rows, window) a decode call can use."""
        return [(b, w) for b in self.decode for w in self.window]

    def prefill_pairs(self) -> list[tuple[int, int]]:
        """Every (chunk, window) a prefill call can use: the window covers the chunk."""
        return [(c, w) for w in self.window for c in self.prefill if c <= w]
