"""Keep the libraries under fleetlab from printing notices a learner cannot act on.

Importing Paddle and PaddleFormers prints, before anything useful, a handful of notices
that are false or irrelevant here:

- Paddle warns that ``ccache`` is missing (it only matters when compiling C++ extensions);
- transformers (which PaddleFormers imports) says "PyTorch was not found. Models won't be
  available...": PaddleFormers hides torch on purpose, and its models work;
- PaddleFormers logs a coloured WARNING about that choice, and INFO lines such as
  ``loss_subbatch_sequence_length...`` when a model is built;
- setuptools warns that it "is replacing distutils" when Paddle imports ``distutils``;
- ``import paddle`` prints "WARNING: OMP_NUM_THREADS set to N, not 1..." whenever more
  than one OpenMP thread is asked for (``make`` asks for 2): it concerns data parallelism
  and OpenBLAS builds, and the PyPI wheels use MKL;
- ``import paddle`` sets the *root* logger to INFO with a handler of its own, so every
  library's INFO messages (fleetlab's included) would start to print.

:func:`install` silences exactly those, once, at the source: environment variables and
logger filters set before the libraries are imported, warnings filtered by message and
module, Paddle's two OpenMP lines dropped from stderr while Paddle imports, and the root
logger put back as it was after ``import paddle``. It changes the whole process, so
importing ``fleetlab`` never runs it: importing the lab (:mod:`fleetlab.lab`) does, and so does
the command line (``python -m fleetlab ...``), so a notebook needs no boilerplate, as long as it
imports the lab before paddle. Anything else the libraries report (an unknown warning, an
error) still shows.

fleetlab's own log messages (logger ``"fleetlab"``) stay at WARNING by default; the
command line's ``-v`` turns them up to INFO (:func:`verbose`). To see every library notice
again, set the environment variable ``FLEETLAB_LIBRARY_NOTICES=1`` before importing the lab.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import io
import logging
import os
import sys
import warnings

NOTICES_ENV = "FLEETLAB_LIBRARY_NOTICES"  # (fleetlab.distributed.launch reads it too, for the ranks it starts)

# (message regex, module regex) of the warnings silenced: narrow on purpose.
SILENCED_WARNINGS = (
    (r"No ccache found", r"paddle\.utils\.cpp_extension"),
    (r"Setuptools is replacing distutils", r"_distutils_hack"),
)
# PaddleFormers' logger (propagate=False, a handler of its own) and the WARNING messages
# it prints on import that are silenced; its other warnings and errors still show.
PADDLEFORMERS_LOGGER = "PaddleFormers"
PADDLEFORMERS_NOTICES = ("Due to potential compatibility issues between PaddlePaddle and PyTorch",)
# Lines ``import paddle`` prints to stderr when OMP_NUM_THREADS > 1 (paddle.base.__bootstrap__).
PADDLE_IMPORT_LINES = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY.")
# The format of the handler ``import paddle`` puts on the root logger.
_PADDLE_ROOT_FORMAT = "[%(asctime)-15s] [%(levelname)8s] %(filename)s:%(lineno)s - %(message)s"

_installed = False


class _PaddleFormersNotices(logging.Filter):
    """Drop PaddleFormers' INFO/DEBUG lines and its known import-time warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        if record.levelno == logging.WARNING:
            message = record.getMessage()
            return not any(notice in message for notice in PADDLEFORMERS_NOTICES)
        return True


class _DropLines(io.TextIOBase):
    """A text stream that passes every line on to ``stream`` except those starting with ``drop``."""

    def __init__(self, stream, drop: tuple[str, ...]):
        self.stream, self.drop, self._pending = stream, drop, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            if not line.startswith(self.drop):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def finish(self) -> None:
        """Pass on what is left of an unfinished line."""
        if self._pending:
            self.stream.write(self._pending)
            self._pending = ""


def _tidy_root_logger(level: int) -> None:
    """Undo what ``import paddle`` did to the root logger: its handler and its INFO level."""
    root = logging.getLogger()
    paddle_handlers = [h for h in root.handlers
                       if h.formatter is not None and h.formatter._fmt == _PADDLE_ROOT_FORMAT]
    for handler in paddle_handlers:
        root.removeHandler(handler)
    if paddle_handlers:
        root.setLevel(level)


class _AfterPaddleImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: once ``paddle`` has been imported, tidy the root logger."""

    def __init__(self, root_level: int):
        self.root_level = root_level

    def find_spec(self, fullname, path, target=None):
        if fullname != "paddle":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("paddle")  # the finders after this one
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, root_level = spec.loader.exec_module, self.root_level

        def exec_then_tidy(module):
            stderr = sys.stderr
            sys.stderr = filtered = _DropLines(stderr, PADDLE_IMPORT_LINES)
            try:
                exec_module(module)
            finally:
                if sys.stderr is filtered:
                    sys.stderr = stderr
                filtered.finish()
                _tidy_root_logger(root_level)

        spec.loader.exec_module = exec_then_tidy  # this loader instance serves this import only
        return spec


def install() -> None:
    """Silence the libraries' import-time notices (see the module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("fleetlab").setLevel(logging.WARNING)
    if os.environ.get(NOTICES_ENV, "") not in ("", "0"):
        return
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found..."
    for message, module in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    logging.getLogger(PADDLEFORMERS_LOGGER).addFilter(_PaddleFormersNotices())  # survives its setLevel
    root_level = logging.getLogger().level
    if "paddle" in sys.modules:  # imported before fleetlab: tidy now
        _tidy_root_logger(root_level)
    else:
        sys.meta_path.insert(0, _AfterPaddleImport(root_level))


def verbose(level: int = logging.INFO) -> None:
    """Let fleetlab's own log messages through from ``level`` up (the command line's ``-v``)."""
    logging.getLogger("fleetlab").setLevel(level)
