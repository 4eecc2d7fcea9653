"""How the server stops: drain, then end what is left with an error, then close.

uvicorn stops on SIGINT / SIGTERM (or ``server.should_exit = True``) by closing its listening
sockets and waiting for open connections to finish; past ``timeout_graceful_shutdown`` it cancels
their tasks, and each cancelled request handler is logged as an "Exception in ASGI application"
traceback while its client sees the connection drop. For a server whose streams run for minutes
that is the common case, not the exception. :class:`DrainingServer` inserts one stage before
uvicorn's own wait:

1. stop listening, answer new requests (on connections already open) and ``/health`` with 503;
2. let the requests running finish, for up to ``shutdown_timeout`` seconds (0: none);
3. abort the engine requests of every one left: a stream ends with an error event and
   ``data: [DONE]``, a whole response is a 503 (:meth:`OpenAIServing.drain`).

Then every handler returns on its own and uvicorn's wait ends at once: nothing is cancelled,
nothing logged per request. A second Ctrl-C skips the wait of stage 2, quietly: uvicorn, told
to force its exit, would stop waiting for the handlers and skip the app's lifespan shutdown,
whose task asyncio then cancels with a ``CancelledError`` traceback; here the handlers, already
ended by stage 3, are given their moment to send their last event, and the lifespan is shut
down all the same.
"""

from __future__ import annotations

import asyncio
import time

import uvicorn


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` for an app built by :func:`~fleetlab.serving.app.build_app` (see the module
    docstring). ``serving``: the app's ``OpenAIServing`` (``app.state.serving``);
    ``shutdown_timeout``: seconds in-flight requests may take to finish once told to stop."""

    def __init__(self, config: uvicorn.Config, serving, shutdown_timeout: float = 0.0):
        super().__init__(config)
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout={shutdown_timeout} must be >= 0")
        self.serving, self.shutdown_timeout = serving, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting connections (uvicorn does it again: harmless)
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.serving.drain(self.shutdown_timeout, lambda: self.force_exit)
        await self._handlers_done(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skipped it (see the module docstring)
            await self.lifespan.shutdown()

    async def _handlers_done(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) for the request handlers, each ended by the drain, to return."""
        deadline = time.monotonic() + timeout
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
