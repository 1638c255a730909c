"""EngineLoop: the engine on its own thread, fed by the asyncio server through thread-safe queues.

The engine is not thread-safe and must never be stepped from the event loop (a step of a large
model takes tens of milliseconds to seconds and would stall every connection). So exactly one
thread owns it:

- handlers call ``submit`` / ``abort`` (any thread): the call is appended to a pending queue under
  a condition variable and the engine thread is woken;
- the engine thread, each iteration, hands pending requests and aborts to the engine, runs one
  ``step()`` if work exists, routes each ``RequestOutput`` to its request's ``asyncio.Queue``
  through ``loop.call_soon_threadsafe``, then refreshes the metrics gauges from ``stats()``; with
  nothing to do it sleeps on the condition.

Determinism does not depend on *when* a request reaches the engine: in ``corun`` mode each
request's shapes depend only on itself (DESIGN.md), so the loop needs no ordering guarantees beyond
"every submitted request is eventually added".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corun.engine import QueueFullError as EngineQueueFullError

if TYPE_CHECKING:
    from corun.api.metrics import ServerMetrics
    from corun.sampling_params import SamplingParams

logger = logging.getLogger("corun.serve")


class QueueFullError(EngineQueueFullError):
    """The waiting queue is at its limit: the server answers 503 instead of queueing."""


class EngineDeadError(RuntimeError):
    """The engine thread died; the server answers 503 and /health reports it."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True)
class EngineError:
    """Put on a request's queue when the engine rejected or failed it."""

    message: str
    status: int  # the HTTP status the server answers with


class EngineLoop:
    """Owns ``engine`` on a daemon thread; see the module docstring for the protocol."""

    def __init__(
        self,
        engine: Any,
        metrics: ServerMetrics | None = None,
        max_queue_len: int | None = None,
        idle_timeout_s: float = 0.5,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_failure(exc)`` runs on the engine thread after the engine died and every waiting
        client got its error (``corun.serve`` shuts the server down from it)."""
        self._engine = engine
        self._on_failure = on_failure
        self._metrics = metrics
        self.max_queue_len = max_queue_len
        self._idle_timeout_s = idle_timeout_s
        self._cond = threading.Condition()
        self._pending_adds: deque[tuple[str, list[int], SamplingParams, float]] = deque()
        self._pending_aborts: deque[str] = deque()
        self._sinks: dict[str, _Sink] = {}
        self._num_waiting = 0  # the engine's waiting count after the last step
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="corun-engine", daemon=True)

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._refresh_stats()  # the gauges exist from the first scrape on (thread not started yet)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting: not yet handed to the engine, plus the engine's own waiting queue."""
        return len(self._pending_adds) + self._num_waiting

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
    ) -> None:
        """Queue a request; ``(request_id, RequestOutput | EngineError)`` items arrive on ``queue``.

        Call from the event loop that reads ``queue``; several requests may share one queue.
        Raises QueueFullError when ``max_queue_len`` requests already wait, EngineDeadError when
        the engine thread is gone.
        """
        sink = _Sink(asyncio.get_running_loop(), queue)
        with self._cond:
            if not self.is_alive or self._stopped:
                raise EngineDeadError(f"the engine is not running: {self._error!r}")
            if self.max_queue_len is not None and self.num_waiting >= self.max_queue_len:
                raise QueueFullError(
                    f"the waiting queue is full ({self.max_queue_len} requests); retry later"
                )
            self._sinks[request_id] = sink
            self._pending_adds.append((request_id, prompt_token_ids, params, time.perf_counter()))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone): the engine frees its KV; idempotent."""
        with self._cond:
            if self._sinks.pop(request_id, None) is None:
                return
            # Not handed to the engine yet: drop it here, the engine never hears of it.
            for entry in self._pending_adds:
                if entry[0] == request_id:
                    self._pending_adds.remove(entry)
                    return
            self._pending_aborts.append(request_id)
            self._cond.notify()

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        with self._cond:
            self._sinks.pop(request_id, None)

    # -- engine thread ---------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: object) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            # The event loop may already be closed at shutdown; nobody is listening then.
            try:
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (request_id, item))
            except RuntimeError:
                pass

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._stopped
                        and not self._pending_adds
                        and not self._pending_aborts
                        and not self._engine.has_unfinished_requests()
                    ):
                        self._cond.wait(self._idle_timeout_s)
                        # Idle is when nothing else would notice a dead tensor-parallel worker.
                        self._check_health()
                    if self._stopped:
                        return
                    adds = list(self._pending_adds)
                    self._pending_adds.clear()
                    aborts = list(self._pending_aborts)
                    self._pending_aborts.clear()
                for request_id in aborts:
                    self._engine.abort_request(request_id)
                for request_id, prompt_token_ids, params, arrival_time in adds:
                    try:
                        self._engine.add_request(
                            prompt_token_ids,
                            params,
                            request_id=request_id,
                            arrival_time=arrival_time,
                        )
                    except ValueError as exc:  # validated before, but the engine has the last word
                        self._deliver(request_id, EngineError(str(exc), status=400))
                    except QueueFullError as exc:
                        self._deliver(request_id, EngineError(str(exc), status=503))
                if self._engine.has_unfinished_requests():
                    for output in self._engine.step():
                        self._deliver(output.request_id, output)
                        if output.finished:
                            self.release(output.request_id)
                self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - report to every waiting client, then die
            logger.exception("engine loop died")
            with self._cond:
                self._error = exc
                sinks = list(self._sinks)
            for request_id in sinks:
                self._deliver(request_id, EngineError(f"engine failure: {exc!r}", status=500))
            if self._on_failure is not None:
                self._on_failure(exc)

    @property
    def error(self) -> BaseException | None:
        """The exception the engine thread died of, if it did."""
        return self._error

    def _check_health(self) -> None:
        check = getattr(self._engine, "check_health", None)
        if check is not None:
            check()

    def _refresh_stats(self) -> None:
        stats = self._engine.stats()
        self._num_waiting = int(stats["num_waiting"])
        if self._metrics is not None:
            self._metrics.observe_engine(
                running=int(stats["num_running"]),
                waiting=self.num_waiting,
                kv_used=int(stats["num_kv_blocks_used"]),
                kv_total=int(stats["num_kv_blocks"]),
            )
