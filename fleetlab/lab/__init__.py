"""The lab: what a learner and a benchmark use on top of the engine.

- :mod:`~fleetlab.lab.viz`: pictures of what the engine does (matplotlib, ipywidgets);
- :mod:`~fleetlab.lab.bench`: the benchmarks behind ``python -m fleetlab bench``;
- :mod:`~fleetlab.lab.lessons`: teaching variants of engine pieces;
- :mod:`~fleetlab.lab.demo`: ``python -m fleetlab demo``;
- :mod:`~fleetlab.lab.quiet`: the quiet mode, on once the lab is imported (a notebook imports it
  before Paddle, so Paddle's and PaddleFormers' import-time notices stay out of sight);
- :mod:`~fleetlab.lab.cpu_tuning`: process-wide CPU tuning for programs (never at import).

The lab imports the engine; no engine module imports the lab, and matplotlib and ipywidgets are
imported only here. Importing ``fleetlab`` itself changes no process state: the lab and the
command line turn the quiet mode on.
"""

from __future__ import annotations

import importlib

from fleetlab.lab import quiet as _quiet

_quiet.install()

_SUBMODULES = ("viz", "bench", "lessons", "demo", "quiet", "cpu_tuning")


def __getattr__(name: str):
    if name in _SUBMODULES:
        module = importlib.import_module(f"fleetlab.lab.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fleetlab.lab' has no attribute {name!r}")
