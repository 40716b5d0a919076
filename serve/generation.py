"""`Generation`: one engine Request as a route sees it (its delta stream, what it produced so
far, time to first token, metrics), and the OpenAI usage of a request's choices."""
from __future__ import annotations

import time

from serve import schema
from serve.logprobs import chat_lp
from serve.schema import UnavailableError
from serve.state import State


class _Acc:
    """What a request produced so far."""

    def __init__(self):
        self.text = []
        self.n_tokens = 0
        self.logprobs: list = []
        self.finish_reason = None
        self.first_token_at = None


class Generation:
    """One request through the engine: shared by both routes, both modes."""

    def __init__(self, st: State, parsed: schema.ParsedRequest, req, route: str, t0: float, rid: str):
        self.st, self.parsed, self.req, self.route, self.t0, self.rid = st, parsed, req, route, t0, rid
        self.acc = _Acc()
        self.gen = st.aengine.stream(req)
        self.scores: dict | None = None      # the prompt's own logprobs (prompt_logprobs, echo)
        self.n_images = len(req.images)
        self.image_tokens = req.num_image_tokens
        self.video_tokens = req.num_video_tokens

    async def next(self):
        try:
            d = await self.gen.__anext__()
        except StopAsyncIteration:
            return None
        a = self.acc
        if d.error is not None:
            raise d.error
        if d.finish_reason == "abort":
            raise UnavailableError("the request was aborted because the server is shutting down")
        if d.token_ids and a.first_token_at is None:
            a.first_token_at = time.monotonic()
            self.st.metrics.ttft.labels(self.route).observe(a.first_token_at - self.t0)
        a.n_tokens += len(d.token_ids)
        a.text.append(d.text)
        if d.finished:
            a.finish_reason = d.finish_reason
            self._account()
        return d

    def _account(self) -> None:
        m, a = self.st.metrics, self.acc
        if self.req.index == 0:       # n > 1: the prompt counts once
            m.prompt_tokens.inc(self.req.prompt_len)
            m.image_tokens.inc(self.image_tokens)
            m.video_tokens.inc(self.video_tokens)
            m.cached_tokens.inc(self.req.cached_tokens)
        m.completion_tokens.inc(a.n_tokens)

    def usage(self) -> dict:
        return usage_of([self])

    async def close(self) -> None:
        await self.gen.aclose()

    def logprob_entries(self, d) -> list:
        return chat_lp(self.st, d, self.parsed.logprobs or 0) if d.logprobs is not None else []


def usage_of(gens: list[Generation]) -> dict:
    """OpenAI usage of one request's choices: the prompt once, the completions summed."""
    g = gens[0]
    out = schema.usage(g.req.prompt_len, sum(x.acc.n_tokens for x in gens), int(g.req.cached_tokens),
                       g.image_tokens, g.video_tokens)
    if g.req.pruned_tokens:   # the `intervention` extension's FastV: image tokens dropped after its layer
        out["prompt_tokens_details"]["pruned_tokens"] = int(g.req.pruned_tokens)
    return out


