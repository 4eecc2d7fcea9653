"""Benchmark: what decode-first batching costs per step, two ways.

* **moves** (the production Paddle engine, the leading open engine's v1): each step
  ``condense()`` then ``reorder_split_prefill_and_decode()`` move rows of every field so
  rows ``[0, num_decodes)`` are decodes; the step then reads contiguous slices, and
  ``sync_to_device()`` copies the live prefix of the device fields.
* **gather** (the leading open engine's newer runner): rows never move; each step builds
  an index map (live rows, decodes first, stable) and gathers only the fields the step
  reads through it, then uploads the gathered device fields.

Both batches see the same requests: every step some requests finish, new ones arrive
(prompts chunked), and each running request gains one token. Only the decode-first part
is timed; both strategies are checked to agree on which requests are decodes.

Run: ``python -m fleetlab bench reorder [--out DIR] [-q]``. Results: ``<out>/reorder.json``::

    schema_version, created, command, preset ("full" | "tiny"), elapsed_s
    machine: see fleetlab.lab.bench.machine (threads, load average, cpu_use while measuring)
    config: {rows, steps, warmup, max_model_len, chunk, finish_rate, seed}
    results: list of ReorderTiming fields, one per row count (medians in microseconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from fleetlab.engine.input_batch import InputBatch
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.lab.lessons.reorder import decode_first_order
from fleetlab.lab.lessons.row_moves import append_tokens

DEFAULT_OUT = Path("benchmarks/results")
# Host fields the step reads besides the device fields (query lengths, context lengths).
_HOST_STEP_READS = ("num_computed_tokens", "num_scheduled_tokens", "num_tokens")


@dataclass(slots=True)
class ReorderTiming:
    """Per-step cost of one batch size, medians in microseconds over the timed steps."""

    rows: int
    steps: int
    mean_decodes: float
    moves_us: float
    rows_moved: float
    moves_sync_us: float
    gather_us: float
    gather_upload_us: float


@dataclass(slots=True)
class _Req:
    prompt_len: int
    computed: int = 0


class _Workload:
    """The request stream both batches follow: finish, arrive, schedule, grow."""

    def __init__(self, rows: int, max_model_len: int, chunk: int, finish_rate: float, seed: int):
        self.rows, self.max_model_len, self.chunk, self.finish_rate = rows, max_model_len, chunk, finish_rate
        self.rng = np.random.default_rng(seed)
        self.reqs: dict[str, _Req] = {}
        self.next_id = 0

    def finished(self) -> list[str]:
        """Requests leaving this step: a random ``finish_rate`` of decodes, or full ones."""
        out = []
        for rid, r in self.reqs.items():
            decoding = r.computed >= r.prompt_len
            full = r.computed + 2 >= self.max_model_len
            if full or (decoding and self.rng.random() < self.finish_rate):
                out.append(rid)
        for rid in out:
            del self.reqs[rid]
        return out

    def arrivals(self) -> list[tuple[str, int]]:
        """New requests filling the free rows: ``(req_id, prompt_len)``."""
        new = []
        for _ in range(self.rows - len(self.reqs)):
            rid = f"r{self.next_id}"
            self.next_id += 1
            prompt_len = int(self.rng.integers(16, self.max_model_len // 2))
            self.reqs[rid] = _Req(prompt_len)
            new.append((rid, prompt_len))
        return new

    def scheduled(self) -> dict[str, int]:
        return {
            rid: 1 if r.computed >= r.prompt_len else min(self.chunk, r.prompt_len - r.computed)
            for rid, r in self.reqs.items()
        }


def _apply(batch: InputBatch, gone, new, sched, prompts) -> None:
    for rid in gone:
        batch.remove_request(rid)
    for rid, _ in new:
        batch.add_request(rid, prompts[rid])
    batch.set_num_scheduled(sched)


def _finish_step(batch: InputBatch, sched: dict[str, int]) -> None:
    """After the (unmodelled) forward: computed += scheduled; finished prompts gain a token."""
    for rid, n in sched.items():
        row = batch.req_id_to_row[rid]
        batch.num_computed_tokens[row] += n
        if batch.num_computed_tokens[row] == batch.num_tokens[row]:
            append_tokens(batch, row, [7])


def _time_moves(batch: InputBatch, threshold: int) -> tuple[float, float, int, list]:
    t0 = time.perf_counter()
    kept = batch.condense()
    perm, num_decodes = batch.reorder_split_prefill_and_decode(threshold)
    t1 = time.perf_counter()
    batch.sync_to_device()
    t2 = time.perf_counter()
    moved = int((kept != np.arange(len(kept))).sum() + (perm != np.arange(len(perm))).sum())
    return t1 - t0, t2 - t0, moved, batch.req_ids[:num_decodes]


def _time_gather(batch: InputBatch, threshold: int, device_fields: list[str]) -> tuple[float, float, list]:
    t0 = time.perf_counter()
    order, num_decodes = decode_first_order(batch, threshold)
    gathered = {name: batch.buffer(name)[order] for name in (*device_fields, *_HOST_STEP_READS)}
    t1 = time.perf_counter()
    for name in device_fields:
        paddle.to_tensor(gathered[name])
    t2 = time.perf_counter()
    req_ids = batch.req_ids
    return t1 - t0, t2 - t0, [req_ids[r] for r in order[:num_decodes]]


def run_benchmark(
    rows: int, steps: int = 200, *, max_model_len: int = 2048, block_size: int = 16, chunk: int = 128,
    finish_rate: float = 0.05, decode_threshold: int = 1, warmup: int = 10, seed: int = 0, tick=None,
) -> ReorderTiming:
    """Run ``warmup + steps`` steps of the workload on two batches of ``rows`` rows;
    ``tick()`` (a progress bar's) runs after each step, outside the timing."""
    sizes = {"max_num_seqs": rows, "max_model_len": max_model_len,
             "max_blocks_per_seq": -(-max_model_len // block_size)}
    moving, gathering = InputBatch(**sizes), InputBatch(**sizes)
    device_fields = [f.name for f in moving.fields if f.home == "device"]
    work = _Workload(rows, max_model_len, chunk, finish_rate, seed)
    prompts: dict[str, np.ndarray] = {}
    samples = []
    for step in range(warmup + steps):
        gone, new = work.finished(), work.arrivals()
        prompts.update((rid, np.full(n, 3, dtype=np.int64)) for rid, n in new)
        sched = work.scheduled()
        for batch in (moving, gathering):
            _apply(batch, gone, new, sched, prompts)
        m_us, ms_us, moved, m_dec = _time_moves(moving, decode_threshold)
        g_us, gu_us, g_dec = _time_gather(gathering, decode_threshold, device_fields)
        if sorted(m_dec) != sorted(g_dec):
            raise RuntimeError(f"step {step}: the two strategies disagree on the decode rows")
        if step >= warmup:
            samples.append((m_us, ms_us, moved, g_us, gu_us, len(m_dec)))
        for batch in (moving, gathering):
            _finish_step(batch, sched)
        for rid, n in sched.items():
            work.reqs[rid].computed += n
        if tick is not None:
            tick()
    a = np.array(samples, dtype=np.float64)
    med = np.median(a, axis=0)
    return ReorderTiming(rows, steps, float(a[:, 5].mean()), med[0] * 1e6, float(a[:, 2].mean()),
                         med[1] * 1e6, med[3] * 1e6, med[4] * 1e6)


def format_table(results: list[ReorderTiming]) -> str:
    head = (f"{'rows':>5} {'decodes':>8} | {'moves us':>9} {'rows moved':>10} {'moves+sync':>10} | "
            f"{'gather us':>9} {'gather+upload':>13} | {'moves/gather':>12}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.rows:>5} {r.mean_decodes:>8.1f} | {r.moves_us:>9.1f} {r.rows_moved:>10.1f} "
            f"{r.moves_sync_us:>10.1f} | {r.gather_us:>9.1f} {r.gather_upload_us:>13.1f} | "
            f"{r.moves_us / r.gather_us:>12.2f}"
        )
    return "\n".join(lines)


def run(args, argv=None) -> dict:
    """Every ``args.rows`` size, one progress bar each; writes ``<args.out>/reorder.json``."""
    start = time.perf_counter()
    machine = MachineRecord()
    results = []
    for rows in args.rows:
        with section(f"reorder, {rows} rows", args.warmup + args.steps, quiet=args.quiet, unit="step") as bar:
            results.append(run_benchmark(rows, args.steps, max_model_len=args.max_model_len, chunk=args.chunk,
                                         finish_rate=args.finish_rate, warmup=args.warmup, seed=args.seed,
                                         tick=bar.update))
    config = {k: getattr(args, k) for k in ("rows", "steps", "warmup", "max_model_len", "chunk", "finish_rate",
                                            "seed")}
    result = {"schema_version": 1,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m fleetlab bench reorder " + " ".join(argv or []),
              "preset": "tiny" if args.tiny else "full", "machine": machine.close(), "config": config,
              "results": [dataclasses.asdict(r) for r in results], "elapsed_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reorder.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    """Print the per-step cost table for each ``--rows`` size; write reorder.json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fleetlab bench reorder", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=200, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk per step")
    p.add_argument("--finish-rate", type=float, default=0.05, help="chance a decode finishes each step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"folder for reorder.json (default {DEFAULT_OUT})")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (tests, smoke checks)")
    add_quiet(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.steps, args.warmup, args.max_model_len, args.chunk = [8, 16], 4, 2, 64, 8
    result = run(args, argv)
    print(f"decode-first batching per step, median of {args.steps} steps (microseconds), "
          f"device {paddle.device.get_device()}")
    print("moves = condense + two-pointer reorder of all fields; +sync = then sync_to_device()")
    print("gather = index map (no row moves) + gather of the fields a step reads; +upload = device copy")
    print(format_table([ReorderTiming(**r) for r in result["results"]]))
    print(f"\n{describe(result['machine'])}")
    print(f"wrote {Path(args.out) / 'reorder.json'} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
