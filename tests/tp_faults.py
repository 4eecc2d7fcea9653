"""A tensor-parallel rank that fails on purpose, for the failure tests (not part of fleetlab).

    python -m paddle.distributed.launch --nproc_per_node 2 python -m tp_faults \\
        --kill-rank 1 --kill-at-step 3 --out OUT ...   # rank 1 SIGKILLs itself before step 3
    ... python -m tp_faults --diverge-rank 1 --out OUT ...  # rank 1 serves other prompts

Everything else is ``fleetlab.lab.tp_worker``'s; ``tests/`` must be on ``PYTHONPATH``.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from fleetlab.distributed.group import launched_rank
from fleetlab.lab import tp_worker as worker


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--diverge-rank", type=int, default=None, help="this rank serves other prompts (same lengths)")
    p.add_argument("--stall-rank", type=int, default=None, help="this rank sleeps 60 s before --kill-at-step")
    faults, rest = p.parse_known_args()
    rank = launched_rank()
    out = Path(rest[rest.index("--out") + 1])
    if faults.diverge_rank == rank:
        rest += ["--workload", json.dumps({"prompt_seed": 2})]

    def before_step(step: int) -> None:
        if rank == faults.kill_rank and step == faults.kill_at_step:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"killed_rank{rank}").write_text(str(time.time()))  # when, for the test's clock
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == faults.stall_rank and step == faults.kill_at_step:
            time.sleep(60)  # busy while its peer dies: only the launcher's SIGTERM ends it

    return worker.main(rest, before_step=before_step)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as the worker: leave without interpreter teardown
