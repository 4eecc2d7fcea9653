"""The command line: ``python -m fleetlab demo`` serves real prompts and reports real figures."""

import os
import re

from fleetlab.__main__ import main
from fleetlab.demo import check, timeline


def test_demo_prints_answers_timeline_and_figures(capsys):
    assert main(["demo", "--num-prompts", "10", "--num-blocks", "16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"arithmetic right: (\d+)/(\d+)", out)
    right, total = map(int, re.search(r"arithmetic right: (\d+)/(\d+)", out).groups())
    assert total >= 4 and right >= total - 1  # the shipped model gets >= 99% of held-out sums
    assert "output tokens/s" in out and "prefix-cache hit rate" in out
    assert len(re.findall(r"req +\d+ \|[PDx. ]+\|", out)) == 10


def test_check_and_timeline_helpers():
    assert check("12+7=", "19") == "ok" and check("6*7=", "41") == "want 42" and check("count 3 ", "4") == ""
    assert timeline([], ["a"]) == [""]


def test_help_and_unknown_bench(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert main(["-v", "bench", "nope"]) == 2  # -v is taken before or after the command


# A line a library prints as a notice: a Python warning, a logging record, a colour code.
NOISE = re.compile(r"warning|\bINFO\b|\x1b\[|PyTorch was not found|ccache|distutils", re.I)


def test_demo_prints_no_library_notices():
    """The demo, as a user runs it, shows only its own output: no warning or INFO line
    from Paddle, PaddleFormers or transformers (fleetlab.quiet keeps them out)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FLEETLAB_LIBRARY_NOTICES")}
    env["OMP_NUM_THREADS"] = "2"  # as `make demo` sets it: Paddle then prints an OpenMP warning
    done = subprocess.run([sys.executable, "-m", "fleetlab", "demo", "--num-prompts", "3"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    noisy = [line for line in (done.stdout + done.stderr).splitlines() if NOISE.search(line)]
    assert noisy == [] and done.stderr == "", noisy or done.stderr
    assert "arithmetic right" in done.stdout


def test_verbose_turns_fleetlab_info_on():
    """-v lets fleetlab's own INFO messages through."""
    import logging

    from fleetlab import quiet

    fleet_logger = logging.getLogger("fleetlab")
    before = fleet_logger.level
    try:
        fleet_logger.setLevel(logging.WARNING)  # as fleetlab.quiet.install() leaves it
        quiet.verbose()
        assert fleet_logger.getEffectiveLevel() == logging.INFO
    finally:
        fleet_logger.setLevel(before)
