"""Runs the engine loop on its own thread and streams each request's outputs to an asyncio queue.

The event loop never blocks on tensor work: handlers submit requests and cancellations through a
thread-safe inbox; the engine thread applies them between steps, so a cancelled request's KV blocks are
free before the next step runs. Outputs travel back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from inference.engine import LLMEngine
from inference.output import RequestOutput
from inference.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or died on an exception)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    keep_logprobs: bool = True


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run a function on the engine thread between steps (faults, stats that must be consistent)."""

    fn: Callable[[LLMEngine], object]
    done: asyncio.Future[object]
    loop: asyncio.AbstractEventLoop


StepHook = Callable[["AsyncEngine"], None]
_Stream = asyncio.Queue[RequestOutput | Exception]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.before_step: list[StepHook] = []  # fault hooks: delays, hangs, device failure
        self.after_step: list[Callable[[LLMEngine], None]] = []  # metrics

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet running (in the inbox or the scheduler's waiting queue)."""
        return max(len(self._streams) - self.engine.scheduler.num_running, 0)

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Seq[int], params: SamplingParams, *,
                       priority: int = 0, keep_logprobs: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; closing the iterator early aborts the request.
        ``keep_logprobs``: the finished output carries every token's logprobs (off for streams)."""
        if not self.is_alive:
            raise EngineDeadError("engine loop is not running")
        self.engine.validate_prompt(prompt)
        loop = asyncio.get_running_loop()
        q: _Stream = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._inbox.put(_Add(request_id, list(prompt), params, priority, self.engine.clock(), keep_logprobs))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if not self.is_alive:
            raise EngineDeadError("engine loop is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[object] = loop.create_future()
        self._inbox.put(_Call(fn, done, loop))
        return await done

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                for hook in self.before_step:
                    hook(self)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    # Metrics first: a client that got its last token and then reads /metrics must find
                    # the step that made it counted (dispatching first left a window, seen under load).
                    for after in self.after_step:
                        after(self.engine)
                    self._dispatch(outputs)
                self.last_progress = time.monotonic()
        except BaseException as exc:  # the loop must report, not vanish
            logger.exception("engine loop died")
            self.error = exc
        finally:
            reason = f"engine loop died: {self.error}" if self.error else "engine stopped"
            self._fail_streams(EngineDeadError(reason))

    def fail_in_flight(self, reason: str) -> None:
        """Finish every request in the engine with an error; engine thread only."""
        self._dispatch(self.engine.fail_all(reason))

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            self.last_progress = time.monotonic()
            return
        while item is not None:
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item: _Add | _Abort | _Call) -> None:
        if isinstance(item, _Add):
            if item.request_id not in self._streams:  # cancelled before it reached the engine
                return
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params, priority=item.priority,
                                        arrival_time=item.arrival_time, keep_logprobs=item.keep_logprobs)
            except ValueError as exc:
                self._send(item.request_id, exc)
        elif isinstance(item, _Abort):
            self.engine.abort_request(item.request_id)
        else:
            try:
                result = item.fn(self.engine)
            except Exception as exc:
                item.loop.call_soon_threadsafe(_settle, item.done, None, exc)
            else:
                item.loop.call_soon_threadsafe(_settle, item.done, result, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._send(out.request_id, out)

    def _send(self, request_id: str, item: RequestOutput | Exception) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_streams(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._send(request_id, exc)


def _settle(future: asyncio.Future[object], result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
