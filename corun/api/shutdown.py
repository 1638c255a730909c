"""Graceful shutdown: uvicorn's server with a drain between the signal and the exit.

uvicorn alone, on SIGTERM, stops accepting connections, waits ``timeout_graceful_shutdown`` for
the open ones, cancels what remains (a client mid-stream gets an empty reply: no error event, no
``[DONE]``) and re-raises the signal, so the process exits 143. ``DrainingServer`` instead:

1. on the first SIGTERM or SIGINT, starts ``ServerState.drain``: new requests get 503 with
   ``Retry-After`` (the port stays open, so clients get an answer, not a refused connection) and
   ``/health`` turns 503, while the requests in flight run on;
2. once none is left, or at ``shutdown_timeout_s``, when the rest are ended with an error event
   and ``[DONE]`` (streams) or an error body, it lets uvicorn shut down (the engine thread stops,
   the engine closes) and the process exits 0;
3. a second signal exits at once, as uvicorn's second Ctrl+C does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from corun.api.server import ServerState

logger = logging.getLogger("corun.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit (status 143).
        if self._loop is None or self.should_exit or self._signalled:
            logger.warning("signal %s again: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self._signalled = True
        logger.info("signal %s: draining (at most %.1f s)", signal.Signals(sig).name,
                    self.shutdown_timeout_s)
        # A signal handler may run in the middle of the loop's own code: hand over to the loop.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.shutdown_timeout_s)
        finally:
            self.should_exit = True
