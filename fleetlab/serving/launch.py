"""Start a server in the background: in a thread of this process, or as a separate process.

- :class:`ServerThread` runs uvicorn on a thread, on a free loopback port, around an
  ``AsyncLLM`` you built (tests, README examples: no second copy of the model).
- :class:`ServerProcess` runs ``python -m fleetlab serve ...`` as a child process and waits
  until ``/health`` answers (notebooks, ``bench serve``: the server's CPU time is its own).

Both are context managers and have ``url`` (``http://127.0.0.1:PORT``), ``base_url`` (``url +
"/v1"``, what an OpenAI client wants) and ``stop()``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


class _Server:
    url: str

    @property
    def base_url(self) -> str:
        """``url + "/v1"``: what an OpenAI client's ``base_url`` wants."""
        return self.url + "/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class ServerThread(_Server):
    """uvicorn serving ``build_app(engine, model_name)`` on a daemon thread.

    Args:
      engine: an ``AsyncLLM``; stopped by :meth:`stop` only with ``shutdown_engine=True``.
      model_name: the name clients use.
      host, port: where to listen (port 0: any free port; ``url`` says which).
      api_key: as ``serve --api-key``; shutdown_timeout: as ``serve --shutdown-timeout``;
      cors: ``build_app``'s (``CORSMiddleware`` keywords, as ``serve --allowed-origins ...``).
    """

    def __init__(self, engine, model_name: str = "tiny", host: str = "127.0.0.1", port: int = 0,
                 shutdown_engine: bool = True, verbose: bool = False, timeout: float = 30.0,
                 api_key: str | None = None, shutdown_timeout: float = 0.0, cors: dict | None = None):
        from fleetlab.serving.app import build_app
        from fleetlab.serving.listen import bind, uvicorn_server

        self.engine, self.shutdown_engine = engine, shutdown_engine
        self.app = build_app(engine, model_name, api_key=api_key, cors=cors)
        self._sock = bind(host, port)
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn_server(self.app, verbose, shutdown_timeout)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ServerThread: uvicorn did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop uvicorn as Ctrl-C stops ``serve`` (:mod:`fleetlab.serving.shutdown`) and, if asked, the engine."""
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()
        if self.shutdown_engine:
            self.engine.shutdown()


class ServerProcess(_Server):
    """``python -m fleetlab serve ARGS --port 0`` in a child process, ready when ``/health`` says so.

    Args:
      args: the ``serve`` options, e.g. ``["--model", "tiny", "--max-num-seqs", "32"]``.
      timeout: seconds to wait for the server to come up.
      log: file for the server's output (default: a temporary file; ``log_text()`` reads it).
    """

    def __init__(self, args=(), timeout: float = 120.0, log: str | os.PathLike | None = None,
                 python: str | None = None):
        args = list(args)
        if "--port" not in args:
            args += ["--port", "0"]
        if log is None:
            fd, log = tempfile.mkstemp(prefix="fleetlab-serve-", suffix=".log")
            os.close(fd)
        self.log = Path(log)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([python or sys.executable, "-m", "fleetlab", "serve", *args],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.url = self._wait_for_address(timeout)
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        """What the server printed so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")

    def _wait_for_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"on (http://[^\s/]+)/v1", self.log_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"fleetlab serve exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"fleetlab serve printed no address within {timeout} s:\n{self.log_text()[-3000:]}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"fleetlab serve exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"fleetlab serve at {self.url} was not healthy within {timeout} s")

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGINT) -> int | None:
        """Ask the server to stop (``sig``: SIGINT, as Ctrl-C), kill it if it lingers; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
