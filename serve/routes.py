"""The routes other than generation: /v1/models, LoRA adapter loading, /health, /metrics,
/v1/embeddings, and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import asyncio
import base64
from typing import Any

from aiohttp import web

from mmjax.errors import InvalidRequestError
from serve import schema
from serve.connection import read_json
from serve.inputs import build_request, check_model, load_images, warn_ignored
from serve.schema import UnavailableError
from serve.state import STATE, State


# ---- simple routes ----------------------------------------------------------------------------------

def _model_card(st: State) -> dict:
    return {"id": st.config.served_model_name, "object": "model", "created": st.created, "owned_by": "mmjax",
            "root": str(st.vlm.loaded.path), "max_model_len": st.engine.max_model_len,
            "image_token": st.vlm.tokenizer.image_token, "video_token": st.vlm.tokenizer.video_token}


def _lora_card(st: State, name: str) -> dict:
    _, adapter = st.engine.adapters.loaded[name]
    return {"id": name, "object": "model", "created": st.created, "owned_by": "mmjax", "root": adapter.path,
            "parent": st.config.served_model_name, "max_model_len": st.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(st)] + [_lora_card(st, n)
                                                                          for n in st.engine.lora_names]})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    model = request.match_info["model"]
    check_model(st, model)
    return web.json_response(_model_card(st) if model == st.config.served_model_name else _lora_card(st, model))


def _lora_name(body: Any) -> str:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("'lora_name' (a non-empty string) is required", param="lora_name")
    return name


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime adapter loading: {"lora_name", "lora_path"} -> a free adapter slot (no
    recompile). 400 (LoRAError) for a malformed adapter, a rank over --max-lora-rank, no free slot."""
    st = request.app[STATE]
    body = await read_json(request, st)
    name, path = _lora_name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("'lora_path' (a non-empty string) is required", param="lora_path")
    if name == st.config.served_model_name:
        raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
    await asyncio.get_running_loop().run_in_executor(st.executor, st.engine.load_lora, name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = _lora_name(await read_json(request, st))
    if name == st.config.served_model_name:
        raise InvalidRequestError("the base model cannot be unloaded", param="lora_name")
    check_model(st, name)
    st.engine.unload_lora(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not st.aengine.alive():
        return web.json_response({"status": "engine loop stopped"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics_route(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- /v1/embeddings --------------------------------------------------------------------------------

async def embeddings(request: web.Request) -> web.Response:
    """OpenAI embeddings: "input" (a string, a list of strings, token ids or lists of them) or
    vLLM's multimodal form "messages" (chat messages with images, rendered with the template).
    Extensions: "pooling" ("last", default, or "mean"), "normalize" (default true). Each input's
    final normed hidden state (VLM.embed's rule); encoding_format "float" or "base64"."""
    st = request.app[STATE]
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    body = await read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    check_model(st, body.get("model"))
    warn_ignored(schema.unknown_fields(body, schema.EMBEDDING_FIELDS), request.path)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise InvalidRequestError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    pooling = body.get("pooling", "last")
    if pooling not in ("last", "mean"):
        raise InvalidRequestError("'pooling' must be 'last' or 'mean'", param="pooling")
    normalize = schema._bool(body, "normalize", True)
    if body.get("dimensions") is not None:
        raise InvalidRequestError("'dimensions' is not supported (the embedding is the model's hidden size)",
                                  param="dimensions", code="unsupported_parameter")
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k in ("model", "messages", "chat_template_kwargs",
                                                          "add_generation_prompt", "mm_processor_kwargs")}
        parsed = [schema.parse_chat(chat, limits=st.limits)]
    else:
        inp = body.get("input")
        items = inp if isinstance(inp, list) and inp and not all(schema._is_int(t) for t in inp) else [inp]
        if not items or len(items) > 256:
            raise InvalidRequestError("'input' must be a string, token ids, or a list of at most 256 of them",
                                      param="input")
        parsed = []
        for i, x in enumerate(items):
            try:
                parsed.append(schema.parse_completion({"prompt": x}, limits=st.limits))
            except InvalidRequestError as e:
                e.param = f"input[{i}]" if len(items) > 1 else "input"
                raise
    for p in parsed:
        for ref in p.images:
            ref.options = p.image_options
    try:
        images = [await load_images(st, p.images) for p in parsed]
        # on the embeddings lane (serve/embeddings.py), never in the tokenization pool chat uses;
        # dropped before its next unit of work if the client leaves
        vecs, n_tok = await st.embed_lane.run(_embed_work(st, parsed, images, pooling, normalize))
    except asyncio.CancelledError:
        st.metrics.disconnects.inc()
        raise
    data = []
    for i, v in enumerate(vecs):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return web.json_response({"object": "list", "data": data, "model": st.config.served_model_name,
                              "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})


def _embed_work(st: State, parsed: list, images: list, pooling: str, normalize: bool):
    """An embedding request's work, unit by unit (a generator run by the lane: each `yield`
    ends a unit): tokenizing its inputs (32 a unit), then one forward per piece of at most
    `embed_batch_tokens` padded tokens (times the data-parallel replicas, which split a piece
    between them). Returns (vectors [inputs, hidden], prompt tokens)."""
    import numpy as np

    from mmjax.models.family import run_spans
    from mmjax.research.prompt import PromptInputs

    from serve.embeddings import pieces

    ps, n_tok = [], 0
    fam = st.vlm.family
    for i, (p, ims) in enumerate(zip(parsed, images)):
        req = build_request(st, p, ims, "embed")[0]
        ps.append(PromptInputs(req.prompt_ids, req.images, req.image_pos, req.positions,
                               run_spans(req.prompt_ids, fam.image_token_id), req.prompt_len))
        n_tok += req.prompt_len
        if i % 32 == 31:
            yield
    yield
    budget = st.config.embed_batch_tokens
    replicas = len(st.engine.replicas)
    out = np.zeros((len(ps), st.vlm.model.language_model.hidden_size), np.float32)
    for piece in pieces([len(p.ids) for p in ps], budget * replicas):
        out[piece] = st.vlm.embed_prompts([ps[i] for i in piece], pooling, normalize, max_batch_tokens=budget)
        yield
    return out, n_tok


# ---- /tokenize, /detokenize (vLLM's extension routes) ------------------------------------------------

async def tokenize(request: web.Request) -> web.Response:
    """{"prompt" (+ "images") | "messages", "add_special_tokens", "add_generation_prompt",
    "chat_template_kwargs", "mm_processor_kwargs", "return_token_strs"} -> {"count", "max_model_len",
    "tokens", "image_tokens" (per image), "token_strs"?}: exactly the ids generation would see."""
    st = request.app[STATE]
    body = await read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k in ("model", "messages", "chat_template_kwargs",
                                                          "add_generation_prompt", "mm_processor_kwargs", "tools")}
        parsed = schema.parse_chat(chat, limits=st.limits)
    else:
        comp = {k: v for k, v in body.items() if k in ("model", "prompt", "images", "mm_processor_kwargs")}
        parsed = schema.parse_completion(comp, limits=st.limits)
    check_model(st, parsed.model)
    warn_ignored(schema.unknown_fields(body, schema.TOKENIZE_FIELDS), request.path)
    add_special = schema._bool(body, "add_special_tokens", True)
    strs = schema._bool(body, "return_token_strs", False)
    for ref in parsed.images:
        ref.options = parsed.image_options
    images = await load_images(st, parsed.images)

    def run():
        if parsed.kind == "completion" and isinstance(parsed.prompt, str) and not images and not add_special:
            ids = st.vlm.tokenizer.encode(parsed.prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in build_request(st, parsed, images, "tokenize")[0].prompt_ids]
        out = {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids,
               "image_tokens": [im.num_tokens for im in images]}
        if strs:
            out["token_strs"] = [st.vlm.tokenizer.id_to_token(t) for t in ids]
        return out
    return web.json_response(await asyncio.get_running_loop().run_in_executor(st.executor, run))


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept, as vLLM)."""
    st = request.app[STATE]
    body = await read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    check_model(st, body.get("model"))
    warn_ignored(schema.unknown_fields(body, schema.DETOKENIZE_FIELDS), request.path)
    toks = body.get("tokens")
    vocab = st.vlm.tokenizer.vocab_size
    if not isinstance(toks, list) or len(toks) > st.engine.max_model_len * 4 or not all(
            schema._is_int(t) and 0 <= t < vocab for t in toks):
        raise InvalidRequestError(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    text = await asyncio.get_running_loop().run_in_executor(
        st.executor, lambda: st.vlm.tokenizer.decode(toks, skip_special_tokens=False))
    return web.json_response({"prompt": text})


