"""Where and under what load a benchmark's figures were measured: one record every results file carries.

A timing on a shared machine means little without the load it was taken under, so each
benchmark opens a :class:`MachineRecord` before it measures and closes it after::

    with MachineRecord() as machine:
        ...                     # measure
    result["machine"] = machine.info

``info`` then holds the processor, the cores, ``OMP_NUM_THREADS``, the versions, the load
average at the start and the end, and ``cpu_use``: how many cores were busy on average while
measuring, split into this benchmark's own processes and everything else (from
``/proc/stat`` and :func:`os.times`; Linux only, ``None`` elsewhere).
"""

from __future__ import annotations

import os
import platform
import time


class MachineRecord:
    """The machine description and the load while a benchmark ran (a context manager)."""

    def __init__(self, with_paddle: bool = True):
        self.info = machine_info(with_paddle)
        self._start = _cpu_counters()

    def __enter__(self) -> MachineRecord:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> dict:
        """Record the load at the end; returns ``info``. Closing twice keeps the first end."""
        if "load_average_end" not in self.info:
            self.info["load_average_end"] = load_average()
            self.info["cpu_use"] = cpu_use(self._start, _cpu_counters())
        return self.info


def machine_info(with_paddle: bool = True) -> dict:
    """Processor, cores, Python, ``OMP_NUM_THREADS``, the load average now and, with
    ``with_paddle``, Paddle's and PaddleFormers' versions and device."""
    info = {"platform": platform.platform(), "processor": cpu_name(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average": load_average()}
    if with_paddle:
        # Imported only when asked for: they take seconds to import, and describing a stored
        # record (tools/readme_figures.py) or taking one ``with_paddle=False`` needs neither.
        import paddle
        import paddleformers

        info.update(paddle=paddle.__version__, paddleformers=getattr(paddleformers, "__version__", "?"),
                    device=paddle.device.get_device())
    return info


def describe(m: dict) -> str:
    """One sentence of a results file's ``machine`` record: where, with how many threads, under
    what load (what an older file did not record is said to be missing)."""
    where = f"{m.get('processor', '?')}, {m.get('cpu_count', '?')} cores"
    if m.get("device"):
        where += f", {'CPU only' if m['device'] == 'cpu' else m['device']}"
    if m.get("paddle"):
        where += f", Paddle {m['paddle']}" + (f", PaddleFormers {m['paddleformers']}" if m.get("paddleformers") else "")
    threads = m.get("omp_num_threads")
    threads = f"OMP_NUM_THREADS={threads}" if threads else ("OMP_NUM_THREADS unset" if "omp_num_threads" in m
                                                            else "threads not recorded")
    load = m.get("load_average")
    load = f"load average {load[0]:g} at the start" if load else "load average not recorded"
    if m.get("load_average_end"):
        load += f", {m['load_average_end'][0]:g} at the end"
    use = m.get("cpu_use")
    other = (f"other work kept {use['other']:.1f} of the {m.get('cpu_count', '?')} cores busy on average "
             f"while it measured" if use else "what other work used of the cores was not recorded")
    return f"{where}; {threads}; {load}; {other}"


def load_average() -> list[float] | None:
    """The 1/5/15-minute load average, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def cpu_name() -> str:
    """The processor's model name from ``/proc/cpuinfo`` (or what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def _cpu_counters() -> dict | None:
    """Wall clock, the machine's busy CPU seconds (``/proc/stat``) and this process's own CPU
    seconds, its finished children's included (:func:`os.times`)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait kept a core busy
    # (steal: the hypervisor gave the core to another machine).
    busy = sum(fields[:8]) - fields[3] - fields[4]
    t = os.times()
    return {"wall": time.perf_counter(), "busy_s": busy / os.sysconf("SC_CLK_TCK"),
            "own_s": t.user + t.system + t.children_user + t.children_system}


def cpu_use(start: dict | None, end: dict | None) -> dict | None:
    """Mean busy cores between two counters: ``total``, ``own`` (this process and its waited-for
    children) and ``other`` (the rest of the machine: other users' work), over ``seconds``."""
    if start is None or end is None or end["wall"] <= start["wall"]:
        return None
    seconds = end["wall"] - start["wall"]
    total = (end["busy_s"] - start["busy_s"]) / seconds
    own = (end["own_s"] - start["own_s"]) / seconds
    return {"seconds": round(seconds, 2), "total": round(total, 2), "own": round(own, 2),
            "other": round(max(0.0, total - own), 2)}
