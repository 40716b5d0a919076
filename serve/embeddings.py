"""The embeddings lane: /v1/embeddings work on a thread of its own, never in the templating /
tokenization pool that chat and completions requests go through.

An embedding request is a job: a generator run on the lane's thread, each `yield` ending one
unit of work (tokenizing a slice of its inputs, or one forward of at most `batch_tokens` padded
tokens: `pieces`). The lane runs one unit at a time, round-robin over its jobs, so a one-word
request waits for at most one unit of each other request, not for their whole work; the
engine's own steps run beside it (JAX runs the two threads' computations concurrently).
At most `max_jobs` requests wait (beyond: 503 `queue_full`). A job whose client went away is
dropped before its next unit (the handler marks it when it is cancelled), so abandoned work
stops within one unit.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, Iterator

from mmjax.errors import QueueFullError
from serve.schema import UnavailableError

log = logging.getLogger("mmjax.serve")


def pieces(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Input indices grouped into forwards of at most `batch_tokens` padded tokens, as
    `VLM.embed_prompts` pads them (prompts to a power of two of at least 16 tokens, rows to a
    power of two): similar lengths together, shortest first; an input longer than the budget
    goes alone."""
    def pad(n: int) -> int:
        return max(16, 1 << (max(n, 1) - 1).bit_length())

    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = 1 << len(cur).bit_length()           # the rows with this one added, padded
        if cur and rows * pad(lengths[i]) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


class _Job:
    __slots__ = ("work", "loop", "fut", "cancelled")

    def __init__(self, work: Iterator, loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
        self.work, self.loop, self.fut = work, loop, fut
        self.cancelled = False

    def deliver(self, value: Any = None, error: BaseException | None = None) -> None:
        def done():
            if not self.fut.done():
                if error is not None:
                    self.fut.set_exception(error)
                else:
                    self.fut.set_result(value)
        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:        # the loop is closed (shutdown)
            pass


class EmbedLane:
    """One thread running embedding jobs unit by unit, round-robin (module docstring)."""

    def __init__(self, max_jobs: int = 64):
        self.max_jobs = max_jobs
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.units = 0              # units run
        self.dropped = 0            # jobs dropped because their client left
        self.running = False        # a unit is running now

    def depth(self) -> int:
        """Jobs waiting for their next unit (the one running excluded)."""
        return len(self._jobs)

    async def run(self, work: Iterator) -> Any:
        """Run generator `work` on the lane (each `yield` ends a unit); its return value is the
        result. Cancelling the awaiting task drops the job before its next unit."""
        loop = asyncio.get_running_loop()
        job = _Job(work, loop, loop.create_future())
        with self._cv:
            if self._closed:
                raise UnavailableError("the server is shutting down and accepts no new requests")
            if len(self._jobs) >= self.max_jobs:
                raise QueueFullError(f"the embeddings lane is at capacity ({self.max_jobs} requests waiting); "
                                     "retry later")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mmjax-embed", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            return await job.fut
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                self.running = True
            try:
                if job.cancelled:
                    self.dropped += 1
                    job.work.close()
                    continue
                try:
                    next(job.work)
                except StopIteration as e:
                    job.deliver(e.value)
                    continue
                except Exception as e:      # the request's error (or a bug: its request only)
                    job.deliver(error=e)
                    continue
                finally:
                    self.units += 1
                with self._cv:
                    self._jobs.append(job)      # round-robin: its next unit after the others'
            finally:
                self.running = False

    def close(self) -> None:
        """Refuse new jobs, fail the waiting ones (503), stop the thread after the running unit."""
        with self._cv:
            self._closed = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        for job in jobs:
            job.work.close()
            job.deliver(error=UnavailableError("the server is shutting down"))
