"""Tool-call formats: one parser per chat-template family, each reading its calls out of the
generated text and writing the grammar that enforces tool_choice "required" / a named function.

- `hermes` (Qwen2 / 2.5 / -VL): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1 / 3.2): `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), calls joined by `; `;
- `mistral` (Mistral / Pixtral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizers / templates with an `[ARGS]` token).

The names are vLLM's `--tool-call-parser` names. `choose` picks one per checkpoint from its chat
template and vocabulary (the server's `--tool-call-parser` overrides). Mistral's markers
(`[TOOL_CALLS]`, `[ARGS]`) are special tokens in its vocabularies, dropped by the usual
detokenization, so `keep_special` asks such a request to keep special tokens in its text, and
the grammar names a marker that is one token by its id (`<[id]>`), so the model emits the token
a real checkpoint would. (Llama's `<|python_tag|>` may be dropped: the JSON alone parses.)
"""
from __future__ import annotations

import json
import re
import uuid

MAX_CALLS = 3                 # tool calls one "required" answer may hold
# compact JSON (a model could otherwise pad with whitespace forever); spaced separators as the
# templates write them (`tojson`)
_JSON_OPTS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_DEC = json.JSONDecoder()


def _call(name: str, args) -> dict:
    """One OpenAI tool call (arguments as a JSON string)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else
                         json.dumps(args, ensure_ascii=False)}}


def _obj_call(obj, args_keys=("arguments", "parameters")) -> dict | None:
    """{"name": str, "arguments"|"parameters": {...}} -> a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, (dict, str)):
        return None
    return _call(obj["name"], args)


def _suffix_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _lit(s: str) -> str:
    return json.dumps(s)


def _marker(tokenizer, s: str) -> str:
    """A grammar terminal for marker text `s`: the token itself when the vocabulary has it as one
    token (what a real checkpoint emits), else the text."""
    tid = tokenizer.token_id(s) if tokenizer is not None else None
    return f"<[{tid}]>" if tid is not None else _lit(s)


def _schema(tool: dict, args_key: str) -> dict:
    f = tool["function"]
    s = {"type": "object", "properties": {"name": {"const": f["name"]},
                                          args_key: f.get("parameters") or {"type": "object"}},
         "required": ["name", args_key], "additionalProperties": False}
    return s


def _any_of(tools: list[dict], args_key: str) -> dict:
    s = _schema(tools[0], args_key) if len(tools) == 1 else {"anyOf": [_schema(t, args_key) for t in tools]}
    s["x-guidance"] = _JSON_OPTS
    return s


def _repeat(item: str, sep: str, many: bool) -> str:
    """`item`, or with `many` one to MAX_CALLS of them joined by `sep`."""
    if not many:
        return item
    out = item
    for _ in range(MAX_CALLS - 1):
        out = f"{item} ({_lit(sep)} {out})?" if sep else f"{item} ({out})?"
    return out


class ToolParser:
    """One format. `parse(text)` -> (content outside the calls, OpenAI tool_calls); `find(text)`:
    where the calls start (-1: none yet); `held_back(text)`: characters at the end of streamed
    text to hold while they could still start a call; `grammar(tools, many)`: Lark
    text admitting only calls of `tools` (one, or 1 to MAX_CALLS with `many`)."""
    name = ""
    keep_special = False

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer          # for markers that are one token of the vocabulary

    def find(self, text: str) -> int:
        raise NotImplementedError

    def held_back(self, text: str) -> int:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def grammar(self, tools: list[dict], many: bool) -> str:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def find(self, text: str) -> int:
        return text.find(self.OPEN)

    def held_back(self, text: str) -> int:
        return _suffix_prefix(text, self.OPEN)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """A block that is not a JSON object with a string "name" stays in the content."""
        calls, kept, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            try:
                call = _obj_call(json.loads(m.group(1)))
            except ValueError:
                continue
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        return ("".join(kept).strip() if calls else text), calls

    def grammar(self, tools: list[dict], many: bool) -> str:
        return "\n".join([f"start: {_repeat('call', chr(10), many)}",
                          f"call: {_lit(self.OPEN + chr(10))} obj {_lit(chr(10) + self.CLOSE)}",
                          f"obj: %json {json.dumps(_any_of(tools, 'arguments'))}", ""])


class Llama3JsonParser(ToolParser):
    """The whole answer is the calls (vLLM's llama3_json): after optional whitespace and
    `<|python_tag|>`, JSON objects separated by `;` / whitespace. Anything else is content."""
    name = "llama3_json"
    TAG = "<|python_tag|>"            # dropped from the text when special; the JSON alone parses

    def find(self, text: str) -> int:
        i = text.find(self.TAG)
        if i >= 0:
            return i
        s = text.lstrip()
        return len(text) - len(s) if s.startswith("{") else -1

    def held_back(self, text: str) -> int:
        s = text.lstrip()
        if not s or self.TAG.startswith(s):          # could still be the start of a call
            return len(text)
        return _suffix_prefix(text, self.TAG)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        i = self.find(text)
        if i < 0:
            return text, []
        body = text[i:]
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        calls, j = [], 0
        while True:
            while j < len(body) and (body[j].isspace() or body[j] == ";"):
                j += 1
            if j == len(body):
                break
            try:
                obj, j = _DEC.raw_decode(body, j)
            except ValueError:
                return text, []
            call = _obj_call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
        return (text[:i].strip() if calls else text), calls

    def grammar(self, tools: list[dict], many: bool) -> str:
        return "\n".join([f"start: {_repeat('obj', '; ', many)}",
                          f"obj: %json {json.dumps(_any_of(tools, 'parameters'))}", ""])


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON list of calls (older templates), or `name[ARGS]{...}` after
    each `[TOOL_CALLS]` (templates of tokenizers with an `[ARGS]` token). Content before the
    first marker is the message content."""
    name = "mistral"
    TOOL, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keep_special = True

    def __init__(self, tokenizer=None, args_form: bool = False):
        super().__init__(tokenizer)
        self.args_form = args_form          # write (grammar) the `name[ARGS]{...}` form

    def find(self, text: str) -> int:
        return text.find(self.TOOL)

    def held_back(self, text: str) -> int:
        return _suffix_prefix(text, self.TOOL)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        i = text.find(self.TOOL)
        if i < 0:
            return text, []
        calls = []
        for seg in text[i:].split(self.TOOL)[1:]:
            seg = seg.strip()
            if not seg:
                continue
            if seg.startswith("[") or seg.startswith("{"):      # JSON list (or one object)
                try:
                    obj, end = _DEC.raw_decode(seg)
                except ValueError:
                    return text, []
                if seg[end:].strip():
                    return text, []
                for o in obj if isinstance(obj, list) else [obj]:
                    call = _obj_call(o)
                    if call is None:
                        return text, []
                    calls.append(call)
            else:                                               # name[ARGS]{...}
                name, sep, args = seg.partition(self.ARGS)
                name = name.split("[CALL_ID]")[0].strip()
                try:
                    obj, end = _DEC.raw_decode(args.strip())
                except ValueError:
                    return text, []
                if not sep or not name or not isinstance(obj, dict) or args.strip()[end:].strip():
                    return text, []
                calls.append(_call(name, obj))
        return (text[:i].strip() if calls else text), calls

    def grammar(self, tools: list[dict], many: bool) -> str:
        tc = _marker(self.tokenizer, self.TOOL)
        if not self.args_form:
            return "\n".join([f"start: {tc} \"[\" {_repeat('obj', ', ', many)} \"]\"",
                              f"obj: %json {json.dumps(_any_of(tools, 'arguments'))}", ""])
        args = _marker(self.tokenizer, self.ARGS)
        lines = [f"start: {_repeat('call', '', many)}",
                 "call: " + " | ".join(f"c{k}" for k in range(len(tools)))]
        for k, t in enumerate(tools):
            params = dict(t["function"].get("parameters") or {"type": "object"}, **{"x-guidance": _JSON_OPTS})
            lines.append(f"c{k}: {tc} {_lit(t['function']['name'])} {args} %json {json.dumps(params)}")
        return "\n".join(lines + [""])


PARSERS = ("hermes", "llama3_json", "mistral")


def choose(tokenizer, name: str | None = None) -> ToolParser:
    """The parser for a checkpoint: `name` (the server's --tool-call-parser) if given, else from
    its chat template and vocabulary: `[TOOL_CALLS]` -> mistral, `<tool_call>` -> hermes,
    `<|python_tag|>` or a Llama-3 header template -> llama3_json, otherwise hermes."""
    tpl = (getattr(tokenizer, "chat_template", None) or "") if tokenizer is not None else ""

    def has(tok: str) -> bool:
        return tok in tpl or (tokenizer is not None and tokenizer.token_id(tok) is not None)

    if name is None:
        if has(MistralParser.TOOL):
            name = "mistral"
        elif "<tool_call>" in tpl:
            name = "hermes"
        elif Llama3JsonParser.TAG in tpl or "<|start_header_id|>" in tpl:
            name = "llama3_json"
        else:
            name = "hermes"
    if name == "mistral":
        return MistralParser(tokenizer, args_form=has(MistralParser.ARGS))
    if name == "llama3_json":
        return Llama3JsonParser(tokenizer)
    if name == "hermes":
        return HermesParser(tokenizer)
    raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(PARSERS)})")
