"""The server's state: one `State` per app, stored under `app[STATE]`, read by every route,
middleware and the connection protocol."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from serve.config import ServerConfig
from serve.media import MediaFetcher
from serve.metrics import ServerMetrics
from serve.schema import RequestLimits


@dataclass
class State:
    vlm: Any
    engine: Any
    aengine: Any
    config: ServerConfig
    fetcher: MediaFetcher
    metrics: ServerMetrics
    executor: ThreadPoolExecutor
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    active: set = field(default_factory=set)     # request ids being served
    logger_task: Any = None
    watchdog_task: Any = None
    token_cache: dict = field(default_factory=dict)   # token id -> (text, bytes) for logprobs
    body_cap: int = 0
    text_room: int = 0                                 # body bytes outside image data URIs
    limits: RequestLimits = field(default_factory=RequestLimits)
    stats_prev: Any = None                             # (engine stats, time) of the last log line
    embed_lane: Any = None                             # serve.embeddings.EmbedLane (/v1/embeddings work)
    _tool_parser: Any = None                           # (chat template, ToolParser) last chosen

    def tool_parser(self):
        """The tool-call format: --tool-call-parser, else chosen from the chat template and
        vocabulary (serve/tool_parsers.choose), again whenever the template changes."""
        tok = self.vlm.tokenizer
        if self._tool_parser is None or self._tool_parser[0] != tok.chat_template:
            from serve.tool_parsers import choose
            self._tool_parser = (tok.chat_template, choose(tok, self.config.tool_call_parser))
        return self._tool_parser[1]


STATE = web.AppKey("mmjax_state", State)

