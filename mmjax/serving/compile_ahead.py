"""Shapes compiled ahead of time, off the engine thread (`AheadOfTime`, a part of ModelRunner):
the steps one request can reach beyond the ladders `warmup` compiles (a FastV prefill, a
prompt_logprobs chunk not warmed up) compile in one background thread while the engine serves
the shapes that exist."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import jax
import numpy as np

from mmjax.backend import compiling_for
from mmjax.serving.batching import PrefillChunk

log = logging.getLogger("mmjax.runner")


def _abstract(x):
    """An argument as the abstract value a step is lowered for (its sharding kept)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


_COMPILER: concurrent.futures.ThreadPoolExecutor | None = None
_COMPILER_LOCK = threading.Lock()


def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread compiling steps ahead of time for every runner (`ModelRunner.ready`)."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            _COMPILER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmjax-compile")
        return _COMPILER



class AheadOfTime:
    """ModelRunner's background compiles: `ready` starts one and says when it is done; `_track`
    then calls the executable it left in `_aot`."""

    def ready(self, chunks: list[PrefillChunk], prune: tuple[int, int] | None = None) -> bool:
        """Can `prefill(chunks, prune)` run now without compiling on the calling thread? The
        steps a single request reaches beyond the ladders `warmup` compiles, a FastV call
        (prefill_pruned: one shape per chunk, layer, keep and output length) and a
        prompt_logprobs call not warmed up (prefill_scores), compile in a background thread,
        ahead of time, their executable then kept for that shape: until it is done this says
        False (the engine serves the shapes that exist meanwhile). The compile's error, if it
        failed, is raised here once. Other calls: True (they compile on first use; `warmup`
        compiles them all up front)."""
        spec = self._ahead_spec(chunks, prune)
        if spec is None:
            return True
        kind, shape, fn, args, kw = spec
        if shape in self.compiled[kind]:
            return True
        key = (kind, shape)
        fut = self._compiling.get(key)
        if fut is None:
            abstract = jax.tree.map(_abstract, (self.lm_leaves, self.cache, self.state) + tuple(args))
            self._compiling[key] = _compile_pool().submit(self._compile_ahead, kind, shape, fn, abstract, kw)
            return False
        if not fut.done():
            return False
        del self._compiling[key]
        executable, dt = fut.result()        # its error, if the compile failed
        self._aot[key] = executable
        self.compiled[kind].add(shape)
        self.compile_seconds += dt
        return True

    def _ahead_spec(self, chunks: list[PrefillChunk], prune):
        """(kind, shape, jitted step, array arguments after params / cache / state, static kwargs) of a
        call `ready` compiles off the calling thread; None for the others."""
        if self._announce is not None or not chunks:       # multi-host: every process compiles in step
            return None
        if prune is not None:
            shape, args, kw = self._pruned_args(chunks[0], prune)
            return "prefill_pruned", shape, self._prefill_pruned, args, kw
        if chunks[0].next_ids is not None:
            shape, args = self._scores_args(chunks[0])
            return "prefill_scores", shape, self._prefill_scores, args, {}
        return None

    def compile_key(self, chunks: list[PrefillChunk], prune=None) -> tuple | None:
        """(kind, shape) of the call `ready` looked at (None: one that never waits)."""
        spec = self._ahead_spec(chunks, prune)
        return None if spec is None else spec[:2]

    def compile_done(self, key: tuple | None) -> bool:
        """Is the background compile of `key` (`compile_key`) over (or none running)?"""
        fut = self._compiling.get(key) if key is not None else None
        return fut is None or fut.done()

    def _compile_ahead(self, kind: str, shape, fn, abstract: tuple, kw: dict):
        """(executable, seconds) of `fn` for these abstract arguments (in the compile thread)."""
        t0 = time.perf_counter()
        with compiling_for(self.tuning.platform):
            executable = fn.lower(*abstract, **kw).compile()
        dt = time.perf_counter() - t0
        log.info("compiled %s %s in %.2fs (in the background)", kind, shape, dt)
        return executable, dt

    def compiling(self) -> int:
        """Compiles running in the background (`ready`)."""
        return len(self._compiling)

    def wait_compiling(self, timeout: float) -> None:
        """Wait up to `timeout` s for one of the background compiles to finish."""
        if self._compiling:
            concurrent.futures.wait(list(self._compiling.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

