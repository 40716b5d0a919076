"""Tokenizer (HF `tokenizers`) + the checkpoint's jinja2 chat template + image placeholders.

Injection policy (decided, documented, tested): in chat messages, text that contains the model's
image placeholder string (e.g. "<image>") is REJECTED with PromptError. Escaping would silently
change what the user wrote and the placeholder has no legitimate use in message text; only image
parts bind images. In raw `generate` prompts the researcher writes placeholders on purpose, and
their count must equal the number of images.
"""
from __future__ import annotations

import json
import os
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


class Tokenizer:
    """Host-side text <-> ids for one checkpoint."""

    def __init__(self, model_dir: str | os.PathLike, image_token: str | None, chat_template: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise CheckpointError(f"{d} has no tokenizer.json", param="tokenizer")
        self._tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.image_token = image_token
        self.image_token_id = self._tok.token_to_id(image_token) if image_token else None
        self.chat_template = chat_template or load_chat_template(d, cfg)
        self._env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = self._raise
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token spells more than this many UTF-8 bytes (an over-estimate for byte-level and
        # sentencepiece vocabularies), so a text of n bytes is at least n / max_token_bytes tokens:
        # a bound checked before tokenizing text that cannot fit the context.
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)),
                                   default=1)

    @staticmethod
    def _raise(message: str):
        raise PromptError(f"chat template: {message}", param="messages")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """OpenAI-style messages (content: str or list of {"type": "text"|"image", ...}) -> prompt."""
        if not self.chat_template:
            raise PromptError("this model has no chat template; pass a raw prompt or --chat-template",
                              param="messages")
        if self.image_token:
            for i, m in enumerate(messages):
                parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
                for part in parts:
                    if part.get("type") == "text" and self.image_token in (part.get("text") or ""):
                        raise PromptError(
                            f"messages[{i}] text contains the reserved image placeholder {self.image_token!r}; "
                            "images must be sent as image parts", param=f"messages[{i}].content")
        try:
            tpl = self._env.from_string(self.chat_template)
            return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except PromptError:
            raise
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed to render: {e}", param="messages") from e

    def encode_prompt(self, prompt: str, image_token_counts: list[int]) -> list[int]:
        """Tokenize a prompt holding one placeholder per image and expand placeholder i into
        image_token_counts[i] copies of the image token id. BOS is added by the tokenizer's
        post-processor unless the prompt already starts with it."""
        add_special = not (self.bos_token and prompt.startswith(self.bos_token))
        ids = self.encode(prompt, add_special_tokens=add_special)
        if self.image_token_id is None:
            if image_token_counts:
                raise PromptError("this model takes no images", param="images")
            return ids
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(image_token_counts):
            raise PromptError(f"prompt has {len(where)} image placeholder(s) {self.image_token!r} but "
                              f"{len(image_token_counts)} image(s) were given", param="images")
        out: list[int] = []
        prev = 0
        for pos, n in zip(where, image_token_counts):
            out.extend(ids[prev:pos])
            out.extend([self.image_token_id] * n)
            prev = pos + 1
        out.extend(ids[prev:])
        return out


class IncrementalDetokenizer:
    """Streams text for a growing list of ids without ever emitting half a UTF-8 character
    (a pending byte-level token decodes to U+FFFD until its sequence completes)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""  # text emitted so far

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        return delta

    def flush(self) -> str:
        full = self.tok.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
