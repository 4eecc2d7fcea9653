"""The ``disagg`` proxy: the client's one address in front of the prefill + decode job.

It forwards every request to the decode rank's OpenAI server (which pulls each prompt's K/V
from the prefill rank) and streams the answer back byte for byte, and it watches both
processes. Once either is gone (killed, crashed, or stopped by the launcher after its peer
died: ``paddle.distributed.launch`` ends the whole job when one rank fails) every request
gets **503** with a message naming the process, at once: a new one before it is forwarded, one
in flight as soon as the watch sees the death (a stream that has started gets an ``error``
event and ``[DONE]``). It never waits on a dead rank. The proxy keeps answering 503 until it
is stopped; restarting the job is the operator's move.

vLLM's ``disagg_proxy_server.py`` (its examples) forwards to a prefill and a decode instance;
FastDeploy's router and SGLang's ``mini_lb`` pick the pair. Here the decode side routes to the
prefill side itself (the handshake), so the proxy has one upstream and two processes to watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ROLES = {"prefill": 1, "decode": 0}  # role -> rank in the job
POLL_S = 0.2
# Hop-by-hop headers and those the body's new framing replaces.
_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def alive(pid: int) -> bool:
    """The process exists and is no zombie (a killed rank stays one until the launcher reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        import os

        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass
class JobWatch:
    """Which of the job's processes are alive: the launcher and the two ranks, whose pids the
    ranks write as ``<pid_dir>/<role>.pid`` when they start (:func:`write_pid`)."""

    launcher: object  # a subprocess.Popen
    pid_dir: Path
    log_dir: str = ""
    down: str | None = None  # why the job is down (None while it is up)
    pids: dict = field(default_factory=dict)

    def poll(self) -> str | None:
        """Look once; the first death seen is the one named from then on."""
        if self.down is None:
            for role in ROLES:
                path = self.pid_dir / f"{role}.pid"
                if role not in self.pids and path.exists() and path.read_text().strip():
                    self.pids[role] = int(path.read_text())
            for role, pid in self.pids.items():
                if not alive(pid):
                    self.down = (f"the {role} engine (rank {ROLES[role]}, pid {pid}) exited; the disaggregated "
                                 f"job is down: restart `python -m fleetlab disagg` (rank logs: {self.log_dir})")
                    break
            else:
                if self.launcher.poll() is not None:
                    self.down = (f"the disaggregated job ended (exit code {self.launcher.returncode}); restart "
                                 f"`python -m fleetlab disagg` (rank logs: {self.log_dir})")
            if self.down:
                logger.warning("disagg proxy: %s", self.down)
        return self.down


def write_pid(role: str) -> None:
    """A rank of the job: write its pid where the proxy looks (``FLEETLAB_DISAGG_PID_DIR``)."""
    import os

    pid_dir = os.environ.get("FLEETLAB_DISAGG_PID_DIR")
    if pid_dir:
        tmp = Path(pid_dir, f".{role}.pid")
        tmp.write_text(str(os.getpid()))
        tmp.replace(Path(pid_dir, f"{role}.pid"))


class Gone(Exception):
    """The job went down while a request waited on it."""


async def _or_gone(awaitable, gone: asyncio.Event):
    """``await awaitable``, unless the job goes down first (then :class:`Gone`)."""
    task, stop = asyncio.ensure_future(awaitable), asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise Gone
    finally:  # also when this wait is cancelled (the client hung up, the server stops)
        stop.cancel()
        task.cancel()
        # An abandoned read may still fail as it ends (a dying rank closed its socket): an error
        # answered already, not one for asyncio to log as never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def build_proxy(upstream: str, watch: JobWatch):
    """A Starlette app forwarding every path to ``upstream`` (``http://host:port``) while ``watch`` is up."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from fleetlab.serving.errors import error_body

    gone = asyncio.Event()
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=5.0))

    def unavailable(why: str) -> JSONResponse:
        return JSONResponse(error_body(why, "engine_dead", code="service_unavailable"), status_code=503)

    async def forward(request):
        if watch.poll():
            return unavailable(watch.down)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        up = client.build_request(request.method, request.url.path, params=request.query_params, headers=headers,
                                  content=await request.body())
        try:
            resp = await _or_gone(client.send(up, stream=True), gone)
        except (Gone, httpx.TransportError) as exc:
            return unavailable(watch.poll() or f"the decode engine stopped answering ({type(exc).__name__})")
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")

        async def body():
            chunks = resp.aiter_raw()
            try:
                while True:
                    try:
                        yield await _or_gone(chunks.__anext__(), gone)
                    except StopAsyncIteration:
                        return
            except (Gone, httpx.TransportError) as exc:
                why = watch.poll() or f"the decode engine stopped answering ({type(exc).__name__})"
                if sse:  # the status went out already: the stream ends with the error
                    err = error_body(why, "engine_dead", code="service_unavailable")
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()

        keep = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
        return StreamingResponse(body(), status_code=resp.status_code, headers=keep)

    async def watch_loop():
        while not watch.poll():
            await asyncio.sleep(POLL_S)
        gone.set()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.ensure_future(watch_loop())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)
