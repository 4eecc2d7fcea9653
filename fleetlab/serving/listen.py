"""Where a server listens: a bound socket, and the uvicorn server that serves an app on it.

Shared by ``python -m fleetlab serve`` (:mod:`fleetlab.serving.cli`), the background servers of
:mod:`fleetlab.serving.launch` and the disaggregated job (:mod:`fleetlab.serving.disagg.cli`). The
socket is bound before the engine is built, so a port already taken is refused at once.
"""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app, verbose: bool = False, shutdown_timeout: float = 0.0):
    """A :class:`~fleetlab.serving.shutdown.DrainingServer` for ``app``: warnings only unless
    ``verbose`` (then uvicorn's INFO lines and one access line per request)."""
    import uvicorn

    from fleetlab.serving.shutdown import DrainingServer

    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=3, lifespan="on")
    return DrainingServer(config, app.state.serving, shutdown_timeout)
