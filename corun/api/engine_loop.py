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

Pause (``pause`` / ``resume``, the server's ``POST /pause`` and ``POST /resume``, as vLLM's and
SGLang's RL endpoints): the engine thread stops stepping after its current step; requests in
flight keep their place and KV blocks, new ones are handed to the engine's waiting queue and
aborts are still carried out, so a client that leaves is still aborted. In ``corun`` mode a pause
changes no request's bits (its shapes depend on itself alone, not on when it runs).

Weight updates (``update_weights``, the server's ``POST /update_weights_from_disk``): run on the
engine thread between steps, once no request in the engine has started. While an update waits,
no new request is handed to the engine or admitted by it, and the running ones step to their
end (a drain); then the weights are swapped atomically and the queued requests start on the new
ones. So every request runs all its steps on one set of weights, and its bits are those of a
fresh engine with them. An update while paused with requests in flight cannot drain and is
refused (``WeightUpdateConflict``), as is a second update while one waits.

Failure isolation: an exception while serving one request (adding it, aborting it, routing one
of its outputs) fails that request only (``EngineError`` on its queue, the request aborted in the
engine) and the loop carries on. Only an exception of ``step()`` itself, which cannot be pinned
on one request and may leave the engine half-stepped, ends the loop: every waiting client gets a
500 and ``on_failure`` runs. (Requests are validated to the engine's ranges before they get here,
so a request's own values cannot fail a step.)

The queue limit counts *sequences* (each of a request's ``n`` samples of each prompt is one), as
the engine's waiting queue does, and a request is admitted whole or not at all.

Determinism does not depend on *when* a request reaches the engine: in ``corun`` mode each
request's shapes depend only on itself (DESIGN.md), so the loop needs no ordering guarantees beyond
"every submitted request is eventually added".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from corun.engine import QueueFullError as EngineQueueFullError

if TYPE_CHECKING:
    from corun.api.metrics import ServerMetrics
    from corun.sampling_params import SamplingParams

logger = logging.getLogger("corun.serve")


class QueueFullError(EngineQueueFullError):
    """The waiting queue is at its limit: the server answers 503 instead of queueing."""


class EngineDeadError(RuntimeError):
    """The engine thread died or stopped; the server answers 503 and /health reports it."""


class WeightUpdateConflict(RuntimeError):
    """A weight update that cannot run now (paused with requests in flight, or another update
    waiting); the server answers 409 and nothing changed."""


@dataclass
class _WeightUpdate:
    """A weight update handed to the engine thread; ``done`` is set with a fingerprint or an
    error."""

    weights: Any
    done: threading.Event = field(default_factory=threading.Event)
    fingerprint: str | None = None
    error: BaseException | None = None


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    final_only: bool = False


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
        """``max_queue_len``: waiting sequences at most. ``on_failure(exc)`` runs on the engine
        thread after the engine died and every waiting client got its error (``corun.serve``
        shuts the server down from it)."""
        self._engine = engine
        self.system_fingerprint: str = engine.system_fingerprint
        self._on_failure = on_failure
        self._metrics = metrics
        self.max_queue_len = max_queue_len
        self._idle_timeout_s = idle_timeout_s
        self._cond = threading.Condition()
        self._pending_adds: deque[_Pending] = deque()
        self._pending_seqs = 0  # sequences in _pending_adds
        self._pending_aborts: deque[str] = deque()
        self._sinks: dict[str, _Sink] = {}
        # Requests in the engine that report only their finished output (engine thread only):
        # their inter-token gaps are recorded here when it comes, aborted or not (a client that
        # left no longer reads it).
        self._final_only: set[str] = set()
        self._num_waiting = 0  # the engine's waiting sequences after the last step
        self._stopped = False
        self._paused = False
        self._pause_seen = False  # the engine thread has parked since the pause was asked for
        self._error: BaseException | None = None
        self._update: _WeightUpdate | None = None
        self._thread = threading.Thread(target=self._run, name="corun-engine", daemon=True)

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._refresh_stats()  # the gauges exist from the first scrape on (thread not started yet)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def pause(self) -> None:
        """Stop stepping; returns once the engine thread has finished its current step, so no
        step runs until ``resume``. Blocks for up to one step: call it off the event loop.
        Raises EngineDeadError when the engine thread is gone."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while not self._pause_seen:
                if not self.is_alive or self._stopped:
                    raise EngineDeadError(f"the engine is not running: {self._error!r}")
                self._cond.wait(self._idle_timeout_s)

    def resume(self) -> None:
        """Step again (a no-op when not paused)."""
        with self._cond:
            self._paused = False
            self._pause_seen = False
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def update_weights(self, weights: Any) -> str:
        """Swap the engine's weights (``LLMEngine.update_weights``: named tensors or a
        checkpoint directory) once the requests in flight have finished (module docstring);
        blocks until done and returns the new system fingerprint: call it off the event loop.
        Raises what the engine raised (``CheckpointError`` for a bad update, weights unchanged),
        ``WeightUpdateConflict``, or ``EngineDeadError``."""
        update = _WeightUpdate(weights)
        with self._cond:
            if not self.is_alive or self._stopped:
                raise EngineDeadError(f"the engine is not running: {self._error!r}")
            if self._update is not None:
                raise WeightUpdateConflict("another weight update is in progress")
            self._update = update
            self._cond.notify_all()
        while not update.done.wait(self._idle_timeout_s):
            if not self.is_alive or self._stopped:
                raise EngineDeadError(f"the engine is not running: {self._error!r}")
        if update.error is not None:
            raise update.error
        return update.fingerprint

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def num_waiting(self) -> int:
        """Sequences waiting: not yet handed to the engine, plus the engine's waiting queue."""
        return self._pending_seqs + self._num_waiting

    def submit(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        queue: asyncio.Queue,
        final_only: bool = False,
    ) -> None:
        """Queue ``(request_id, prompt_token_ids, params)`` requests, all or none; items
        ``(request_id, RequestOutput | EngineError)`` arrive on ``queue``: every step's, or with
        ``final_only`` (a response that is not streamed) only the finished one.

        Call from the event loop that reads ``queue``. Raises QueueFullError when the requests'
        sequences would take the waiting ones past ``max_queue_len`` (nothing is queued then),
        EngineDeadError when the engine thread is gone.
        """
        sink = _Sink(asyncio.get_running_loop(), queue)
        num_seqs = sum(params.num_samples for _, _, params in requests)
        now = time.perf_counter()
        with self._cond:
            if not self.is_alive or self._stopped:
                raise EngineDeadError(f"the engine is not running: {self._error!r}")
            limit = self.max_queue_len
            if limit is not None and self.num_waiting + num_seqs > limit:
                raise QueueFullError(
                    f"the waiting queue holds {self.num_waiting} of at most {limit} sequences "
                    f"and this request adds {num_seqs} (prompts x n); retry later"
                )
            for request_id, prompt_token_ids, params in requests:
                self._sinks[request_id] = sink
                self._pending_adds.append(_Pending(request_id, prompt_token_ids, params, now,
                                                   final_only))
            self._pending_seqs += num_seqs
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone): the engine frees its KV; idempotent."""
        with self._cond:
            if self._sinks.pop(request_id, None) is None:
                return
            # Not handed to the engine yet: drop it here, the engine never hears of it.
            for entry in self._pending_adds:
                if entry.request_id == request_id:
                    self._pending_adds.remove(entry)
                    self._pending_seqs -= entry.params.num_samples
                    return
            self._pending_aborts.append(request_id)
            self._cond.notify_all()

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        with self._cond:
            self._sinks.pop(request_id, None)

    @property
    def error(self) -> BaseException | None:
        """The exception the engine thread died of, if it did."""
        return self._error

    # -- engine thread ---------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: object) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            # The event loop may already be closed at shutdown; nobody is listening then.
            try:
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (request_id, item))
            except RuntimeError:
                pass

    def _fail_request(self, request_id: str, exc: BaseException, status: int = 500) -> None:
        """One request failed: its client gets the error, the engine drops it, the rest go on."""
        if status >= 500:
            logger.error("request %s failed: %r", request_id, exc, exc_info=exc)
        self._deliver(request_id, EngineError(f"{type(exc).__name__}: {exc}", status=status))
        self.release(request_id)
        try:
            self._engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - it may never have reached the engine
            logger.exception("could not abort failed request %s", request_id)

    def _take_work(self) -> tuple[list[_Pending], list[str], bool, _WeightUpdate | None] | None:
        """Wait for work: (requests to add, aborts, paused, the waiting weight update); None
        when stopped. While paused, only adds, aborts and an update are work (``pause`` waits
        for this thread to get here); while an update waits, adds stay pending."""
        with self._cond:
            while True:
                if self._paused and not self._pause_seen:
                    self._pause_seen = True
                    self._cond.notify_all()
                if (self._stopped or self._pending_aborts or self._update is not None
                        or self._pending_adds
                        or (not self._paused and self._engine.has_unfinished_requests())):
                    break
                # (notify_all everywhere: pause() waits on this condition too)
                self._cond.wait(self._idle_timeout_s)
                # Idle is when nothing else would notice a dead tensor-parallel worker.
                self._check_health()
            if self._stopped:
                return None
            update = self._update
            adds = [] if update is not None else list(self._pending_adds)
            if update is None:
                self._pending_adds.clear()
                self._pending_seqs = 0
            aborts = list(self._pending_aborts)
            self._pending_aborts.clear()
            # Counted as the engine's waiting until the next stats refresh, so a burst of
            # submissions cannot slip past the limit in between.
            self._num_waiting += sum(entry.params.num_samples for entry in adds)
            return adds, aborts, self._paused, update

    def _add(self, entry: _Pending) -> None:
        try:
            self._engine.add_request(
                entry.prompt_token_ids,
                entry.params,
                request_id=entry.request_id,
                arrival_time=entry.arrival_time,
                final_only=entry.final_only,
            )
            if entry.final_only:
                self._final_only.add(entry.request_id)
            return
        except ValueError as exc:  # validated before, but the engine has the last word
            failure, status = exc, 400
        except EngineQueueFullError as exc:
            failure, status = exc, 503
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the engine's
            failure, status = exc, 500
        with self._cond:  # it never joined the engine's queue: stop counting it as waiting
            self._num_waiting -= entry.params.num_samples
        self._fail_request(entry.request_id, failure, status)

    def _route(self, output: Any, batch: dict[asyncio.AbstractEventLoop, list]) -> None:
        """Add ``output`` to ``batch`` (per event loop, its queues' items in step order)."""
        request_id = output.request_id
        try:
            finished = output.finished
            if finished and request_id in self._final_only:
                self._final_only.discard(request_id)
                self._observe_gaps(output)
            sink = self._sinks.get(request_id)
            if sink is not None:
                batch.setdefault(sink.loop, []).append((sink.queue, (request_id, output)))
            if finished:
                self.release(request_id)
        except Exception as exc:  # noqa: BLE001 - one request's output, not the engine's
            self._fail_request(request_id, exc)

    @staticmethod
    def _flush(batch: dict[asyncio.AbstractEventLoop, list]) -> None:
        """Hand a step's outputs over: one wake-up of each event loop a step, not one an output
        (every thread-safe call writes to the loop's self-pipe, on this thread, under the GIL
        the event loop needs too)."""
        for loop, items in batch.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop closed at shutdown: nobody is listening
                pass

    def _observe_gaps(self, output: Any) -> None:
        """The inter-token gaps of a final-only request's samples: between the engine's commit
        times of their tokens (a stream's are recorded as the server receives its steps)."""
        if self._metrics is None:
            return
        for completion in output.outputs:
            times = getattr(completion, "token_times", None) or []
            for earlier, later in itertools.pairwise(times):
                self._metrics.observe_itl(later - earlier)

    def _run(self) -> None:
        try:
            while (work := self._take_work()) is not None:
                adds, aborts, paused, update = work
                for request_id in aborts:
                    try:
                        self._engine.abort_request(request_id)
                    except Exception:  # noqa: BLE001 - the client is gone anyway
                        logger.exception("abort of request %s failed", request_id)
                for entry in adds:
                    self._add(entry)
                stepping = not paused and self._engine.has_unfinished_requests()
                if update is not None:
                    stepping = self._drain_for(update, paused)
                outputs = self._engine.step() if stepping else []
                # Before routing: a client that gets its last token and sends the next request
                # at once must see the queue as this step left it.
                self._refresh_stats()
                # About to idle (nothing left, or paused): a step that sampled nothing, the
                # last before an abort or a pause, is counted now rather than at the next work.
                self._observe_steps(
                    wait=not stepping or not self._engine.has_unfinished_requests())
                batch: dict[asyncio.AbstractEventLoop, list] = {}
                for output in outputs:
                    self._route(output, batch)
                self._flush(batch)
        except BaseException as exc:  # noqa: BLE001 - report to every waiting client, then die
            logger.exception("engine loop died")
            with self._cond:
                self._error = exc
                sinks = list(self._sinks)
            for request_id in sinks:
                self._deliver(request_id, EngineError(f"engine failure: {exc!r}", status=500))
            if self._on_failure is not None:
                self._on_failure(exc)

    def _drain_for(self, update: _WeightUpdate, paused: bool) -> bool:
        """One iteration of a waiting weight update: apply it if no request has started, refuse
        it if paused with requests in flight, else hold admissions and step (True) to let the
        running requests finish."""
        engine = self._engine
        if engine.has_started_requests() and not paused:
            engine.hold_admissions(True)
            return True
        try:
            if engine.has_started_requests():
                raise WeightUpdateConflict(
                    "the server is paused with requests in flight, which would run on two sets "
                    "of weights: /resume to let them finish (the update waits for them), or "
                    "abort them")
            update.fingerprint = engine.update_weights(update.weights)
            self.system_fingerprint = update.fingerprint
        except Exception as exc:  # noqa: BLE001 - the caller's error; the engine is unchanged
            update.error = exc
        finally:
            engine.hold_admissions(False)
            with self._cond:
                self._update = None
                self._cond.notify_all()
            update.done.set()
        return False

    def _check_health(self) -> None:
        check = getattr(self._engine, "check_health", None)
        if check is not None:
            check()

    def _observe_steps(self, wait: bool) -> None:
        """The steps whose forward has ended (a step that sampled nothing may still run on the
        device: corun.step_timing), counted before the outputs they produced are routed;
        ``wait``: every step, waiting for the device (the loop is about to idle)."""
        timer = self._engine.step_timer
        if timer is None:  # an engine built without time_steps
            return
        for step in timer.take_finished(wait=wait):
            if self._metrics is not None:
                self._metrics.observe_step(step.kind, step.num_real_tokens, step.seconds)

    def _refresh_stats(self) -> None:
        stats = self._engine.stats()
        with self._cond:
            self._num_waiting = int(stats["num_waiting"])
        if self._metrics is not None:
            self._metrics.observe_engine(
                running=int(stats["num_running"]),
                waiting=self.num_waiting,
                kv_used=int(stats["num_kv_blocks_used"]),
                kv_total=int(stats["num_kv_blocks"]),
            )
            self._metrics.observe_prefix_cache(int(stats.get("prefix_cache_queries", 0)),
                                               int(stats.get("prefix_cache_hits", 0)))
