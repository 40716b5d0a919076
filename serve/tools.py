"""Tool calling (chat): `tools` / `tool_choice` validation and the grammar that enforces
"required" and named choices. The formats (hermes, llama3_json, mistral: parsing calls out of
the model's text and writing their grammars) are in serve/tool_parsers.py.

The chat template renders the tools (`tools=` template variable); "none" leaves them out of
the prompt (vLLM's default). "required" / a named function: a grammar (llguidance Lark with
embedded JSON schemas) admits only tool calls, in the checkpoint's format, whose arguments
match the function's parameters.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from mmjax.errors import InvalidRequestError
from mmjax.serving.structured import StructuredSpec
from serve.tool_parsers import ToolParser

MAX_TOOLS = 128
log = logging.getLogger("mmjax.serve")


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {msg}", param=param)


@dataclass
class ToolRequest:
    tools: list[dict]            # validated OpenAI tool objects
    choice: str | dict           # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parser: ToolParser | None = None   # the checkpoint's format (set by schema.parse_chat)
    parallel: bool = True        # parallel_tool_calls: false -> at most one call

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
        if name in names:       # a call could not say which one it means
            raise _bad(f"{p}.function.name", f"repeats the name {name!r} of an earlier tool: tool names must be "
                                             "unique")
        names.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{p}.function.parameters", "must be a JSON schema object")
        try:    # a lone surrogate (JSON "\ud800") in a description or schema is not text
            json.dumps(t, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(f"'{p}' is not valid Unicode text: {e.reason} at character {e.start}",
                                      param=p, code="invalid_text") from None
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
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    return ToolRequest([dict(t, type="function") for t in tools], choice, parallel=parallel is not False)


def choice_grammar(tr: ToolRequest, parser: ToolParser) -> StructuredSpec | None:
    """The grammar enforcing tool_choice "required" (1 to tool_parsers.MAX_CALLS calls of any tools) or a named
    function (exactly one call of it), in `parser`'s format; None for "auto" / "none"."""
    if tr.choice in ("auto", "none"):
        return None
    if isinstance(tr.choice, dict):
        name = tr.choice["function"]["name"]
        return StructuredSpec("grammar", parser.grammar([t for t in tr.tools if t["function"]["name"] == name],
                                                        many=False), "tool_choice")
    return StructuredSpec("grammar", parser.grammar(tr.tools, many=tr.parallel), "tool_choice")


def parse_output(tr: ToolRequest, text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a finished answer in the request's format; with
    parallel_tool_calls false only the first call is kept (vLLM)."""
    content, calls = tr.parser.parse(text)
    return content, calls if tr.parallel else calls[:1]


class ToolStream:
    """One streamed choice's tool calls, argument by argument (vLLM's streaming): a call's first
    fragment holds its index, id, type and name (arguments ""), then `function.arguments`
    fragments follow as its JSON arguments are generated; `finish` sends what the finished
    text's parse holds beyond that, so the fragments join to the non-streamed `arguments`."""

    def __init__(self, tr: ToolRequest):
        self.tr = tr
        self.ids: list[str] = []        # ids of the calls whose first fragment went out
        self.sent: list[str] = []       # arguments text sent per call

    def _header(self, j: int, name: str, cid: str | None = None) -> dict:
        self.ids.append(cid or f"call_{uuid.uuid4().hex[:24]}")
        self.sent.append("")
        return {"index": j, "id": self.ids[j], "type": "function", "function": {"name": name, "arguments": ""}}

    def _args(self, j: int, args: str) -> list[dict]:
        sent = self.sent[j]
        if len(args) <= len(sent):
            return []
        if not args.startswith(sent):
            # only an unconstrained ("auto") answer whose call text turned out malformed can get
            # here: what went out cannot be taken back
            log.warning("streamed tool call %d diverged from the parsed arguments", j)
            return []
        self.sent[j] = args
        return [{"index": j, "function": {"arguments": args[len(sent):]}}]

    def update(self, text: str) -> list[dict]:
        """The new fragments of the (growing) answer `text`, in order."""
        out: list[dict] = []
        partial = self.tr.parser.stream(text)
        for j, call in enumerate(partial if self.tr.parallel else partial[:1]):
            if j == len(self.ids):
                if call.name is None:
                    break
                out.append(self._header(j, call.name))
            out += self._args(j, call.args)
        return out

    def finish(self, calls: list[dict]) -> list[dict]:
        """The fragments left once the answer is done; `calls`: its parse (parse_output)."""
        out: list[dict] = []
        for j, c in enumerate(calls):
            if j == len(self.ids):
                out.append(self._header(j, c["function"]["name"], c["id"]))
            out += self._args(j, c["function"]["arguments"])
        return out


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
