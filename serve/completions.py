"""/v1/chat/completions and /v1/completions: parse, build the engine requests, await each
choice's first delta (so errors before the first token keep their HTTP status), then answer in
one JSON body or hand over to serve.streaming."""
from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from mmjax.serving import prompt_logprobs
from serve import schema, tools
from serve.connection import read_json, route_name
from serve.generation import Generation, usage_of
from serve.inputs import build_request, check_model, load_images, warn_ignored
from serve.logprobs import completion_lp, echo_entries, echo_text, vllm_prompt_logprobs
from serve.schema import UnavailableError
from serve.state import STATE
from serve.streaming import stream_response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = time.monotonic()
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    if not st.aengine.alive():
        raise UnavailableError("the engine loop stopped; the server must be restarted")
    body = await read_json(request, st)
    parsed = schema.parse_chat(body, limits=st.limits, tool_parser=st.tool_parser()) if kind == "chat" else \
        schema.parse_completion(body, limits=st.limits)
    check_model(st, parsed.model)
    warn_ignored(parsed.ignored, request.path)
    for ref in parsed.images:
        ref.options = parsed.image_options
    st.metrics.images.inc(sum(r.kind == "image" for r in parsed.images))
    st.metrics.videos.inc(sum(r.kind == "video" for r in parsed.images))
    images = await load_images(st, parsed.images)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    echo_lp = parsed.kind == "completion" and parsed.echo and parsed.logprobs is not None
    k_prompt = max(parsed.prompt_logprobs or 0, parsed.logprobs or 0)
    if parsed.prompt_logprobs is not None or echo_lp:     # from the prefill's logits of every prompt position
        parsed.sampling.prompt_logprobs = k_prompt
    reqs = await loop.run_in_executor(st.executor, build_request, st, parsed, images, rid)
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    route = route_name(request)
    gens = [Generation(st, parsed, r, route, t0, rid) for r in reqs]
    st.active.add(rid)
    st.metrics.in_flight.inc()
    try:
        # QueueFullError / engine failure surface here, before any header
        firsts = [await g.next() for g in gens]
        if parsed.sampling.prompt_logprobs is not None:     # choice 0's prefill wrote them before its first token
            scores = prompt_logprobs.prompt_scores(reqs[0], k_prompt)
            for g in gens:
                g.scores = scores
        if parsed.stream:
            return await stream_response(request, gens, firsts, kind)
        return await _collect(gens, firsts, kind)
    except asyncio.CancelledError:
        st.metrics.disconnects.inc()
        raise
    finally:
        st.active.discard(rid)
        st.metrics.in_flight.dec()
        for g in gens:
            await g.close()


async def _collect_one(g: Generation, d, kind: str) -> dict:
    entries = []
    while d is not None:
        entries.extend(g.logprob_entries(d))
        if d.finished:
            break
        d = await g.next()
    a = g.acc
    text = "".join(a.text)
    lp = None
    echo = kind == "completion" and g.parsed.echo
    if echo:
        text = echo_text(g.st, g.parsed, g.req) + text
    if g.parsed.logprobs is not None:
        if kind == "chat":
            lp = schema.chat_logprobs(entries)
        else:
            if echo:
                entries = echo_entries(g.st, g.scores, g.req.prompt_ids.tolist(), g.parsed.logprobs) + entries
            lp = completion_lp(entries, 0)[0]
    i = g.req.index
    if kind == "chat":
        msg, fr = {"role": "assistant", "content": text}, a.finish_reason
        if g.parsed.tools is not None and g.parsed.tools.parse:
            content, calls = tools.parse_output(g.parsed.tools, text)
            if calls:
                msg = {"role": "assistant", "content": content or None, "tool_calls": calls}
                fr = "tool_calls" if fr == "stop" else fr
        return {"index": i, "message": msg, "logprobs": lp, "finish_reason": fr}
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": a.finish_reason}


async def _collect(gens: list[Generation], firsts: list, kind: str) -> web.Response:
    choices = await asyncio.gather(*(_collect_one(g, d, kind) for g, d in zip(gens, firsts)))
    g, st = gens[0], gens[0].st
    obj = "chat.completion" if kind == "chat" else "text_completion"
    out = {"id": g.rid, "object": obj, "created": schema.now(), "model": g.req.lora or st.config.served_model_name,
           "choices": list(choices), "usage": usage_of(gens)}
    if g.parsed.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(st, g.scores)
    return web.json_response(out)


