"""Structured output: a request's JSON schema / regex / choice / grammar compiled by llguidance
into a matcher that, before every step, fills the request's allowed-token bitmask row (applied
inside the compiled sampling step; see serving/constraints.py) and follows its tokens.

Why llguidance: a Rust library with a pure-Python wheel API (no torch), numpy bitmasks in the
layout the compiled step unpacks, JSON schema + regex + Lark grammars in one engine, mask
computation in tens of microseconds per token, and a tokenizer built straight from the
`tokenizer.json` every family ships (byte-level BPE, SentencePiece byte fallback alike).

Compilation runs in `Engine.make_request` (the server calls it in its thread pool, never on the
event loop); a compiled matcher is cached per (kind, spec) and each request gets a copy of it.
An invalid schema / regex / grammar is an InvalidRequestError (400) naming the field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmjax.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compact JSON: a model may otherwise emit whitespace forever inside a valid document.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_CACHED = 256


@dataclass(frozen=True)
class StructuredSpec:
    """kind: one of KINDS; value: a JSON schema (dict or JSON text) for "json", a regex or a
    grammar (Lark, or GBNF with '::=') string, a list of strings for "choice", None for
    "json_object"; param: the request field it came from (for errors)."""
    kind: str
    value: Any = None
    param: str = "response_format"

    def key(self) -> str:
        return self.kind + "\x00" + json.dumps(self.value, sort_keys=True)

    def grammar(self) -> str:
        """The llguidance grammar text (not yet validated)."""
        import llguidance

        m = llguidance.LLMatcher
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=self.param) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("the JSON schema must be an object", param=self.param)
            try:
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(f"invalid JSON schema: {e}", param=self.param) from None
        if self.kind == "regex":
            return m.grammar_from_regex(self.value)
        if self.kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if self.kind == "grammar":
            text = self.value
            if "::=" in text:                      # GBNF (llama.cpp / vLLM's xgrammar style)
                try:
                    text = llguidance.gbnf_to_lark(text)
                except Exception as e:  # noqa: BLE001 - any converter failure is the client's grammar
                    raise InvalidRequestError(f"invalid GBNF grammar: {e}", param=self.param) from None
            return m.grammar_from_lark(text)
        raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", param=self.param)


def check_spec(kind: str, value: Any, param: str) -> StructuredSpec:
    """Types of a spec from a request (the grammar itself is checked when compiled)."""
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)) or len(value) > 1024:
            raise InvalidRequestError("a choice must be a non-empty list of at most 1024 strings", param=param)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value or len(value) > 100_000:
            raise InvalidRequestError(f"a {kind} must be a non-empty string", param=param)
    elif kind == "json":
        if not isinstance(value, (dict, str, bool)):
            raise InvalidRequestError("a JSON schema must be an object (or its JSON text)", param=param)
        if len(json.dumps(value)) > 1_000_000:
            raise InvalidRequestError("the JSON schema is larger than 1 MB", param=param)
    return StructuredSpec(kind, value, param)


class Grammar:
    """One request's matcher: a TokenConstraint (serving/constraints.py)."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self._buf = np.empty(words, np.int32)

    def fill(self, bits: np.ndarray, output_ids: list[int]) -> None:
        if self.matcher.is_stopped():
            return                               # the request ends at this token (finished())
        self.matcher.unsafe_compute_mask_ptr(self._buf.ctypes.data, self._buf.nbytes)
        bits &= self._buf.view(np.uint32)

    def advance(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    def finished(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Per engine: the llguidance tokenizer (built once from tokenizer.json) and compiled
    matchers cached by spec (LRU, thread-safe: make_request runs on the server's pool)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self.words = (vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._ll = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.hits = self.misses = 0

    def ll_tokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self.tokenizer.to_json_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids or None)
            return self._ll

    def matcher(self, spec: StructuredSpec):
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit.deep_copy()
        tok = self.ll_tokenizer()
        grammar = spec.grammar()
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err:
            raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: {err.splitlines()[0][:500]}",
                                      param=spec.param, code="invalid_grammar")
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {spec.kind}: {m.get_error()[:500]}", param=spec.param,
                                      code="invalid_grammar")
        with self._lock:
            self.misses += 1
            self._cache[key] = m
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return m.deep_copy()


def grammar_constraint(engine, spec: StructuredSpec) -> Grammar:
    """A fresh Grammar constraint for one request of `engine`."""
    comp = getattr(engine, "grammars", None)
    if comp is None:
        raise InvalidRequestError("structured output is not available on this engine", param=spec.param)
    return Grammar(comp.matcher(spec), comp.words)
