"""The small benchmark commands (``bench reorder``, ``bench attention``) and what every benchmark
shares: a progress bar per section on stderr (``-q``: none), and the machine and its load recorded
in the results file. Benchmarks are commands, not timed tests: nothing here checks a speed."""

import json
import re
import time

import pytest

from fleetlab.lab.bench.cli import main
from fleetlab.lab.bench.machine import MachineRecord, cpu_use, describe


def bars(err: str) -> list[str]:
    """The names of the progress bars that reached 100% in ``err``."""
    return [piece.split(":")[0] for piece in re.split(r"[\r\n]", err) if "100%" in piece]


def test_reorder_tiny_writes_its_results_with_a_bar_per_row_count(tmp_path, capsys):
    assert main(["reorder", "--tiny", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert sorted(set(bars(err))) == ["reorder, 16 rows", "reorder, 8 rows"]
    r = json.loads((tmp_path / "reorder.json").read_text())
    assert r["preset"] == "tiny" and r["command"].startswith("python -m fleetlab bench reorder")
    assert [t["rows"] for t in r["results"]] == [8, 16]
    assert all(t["steps"] == r["config"]["steps"] for t in r["results"])
    assert all(t["moves_sync_us"] >= t["moves_us"] > 0 and t["gather_upload_us"] >= t["gather_us"] > 0
               for t in r["results"])
    assert describe(r["machine"]) in out


def test_attention_tiny_times_both_backends_and_they_agree(tmp_path, capsys):
    assert main(["attention", "--tiny", "--out", str(tmp_path)]) == 0
    _, err = capsys.readouterr()
    assert bars(err) == ["attention cases"]
    r = json.loads((tmp_path / "attention.json").read_text())
    assert [c["case"] for c in r["cases"]] == ["4 decodes @ ctx 64", "prefill 32 tokens"]
    for c in r["cases"]:
        assert c["max_diff"] < 1e-4  # the tiled attention gives the naive one's numbers
        assert c["tiled_ms"] >= c["tiled_best_ms"] > 0 and c["naive_ms"] >= c["naive_best_ms"] > 0
    assert r["config"]["malloc_tuned"] in (True, False)


@pytest.mark.parametrize("name", ["reorder", "attention"])
def test_quiet_shows_no_bar(name, tmp_path, capsys):
    assert main([name, "--tiny", "-q", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_the_machine_record_holds_threads_and_load_at_both_ends(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with MachineRecord(with_paddle=False) as machine:
        start = time.process_time()
        while time.process_time() - start < 0.1:  # work of this process's own: surely many clock ticks of
            sum(i * i for i in range(10_000))     # CPU time, however loaded the machine (a fixed loop was not)
    m = machine.info
    assert m["omp_num_threads"] == "1" and m["cpu_count"] >= 1
    assert len(m["load_average"]) == len(m["load_average_end"]) == 3
    use = m["cpu_use"]
    assert use["seconds"] > 0 and use["own"] > 0 and use["other"] >= 0
    assert machine.close() is m and m["cpu_use"] is use  # closing again keeps the first end


def test_cpu_use_splits_busy_cores_into_own_and_other():
    start = {"wall": 10.0, "busy_s": 100.0, "own_s": 5.0}
    end = {"wall": 12.0, "busy_s": 103.0, "own_s": 6.0}  # 3 busy core-seconds in 2 s, 1 of them ours
    assert cpu_use(start, end) == {"seconds": 2.0, "total": 1.5, "own": 0.5, "other": 1.0}
    assert cpu_use(None, end) is None and cpu_use(end, end) is None


def test_describe_says_what_an_older_file_did_not_record():
    new = {"processor": "AMD EPYC", "cpu_count": 2, "device": "cpu", "paddle": "3.3.1", "paddleformers": "1.2.0",
           "omp_num_threads": "1", "load_average": [0.5, 0.4, 0.3], "load_average_end": [0.7, 0.5, 0.3],
           "cpu_use": {"seconds": 60.0, "total": 1.1, "own": 1.0, "other": 0.1}}
    assert describe(new) == ("AMD EPYC, 2 cores, CPU only, Paddle 3.3.1, PaddleFormers 1.2.0; OMP_NUM_THREADS=1; "
                             "load average 0.5 at the start, 0.7 at the end; other work kept 0.1 of the 2 cores "
                             "busy on average while it measured")
    old = describe({"processor": "x86_64", "cpu_count": 2, "load_average": [6.36, 4.47, 2.78]})
    assert "threads not recorded" in old and "was not recorded" in old and "6.36 at the start" in old
