"""Start a tensor-parallel job from Python: ``paddle.distributed.launch`` in a subprocess.

Tests, notebooks, ``bench tp`` and ``demo --tensor-parallel-size N`` use it; by hand the
same job is one shell line::

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir /tmp/fleetlab-tp \\
        python -m fleetlab demo --tensor-parallel-size 2

The launcher starts one process per rank (``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM`` set),
prints rank 0's output, writes every rank's to ``<log_dir>/workerlog.<rank>``, and stops
the job as soon as one rank fails (measured with Paddle 3.3.1: a rank killed while its peer
computes ends the job in about 5 s; a peer blocked in a gloo all-reduce gets an error at
once, as the dead rank's socket closes; a rank that hangs without dying trips gloo's own
30 s timeout).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class LaunchResult:
    """A finished launch: exit code, rank 0's output (and the launcher's), seconds, every
    rank's log by rank, and the command that ran."""

    returncode: int
    output: str
    seconds: float
    worker_logs: dict[int, str]
    command: list[str]


def launch_command(module_args: list[str], nproc: int, log_dir: str | os.PathLike) -> list[str]:
    """``python -m paddle.distributed.launch ... python -m <module_args>`` as an argv list."""
    return [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
            "--log_dir", str(log_dir), "--log_level", "WARNING", sys.executable, "-m", *module_args]


def launch(module_args: list[str], nproc: int, *, log_dir: str | os.PathLike | None = None,
           timeout: float = 300, threads_per_rank: int = 1, env: dict | None = None,
           stream: bool = False) -> LaunchResult:
    """Run ``python -m <module_args>`` on ``nproc`` ranks and wait for the job to end.

    ``threads_per_rank`` sets ``OMP_NUM_THREADS`` in each rank (on a 2-core machine two
    ranks of one thread each use both cores). ``stream=True`` lets rank 0's output through
    to this process's stdout instead of capturing it. Raises ``subprocess.TimeoutExpired``
    after ``timeout`` seconds (the job is killed first).
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="fleetlab-tp-"))
    cmd = launch_command(module_args, nproc, log_dir)
    run_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):  # a launch from inside a launch starts afresh
        run_env.pop(key, None)
    t0 = time.perf_counter()
    # Its own session: on a timeout the launcher and every rank it started go down together.
    proc = subprocess.Popen(cmd, env=run_env, text=True, stdout=None if stream else subprocess.PIPE,
                            stderr=None if stream else subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    seconds = time.perf_counter() - t0
    logs = {}
    for path in sorted(log_dir.glob("workerlog.*")):
        suffix = path.name.rsplit(".", 1)[-1]
        if suffix.isdigit():
            logs[int(suffix)] = path.read_text(errors="replace")
    return LaunchResult(proc.returncode, output or "", seconds, logs, cmd)


def shell_line(cmd: list[str]) -> str:
    """``cmd`` as one copy-pasteable shell line."""
    return " ".join(shlex.quote(c) for c in cmd)
