"""The wall time of each engine step, for the server's metrics, without a sync of its own.

A step that samples reads its tokens back, so the host has waited for its forward when the step
returns. A step that samples nothing (a prompt chunk that does not end its prompt) returns as
soon as its forward is queued: timed on the host, it would count only the launch, and its device
time would land in the step after it. On CUDA each step is therefore timed with two events on the
step's stream, and read once its end event has completed (``take_finished``), a step or more
later; the host is never made to wait. The start event completes when the device reaches it:
at once after a step that sampled, after the previous forward otherwise, so a step's time is its
own and the host work hidden behind the previous forward is not counted twice. On the CPU the
forward runs inside the call, and the host clock is the step's time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepSummary:
    """One step that ran a forward: its kind, scheduled tokens and wall time (from its schedule,
    or from the previous forward's end on a device still busy with it, to its forward's end)."""

    kind: str  # "decode", "prefill" or "combined" (a decode part with a prefill part)
    num_real_tokens: int
    seconds: float


class StepTimer:
    """Each step's time on one device: ``start`` before its schedule, ``finish`` after its
    work is queued, ``take_finished`` for the steps whose forward has ended. One thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._pending: deque[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._finished: list[StepSummary] = []

    def start(self) -> object:
        """A mark taken before the step's schedule."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish(self, start: object, kind: str, num_tokens: int, forward_done: bool) -> None:
        """The step (begun at ``start``) has queued or run all its work; ``forward_done``: the
        host has already waited for its forward (it read sampled tokens), so it is resolved now
        (with every step before it) and reaches the next ``take_finished``, before the outputs
        it produced are delivered."""
        if not self._cuda:
            self._finished.append(StepSummary(kind, num_tokens, time.perf_counter() - start))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((kind, num_tokens, start, end))
        if forward_done:  # only the event itself is left on the device: microseconds
            end.synchronize()

    def take_finished(self, wait: bool = False) -> list[StepSummary]:
        """The steps whose forward has ended since the last call, in step order (a step still
        on the device, and every step after it, waits for a later call); ``wait``: wait for
        every pending step's forward first (the engine is about to idle, so the device has
        nothing else to do and no later call may come soon)."""
        if wait and self._pending:
            self._pending[-1][3].synchronize()  # one stream: the last end is after every other
        while self._pending and self._pending[0][3].query():
            kind, num_tokens, start, end = self._pending.popleft()
            self._finished.append(StepSummary(kind, num_tokens, start.elapsed_time(end) / 1e3))
        finished, self._finished = self._finished, []
        return finished
