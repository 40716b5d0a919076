"""Word of the minutes mmjax spends before it can answer: building its CPU kernels with the C++
compiler (once per machine and source version; `mmjax.kernels.cpu_library`) and compiling the
shapes of a warmup (`Engine.warmup`), one line per compiled shape: n of N, the shape, seconds.

The lines go to the `mmjax.progress` logger at INFO. The offline API stays quiet unless asked:
`mmjax.load(..., verbose=True)` (or `enable()`) prints them to stderr, and so does any logging
set up at INFO (`logging.basicConfig(level=logging.INFO)`). The command line prints them
(`mmjax serve`: in the server log; `mmjax bench engine`, `mmjax generate`: on stderr).
"""
from __future__ import annotations

import logging
import sys
from typing import Callable

log = logging.getLogger("mmjax.progress")

# progress(n, total, kind, shape, seconds): shape n of total compiled, `kind` ("encode",
# "prefill", "decode", ...) of `shape` (its bucket), in `seconds` (a persistent-cache hit is fast)
Progress = Callable[[int, int, str, object, float], None]


def enable(stream=None) -> None:
    """Print the progress lines to `stream` (default stderr), "mmjax: ..." (idempotent). They then
    no longer go on to the root logger's handlers (no line twice)."""
    if not any(getattr(h, "_mmjax_progress", False) for h in log.handlers):
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(logging.Formatter("mmjax: %(message)s"))
        handler._mmjax_progress = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def log_compiled(n: int, total: int, kind: str, shape, seconds: float) -> None:
    """The default warmup reporter: one INFO line per compiled shape."""
    log.info("warmup: compiled shape %d/%d, %s %s, in %.1f s", n, total, kind, _shape_text(shape), seconds)


def _shape_text(shape) -> str:
    """A bucket as "(256, 8)" (prefill: tokens, sequences; decode: rows, steps a call; encode:
    the family's bucket)."""
    return "(" + ", ".join(str(x) for x in (shape if isinstance(shape, tuple) else (shape,))) + ")"
