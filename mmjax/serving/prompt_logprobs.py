"""The prompt's own logprobs (SamplingParams.prompt_logprobs), as the engine's prefill computed
them from its logits of every prompt position (runner.prompt_scores, chunk by chunk): one
place that joins the chunks, used by the server's `prompt_logprobs` / echo and by the offline
`RequestOutput.prompt_logprobs` (vLLM's offline shape: `Logprob` objects)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Logprob:
    """One token's entry at a prompt position (vLLM's `Logprob`): its log-probability given the
    tokens before, its rank in that distribution (1 = the argmax) and its text (image tokens as
    the model's placeholder)."""
    logprob: float
    rank: int
    decoded_token: str


def prompt_scores(req, k: int) -> dict | None:
    """{"ids": prompt ids [P], and for each prompt token after the first (P - 1 rows): "chosen"
    its logprob, "rank", "top" / "top_lp" the top-k ids / logprobs} as lists; None when the
    request did not ask (or has not been prefilled)."""
    if not req.prompt_scores:
        return None
    chosen, rank, top, top_lp = (np.concatenate(x)[:req.prompt_len - 1] for x in zip(*req.prompt_scores))
    return {"ids": req.prompt_ids.tolist(), "chosen": chosen.tolist(), "rank": rank.tolist(),
            "top": top[:, :k].tolist(), "top_lp": top_lp[:, :k].tolist()}


def per_position(sc: dict, token_str: Callable[[int], str], make=Logprob) -> list:
    """vLLM's prompt_logprobs: None for the first token, then per position {token id: make(logprob,
    rank, decoded_token)} holding the prompt token and the top-k (the prompt token first; a top-k
    entry equal to it keeps the prompt token's own rank)."""
    out: list = [None]
    for j, tid in enumerate(sc["ids"][1:]):
        d = {tid: make(sc["chosen"][j], sc["rank"][j], token_str(tid))}
        for r, (a, v) in enumerate(zip(sc["top"][j], sc["top_lp"][j])):
            if a not in d:
                d[a] = make(v, r + 1, token_str(a))
        out.append(d)
    return out
