"""The command line: ``python -m fleetlab demo`` serves real prompts and reports real figures."""

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
