"""The ``disagg`` proxy: the client's one address in front of the prefill + decode job.

It forwards every request to the decode rank's OpenAI server (which pulls each prompt's K/V
from the prefill rank) and streams the answer back byte for byte, and it watches both
processes. Once either is gone (killed, crashed, or stopped by the launcher after its peer
died: ``paddle.distributed.launch`` ends the whole job when one rank fails) every request
gets **503** with a message naming the process, at once: a new one before it is forwarded, one
in flight as soon as the watch sees the death (a stream that has started gets an ``error``
event and ``[DONE]``). It never waits on a dead rank. The proxy keeps answering 503 until it
is stopped; restarting the job is the operator's move.

A rank's death also stops its peer: the launcher sends the decode rank SIGTERM, and its server
ends the streams it still holds with its own "the server is shutting down" error, which would
reach the client before the proxy's watch names the rank that died. So an upstream
``shutting_down`` error (a stream's event or a whole 503) is answered with the watch's reason
instead, waiting up to ``NAME_WAIT_S`` for the watch to see the death; only a decode server
stopped on its own (the job still up) passes its message through.

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
NAME_WAIT_S = 3.0  # how long an upstream shutdown waits for the watch to name the rank that died
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


def shutting_down(payload: bytes) -> bool:
    """Whether ``payload`` (an SSE event or a response body) is the decode server's own shutdown error."""
    if b"shutting_down" not in payload:
        return False
    text = payload.decode("utf-8", "replace").strip()
    text = text[len("data:"):].strip() if text.startswith("data:") else text
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "shutting_down"


async def why_down(watch: JobWatch, wait: float = NAME_WAIT_S) -> str | None:
    """The watch's reason the job is down, waiting up to ``wait`` seconds for it to see a death
    (the peer's shutdown can come first); None if the job is still up."""
    deadline = asyncio.get_running_loop().time() + wait
    while watch.poll() is None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(POLL_S / 4)
    return watch.poll()


def build_proxy(upstream: str, watch: JobWatch, transport=None):
    """A Starlette app forwarding every path to ``upstream`` (``http://host:port``) while ``watch``
    is up. ``transport``: httpx's, for tests (an ``httpx.ASGITransport`` standing in for the rank)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from fleetlab.serving.errors import error_body

    gone = asyncio.Event()
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=5.0), transport=transport)

    def unavailable(why: str) -> JSONResponse:
        return JSONResponse(error_body(why, "engine_dead", code="service_unavailable"), status_code=503)

    def error_event(why: str) -> bytes:
        err = error_body(why, "engine_dead", code="service_unavailable")
        return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()

    async def forward(request):
        if watch.poll():
            return unavailable(watch.down)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        up = client.build_request(request.method, request.url.path, params=request.query_params, headers=headers,
                                  content=await request.body())
        try:
            resp = await _or_gone(client.send(up, stream=True), gone)
        except (Gone, httpx.TransportError) as exc:
            return unavailable(await why_down(watch) or f"the decode engine stopped answering ({type(exc).__name__})")
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        keep = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
        if resp.status_code == 503 and not sse:  # a whole answer: the decode server's shutdown?
            content = await resp.aread()
            await resp.aclose()
            why = await why_down(watch) if shutting_down(content) else None
            return unavailable(why) if why else Response(content, status_code=503, headers=keep)

        async def body():
            chunks, pending = resp.aiter_raw(), b""
            try:
                while True:
                    try:
                        chunk = await _or_gone(chunks.__anext__(), gone)
                    except StopAsyncIteration:
                        if pending:
                            yield pending
                        return
                    if not sse:
                        yield chunk
                        continue
                    *events, pending = (pending + chunk).split(b"\n\n")  # whole events only
                    for event in events:
                        why = await why_down(watch) if shutting_down(event) else None
                        if why:  # the peer's shutdown, not the reason: name the rank that died
                            yield error_event(why)
                            return
                        yield event + b"\n\n"
            except (Gone, httpx.TransportError) as exc:
                why = await why_down(watch) or f"the decode engine stopped answering ({type(exc).__name__})"
                if sse:  # the status went out already: the stream ends with the error
                    yield error_event(why)
            finally:
                await resp.aclose()

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
