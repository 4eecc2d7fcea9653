"""Importing fleetlab, or any engine module, changes no process state: the environment, the warning
filters and the import hooks are what importing Paddle and PaddleFormers alone leaves them. The quiet
mode is the lab's and the command line's to turn on (``fleetlab.lab``, ``python -m fleetlab``)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Prints what a process holds after ``imports``: its environment, its warning filters, its import hooks.
STATE = """
import json, os, sys, warnings
{imports}
print(json.dumps({{"environ": dict(os.environ), "filters": [repr(f) for f in warnings.filters],
                   "meta_path": [type(f).__module__ + "." + type(f).__qualname__ for f in sys.meta_path]}}))
"""
LIBRARIES = "import paddle, paddleformers, paddleformers.transformers"
FLEETLAB = "import fleetlab; fleetlab.LLM; import fleetlab.engine.scheduler"


def state_after(imports: str) -> dict:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", STATE.format(imports=imports)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_fleetlab_changes_no_process_state():
    alone = state_after(LIBRARIES)
    with_fleetlab = state_after(f"{LIBRARIES}; {FLEETLAB}")
    assert with_fleetlab == alone
    fleetlab_first = state_after(f"{FLEETLAB}; {LIBRARIES}")  # fleetlab first: nothing waits for Paddle either
    assert fleetlab_first == alone


def test_the_lab_turns_the_quiet_mode_on():
    """The check above can fail: the lab's import changes exactly what it is there to change."""
    alone = state_after(LIBRARIES)
    lab = state_after(f"import fleetlab.lab; {LIBRARIES}")
    assert lab["environ"] != alone["environ"] and lab["filters"] != alone["filters"]
    assert lab["environ"].get("TRANSFORMERS_NO_ADVISORY_WARNINGS") == "1"
