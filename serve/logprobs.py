"""Logprobs in the OpenAI shapes: per-token text and raw bytes, chat entries, completion
entries with text offsets, the echoed prompt's entries, and vLLM's `prompt_logprobs`.

The engine's incremental detokenizer gives the stream's text; a logprob entry also needs each
token's own text and its true bytes (a token holding part of a UTF-8 character decodes to U+FFFD
alone), which the byte-level vocabulary gives here."""
from __future__ import annotations

from mmjax.serving import prompt_logprobs
from serve import schema
from serve.state import State


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def token_info(st: State, tid: int) -> tuple[str, list[int]]:
    """(text, raw bytes) of one token; a token holding part of a UTF-8 character has text with
    U+FFFD but its true bytes (as in the OpenAI API's `bytes`)."""
    cache = st.token_cache
    hit = cache.get(tid)
    if hit is not None:
        return hit
    tok = st.vlm.tokenizer
    text = tok.decode([tid], skip_special_tokens=False)
    piece = tok.id_to_token(tid) or ""
    if piece and all(ch in _BYTE_DECODER for ch in piece) and "\ufffd" in text:
        raw = bytes(_BYTE_DECODER[ch] for ch in piece)
    elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        raw = bytes([int(piece[3:5], 16)])
    else:
        raw = text.encode("utf-8")
    if len(cache) < 200_000:
        cache[tid] = (text, list(raw))
    return text, list(raw)


def token_str(st: State, tid: int) -> str:
    return token_info(st, tid)[0]


def chat_lp(st: State, d, n: int) -> list[dict]:
    """Delta logprobs -> OpenAI chat entries. The engine's per-token dict holds the top-n
    alternatives plus the chosen token (which may or may not be among them)."""
    out = []
    for tid, lp in zip(d.token_ids, d.logprobs or []):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
        tok, raw = token_info(st, tid)
        alts = []
        for i, v in top:
            t, b = token_info(st, i)
            alts.append({"token": t, "logprob": v, "bytes": b})
        out.append({"token": tok, "logprob": lp[tid], "bytes": raw, "top_logprobs": alts})
    return out


def prompt_token_str(st: State, tid: int) -> str:
    """A prompt token as text; image tokens show as the model's image placeholder."""
    if tid == st.vlm.family.image_token_id and st.vlm.tokenizer.image_token:
        return st.vlm.tokenizer.image_token
    return token_str(st, tid)


def vllm_prompt_logprobs(st: State, sc: dict) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank,
    decoded_token}} holding the prompt token and the top-k."""
    return [d if d is None else {str(t): v for t, v in d.items()} for d in prompt_logprobs.per_position(
        sc, lambda t: prompt_token_str(st, t), lambda lp, r, s: {"logprob": lp, "rank": r, "decoded_token": s})]


def echo_entries(st: State, sc: dict | None, ids: list[int], k: int | None) -> list[dict]:
    """Completion logprob entries of the echoed prompt (the first token has none)."""
    entries = []
    for j, tid in enumerate(ids):
        e = {"token": prompt_token_str(st, tid), "logprob": None, "top_logprobs": []}
        if j and sc is not None:
            e["logprob"] = sc["chosen"][j - 1]
            e["top_logprobs"] = [{"token": prompt_token_str(st, a), "logprob": v}
                                 for a, v in zip(sc["top"][j - 1][:k or 0], sc["top_lp"][j - 1][:k or 0])]
        entries.append(e)
    return entries


def echo_text(st: State, parsed: schema.ParsedRequest, req) -> str:
    """The prompt as echoed: a string prompt as given (with the image placeholders the server
    prepended, if any), token ids decoded (special tokens kept)."""
    if isinstance(parsed.prompt, str):
        tok = st.vlm.tokenizer
        if parsed.images and tok.image_token and tok.image_token not in parsed.prompt:
            return (tok.image_token + "\n") * len(parsed.images) + parsed.prompt
        return parsed.prompt
    return st.vlm.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)


def completion_lp(entries: list[dict], offset: int) -> tuple[dict, int]:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                   if e["logprob"] is not None else None)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out, offset


