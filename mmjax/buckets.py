"""Shape ladders: every shape that reaches a compiled step comes from here, so the number of
compilations is bounded by the product of a few short ladders (encode buckets are the family's:
models/family.Family.encode_plan)."""
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
    decode:  slots advanced per decode call (the first `rows` cache rows), up to `max_num_seqs`;
             one running request pays for a 1-row step, not for every slot.
    segments: sequences one prefill call packs (models/text/packing.py): one rung,
             min(max_segments, max_num_seqs, the smallest chunk); a prefill call's shape is
             (chunk, segments) and a call packing fewer sequences skips the unused segments'
             attention at run time, so the rung costs no compilations beyond the chunk ladder.
    The cache length in use is not a bucket: attention skips the KV segments past it at run
    time (models/decoder.py), so it costs no compilations.
    """
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    segments: tuple[int, ...] = (1,)

    @classmethod
    def make(cls, *, prefill_chunk: int, max_num_seqs: int, max_segments: int = 1) -> "Buckets":
        prefill = pow2_ladder(min(16, prefill_chunk), prefill_chunk)
        return cls(prefill=prefill, decode=pow2_ladder(1, max_num_seqs),
                   segments=(max(1, min(max_segments, max_num_seqs, prefill[0])),))
