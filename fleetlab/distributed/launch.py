"""Start a tensor-parallel job from Python: ``paddle.distributed.launch`` in a subprocess.

Tests, notebooks, ``bench tp`` and ``demo --tensor-parallel-size N`` use it; by hand the
same job is one shell line::

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir /tmp/fleetlab-tp \\
        python -m fleetlab demo --tensor-parallel-size 2

The launcher starts one process per rank (``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM`` set),
prints rank 0's output, writes every rank's to ``<log_dir>/workerlog.<rank>``, and stops
the job as soon as one rank fails (measured with Paddle 3.3.1: a rank killed while its peer
computes ends the job in 1-5 s, the launcher's SIGTERM stopping the peer; a peer blocked in a
gloo all-reduce gets an error at once, as the dead rank's socket closes; a rank that hangs
without dying trips gloo's own 30 s timeout).

What the launcher and the ranks print besides the program's own output says nothing to a
fleetlab user, so it is kept out unless ``FLEETLAB_LIBRARY_NOTICES=1`` asks for every library
notice (as :mod:`fleetlab.lab.quiet` does in one process): Paddle's C++ INFO lines (glog, the
gloo store connecting), the launcher's own ``import paddle`` warning about ``ccache``, and the
"Modified FLAGS detected" block ``init_parallel_env`` writes. Every rank's log keeps the rest.
"""

from __future__ import annotations

import codecs
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Set (not "0"): show every library notice, in the ranks too (the lab's quiet mode, fleetlab.lab.quiet, reads it).
NOTICES_ENV = "FLEETLAB_LIBRARY_NOTICES"

# Environment that silences the launcher's and the ranks' notices at their source.
QUIET_ENV = {"GLOG_minloglevel": "1"}  # glog: WARNING and up
CCACHE_WARNING = "ignore:No ccache found"  # a PYTHONWARNINGS entry (message prefix)


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
    ranks of one thread each use both cores). ``stream=True`` also passes rank 0's output on
    to this process's stdout as it comes, less the library notices (see the module docstring);
    ``LaunchResult.output`` holds all of it either way. Raises ``subprocess.TimeoutExpired``
    after ``timeout`` seconds (the job is killed first).
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="fleetlab-tp-"))
    cmd = launch_command(module_args, nproc, log_dir)
    run_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):  # a launch from inside a launch starts afresh
        run_env.pop(key, None)
    quiet = run_env.get(NOTICES_ENV, "") in ("", "0")
    if quiet:
        run_env = {**QUIET_ENV, **run_env}
        run_env["PYTHONWARNINGS"] = ",".join(w for w in (run_env.get("PYTHONWARNINGS"), CCACHE_WARNING) if w)
    t0 = time.perf_counter()
    # Its own session: on a timeout the launcher and every rank it started go down together.
    proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    reader = OutputReader(proc.stdout, NoticeFilter(sys.stdout, drop=quiet) if stream else None)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        reader.join()
    seconds = time.perf_counter() - t0
    logs = {}
    for path in sorted(log_dir.glob("workerlog.*")):
        suffix = path.name.rsplit(".", 1)[-1]
        if suffix.isdigit():
            logs[int(suffix)] = path.read_text(errors="replace")
    output = reader.text()
    if proc.returncode != 0 and (missing := failure_summary(proc.returncode, logs, output, log_dir)):
        output += missing  # the launcher tails only the rank it saw fail first, and may miss the others' last lines
        if stream:
            sys.stdout.write(missing)
            sys.stdout.flush()
    return LaunchResult(proc.returncode, output, seconds, logs, cmd)


def failure_summary(returncode: int, logs: dict[int, str], output: str, log_dir) -> str:
    """What a failed job's output lacks: each rank's last error that the launcher did not pass on
    (one line each), or, when no rank wrote one, that a rank was killed; "" when nothing is missing."""
    errors = {rank: err for rank, log in sorted(logs.items()) if (err := last_error(log)) is not None}
    lines = [f"  rank {rank}: {err}" for rank, err in errors.items() if err not in output]
    if not errors:
        lines = [f"  no rank wrote an error: one was killed or exited silently (logs: {log_dir})"]
    return f"fleetlab: the job failed (exit status {returncode}); from the ranks' logs:\n" + "\n".join(lines) + "\n" \
        if lines else ""


def last_error(log: str) -> str | None:
    """The exception line that ends a log's last Python traceback (None: the log holds none)."""
    _, found, tail = log.rpartition("Traceback (most recent call last):")
    lines = [line for line in tail.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    return lines[-1] if found and lines else None


class OutputReader(threading.Thread):
    """Reads a pipe to its end on a thread of its own, keeping everything and passing it on
    to ``show`` (a :class:`NoticeFilter`, or None) as it arrives."""

    def __init__(self, pipe, show):
        super().__init__(daemon=True)
        self.pipe, self.show, self.chunks = pipe, show, []
        self.start()

    def run(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(self.pipe.fileno(), 1 << 16):
            text = decoder.decode(chunk)
            self.chunks.append(text)
            if self.show is not None:
                self.show.write(text)
        if self.show is not None:
            self.show.finish()
        self.pipe.close()

    def text(self) -> str:
        return "".join(self.chunks)


class NoticeFilter:
    """Passes text on to the stream ``out`` less (with ``drop``) the "Modified FLAGS detected"
    block that ``paddle.distributed.init_parallel_env`` writes (a heading, one line per flag,
    a rule of ``=``).

    Text goes on piece by piece as each piece ends, at a newline or a carriage return (so a
    progress bar's updates pass as they come); ``finish`` passes on what is left.
    """

    def __init__(self, out, drop: bool = True):
        self.out, self.drop, self.pending, self.skipping = out, drop, "", False

    def write(self, text: str) -> None:
        *pieces, self.pending = re.split(r"(?<=[\r\n])", self.pending + text)
        for piece in pieces:
            self._emit(piece)
        self.out.flush()

    def finish(self) -> None:
        self._emit(self.pending)
        self.pending = ""
        self.out.flush()

    def _emit(self, piece: str) -> None:
        line = piece.strip()
        if self.drop and "Modified FLAGS detected" in line:
            self.skipping = True
        elif self.skipping:
            self.skipping = not (line and set(line) == {"="})  # the closing rule ends the block
        else:
            self.out.write(piece)


def shell_line(cmd: list[str]) -> str:
    """``cmd`` as one copy-pasteable shell line."""
    return " ".join(shlex.quote(c) for c in cmd)
