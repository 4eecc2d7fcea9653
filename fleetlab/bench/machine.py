"""Where a benchmark's figures were measured: one record every benchmark's JSON carries."""

from __future__ import annotations

import os
import platform


def machine_info(with_paddle: bool = True) -> dict:
    """Processor, cores, Python, the load average (above ``cpu_count``: other work competed for
    the cores while measuring) and, with ``with_paddle``, Paddle's and PaddleFormers' versions
    and device."""
    info = {"platform": platform.platform(), "processor": cpu_name(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average": load_average()}
    if with_paddle:
        import paddle
        import paddleformers

        info.update(paddle=paddle.__version__, paddleformers=getattr(paddleformers, "__version__", "?"),
                    device=paddle.device.get_device())
    return info


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
