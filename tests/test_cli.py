"""The command line: ``python -m fleetlab demo`` serves real prompts and reports real figures."""

import os
import re

import pytest

from fleetlab.__main__ import main
from fleetlab.lab.demo import check, timeline


def test_demo_prints_answers_timeline_and_figures(capsys):
    assert main(["demo", "--num-prompts", "10", "--num-blocks", "16", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # -q: no progress bar
    assert re.search(r"arithmetic right: (\d+)/(\d+)", out)
    right, total = map(int, re.search(r"arithmetic right: (\d+)/(\d+)", out).groups())
    assert total >= 4 and right >= total - 1  # the shipped model gets >= 99% of held-out sums
    assert "tiny trained Llama (1.00M parameters)" in out
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
    """The demo, as a user runs it, shows only its own output and a progress bar on stderr: no
    warning or INFO line from Paddle, PaddleFormers or transformers (fleetlab.lab.quiet keeps them out)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FLEETLAB_LIBRARY_NOTICES")}
    env["OMP_NUM_THREADS"] = "2"  # as `make demo` sets it: Paddle then prints an OpenMP warning
    done = subprocess.run([sys.executable, "-m", "fleetlab", "demo", "--num-prompts", "3"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    noisy = [line for line in (done.stdout + done.stderr).splitlines() if NOISE.search(line)]
    assert noisy == [], noisy
    bar = [piece for piece in re.split(r"[\r\n]", done.stderr) if piece.strip()]
    assert bar and all(BAR.match(piece) for piece in bar), done.stderr
    assert "3/3" in bar[-1]
    assert "arithmetic right" in done.stdout


# A progress bar's line: "requests:  33%|###   | 1/3 [00:00<00:01,  1.5req/s]"
BAR = re.compile(r"requests: +\d+%\|.*\| \d+/\d+ \[")


@pytest.mark.slow
def test_tensor_parallel_demo_answers_like_one_process_without_launcher_notices(capsys):
    """``demo --tensor-parallel-size 2`` launches itself on two ranks and prints the answers one
    process prints. It shows the launch line and the demo's own output: no glog line, no
    "Modified FLAGS" block, no ccache warning; the model's size is the whole model's, and rank
    0's shard is named as a part of it."""
    import subprocess
    import sys

    args = ["demo", "--num-prompts", "6", "--num-blocks", "12"]
    assert main(args) == 0
    alone = [ln for ln in capsys.readouterr().out.splitlines() if " -> " in ln]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FLEETLAB_LIBRARY_NOTICES")}
    done = subprocess.run([sys.executable, "-m", "fleetlab", *args, "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "paddle.distributed.launch --nproc_per_node 2" in done.stdout
    assert [ln for ln in done.stdout.splitlines() if " -> " in ln] == alone
    assert "tensor parallel: 2 ranks on gloo" in done.stdout and "KV heads [0] of 2" in done.stdout
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if "paddle.distributed.launch" not in ln]
    noisy = [ln for ln in lines if NOISE.search(ln) or GLOG.match(ln) or "FLAGS" in ln or set(ln.strip()) == {"="}]
    assert noisy == [] and done.stderr == "", noisy or done.stderr
    assert "tiny trained Llama (1.00M parameters, split over 2 ranks)" in done.stdout
    assert re.search(r"rank 0 holds .*: 0\.\d\dM of the 1\.00M parameters", done.stdout)


# A C++ log line from glog: "I1201 21:39:51.986334 11147 tcp_store.cc:336] ..."
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def test_notice_filter_drops_the_modified_flags_block_and_passes_bars_as_they_come():
    import io

    from fleetlab.distributed.launch import NoticeFilter

    out = io.StringIO()
    shown = NoticeFilter(out)
    shown.write("before\n=== Modified FLAGS detected ===\nFLAGS(name='x', current_value=True, default_value=")
    shown.write("False)\n==========\nafter\n\rbar 1/2")
    assert out.getvalue() == "before\nafter\n\r"  # the unfinished bar piece waits for its end ...
    shown.write("\rbar 2/2")
    assert out.getvalue() == "before\nafter\n\rbar 1/2\r"
    shown.finish()  # ... or for the end of the stream
    assert out.getvalue() == "before\nafter\n\rbar 1/2\rbar 2/2"
    everything = io.StringIO()
    NoticeFilter(everything, drop=False).write("=== Modified FLAGS detected ===\n")
    assert everything.getvalue() == "=== Modified FLAGS detected ===\n"


def test_verbose_turns_fleetlab_info_on():
    """-v lets fleetlab's own INFO messages through."""
    import logging

    from fleetlab.lab import quiet

    fleet_logger = logging.getLogger("fleetlab")
    before = fleet_logger.level
    try:
        fleet_logger.setLevel(logging.WARNING)  # as fleetlab.lab.quiet.install() leaves it
        quiet.verbose()
        assert fleet_logger.getEffectiveLevel() == logging.INFO
    finally:
        fleet_logger.setLevel(before)
