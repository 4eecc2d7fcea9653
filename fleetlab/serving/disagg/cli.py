"""Disaggregated serving: ``python -m fleetlab disagg`` and ``serve --kv-role prefill|decode``.

    python -m fleetlab disagg --model tiny --port 8000

starts a two-rank ``paddle.distributed.launch`` job -- rank 0 runs ``serve --kv-role decode``
(the OpenAI server, on a loopback port of its own; it pulls each prompt's K/V from the prefill
side), rank 1 ``serve --kv-role prefill`` (the prefill engine's loop,
:func:`~fleetlab.serving.disagg.prefill.serve`) -- and, in this process, the proxy
on ``--host``/``--port`` (:mod:`fleetlab.serving.disagg.proxy`): the client's one address,
answering 503 with a clear message once either rank is gone. Every other option is
``serve``'s and goes to both engines. Ctrl-C / SIGTERM stops the proxy and the job.

vLLM's toy proxy sends each request to the prefill instance with ``max_tokens=1`` and then to the
decode instance with the prefill's ``kv_transfer_params``; FastDeploy's router picks a pair and
sends to both. Here the decode side's own handshake does that routing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


class _DropLine:
    """A stream for :class:`~fleetlab.distributed.launch.NoticeFilter`: passes lines on, less those
    containing ``needle`` (rank 0's own address line: clients use the proxy's)."""

    def __init__(self, out, needle: str):
        self.out, self.needle = out, needle

    def write(self, piece: str) -> None:
        if self.needle not in piece:
            self.out.write(piece)

    def flush(self) -> None:
        self.out.flush()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, watch, timeout: float = 180.0) -> bool:
    """Poll ``url`` until it answers 200 (True) or the job is down / ``timeout`` passes (False)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not watch.poll():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def _proxy_options(ap) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="the proxy's address (the client's one address)")
    ap.add_argument("--port", type=int, default=8000, help="the proxy's port (0: any free port)")


def build_parser():
    """What ``disagg --help`` prints: the proxy's options, then ``serve``'s, which go to both
    engines (their own ``--host``/``--port``/``--kv-role`` are set here)."""
    import argparse

    from fleetlab.serving.cli import build_parser as serve_parser

    ap = argparse.ArgumentParser(prog="python -m fleetlab disagg", description=__doc__, parents=[serve_parser()],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve")
    _proxy_options(ap)
    ap.add_argument("--kv-role", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    """``python -m fleetlab disagg [serve options]``: both roles in one ``paddle.distributed.launch``
    job behind the proxy."""
    import argparse
    import tempfile
    from pathlib import Path

    from fleetlab.distributed.launch import CCACHE_WARNING, QUIET_ENV, NoticeFilter, OutputReader, launch_command
    from fleetlab.serving.disagg.proxy import JobWatch, build_proxy
    from fleetlab.serving.listen import bind

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    ap = argparse.ArgumentParser(add_help=False)
    _proxy_options(ap)
    ours, rest = ap.parse_known_args(argv)
    try:
        sock = bind(ours.host, ours.port)
    except OSError as e:
        print(f"fleetlab disagg: cannot listen on {ours.host}:{ours.port}: {e}", file=sys.stderr)
        return 2
    log_dir = os.environ.get("FLEETLAB_DISAGG_LOG_DIR", f"/tmp/fleetlab-disagg-{os.getpid()}")
    pid_dir = Path(tempfile.mkdtemp(prefix="fleetlab-disagg-pids-"))
    inner = _free_port()
    cmd = launch_command(["fleetlab", "serve", "--kv-role", "by-rank", *rest, "--host", "127.0.0.1",
                          "--port", str(inner)], 2, log_dir)
    env = {**QUIET_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1", "FLEETLAB_DISAGG_PID_DIR": str(pid_dir)}
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), CCACHE_WARNING) if w)
    for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        env.pop(key, None)
    # Its own session, so the launcher and both ranks stop as one; rank 0's output passes through
    # less the notices the ranks print at start (fleetlab.distributed.launch's filter).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    OutputReader(proc.stdout, NoticeFilter(_DropLine(sys.stdout, f":{inner}/v1")))
    watch = JobWatch(proc, pid_dir, log_dir)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if not _wait_healthy(f"http://127.0.0.1:{inner}/health", watch):
            print(f"fleetlab disagg: the job did not come up: {watch.poll() or 'no answer'}", file=sys.stderr)
            return 1
        host, port = sock.getsockname()[:2]
        watch.poll()
        pids = ", ".join(f"{role} pid {pid}" for role, pid in sorted(watch.pids.items()))
        print(f"fleetlab disagg: proxy on http://{host}:{port}/v1 ({pids}) -- Ctrl-C stops", flush=True)
        _run_proxy(build_proxy(f"http://127.0.0.1:{inner}", watch), sock)
        return 0 if watch.poll() is None else 1
    except KeyboardInterrupt:  # stopped before the proxy ran
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        _stop_job(proc)


def _run_proxy(app, sock) -> None:
    """uvicorn on ``sock`` until Ctrl-C / SIGTERM (it takes both signals while it runs)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3))
    previous = {sig: signal.signal(sig, lambda *a: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_job(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
