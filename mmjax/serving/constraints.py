"""Host-side token constraints that change every step: each fills a request's allowed-token
bitmask row before a step (uint32 words, bit i of word j = token 32 j + i, llguidance's layout)
and follows the tokens the request generates. The compiled steps apply the bitmask
(serving/sampling.py `process_logits`); rows without a constraint get all ones.

Two kinds: `BadWords` (vLLM's multi-token bad words: a word's last token is banned while the
output ends with the rest of it) and `Grammar` (structured output, serving/structured.py).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenConstraint(Protocol):
    def fill(self, bits: np.ndarray, output_ids: list[int]) -> None:
        """Clear the bits of tokens not allowed next in bits [words] uint32 (in place)."""

    def advance(self, token: int) -> None:
        """The request generated `token`."""

    def finished(self) -> bool:
        """Nothing but the end of the sequence may follow (the request stops)."""


def clear_bit(bits: np.ndarray, token: int) -> None:
    if 0 <= token < bits.size * 32:
        bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences of each bad word, as vLLM builds them: the word (left-stripped) alone and
    with a leading space when that tokenizes to a different first token of the same length."""
    seqs: list[list[int]] = []
    for w in words:
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        if plain:
            seqs.append(plain)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return seqs


class BadWords:
    """Multi-token bad words (one-token words are banned for good in the request's VocabRow)."""

    def __init__(self, seqs: list[list[int]]):
        self.seqs = [list(s) for s in seqs if len(s) > 1]

    def fill(self, bits: np.ndarray, output_ids: list[int]) -> None:
        for s in self.seqs:
            k = len(s) - 1
            if len(output_ids) >= k and output_ids[len(output_ids) - k:] == s[:-1]:
                clear_bit(bits, s[-1])

    def advance(self, token: int) -> None:
        pass

    def finished(self) -> bool:
        return False
