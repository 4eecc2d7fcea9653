"""Runtime checks are not ``assert`` statements: ``python -O`` strips those, and the engine must
refuse a bad call the same way with or without it (#45 item 10).

- no ``assert`` in the package's code except for invariants no caller can break (listed here);
- the checks a learner meets first (a batch with holes reordered, metadata built from bad
  shapes, a device mirror read stale) raise under ``python -O`` too;
- the suite's core cases (the block pool, the scheduler, the InputBatch, greedy parity with the
  model's own forward under reorder, chunking and preemption) pass under ``python -O``.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# file -> why its assert can never fail whatever a caller does
INVARIANTS = {"fleetlab/models/bpe.py": "the tokenizers trainer puts the special tokens first"}
# (pytest rewrites the test modules' own asserts, so they still check under -O; the package's are stripped)
CORE = ["tests/test_block_pool.py", "tests/test_scheduler.py", "tests/test_input_batch.py",
        "tests/test_engine_parity.py::test_reorder_on_and_off", "tests/test_engine_parity.py::test_chunk_budgets[3]",
        "tests/test_engine_parity.py::test_small_pools_force_preemption[10]"]


def optimized(code: str, timeout: float = 540) -> subprocess.CompletedProcess:
    """Run ``code`` under ``python -O``; its first line proves the asserts are gone."""
    proof = "import sys\nassert False, 'python -O did not strip asserts'\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-O", "-c", proof + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=env)


def test_no_assert_guards_a_public_entry():
    found = []
    for path in sorted((ROOT / "fleetlab").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert) and rel not in INVARIANTS:
                found.append(f"{rel}:{node.lineno}")
    assert found == [], f"an assert that python -O strips (raise an error naming the call instead): {found}"


def test_a_learners_bad_calls_are_refused_under_python_O():
    done = optimized("""
import numpy as np
from fleetlab.engine.input_batch import InputBatch
from fleetlab.attention.metadata import AttentionMetadata

def refused(call, error, words):
    try:
        call()
    except error as e:
        if words not in str(e):
            raise SystemExit(f"wrong message: {e}")
        return
    raise SystemExit(f"not refused: {words}")

batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=4)
for i in range(3):
    batch.add_request(f"r{i}", [1, 2, 3], block_ids=[i])
batch.remove_request("r1")
before = batch.req_ids
refused(lambda: batch.reorder_split_prefill_and_decode(), RuntimeError, "rows [1] are holes")
if batch.req_ids != before:
    raise SystemExit(f"the batch changed: {batch.req_ids}")
refused(lambda: batch.sync_to_device(), RuntimeError, "condense")
refused(lambda: batch.dev("block_table"), RuntimeError, "stale")
refused(lambda: batch.dev("token_ids"), ValueError, "lives on the host")
refused(lambda: AttentionMetadata.build([2, 0], [0, 0], [[0], [1]], 4), ValueError, "query_lens")
refused(lambda: AttentionMetadata.build([2], [0, 0], [[0]], 4), ValueError, "one entry per row")
refused(lambda: AttentionMetadata.build([2, 1], [0, 0], [[0]], 4), ValueError, "block_tables")
refused(lambda: AttentionMetadata.build([2], [0], [[-1]], 4), ValueError, "no block allocated")
print("refused, all")
""")
    assert done.returncode == 0 and done.stdout.strip().endswith("refused, all"), done.stdout + done.stderr


def test_the_core_cases_pass_under_python_O():
    done = optimized(f"import pytest\nsys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', *{CORE!r}]))")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
