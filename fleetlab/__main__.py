"""Command line: ``python -m fleetlab {demo,train-tiny,train-code,serve,bench,disagg} ...``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from fleetlab.lab import quiet  # importing the lab turns the quiet mode on: a program, not a library
from fleetlab.lab.cpu_tuning import tune_malloc

# name -> (module with main(argv), help). A command's module is imported only when it runs, so
# ``--help`` stays instant and only ``serve`` needs the server's optional dependencies.
COMMANDS = {
    "demo": ("fleetlab.lab.demo", "serve a batch of prompts on the shipped tiny model and show what happened"),
    "train-tiny": ("fleetlab.models.train", "train the tiny Llama shipped in fleetlab/models/weights"),
    "train-code": ("fleetlab.models.train_code", "train the code model (BPE + Llama) on the Python stdlib"),
    "serve": ("fleetlab.serving.cli", "an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)"),
    "bench": ("fleetlab.lab.bench.cli", "benchmarks: all, reorder, attention, serve, ..."),
    "disagg": ("fleetlab.serving.disagg.cli", "prefill and decode engines on two ranks behind one OpenAI server"),
}
_VERBOSE = ("-v", "--verbose")


def main(argv: list[str] | None = None) -> int:
    """Run ``COMMANDS[argv[0]]``'s ``main`` on the remaining arguments; return its exit status.

    ``-v``/``--verbose`` may stand anywhere (before or after the command) and is not
    passed on to the command.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in _VERBOSE for a in argv)
    argv = [a for a in argv if a not in _VERBOSE]
    parser = argparse.ArgumentParser(prog="python -m fleetlab", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show fleetlab's own INFO log messages (serve: uvicorn's too, with access lines)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command = parser.parse_args(argv[:1]).command
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet.install()  # (done already by importing the lab; said here because the command line relies on it)
    if verbose:
        quiet.verbose()
    tune_malloc()  # a program, not a library: keep Paddle's freed CPU buffers (see cpu_tuning)
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(argv[1:]) or 0)

if __name__ == "__main__":
    sys.exit(main())
