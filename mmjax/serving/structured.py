"""Structured output: a request's JSON schema / regex / choice / grammar compiled by llguidance
into a matcher that, before every step, fills the request's allowed-token bitmask row (applied
inside the compiled sampling step; see serving/constraints.py) and follows its tokens.

Why llguidance: a Rust library with a pure-Python wheel API (no torch), numpy bitmasks in the
layout the compiled step unpacks, JSON schema + regex + Lark grammars in one engine, mask
computation in tens of microseconds per token, and a tokenizer built straight from the
`tokenizer.json` every family ships (byte-level BPE, SentencePiece byte fallback alike).

Compilation runs in `Engine.make_request` (the server calls it in its thread pool, never on the
event loop); a compiled matcher is cached per (kind, spec), the cache bounded by the heap bytes
its matchers hold (`GrammarCompiler.max_bytes`, the server's `--grammar-cache-mib`), and each
request gets a copy of it when it starts generating. Every error is a `GrammarError` (400
`invalid_grammar`) naming the field: an invalid schema / regex / grammar; a constraint that
cannot be satisfied where that shows before any compute (no first token, or the forced tokens
at its start lead into an error; also after intersecting with `allowed_token_ids` / bad words);
and, while the request runs, a matcher that errors or leaves no token allowed ends the request
with that error (carrying the matcher's message) instead of a silent wrong answer.
"""
from __future__ import annotations

import ctypes
import json
import re
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmjax.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compact JSON: a model may otherwise emit whitespace forever inside a valid document.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_CACHED = 256                      # entries, besides the byte bound
DEFAULT_CACHE_BYTES = 128 * 2**20     # heap bytes the cached matchers may hold (--grammar-cache-mib)
MAX_TEXT_CHARS = 100_000              # a regex or grammar string
MAX_CHOICES = 1024
MAX_SCHEMA_BYTES = 1_000_000          # a JSON schema (or a choice list), as JSON text
PROBE_STEPS = 32                      # forced tokens followed up front (GrammarCompiler.probe)


class GrammarError(InvalidRequestError):
    """An output constraint that is invalid, cannot be satisfied, or whose matcher failed while
    the request ran (400; an SSE error event once streaming)."""
    code = "invalid_grammar"


def _first_line(msg: str, limit: int = 500) -> str:
    return (msg or "").strip().splitlines()[0][:limit] if (msg or "").strip() else "unknown error"


def _check_text(value: Any, param: str) -> None:
    """A lone surrogate (JSON "\\ud800") anywhere in a spec is not text: 400 invalid_text, as
    for every other text field (llguidance cannot take it: a UnicodeEncodeError otherwise)."""
    try:
        (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"'{param}' is not valid Unicode text: {e.reason} at character {e.start}",
                                  param=param, code="invalid_text") from None


def _gbnf_to_lark(text: str) -> str:
    """llguidance's GBNF -> Lark converter: `llguidance.gbnf_to_lark` is a module holding the
    function `gbnf_to_lark` (1.x); an older or newer layout exposing the function itself works too."""
    import llguidance
    conv = getattr(llguidance, "gbnf_to_lark", None)
    if conv is None or isinstance(conv, types.ModuleType):
        import importlib
        conv = getattr(importlib.import_module("llguidance.gbnf_to_lark"), "gbnf_to_lark")
    return conv(text)


_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")
_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


def is_gbnf(text: str) -> bool:
    """GBNF (llama.cpp / vLLM's xgrammar style: `root ::= ...`) rather than Lark (`start: ...`)."""
    return bool(_GBNF_RULE.search(text)) and not _LARK_START.search(text)


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
        _check_text(self.value, self.param)
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}", param=self.param) from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("the JSON schema must be an object", param=self.param)
            try:
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise GrammarError(f"invalid JSON schema: {_first_line(str(e))}", param=self.param) from None
        if self.kind == "regex":
            return m.grammar_from_regex(self.value)
        if self.kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if self.kind == "grammar":
            text = self.value
            if is_gbnf(text):                      # GBNF (llama.cpp / vLLM's xgrammar style)
                try:
                    text = _gbnf_to_lark(text)
                except Exception as e:  # noqa: BLE001 - any converter failure is the client's grammar
                    raise GrammarError(f"invalid GBNF grammar: {_first_line(str(e))}", param=self.param) from None
            return m.grammar_from_lark(text)
        raise GrammarError(f"unknown structured output kind {self.kind!r}", param=self.param)


def check_spec(kind: str, value: Any, param: str) -> StructuredSpec:
    """Types, sizes and text of a spec from a request (the grammar itself is checked when compiled)."""
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise GrammarError("a choice must be a non-empty list of strings", param=param)
        if len(value) > MAX_CHOICES:
            raise GrammarError(f"a choice may hold at most {MAX_CHOICES} strings (got {len(value)})", param=param)
        _check_text(value, param)
        if sum(len(c) for c in value) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"a choice's strings may total at most {MAX_SCHEMA_BYTES:,} characters", param=param)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise GrammarError(f"a {kind} must be a non-empty string", param=param)
        if len(value) > MAX_TEXT_CHARS:
            raise GrammarError(f"a {kind} may be at most {MAX_TEXT_CHARS:,} characters (got {len(value):,})",
                               param=param)
        _check_text(value, param)
    elif kind == "json":
        if not isinstance(value, (dict, str, bool)):
            raise GrammarError("a JSON schema must be an object (or its JSON text)", param=param)
        _check_text(value, param)
        n = len(value) if isinstance(value, str) else len(json.dumps(value))
        if n > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES:,} bytes", param=param)
    return StructuredSpec(kind, value, param)


def _bit_count(bits: np.ndarray) -> int:
    return int(np.unpackbits(bits.view(np.uint8)).sum())


def _tokens(bits: np.ndarray, limit: int = 2) -> list[int]:
    """Up to `limit` token ids set in a bitmask [words] uint32."""
    out = []
    for w in np.flatnonzero(bits):
        v = int(bits[w])
        while v and len(out) < limit:
            low = v & -v
            out.append(32 * int(w) + low.bit_length() - 1)
            v ^= low
        if len(out) >= limit:
            break
    return out


class Grammar:
    """One request's matcher: a TokenConstraint (serving/constraints.py). It holds the compiled
    (shared) matcher until the request first needs a mask, then its own copy (a queued request
    costs no copy)."""

    def __init__(self, matcher, words: int, param: str = "response_format"):
        self._shared = matcher
        self._own = None
        self.param = param
        self._buf = np.empty(words, np.int32)
        self.tokens = 0                          # tokens followed so far (for error messages)

    @property
    def matcher(self):
        if self._own is None:
            self._own = self._shared.deep_copy()
            self._shared = None
        return self._own

    def _error(self, what: str) -> GrammarError:
        return GrammarError(f"the output constraint '{self.param}' failed after {self.tokens} generated "
                            f"token(s): {what}", param=self.param)

    def fill(self, bits: np.ndarray, output_ids: list[int]) -> None:
        m = self.matcher
        if m.is_error():
            raise self._error(_first_line(m.get_error()))
        if m.is_stopped():
            return                               # the request ends at this token (finished())
        m.unsafe_compute_mask_ptr(self._buf.ctypes.data, self._buf.nbytes)
        if m.is_error():                         # a parser / lexer limit, or no way to go on
            raise self._error(_first_line(m.get_error()))
        bits &= self._buf.view(np.uint32)

    def advance(self, token: int) -> None:
        m = self.matcher
        if not m.is_stopped():
            if not m.consume_token(int(token)):
                raise self._error(f"at token {int(token)}: {_first_line(m.get_error())}")
            self.tokens += 1
            if m.is_stopped() and not m.is_accepting():     # ended, but not in a complete answer
                raise self._error(f"the matcher stopped ({m.stop_reason()}) before the constraint was complete")

    def finished(self) -> bool:
        m = self.matcher
        return m.is_stopped() and not m.is_error()


def _glibc_heap():
    """mallinfo2 of glibc (heap bytes in use, every thread's arenas and mmapped chunks), or None
    where it does not exist (another libc)."""
    try:
        class _MI2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
        fn.restype = _MI2

        def used() -> int:
            m = fn()
            return int(m.uordblks + m.hblkhd)
        used()
        return used
    except (OSError, AttributeError):
        return None


_HEAP_USED = _glibc_heap()


class GrammarCompiler:
    """Per engine: the llguidance tokenizer (built once from tokenizer.json) and compiled
    matchers cached by spec (LRU, thread-safe: make_request runs on the server's pool).

    The cache is bounded by bytes (`max_bytes`) as well as entries (MAX_CACHED): a matcher of
    1,024 long choices holds tens of MiB. Each entry is charged the heap growth measured while
    it was built (glibc's mallinfo2; builds are serialized so that two do not count each other;
    clamped to [1, 256] x its grammar text's size + 1 MiB, since other threads allocate meanwhile;
    64 x that size where the heap cannot be read: measured 10-75 bytes a character). An entry
    larger than the bound is used by its request and not kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self.words = (vocab_size + 31) // 32
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._build = threading.Lock()
        self._ll = None
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def ll_tokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self.tokenizer.to_json_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids or None)
            return self._ll

    def stats(self) -> dict:
        with self._lock:
            return {"grammar_cache_entries": len(self._cache), "grammar_cache_bytes": self.bytes,
                    "grammar_cache_max_bytes": self.max_bytes, "grammar_cache_hits": self.hits,
                    "grammar_cache_misses": self.misses}

    def _evict(self) -> None:
        while self._cache and (self.bytes > self.max_bytes or len(self._cache) > MAX_CACHED):
            _, (_, n) = self._cache.popitem(last=False)
            self.bytes -= n

    def compiled(self, spec: StructuredSpec):
        """The compiled matcher of `spec` in its initial state, shared (never advance it:
        `matcher` gives a copy)."""
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit[0]
        tok = self.ll_tokenizer()
        try:
            grammar = spec.grammar()
            with self._build:
                before = _HEAP_USED() if _HEAP_USED is not None else None
                err = llguidance.LLMatcher.validate_grammar(grammar, tok)
                if err:
                    raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(err)}", param=spec.param)
                m = llguidance.LLMatcher(tok, grammar, log_level=0)
                after = _HEAP_USED() if before is not None else None
        except UnicodeError as e:           # a lone surrogate that got past the request checks
            raise InvalidRequestError(f"'{spec.param}' is not valid Unicode text: {e}", param=spec.param,
                                      code="invalid_text") from None
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(str(e))}",
                               param=spec.param) from None
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(m.get_error())}",
                               param=spec.param)
        # the measured growth, within what a matcher of this grammar can hold (other threads allocate
        # meanwhile: an XLA compile beside it would otherwise be charged to the grammar)
        size = (min(max(after - before, len(grammar)), 256 * len(grammar) + 2**20) if after is not None
                else 64 * len(grammar) + 65536)
        with self._lock:
            self.misses += 1
            if size <= self.max_bytes and key not in self._cache:
                self._cache[key] = (m, size)
                self.bytes += size
                self._evict()
        return m

    def matcher(self, spec: StructuredSpec):
        """A fresh matcher of `spec` (a copy of the cached one)."""
        return self.compiled(spec).deep_copy()

    def probe(self, spec: StructuredSpec, shared, allowed: np.ndarray | None = None) -> None:
        """Refuse a constraint that cannot be satisfied where that shows up front: the matcher
        errors on its first mask, no token is allowed (with `allowed`: [words] uint32, the
        tokens allowed_token_ids / one-token bad words leave), or the tokens forced at its start
        (a single allowed token, up to PROBE_STEPS) lead into an error or a dead end."""
        m = shared.deep_copy()
        buf = np.empty(self.words, np.int32)
        eos = set(self.eos_ids)
        for step in range(PROBE_STEPS):
            if m.is_stopped():
                if m.is_error():
                    break
                return
            m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            if m.is_error():
                break
            bits = buf.view(np.uint32) if allowed is None else buf.view(np.uint32) & allowed
            if not bits.any():
                raise GrammarError(
                    f"the output constraint '{spec.param}' cannot be satisfied: no token may "
                    f"{'start' if step == 0 else 'continue'} it" +
                    (" within allowed_token_ids / bad_words" if allowed is not None and buf.any() else ""),
                    param=spec.param)
            toks = _tokens(bits)
            if len(toks) != 1 or toks[0] in eos:
                return
            if not m.consume_token(toks[0]):
                break
        else:
            return
        raise GrammarError(f"the output constraint '{spec.param}' cannot be satisfied: "
                           f"{_first_line(m.get_error())}", param=spec.param)


def allowed_bits(words: int, vocab: int, allowed_token_ids=None, banned=()) -> np.ndarray | None:
    """The tokens a request's own rules leave (allowed_token_ids, one-token bad words) as a
    bitmask [words] uint32 (None: every token)."""
    if not allowed_token_ids and not len(banned):
        return None
    ok = np.zeros(words * 32, bool)
    if allowed_token_ids:
        ok[np.asarray(allowed_token_ids, np.int64)] = True
    else:
        ok[:vocab] = True
    if len(banned):
        ok[np.asarray(banned, np.int64)] = False
    return _pack(ok)


def _pack(ok: np.ndarray) -> np.ndarray:
    """bool [words * 32] -> uint32 [words] (bit i of word j = token 32 j + i)."""
    return np.packbits(ok, bitorder="little").view("<u4").astype(np.uint32)


def grammar_constraint(engine, spec: StructuredSpec, allowed: np.ndarray | None = None) -> Grammar:
    """A Grammar constraint for one request of `engine`, checked up front (`GrammarCompiler.probe`)."""
    comp = getattr(engine, "grammars", None)
    if comp is None:
        raise GrammarError("structured output is not available on this engine", param=spec.param)
    shared = comp.compiled(spec)
    comp.probe(spec, shared, allowed)
    return Grammar(shared, comp.words, spec.param)
