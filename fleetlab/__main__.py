"""Command line: ``python -m fleetlab {demo,train-tiny,bench} ...``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module with main(argv), help)
COMMANDS = {
    "demo": ("fleetlab.demo", "serve a batch of prompts on the shipped tiny model and show what happened"),
    "train-tiny": ("fleetlab.models.train", "train the tiny Llama shipped in fleetlab/models/weights"),
    "bench": ("fleetlab.bench.cli", "benchmarks: all, reorder, attention, generate, ..."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m fleetlab", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv[:1] + [a for a in argv[1:] if a in ("-v", "--verbose")])
    rest = [a for a in argv[1:] if a not in ("-v", "--verbose")]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from fleetlab.cpu_tuning import tune_malloc

    tune_malloc()  # a program, not a library: keep Paddle's freed CPU buffers (see cpu_tuning)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
