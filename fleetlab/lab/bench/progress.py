"""Progress for the long commands (``bench ...``, ``demo``): one tqdm bar per section, on stderr.

A section's bar counts what the section repeats (runs, steps, requests) and its postfix says
what runs now; stdout keeps only the results, so ``> file`` captures a clean report. ``-q``
turns the bars off. Bars advance between timed regions, never inside one.
"""

from __future__ import annotations

import contextlib
import sys

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def section(desc: str, total: int | None, *, quiet: bool = False, unit: str = "run"):
    """A tqdm bar for one section of a command (``disable=quiet``); use it as a context manager."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet, leave=True,
                dynamic_ncols=True)


def run_step(bar, what: str, fn):
    """``fn()``, with ``what`` shown on ``bar`` while it runs and the bar advanced by one after
    (``bar`` may be None); returns what ``fn`` returns."""
    if bar is not None:
        bar.set_postfix_str(what)
    result = fn()
    if bar is not None:
        bar.update()
    return result


@contextlib.contextmanager
def bars_and_logs():
    """Route log records (``-v``) through tqdm while bars are shown, so a message does not
    break a bar's line."""
    with logging_redirect_tqdm():
        yield


def add_quiet(parser) -> None:
    """The ``-q/--quiet`` option every long command takes."""
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars (stderr)")
