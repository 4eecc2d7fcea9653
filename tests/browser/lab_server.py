"""Start JupyterLab on a free localhost port, with no token, and always stop it again.

The server runs from the test's own Python (``sys.executable -m jupyter lab``) in its own
process group, with its settings, workspaces and runtime files in a temporary folder so
that neither the user's JupyterLab setup nor the network is touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# User settings that make the page deterministic and keep it off the network:
# every cell stays attached to the DOM (so off-screen widgets render and can be found),
# and no news or update checks are fetched.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}


# Talk to the local server directly, whatever http_proxy a CI machine sets.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_lab_settings(settings_dir: Path) -> None:
    """Write :data:`LAB_SETTINGS` as JupyterLab user-settings files under ``settings_dir``."""
    for relative, values in LAB_SETTINGS.items():
        path = settings_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@dataclass(slots=True)
class LabServer:
    """One JupyterLab process serving ``root_dir``; ``state_dir`` holds its settings and log."""

    root_dir: Path
    state_dir: Path
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path = field(init=False)

    def __post_init__(self):
        self.log_path = self.state_dir / "jupyterlab.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0, attempts: int = 3) -> LabServer:
        """Start the server and wait until its REST API answers.

        A server that dies at once (say, another process took the port in between) is retried
        on a new port; one that is merely slow keeps the whole ``timeout_s``.
        """
        write_lab_settings(self.state_dir / "settings")
        deadline = time.monotonic() + timeout_s
        for _ in range(attempts):
            self.port = free_port()
            self._spawn()
            if self._wait_ready(deadline):
                return self
            self.stop()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"JupyterLab did not answer within {timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)  # the kernel must use the inline backend, not a test's Agg
        env.update(JUPYTERLAB_SETTINGS_DIR=str(self.state_dir / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.state_dir / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self.state_dir / "runtime"),
                   JUPYTER_CONFIG_DIR=str(self.state_dir / "config"),
                   IPYTHONDIR=str(self.state_dir / "ipython"))
        command = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
                   f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={self.root_dir}",
                   "--IdentityProvider.token=", "--ServerApp.password=",
                   "--ServerApp.allow_root=True",  # CI containers run as root
                   "--ServerApp.terminals_enabled=False",
                   "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                   "--LabApp.news_url=None"]
        with open(self.log_path, "ab") as log:
            # Own process group, so stop() can end the server and anything it forked.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=self.root_dir, start_new_session=True)

    def _wait_ready(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with _DIRECT.open(f"{self.url}/api/status", timeout=5) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        return False

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's process group; on SIGTERM the server first shuts its kernels down.

        Kernels run in sessions of their own (jupyter_client starts them so), so any child
        still alive after the server has gone is ended by its pid.
        """
        if self.process is None:
            return
        children = _children(self.process.pid)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=grace_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        for child in children:
            _end(child, grace_s)
        self.process = None

    def log_tail(self, num_chars: int = 3000) -> str:
        """The end of the server's log, for error messages."""
        if not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-num_chars:]


def _children(pid: int) -> list:
    """The live descendants of ``pid`` (kernels included), or [] without psutil."""
    try:
        import psutil
    except ImportError:  # ipykernel needs psutil, so this is rare: rely on the server's own cleanup
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _end(child, grace_s: float) -> None:
    """Terminate one psutil process that outlived the server, killing it if it lingers."""
    import psutil

    try:
        child.terminate()
        child.wait(timeout=grace_s)
    except psutil.TimeoutExpired:
        child.kill()
    except psutil.NoSuchProcess:
        pass
