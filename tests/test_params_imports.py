"""Parameter dataclasses are pure data: importing one loads no Paddle and none of the engine, and the
edge's modules import each other without a cycle (``TYPE_CHECKING`` imports included)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ["fleetlab.engine.sampling_params", "fleetlab.engine.structured_outputs_params", "fleetlab.errors"]


@pytest.mark.parametrize("module", PARAMS)
def test_a_params_module_imports_no_paddle_in_a_fresh_interpreter(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'paddle' "
            "or m in ('fleetlab.edge.sampling', 'fleetlab.llm', 'fleetlab.engine.input_batch')); print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _fleetlab_imports(module: str) -> set[str]:
    """Every fleetlab module ``module`` names in an import, anywhere in its file (TYPE_CHECKING too)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fleetlab"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("fleetlab"))
    return names


def test_no_import_cycle_through_the_edge():
    graph = {m: _fleetlab_imports(m) for m in [*PARAMS, "fleetlab.edge.sampling"]}
    for module in PARAMS:  # the params reach only each other and the errors, never the edge's checks
        assert graph[module] <= set(PARAMS), (module, graph[module])
    assert graph["fleetlab.errors"] == set()
    assert {"fleetlab.engine.structured_outputs_params", "fleetlab.errors"} <= graph["fleetlab.edge.sampling"]
