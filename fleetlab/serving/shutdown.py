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
nothing logged per request. A second Ctrl-C skips the wait of stage 2.
"""

from __future__ import annotations

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
        await super().shutdown(sockets)
