"""README holds: its Python examples run as written, each in a fresh interpreter as a reader would
run it, print what README shows after them and no library notice; its measured figures are the
ones the committed results files hold (``tools/readme_figures.py``)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# A python block, and the text block right after it (what it prints), if there is one.
EXAMPLES = re.findall(r"```python\n(.*?)```\n(?:```text\n(.*?)```\n)?", README, flags=re.S)
# A line a library prints as a notice: a Python warning, a logging record, a colour code.
NOISE = re.compile(r"warning|\bINFO\b|\x1b\[|PyTorch was not found|ccache|distutils", re.I)


def load_tool():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "tools" / "readme_figures.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_readme_has_examples_and_shows_what_some_print():
    assert len(EXAMPLES) >= 3 and sum(bool(shown) for _, shown in EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs_quietly_and_prints_what_readme_shows(index):
    code, shown = EXAMPLES[index]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FLEETLAB_LIBRARY_NOTICES")}
    env["OMP_NUM_THREADS"] = "2"  # as `make` sets it: `import paddle` alone would then print a notice
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "each example prints what it did"
    noisy = [line for line in (done.stdout + done.stderr).splitlines() if NOISE.search(line)]
    assert noisy == [], noisy
    if shown:
        assert done.stdout == shown


def test_readme_figures_are_the_committed_results():
    """Fails when a results file was re-run (or README edited) without
    ``python tools/readme_figures.py render``; the diff says where."""
    drift = load_tool().drift(README)
    assert drift == {}, "\n".join(drift.values())


def test_a_changed_result_is_caught_and_rendered(tmp_path, monkeypatch):
    tool = load_tool()
    spec = json.loads((ROOT / "benchmarks" / "results" / "spec.json").read_text())
    spec["workloads"]["trained"]["runs"][0]["num_steps"] += 1  # speculation off took one more step
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setitem(tool.BLOCKS, "spec", (tmp_path / "spec.json", tool.spec_block))
    assert list(tool.drift(README)) == ["spec"]
    fixed = tool.rendered(README)
    assert tool.drift(fixed) == {} and fixed.count("\n") == README.count("\n")
    steps = spec["workloads"]["trained"]["runs"][0]["num_steps"]
    assert f"| trained: engine steps for the whole batch | {steps} |" in fixed


def test_blocks_are_all_there_and_known():
    tool = load_tool()
    assert set(tool.blocks_in(README)) == set(tool.BLOCKS)
    with pytest.raises(ValueError, match="missing"):
        tool.blocks_in(README.replace("<!-- figures spec -->", "<!-- gone -->"))


def test_a_benchmark_not_run_yet_says_so_and_a_new_run_is_rendered_with_its_load(tmp_path, monkeypatch):
    """attention.json and reorder.json: a block without its file quotes no figure; the file a
    ``--tiny`` run writes renders with its command, threads and load."""
    from fleetlab.lab.bench.cli import main

    tool = load_tool()
    monkeypatch.setitem(tool.BLOCKS, "attention", (tmp_path / "attention.json", tool.attention_block))
    assert "No run of it is committed yet" in tool.render("attention")
    assert main(["attention", "--tiny", "-q", "--out", str(tmp_path)]) == 0
    text = " ".join(tool.render("attention").split())
    r = json.loads((tmp_path / "attention.json").read_text())
    assert f"take {tool.ms(r['cases'][0]['tiled_ms'])} ms" in text
    assert "bench attention --tiny" in text and "other work kept" in text
    threads = r["machine"]["omp_num_threads"]
    assert (f"OMP_NUM_THREADS={threads}" in text) == bool(threads)


def test_the_tool_checks_from_the_command_line():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_figures.py"), "check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"all {len(load_tool().BLOCKS)} figure blocks match" in done.stdout


def test_the_reading_guide_is_current():
    """README's "Read the engine" table (files in a request's order, their sizes) is what
    ``tools/read_the_engine.py`` prints now."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "read_the_engine.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_layout_names_every_package_and_module_of_the_tree_once():
    """README's Layout follows the tree: each folder and module directly under fleetlab/ is named exactly once."""
    layout = README.split("## Layout", 1)[1].split("```", 2)[1]
    package = ROOT / "fleetlab"
    packages = [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    modules = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    entries = sorted(packages + modules)
    counts = {name: len(re.findall(rf"(?<![\w/.]){re.escape(name)}", layout)) for name in entries}
    assert {name: n for name, n in counts.items() if n != 1} == {}
    assert len(entries) > 20
