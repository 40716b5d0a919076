"""Server-sent events for a generation: role / echo / prompt_logprobs chunks first, then each
choice's deltas as they come (tool calls streamed argument by argument), an in-band error event
after the headers, the usage chunk, `data: [DONE]`. A client that goes away is counted and its
choices' pumps are stopped before the caller closes their generators."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from mmjax.errors import MMJaxError
from serve import schema, tools
from serve.generation import Generation, usage_of
from serve.logprobs import completion_lp, echo_entries, echo_text, vllm_prompt_logprobs

log = logging.getLogger("mmjax.serve")


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _pump(i: int, g: Generation, d, q: asyncio.Queue) -> None:
    """Feed one choice's deltas into the request's stream queue: (i, delta, None), an error as
    (i, None, error), and (i, None, None) when it is done."""
    try:
        while d is not None:
            await q.put((i, d, None))
            if d.finished:
                break
            d = await g.next()
    except MMJaxError as e:
        await q.put((i, None, e))
    await q.put((i, None, None))


async def stream_response(request: web.Request, gens: list[Generation], firsts: list, kind: str) -> web.StreamResponse:
    g0 = gens[0]
    st = g0.st
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    created = schema.now()
    model = g0.req.lora or st.config.served_model_name       # an adapter's request answers as that model
    include_usage = g0.parsed.include_usage
    want_lp = g0.parsed.logprobs is not None
    offsets = [0] * len(gens)

    def chunk(choice: dict | None) -> dict:
        obj = {"id": g0.rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
               "created": created, "model": model, "choices": [choice] if choice is not None else []}
        if include_usage:
            obj["usage"] = None
        return obj

    parse_tools = kind == "chat" and g0.parsed.tools is not None and g0.parsed.tools.parse
    parser = g0.parsed.tools.parser if parse_tools else None
    full, sent = [""] * len(gens), [0] * len(gens)
    tstreams = [tools.ToolStream(g0.parsed.tools) for _ in gens] if parse_tools else []
    q: asyncio.Queue = asyncio.Queue()
    pumps: list[asyncio.Task] = []
    try:
        await resp.prepare(request)  # inside: a client that resets before the headers is a disconnect too
        if kind == "chat":
            for g in gens:
                await resp.write(_sse(chunk({"index": g.req.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None})))
        if kind == "completion" and g0.parsed.echo:
            for i, g in enumerate(gens):
                lp = None
                if want_lp:
                    lp, offsets[i] = completion_lp(echo_entries(st, g.scores, g.req.prompt_ids.tolist(),
                                                                  g.parsed.logprobs), 0)
                await resp.write(_sse(chunk({"index": g.req.index, "text": echo_text(st, g.parsed, g.req),
                                             "logprobs": lp, "finish_reason": None})))
        if g0.parsed.prompt_logprobs is not None:
            first = chunk(None)
            first["prompt_logprobs"] = vllm_prompt_logprobs(st, g0.scores)
            await resp.write(_sse(first))
        pumps = [asyncio.ensure_future(_pump(i, g, d, q)) for i, (g, d) in enumerate(zip(gens, firsts))]
        running, failed = len(gens), False
        while running:
            i, d, err = await q.get()
            if d is None:
                if err is not None:  # after the headers: report in-band
                    log.warning("request %s failed mid-stream: %s", g0.rid, err.message)
                    await resp.write(_sse(err.to_openai()))
                    failed = True
                    break
                running -= 1
                continue
            g = gens[i]
            lp = None
            if want_lp:
                entries = g.logprob_entries(d)
                if kind == "chat":
                    lp = schema.chat_logprobs(entries)
                else:
                    lp, offsets[i] = completion_lp(entries, offsets[i])
            text = d.text
            fr = d.finish_reason if d.finished else None
            frags: list[dict] = []
            if parse_tools:   # content streams until a tool call starts; then the calls, argument by argument
                full[i] += d.text
                k = parser.find(full[i])
                if d.finished:
                    _, calls = tools.parse_output(g0.parsed.tools, full[i])
                    upto = (k if k >= 0 else len(full[i])) if calls else len(full[i])
                    fr = "tool_calls" if calls and fr == "stop" else fr
                    frags = tstreams[i].finish(calls)
                else:
                    upto = k if k >= 0 else len(full[i]) - parser.held_back(full[i])
                    frags = tstreams[i].update(full[i]) if k >= 0 else []
                text = full[i][sent[i]:max(sent[i], upto)]
                sent[i] = max(sent[i], upto)
            if text or lp is not None or d.finished or frags:
                if kind == "chat":   # one chunk per tool-call fragment (as vLLM); the last one finishes
                    deltas = ([{"content": text}] if text else []) + [{"tool_calls": [f]} for f in frags] or [{}]
                    for n, delta in enumerate(deltas):
                        await resp.write(_sse(chunk({"index": g.req.index, "delta": delta,
                                                     "logprobs": lp if n == 0 else None,
                                                     "finish_reason": fr if n == len(deltas) - 1 else None})))
                else:
                    await resp.write(_sse(chunk({"index": g.req.index, "text": d.text, "logprobs": lp,
                                                 "finish_reason": fr})))
        if include_usage and not failed and all(g.acc.finish_reason is not None for g in gens):
            u = chunk(None)
            u["usage"] = usage_of(gens)
            await resp.write(_sse(u))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, BrokenPipeError, RuntimeError) as e:
        # client went away mid-stream (aiohttp raises ConnectionResetError / ClientConnectionResetError)
        if isinstance(e, RuntimeError) and "closing" not in str(e).lower():
            raise
        st.metrics.disconnects.inc()
        log.info("client disconnected from %s; request aborted", g0.rid)
    finally:
        for p in pumps:
            if not p.done():
                p.cancel()
        # the pumps must have left their generators before _generate closes them (aclose() on a
        # generator another task is still running raises)
        await asyncio.gather(*pumps, return_exceptions=True)
    return resp


