"""Turning sampled tokens into what clients see: logprobs, EOS / stop ids / stop strings / length
limits, incremental UTF-8-safe text with a held-back tail that could still become a stop string."""
from __future__ import annotations

from mmjax.serving.request import Delta, Request
from mmjax.serving.runner import StepOutput


def append_token(req: Request, out: StepOutput, row: int, eos_ids: frozenset[int], max_model_len: int) -> Delta:
    """Add row `row` of a step's output to `req`; sets req.finish_reason when it is done."""
    tok = int(out.tokens[row])
    req.output_ids.append(tok)
    lp = None
    if req.logprobs is not None:
        n = req.sampling.logprobs
        lp = {int(i): float(v) for i, v in zip(out.top_ids[row][:n], out.top_logprobs[row][:n])}
        lp[tok] = float(out.logprobs[row])
        req.logprobs.append(lp)
    sp = req.sampling
    reason = None
    early = len(req.output_ids) < sp.min_tokens   # min_tokens: no stop of any kind before it
    for c in req.constraints:
        c.advance(tok)
    if not sp.ignore_eos and tok in eos_ids and not early:
        reason = "stop"
    elif tok in sp.stop_token_set and not early:
        reason = "stop"
    else:
        req.text += req.detok.add(tok)
    if reason is None and any(c.finished() for c in req.constraints):
        reason = "stop"                # a grammar that is complete: only the end may follow
    if reason is None and sp.stop and not early:
        hit = min((req.text.find(s) for s in sp.stop if s in req.text), default=-1)
        if hit >= 0:
            req.text = req.text[:hit]
            reason = "stop"
    if reason is None and len(req.output_ids) >= sp.max_tokens:
        reason = "length"
    if reason is None and req.prompt_len + len(req.output_ids) >= max_model_len:
        reason = "length"
    if reason is not None and reason != "stop":
        req.text += req.detok.flush()
    # Hold back a tail that could still become a stop string.
    hold = max((len(s) - 1 for s in sp.stop), default=0) if reason is None else 0
    upto = max(req.emitted, len(req.text) - hold)
    text = req.text[req.emitted:upto]
    req.emitted = upto
    req.finish_reason = reason
    return Delta(req.id, [tok], text, [lp] if lp is not None else None, finished=reason is not None,
                 finish_reason=reason)
