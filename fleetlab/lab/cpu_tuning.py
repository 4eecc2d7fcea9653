"""Process-wide CPU tuning for fleetlab's own programs (the CLI, benchmarks, tests).

On CPU, Paddle frees large buffers after every operation and glibc hands them straight
back to the operating system; the next operation then pays for fresh zeroed pages,
which can cost more than the arithmetic on a small model. Raising glibc's mmap and trim
thresholds keeps freed buffers
in the process. It changes the whole process, so library code never calls it: programs
opt in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters from <malloc.h>


def tune_malloc(threshold_bytes: int = 1 << 30) -> bool:
    """Keep freed buffers below ``threshold_bytes`` in the process; True if glibc accepted."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) and
                  libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):  # not glibc
        return False
    logger.info("glibc malloc tuned: mmap/trim thresholds %d bytes (%s)", threshold_bytes, ok)
    return ok
