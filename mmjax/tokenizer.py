"""Tokenizer (HF `tokenizers`) + the checkpoint's jinja2 chat template + image placeholders.

Injection policy (decided, documented, tested in tests/test_special_tokens.py):

* Image placeholders: in chat messages, text that contains the model's image placeholder string
  (e.g. "<image>") is REJECTED with PromptError. Escaping would silently change what the user
  wrote, and a client that writes the placeholder almost always meant an image; only image parts
  bind images. In raw prompts the caller writes placeholders on purpose, and their count must
  equal the number of images.
* Other special tokens: message text (the content of every message, any role: in the server every
  message comes from the client) never produces a special token id. `</s>`, `<s>`, `<pad>`,
  `<|im_start|>`... typed in a message are tokenized as the plain text they spell, so a user cannot
  end or spoof turns. The chat template's own special tokens stay special. "Special" means an added
  token flagged `special` in tokenizer.json (`get_added_tokens_decoder()`); non-special added
  tokens (e.g. Qwen's `<tool_call>`) are matched in message text as transformers does.
  How: `render_chat` returns a `ChatPrompt` (a str equal to the template's output) recording the
  character spans of message text; `encode_prompt` tokenizes the whole string exactly as before
  (so prompts whose message text holds no special-token string give the very ids of HF's
  `apply_chat_template(tokenize=True)`), and only where a special token overlaps a message span
  re-tokenizes that stretch (between the neighbouring template tokens) with special-token parsing
  off and splices it in.
* Raw prompts (a plain `str`: `vlm.generate("...")`, `/v1/completions` string prompts, anything
  that is not a `ChatPrompt`) are written by the caller on purpose: special-token strings in them
  are parsed as special tokens.
"""
from __future__ import annotations

import bisect
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

from mmjax.errors import CheckpointError, PromptError


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_chat_template(model_dir: Path, tok_cfg: dict) -> str | None:
    """tokenizer_config.json["chat_template"], chat_template.jinja, or chat_template.json."""
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: take "default"
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
    if tpl:
        return tpl
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    if (model_dir / "chat_template.json").is_file():
        return json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return None


class ChatPrompt(str):
    """A rendered chat prompt: a `str` equal to what the chat template renders, plus `user_spans`,
    the sorted, disjoint (start, end) character ranges of message text in it. `encode_prompt`
    tokenizes special-token strings inside these spans as plain text. String operations return a
    plain `str` (the spans are lost and specials parse again): pass the object itself on."""

    def __new__(cls, text: str, user_spans=()):
        self = super().__new__(cls, text)
        self.user_spans = tuple((int(a), int(b)) for a, b in user_spans)
        return self

    def __reduce__(self):
        return ChatPrompt, (str(self), self.user_spans)


class MediaText(str):
    """A family's text for one image / video placeholder (`Family.image_prompt`), plus `wrapper`:
    the (before, after) strings that the text also replaces where both sit right around the
    placeholder (outside message text). Qwen3VLProcessor writes `<|vision_start|>` and
    `<|vision_end|>` around each frame of a video and collapses the template's
    `<|vision_start|><|video_pad|><|vision_end|>` into the bare placeholder before expanding it."""

    def __new__(cls, text: str, wrapper: tuple[str, str] = ("", "")):
        self = super().__new__(cls, text)
        self.wrapper = (str(wrapper[0]), str(wrapper[1]))
        return self

    def __reduce__(self):
        return MediaText, (str(self), self.wrapper)


def _overlaps(spans: tuple, starts: list[int], a: int, b: int) -> bool:
    """Whether the non-empty character range [a, b) overlaps one of the sorted disjoint spans."""
    if b <= a:
        return False
    k = bisect.bisect_left(starts, b) - 1  # the last span starting before b
    return k >= 0 and spans[k][1] > a


# Sentinels that mark message text while rendering: private-use characters (plane 15) absent from
# the rendered prompt. _CONTEXT stands for "a template token precedes this text" when a stretch of
# text is re-tokenized on its own (see Tokenizer._plain_ids).
_SENTINEL_BASE = 0xF0000
_CONTEXT = "\U0010fffd"


class Tokenizer:
    """Host-side text <-> ids for one checkpoint."""

    def __init__(self, model_dir: str | os.PathLike, image_token: str | None, chat_template: str | None = None,
                 video_token: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise CheckpointError(f"{d} has no tokenizer.json", param="tokenizer")
        self._tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        # as transformers does per call: a tokenizer.json's truncation/padding never applies here
        self._tok.no_truncation()
        self._tok.no_padding()
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.image_token = image_token
        self.image_token_id = self._tok.token_to_id(image_token) if image_token else None
        self.video_token = video_token
        self.video_token_id = self._tok.token_to_id(video_token) if video_token else None
        self.chat_template = chat_template or load_chat_template(d, cfg)
        self._env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = self._raise
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token spells more than this many UTF-8 bytes (an over-estimate for byte-level and
        # sentencepiece vocabularies), so a text of n bytes is at least n / max_token_bytes tokens:
        # a bound checked before tokenizing text that cannot fit the context.
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)),
                                   default=1)
        added = self._tok.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        # the ids message text can never produce (added tokens flagged special)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._plain_tok = None  # (clone with special-token parsing off, its context id), on first need
        self._plain_lock = threading.Lock()
        self._tpl = None  # (source, compiled template)

    @staticmethod
    def _raise(message: str):
        raise PromptError(f"chat template: {message}", param="messages")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_id(self, text: str) -> int | None:
        """The id of `text` if the vocabulary holds it as one token (e.g. a special marker)."""
        return self._tok.token_to_id(text)

    def to_json_str(self) -> str:
        """The tokenizer.json text (for grammar engines that build their own tokenizer)."""
        return self._tok.to_str()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> ChatPrompt:
        """OpenAI-style messages (content: str or list of {"type": "text"|"image", ...}) -> prompt.

        Returns a `ChatPrompt`: the rendered string (exactly the template's output) plus the spans
        of message text, whose special-token strings `encode_prompt` keeps as plain text. The spans
        come from a second render with each text wrapped in two sentinel characters (inside its
        leading/trailing whitespace, so templates that `trim` content agree). If that render does
        not agree with the plain one (a template that slices, splits or tests the content), the
        prompt is returned without spans when no message text holds a special token, and
        rejected with PromptError when one does (it cannot be tokenized safely)."""
        if not self.chat_template:
            raise PromptError("this model has no chat template; pass a raw prompt or --chat-template",
                              param="messages")
        for token, what in ((self.image_token, "image"), (self.video_token, "video")):
            if not token:
                continue
            for i, m in enumerate(messages):
                for part in self._text_parts(m):
                    if token in part:
                        raise PromptError(
                            f"messages[{i}] text contains the reserved {what} placeholder {token!r}; "
                            f"{what}s must be sent as {what} parts", param=f"messages[{i}].content")
        plain = self._render(messages, add_generation_prompt, kwargs)
        plain, messages = self._parts_if_dropped(messages, plain, add_generation_prompt, kwargs)
        if not any(t.strip() for m in messages for t in self._text_parts(m)):
            return ChatPrompt(plain)
        cp = _SENTINEL_BASE
        while chr(cp) in plain:
            cp += 1
        start = chr(cp)
        cp += 1
        while chr(cp) in plain:
            cp += 1
        end = chr(cp)
        marked = self._render([self._mark(m, start, end) for m in messages], add_generation_prompt, kwargs)
        spans = self._unmark(marked, start, end, plain)
        if spans is not None:
            return ChatPrompt(plain, spans)
        for i, m in enumerate(messages):
            for part in self._text_parts(m):
                if self.special_ids.intersection(self._tok.encode(part, add_special_tokens=False).ids):
                    raise PromptError(
                        f"messages[{i}] text contains a special token and this model's chat template "
                        "transforms message text, so it cannot be kept apart from the template's own "
                        "special tokens", param=f"messages[{i}].content")
        return ChatPrompt(plain)

    def _parts_if_dropped(self, messages: list, plain: str, add_generation_prompt: bool, kwargs: dict
                          ) -> tuple[str, list]:
        """Templates that only iterate content parts (Idefics3, SmolVLM: `for line in
        message['content']`) render a plain-string content as nothing. Probed with a sentinel
        character as every string content: when no trace of it is rendered, and rendered as one
        text part it shows (and the list is not printed as a Python repr), string contents
        become one text part each (vLLM's "openai" content format); else the render stays."""
        if not any(isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"].strip()
                   for m in messages):
            return plain, messages
        probe = "\U0010fffc"

        def swap(content_of):
            return [{**m, "content": content_of(m["content"])}
                    if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]
        try:
            if probe in self._render(swap(lambda c: probe), add_generation_prompt, kwargs):
                return plain, messages
            shown = self._render(swap(lambda c: [{"type": "text", "text": probe}]), add_generation_prompt, kwargs)
        except PromptError:
            return plain, messages
        if probe not in shown or "'type'" in shown:
            return plain, messages
        as_parts = swap(lambda c: [{"type": "text", "text": c}])
        return self._render(as_parts, add_generation_prompt, kwargs), as_parts

    def _render(self, messages: list, add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            if self._tpl is None or self._tpl[0] != self.chat_template:
                self._tpl = (self.chat_template, self._env.from_string(self.chat_template))
            return self._tpl[1].render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except PromptError:
            raise
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed to render: {e}", param="messages") from e

    @staticmethod
    def _text_parts(m: Any) -> list[str]:
        """The text strings of one message's content."""
        if not isinstance(m, dict):
            return []
        content = m.get("content")
        if isinstance(content, str):
            return [content]
        if isinstance(content, list):
            return [p["text"] for p in content
                    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
        return []

    @staticmethod
    def _mark(m: Any, start: str, end: str) -> Any:
        """The message with each text wrapped as lead + start + core + end + trail (lead/trail: its
        leading/trailing whitespace, so trim/strip in a template leaves the sentinels in place)."""
        def wrap(t: str) -> str:
            core = t.strip()
            if not core:
                return t
            i = len(t) - len(t.lstrip())
            return t[:i] + start + core + end + t[i + len(core):]

        if not isinstance(m, dict):
            return m
        content = m.get("content")
        if isinstance(content, str):
            return {**m, "content": wrap(content)}
        if isinstance(content, list):
            return {**m, "content": [
                {**p, "text": wrap(p["text"])}
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) else p
                for p in content]}
        return m

    @staticmethod
    def _unmark(marked: str, start: str, end: str, plain: str) -> tuple | None:
        """Spans of the text between sentinels, in `marked` with the sentinels removed; None unless
        the sentinels pair up (start, end, start, end...) and removing them gives `plain`."""
        pieces, spans = [], []
        pos = n = 0  # position in marked, length of the output so far
        opened = None
        for mt in re.finditer(f"[{start}{end}]", marked):
            is_start = mt.group() == start
            if is_start == (opened is not None):
                return None
            pieces.append(marked[pos:mt.start()])
            n += mt.start() - pos
            pos = mt.end()
            if is_start:
                opened = n
            else:
                if n > opened:
                    spans.append((opened, n))
                opened = None
        if opened is not None:
            return None
        pieces.append(marked[pos:])
        if "".join(pieces) != plain:
            return None
        return tuple(spans)

    def placeholder_kinds(self, prompt: str) -> list[str]:
        """"image" / "video" for each media placeholder of a raw prompt, in prompt order."""
        tokens = {t: k for t, k in ((self.image_token, "image"), (self.video_token, "video")) if t}
        if not tokens:
            return []
        pattern = "|".join(re.escape(t) for t in tokens)
        return [tokens[m.group()] for m in re.finditer(pattern, str(prompt))]

    def encode_prompt(self, prompt: str, image_token_counts: list[int],
                      image_texts: list[str | None] | None = None,
                      token_ids: list[int] | None = None) -> list[int]:
        """Tokenize a prompt holding one placeholder per image and expand placeholder i into
        image_token_counts[i] copies of the image token id, or, where `image_texts[i]` is a
        string, replace the placeholder by that text before tokenizing (a family whose processor
        expands the placeholder as text, e.g. Gemma's "\n\n<start_of_image>...<end_of_image>\n\n":
        the text around it then tokenizes as the processor's does; a `MediaText` also replaces
        its `wrapper` around the placeholder). BOS is added by the
        tokenizer's post-processor unless the prompt already starts with it (from the template,
        not from message text). A `ChatPrompt` from `render_chat` keeps special-token strings
        inside message text as plain text; a plain str parses them (a raw prompt).
        token_ids: each input's placeholder token id (image or video token), in prompt order
        (default: all images); placeholder i must be input i's kind."""
        spans = tuple(sorted(getattr(prompt, "user_spans", ())))
        text = str(prompt)
        if image_texts is not None and any(t is not None for t in image_texts):
            if len(image_texts) != len(image_token_counts) or any(t is None for t in image_texts):
                raise ValueError("image_texts must give one text per image")
            text, spans = self._expand_placeholders(text, spans, image_texts, token_ids)
            image_token_counts = []
        starts = [a for a, _ in spans]
        add_special = not (self.bos_token and text.startswith(self.bos_token)
                           and not _overlaps(spans, starts, 0, len(self.bos_token)))
        enc = self._tok.encode(text, add_special_tokens=add_special)
        ids = enc.ids
        if spans and any(t in self.special_ids and _overlaps(spans, starts, a, b)
                         for t, (a, b) in zip(ids, enc.offsets)):
            ids = self._demote_specials(text, spans, starts, ids)
        if self.image_token_id is None or (image_texts is not None and not image_token_counts):
            if image_token_counts:
                raise PromptError("this model takes no images", param="images")
            return ids
        media = {self.image_token_id} | ({self.video_token_id} if self.video_token_id is not None else set())
        where = [i for i, t in enumerate(ids) if t in media]
        token_ids = [self.image_token_id] * len(image_token_counts) if token_ids is None else list(token_ids)
        found = [ids[i] for i in where]
        if found != token_ids:
            raise self._placeholder_error(found, token_ids)
        out: list[int] = []
        prev = 0
        for pos, n in zip(where, image_token_counts):
            out.extend(ids[prev:pos])
            out.extend([ids[pos]] * n)
            prev = pos + 1
        out.extend(ids[prev:])
        return out

    def _placeholder_error(self, found: list[int], given: list[int]) -> PromptError:
        """The error for a prompt whose placeholders (token ids, in order) are not the inputs'."""
        n_img, n_vid = found.count(self.image_token_id), len(found) - found.count(self.image_token_id)
        g_img, g_vid = given.count(self.image_token_id), len(given) - given.count(self.image_token_id)
        if (n_img, n_vid) == (g_img, g_vid):
            return PromptError("the prompt's image and video placeholders are not in the order of the inputs",
                               param="images")
        return PromptError(f"prompt has {n_img} image placeholder(s) {self.image_token!r}"
                           + (f" and {n_vid} video placeholder(s) {self.video_token!r}" if self.video_token else "")
                           + f" but {g_img} image(s)" + (f" and {g_vid} video(s)" if self.video_token else "")
                           + " were given", param="videos" if n_img == g_img else "images")

    def _expand_placeholders(self, text: str, spans: tuple, image_texts: list[str],
                             token_ids: list[int] | None = None) -> tuple[str, tuple]:
        """`text` with its i-th image / video placeholder (outside message text) replaced by
        image_texts[i], and the message-text spans moved to match. token_ids: each input's
        placeholder token id (default: all images); placeholder i must be input i's kind."""
        if self.image_token is None:
            raise PromptError("this model takes no images", param="images")
        starts = [a for a, _ in spans]
        # by kind: a family's image token id may be another token than the placeholder (Gemma 3's
        # soft token vs <start_of_image>); videos are the inputs whose token is the video token
        names = {self.image_token: self.image_token_id}
        if self.video_token:
            names[self.video_token] = self.video_token_id
        pattern = "|".join(re.escape(t) for t in sorted(names, key=len, reverse=True))
        hits = [m for m in re.finditer(pattern, text) if not _overlaps(spans, starts, m.start(), m.end())]
        given = [self.video_token_id if self.video_token_id is not None and t == self.video_token_id
                 else self.image_token_id for t in (token_ids or [None] * len(image_texts))]
        if [names[m.group()] for m in hits] != given:
            raise self._placeholder_error([names[m.group()] for m in hits], given)
        pieces, prev, shifts = [], 0, []
        for m, rep in zip(hits, image_texts):
            a, b = m.start(), m.end()
            before, after = getattr(rep, "wrapper", ("", ""))
            if (before or after) and a - len(before) >= prev and text[a - len(before):a] == before \
                    and text[b:b + len(after)] == after \
                    and not _overlaps(spans, starts, a - len(before), b + len(after)):
                a, b = a - len(before), b + len(after)    # the wrapper is replaced too (MediaText)
            pieces += [text[prev:a], str(rep)]
            prev = b
            shifts.append((a, len(rep) - (b - a)))
        pieces.append(text[prev:])

        def moved(i: int) -> int:
            return i + sum(d for pos, d in shifts if pos < i)
        return "".join(pieces), tuple((moved(a), moved(b)) for a, b in spans)

    def _demote_specials(self, text: str, spans: tuple, starts: list[int], ids_post: list[int]) -> list[int]:
        """ids of `text` where every special token overlapping a message span is replaced by the
        tokens of the text it spells. Each stretch from the previous kept added token to the next
        one is re-tokenized with special-token parsing off (the stretch the tokenizer would have
        treated as one piece had these strings not been special), then the post-processor's
        tokens (`ids_post` minus the plain ids: BOS...) are put back around the result."""
        enc = self._tok.encode(text, add_special_tokens=False)
        ids, offs = enc.ids, enc.offsets
        bad = [i for i, (t, (a, b)) in enumerate(zip(ids, offs))
               if t in self.special_ids and _overlaps(spans, starts, a, b)]
        badset = set(bad)

        def kept(i: int) -> bool:
            return ids[i] in self.added_ids and i not in badset

        out: list[int] = []
        prev = 0  # ids[:prev] are settled
        j = 0
        while j < len(bad):
            lo, hi = bad[j], bad[j] + 1
            while lo > prev and not kept(lo - 1):
                lo -= 1
            while hi < len(ids) and not kept(hi):
                hi += 1
            a = offs[lo - 1][1] if lo > 0 else 0
            b = offs[hi][0] if hi < len(ids) else len(text)
            out.extend(ids[prev:lo])
            out.extend(self._plain_ids(text[a:b], after_token=lo > 0))
            prev = hi
            while j < len(bad) and bad[j] < hi:
                j += 1
        out.extend(ids[prev:])
        if len(ids_post) == len(ids):
            return out
        for k in range(len(ids_post) - len(ids) + 1):  # where the plain ids sit among the post-processed
            if ids_post[k:k + len(ids)] == ids:
                return ids_post[:k] + out + ids_post[k + len(ids):]
        raise PromptError("cannot place the tokenizer's post-processor tokens around the prompt",
                          param="messages")

    def _plain_ids(self, text: str, after_token: bool) -> list[int]:
        """Tokenize `text` with special-token parsing off (on a clone of the tokenizer: the flag is
        per instance and tokenization runs in a thread pool). `after_token`: the text follows a
        token in the prompt, so pre-tokenizers that treat the start of the input apart (Metaspace
        prepend_scheme="first") must not; a private added token in front stands for it."""
        with self._plain_lock:
            if self._plain_tok is None:
                from tokenizers import AddedToken
                from tokenizers import Tokenizer as HFTokenizer

                t = HFTokenizer.from_str(self._tok.to_str())
                t.add_tokens([AddedToken(_CONTEXT, special=False, normalized=False)])
                t.encode_special_tokens = True
                self._plain_tok = (t, t.token_to_id(_CONTEXT))
        tok, context_id = self._plain_tok
        if after_token and _CONTEXT not in text:
            ids = tok.encode(_CONTEXT + text, add_special_tokens=False).ids
            if ids and ids[0] == context_id:
                return ids[1:]
        return tok.encode(text, add_special_tokens=False).ids


class IncrementalDetokenizer:
    """Streams text for a growing list of ids without ever emitting half a UTF-8 character
    (a pending byte-level token decodes to U+FFFD until its sequence completes).

    Each token decodes a short window, not the whole list (TGI's and vLLM's scheme): the ids
    from the last emitted boundary but one (`_prefix`, context for decoders that treat a
    sequence's first token apart, e.g. Metaspace dropping its leading space) to the end, less
    the text of the window up to the last boundary (`_read`). Decoding the whole list each
    token grows with the answer's length, and over many rows of long answers costs more host
    time a step than a GPU's whole decode step. A decoder whose window text does not extend the context's (one that
    rewrites earlier text) gets the whole list for that token instead."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens   # False: special tokens (e.g. tool-call markers) stay in the text
        self.ids: list[int] = []
        self.text = ""  # text emitted so far
        self._prefix = 0   # window start: the boundary before the last emitted one
        self._read = 0     # ids[:_read] are in self.text

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        context = self.tok.decode(self.ids[self._prefix:self._read], self.skip) if self._read > self._prefix else ""
        window = self.tok.decode(self.ids[self._prefix:], self.skip)
        if window.endswith("\ufffd"):
            return ""
        if not window.startswith(context):
            return self._whole()
        delta = window[len(context):]
        if not delta:          # e.g. a skipped special token: nothing to show yet
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def _whole(self) -> str:
        full = self.tok.decode(self.ids, self.skip)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text = full
        self._prefix, self._read = max(len(self.ids) - 1, 0), len(self.ids)
        return delta

    def flush(self) -> str:
        full = self.tok.decode(self.ids, self.skip)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
