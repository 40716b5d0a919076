"""Tool calling (chat): `tools` / `tool_choice` validation, the grammar that enforces
"required" and named choices, and parsing tool calls out of the model's text.

Format: hermes-style, as Qwen2/2.5(-VL) chat templates ask for it and vLLM's `hermes` parser
reads it: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
The chat template renders the tools (`tools=` template variable); "none" leaves them out of
the prompt (vLLM's default). "required" / a named function: a grammar (llguidance Lark with
embedded JSON schemas) admits only tool-call blocks whose arguments match the function's
parameters.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from mmjax.errors import InvalidRequestError
from mmjax.serving.structured import StructuredSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_CALLS = 3                # tool calls one "required" answer may hold
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {msg}", param=param)


@dataclass
class ToolRequest:
    tools: list[dict]            # validated OpenAI tool objects
    choice: str | dict           # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets as `tools` (None with tool_choice "none")."""
        return None if self.choice == "none" or not self.tools else self.tools

    @property
    def parse(self) -> bool:
        """Look for tool calls in the output?"""
        return bool(self.tools) and self.choice != "none"


def parse_tools(body: dict) -> ToolRequest | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"must be a list of at most {MAX_TOOLS} tools")
    names = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(p, "must be {'type': 'function', 'function': {...}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise _bad(f"{p}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        names.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{p}.function.parameters", "must be a JSON schema object")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise _bad("tool_choice", "must name one of the request's tools: {'type': 'function', 'function': "
                                      "{'name': ...}}")
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or a named function")
    return ToolRequest([dict(t, type="function") for t in tools], choice)


def _call_schema(tool: dict) -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def choice_grammar(tr: ToolRequest) -> StructuredSpec | None:
    """The grammar enforcing tool_choice "required" (1 to MAX_CALLS calls of any tools) or a named
    function (exactly one call of it); None for "auto" / "none"."""
    if tr.choice in ("auto", "none"):
        return None
    if isinstance(tr.choice, dict):
        name = tr.choice["function"]["name"]
        tools = [t for t in tr.tools if t["function"]["name"] == name]
        many = False
    else:
        tools, many = tr.tools, True
    schema = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    # compact JSON (a model could otherwise pad with whitespace forever); spaced separators as
    # hermes templates write them
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    nl = json.dumps("\n")
    repeat = f" ({nl} call ({nl} call)?)?" if many else ""     # "required": one to MAX_CALLS calls
    lark = "\n".join([f"start: call{repeat}",
                      f"call: {json.dumps(OPEN + chr(10))} obj {json.dumps(chr(10) + CLOSE)}",
                      f"obj: %json {json.dumps(schema)}", ""])
    return StructuredSpec("grammar", lark, "tool_choice")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls' `arguments` (a JSON string in the OpenAI API) become objects, as
    chat templates expect (vLLM does the same)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                f = dict(c.get("function", {}))
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": f})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def parse_calls(text: str) -> tuple[str, list[dict]]:
    """(content outside the tool-call blocks, OpenAI tool_calls). A block that is not a JSON
    object with a string "name" stays in the content."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else
                                   json.dumps(args, ensure_ascii=False)}})
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def held_back(text: str) -> int:
    """Characters at the end of streamed text to hold while they could start a tool call."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
