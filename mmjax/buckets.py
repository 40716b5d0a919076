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


def fine_ladder(lo: int, hi: int, fine_from: int = 128, steps: int = 8, coarse_from: int = 512) -> tuple[int, ...]:
    """Powers of two from lo below `fine_from`, then `steps` evenly spaced rungs per octave
    (128, 144, ..., 256, 288, ...) and half as many from `coarse_from` on (each rung is one more
    compiled shape), always ending exactly at hi. Padding a prefill chunk is paid in compute
    once chunks are compute-bound (about 128 tokens on CPU; weights are read once per call
    either way): with powers of two a 230-token prompt computes 256 rows (11% waste, up to 50%
    in general), with eight rungs per octave 240 (at most 12.5%, ~6% on average)."""
    out, x = [], lo
    while x < min(hi, fine_from):
        out.append(x)
        x *= 2
    while x < hi:
        out.append(x)
        octave = 1 << (x.bit_length() - 1)          # the power of two at or below x
        x += max(octave // (steps if octave < coarse_from else steps // 2), 1)
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

    prefill: chunk lengths (tokens per prefill call), up to `prefill_chunk`: powers of two up to
             128, then eight rungs per octave (`fine_ladder`), so that the last chunk of a
             prompt pads by at most 1/8; powers of two throughout where `fine` is off (GPUs,
             `backend.Tuning.fine_prefill_ladder`: compiles are the cost there, padding is not).
    decode:  slots advanced per decode call (the first `rows` cache rows), up to `max_num_seqs`;
             one running request pays for a 1-row step, not for every slot.
    segments: sequences one prefill call packs (models/nn/packing.py): one rung,
             min(max_segments, max_num_seqs, the smallest chunk); a prefill call's shape is
             (chunk, segments) and a call packing fewer sequences skips the attention blocks it
             does not use at run time, so the rung costs no compilations beyond the chunk ladder.
    The cache length in use is not a bucket: attention skips the KV segments past it at run
    time (models/decoder.py), so it costs no compilations.
    """
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    segments: tuple[int, ...] = (1,)

    @classmethod
    def make(cls, *, prefill_chunk: int, max_num_seqs: int, max_segments: int = 1, fine: bool = True) -> "Buckets":
        prefill = (fine_ladder if fine else pow2_ladder)(min(16, prefill_chunk), prefill_chunk)
        return cls(prefill=prefill, decode=pow2_ladder(1, max_num_seqs),
                   segments=(max(1, min(max_segments, max_num_seqs, prefill[0])),))
