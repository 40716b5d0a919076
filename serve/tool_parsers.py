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
from dataclasses import dataclass

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


def _obj_call(obj, args_keys=("arguments", "parameters"), raw: str | None = None) -> dict | None:
    """{"name": str, "arguments"|"parameters": {...}} -> a call; None if it is not one. `raw`:
    the object's text; an object's arguments are then its own text as generated (what the
    stream sent, fragment by fragment), not a re-serialization."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if not isinstance(args, (dict, str)):
        return None
    if raw is not None and isinstance(args, dict):
        scan = _scan_object(raw, 0, (key,))
        span = scan[1].get(key) if scan is not None else None
        if span is not None and span[1] is not None and json.loads(raw[span[0]:span[1]]) == args:
            args = raw[span[0]:span[1]]
    return _call(obj["name"], args)


# ---- incremental JSON scanning (streamed calls) ------------------------------------------------------

@dataclass
class PartialCall:
    """A tool call as far as the text goes: `name` once complete, `args` the arguments text so far
    (the JSON object's own text, a prefix of the final arguments; "" while unknown or not an
    object), `done` once the call's text is complete."""
    name: str | None
    args: str
    done: bool


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _skip_string(s: str, i: int) -> int | None:
    """s[i] == '"': the index after the closing quote (None: not closed yet)."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _skip_value(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i] (None: not complete yet). Only
    delimits: validity is json's business once complete."""
    if s[i] == '"':
        return _skip_string(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                j = _skip_string(s, j)
                if j is None:
                    return None
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i                                   # a scalar: complete once something follows it
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def _scan_object(s: str, i: int, keys) -> tuple[str | None, dict, int | None] | None:
    """The JSON object starting at s[i], as far as the text goes: (its "name" once complete,
    {key in `keys`: (value start, value end or None while open)}, the index after the object or
    None while open). None: not an object."""
    if i >= len(s) or s[i] != "{":
        return None
    name, spans = None, {}
    j = _ws(s, i + 1)
    while j < len(s):
        if s[j] == "}":
            return name, spans, j + 1
        if s[j] == ",":
            j = _ws(s, j + 1)
            continue
        if s[j] != '"':
            return None
        k = _skip_string(s, j)
        if k is None:
            break
        try:
            key = json.loads(s[j:k])
        except ValueError:
            return None
        j = _ws(s, k)
        if j < len(s) and s[j] != ":":
            return None
        j = _ws(s, j + 1)
        if j >= len(s):
            break
        end = _skip_value(s, j)
        if key in keys:
            spans[key] = (j, end)
        if end is None:
            break
        if key == "name":
            try:
                v = json.loads(s[j:end])
            except ValueError:
                return None
            name = v if isinstance(v, str) else None
        j = _ws(s, end)
    return name, spans, None


def _partial_obj(s: str, i: int, keys=("arguments", "parameters")) -> tuple[PartialCall | None, int | None]:
    """The call object at s[i] -> (PartialCall or None when it is not one, index after it)."""
    scan = _scan_object(s, i, keys)
    if scan is None:
        return None, None
    name, spans, end = scan
    key = next((k for k in keys if k in spans), None)
    args = ""
    if key is not None:
        a, b = spans[key]
        if s[a] == "{":                 # an object streams as it grows (a string only when parsed)
            args = s[a:b if b is not None else len(s)]
    return PartialCall(name, args, end is not None), end


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


def _rebase_refs(schema, base: str):
    """`schema` with every local reference ("$ref": "#...", a JSON pointer into the schema
    itself, e.g. Pydantic's "#/$defs/Loc") made to point into the same schema placed at JSON
    pointer `base` of a larger one: a tool's parameters are resolved against the tool's own
    schema, not against the call object wrapped around it."""
    if isinstance(schema, dict):
        return {k: ("#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase_refs(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def _schema(tool: dict, args_key: str, at: str = "") -> dict:
    """The call object of one tool ({"name": its name, args_key: its parameters}); `at`: the
    JSON pointer of this object in the schema it goes into."""
    f = tool["function"]
    params = _rebase_refs(f.get("parameters") or {"type": "object"}, f"{at}/properties/{args_key}")
    s = {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: params},
         "required": ["name", args_key], "additionalProperties": False}
    return s


def _any_of(tools: list[dict], args_key: str) -> dict:
    s = _schema(tools[0], args_key) if len(tools) == 1 else \
        {"anyOf": [_schema(t, args_key, f"/anyOf/{i}") for i, t in enumerate(tools)]}
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


def _list_items(s: str) -> list[str]:
    """The texts of the items of the (complete) JSON list at the start of `s`."""
    out, j = [], _ws(s, 1)
    while j < len(s) and s[j] != "]":
        end = _skip_value(s, j)
        if end is None:
            break
        out.append(s[j:end])
        j = _ws(s, end)
        if j < len(s) and s[j] == ",":
            j = _ws(s, j + 1)
    return out


class ToolParser:
    """One format. `parse(text)` -> (content outside the calls, OpenAI tool_calls); `find(text)`:
    where the calls start (-1: none yet); `held_back(text)`: characters at the end of streamed
    text to hold while they could still start a call; `stream(text)`: the calls of a growing
    answer so far (PartialCall: name, arguments text, for streaming argument by argument);
    `grammar(tools, many)`: Lark
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

    def stream(self, text: str) -> list[PartialCall]:
        """The calls in (growing) `text` as far as they go, in order; what follows a part that
        is not a call is left out (the finished text's `parse` decides)."""
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
                call = _obj_call(json.loads(m.group(1)), raw=m.group(1))
            except ValueError:
                continue
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        return ("".join(kept).strip() if calls else text), calls

    def stream(self, text: str) -> list[PartialCall]:
        out, i = [], text.find(self.OPEN)
        while i >= 0:
            j = _ws(text, i + len(self.OPEN))
            if j == len(text):
                break
            call, end = _partial_obj(text, j)
            if call is None:
                break
            out.append(call)
            if end is None:
                break
            i = text.find(self.OPEN, end)
        return out

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
                obj, end = _DEC.raw_decode(body, j)
            except ValueError:
                return text, []
            call = _obj_call(obj, ("parameters", "arguments"), raw=body[j:end])
            j = end
            if call is None:
                return text, []
            calls.append(call)
        return (text[:i].strip() if calls else text), calls

    def stream(self, text: str) -> list[PartialCall]:
        i = self.find(text)
        if i < 0:
            return []
        j = i + len(self.TAG) if text.startswith(self.TAG, i) else i
        out = []
        while True:
            while j < len(text) and (text[j].isspace() or text[j] == ";"):
                j += 1
            if j == len(text):
                return out
            call, end = _partial_obj(text, j, ("parameters", "arguments"))
            if call is None:
                return out
            out.append(call)
            if end is None:
                return out
            j = end

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
                raws = _list_items(seg) if isinstance(obj, list) else [seg[:end]]
                for o, raw in zip(obj if isinstance(obj, list) else [obj], raws):
                    call = _obj_call(o, raw=raw)
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
                calls.append(_call(name, args.strip()[:end]))
        return (text[:i].strip() if calls else text), calls

    def stream(self, text: str) -> list[PartialCall]:
        i = text.find(self.TOOL)
        if i < 0:
            return []
        out = []
        for seg in text[i:].split(self.TOOL)[1:]:
            j = _ws(seg, 0)
            if j == len(seg):
                break
            if seg[j] in "[{":                                  # JSON list (or one object)
                k, items = (_ws(seg, j + 1), True) if seg[j] == "[" else (j, False)
                while k < len(seg):
                    call, end = _partial_obj(seg, k)
                    if call is None:
                        return out
                    out.append(call)
                    if end is None:
                        return out
                    if not items:
                        break
                    k = _ws(seg, end)
                    if k < len(seg) and seg[k] == ",":
                        k = _ws(seg, k + 1)
                    elif k < len(seg):
                        break                                   # "]": this list is done
                continue
            name, sep, args = seg[j:].partition(self.ARGS)      # name[ARGS]{...}
            name = name.split("[CALL_ID]")[0].strip()
            if not sep:
                break
            a = _ws(args, 0)
            if a == len(args):
                out.append(PartialCall(name, "", False))
                break
            if args[a] != "{":
                break
            end = _skip_value(args, a)
            out.append(PartialCall(name, args[a:end if end is not None else len(args)], end is not None))
            if end is None:
                break
        return out

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
