"""``python -m fleetlab.lab.tp_worker``: one rank of a tensor-parallel run that reports.

Started once per rank by ``paddle.distributed.launch`` (or alone, for the one-process
baseline), it serves a fixed greedy workload on tiny random models and writes what this
rank saw to ``<out>/rank<r>.json``: each request's tokens, the pool's state afterwards,
this rank's KV heads and bytes, its shard, step times, and its all-reduces (totals, and
every call of one recorded step). Tests, the ``09_tensor_parallel`` notebook and
``bench tp`` read those files. (The failure tests wrap :func:`main` with a ``before_step``
hook that kills a rank, in ``tests/tp_faults.py``.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import paddle

from fleetlab import LLM, SamplingParams
from fleetlab.distributed.group import (
    TensorParallelGroup,
    join_with_fleet,
    launched_rank,
    launched_world_size,
    leave_together,
)
from fleetlab.distributed.layers import column_parallel, row_parallel
from fleetlab.inspect.pool import check_pool
from fleetlab.models import tiny

# The parity workload: prompts longer than the step budget (chunked prefill) and a pool
# too small for all of them at once (preemption).
PARITY = {"prompt_lens": [5, 9, 17, 3, 30, 12], "max_tokens": 6, "block_size": 4, "num_blocks": 14,
          "max_num_batched_tokens": 10, "max_num_seqs": 64}


def prompts_for(lengths, seed: int = 1, vocab: int = 100) -> list[list[int]]:
    """Deterministic random prompts (token ids ``3 .. vocab-1``), one per length."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lengths]


def run_family(family: str, tensor_parallel_size: int = 1, *, prompt_lens=PARITY["prompt_lens"],
               max_tokens: int = PARITY["max_tokens"], block_size: int = PARITY["block_size"],
               num_blocks: int | None = PARITY["num_blocks"],
               max_num_batched_tokens: int = PARITY["max_num_batched_tokens"],
               max_num_seqs: int = PARITY["max_num_seqs"], model_overrides: dict | None = None,
               record_step: int = 1, before_step=None, prompt_seed: int = 1, temperature: float = 0.0,
               top_k: int = 0, prefix_cache: str | None = "hash") -> dict:
    """Serve the workload on ``tiny(family)`` with ``tensor_parallel_size`` ranks; return a report.

    The model is built with seed 0 on every rank (identical weights), then sharded by
    ``LLM``. ``record_step``: the step whose all-reduces are kept one by one.
    ``before_step(step)``, if given, is called before each engine step. ``temperature > 0``
    samples instead (each request's seed drawn by the engine from ``EngineConfig.seed``, as
    for any request without one).
    """
    model = tiny(family, seed=0, **(model_overrides or {}))
    vocab = min(100, int(model.config.vocab_size))
    prompts = prompts_for(prompt_lens, prompt_seed, vocab)
    llm = LLM(model, block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max_num_seqs, record_traces=True, tensor_parallel_size=tensor_parallel_size,
              prefix_cache=prefix_cache)
    tp = llm.tensor_parallel.tp if llm.tensor_parallel else None
    if tp is not None:
        tp.stats.reset()  # the group outlives one LLM: count this run's all-reduces only
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, top_k=top_k)
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=sp) for p in prompts]
    outputs, step_s, step_comm, records = {}, [], [], []
    step = 0
    while llm.has_unfinished_requests():
        if before_step is not None:
            before_step(step)
        if tp is not None:
            tp.stats.recording = step == record_step
            before = (tp.stats.num_calls, tp.stats.seconds)
        t0 = time.perf_counter()
        for out in llm.step():
            outputs[out.request_id] = out.token_ids
        step_s.append(time.perf_counter() - t0)
        if tp is not None:
            step_comm.append([tp.stats.num_calls - before[0], tp.stats.seconds - before[1]])
            if step == record_step:
                records = [asdict(r) for r in tp.stats.records]
                tp.stats.recording = False
                tp.stats.records.clear()
        step += 1
    pool_ok = True
    try:
        check_pool(llm.pool)
    except Exception as e:  # reported, not raised: the test names what broke on which rank
        pool_ok = f"{type(e).__name__}: {e}"
    stats = llm.stats()
    report = {
        "family": family,
        "tokens": [outputs[i] for i in ids],
        "num_preemptions": stats["num_preemptions"],
        "num_blocks": stats["num_blocks"],
        "num_free_blocks": stats["num_free_blocks"],
        "pool_ok": pool_ok,
        "num_kv_heads": llm.kv_cache.num_kv_heads,
        "kv_cache_bytes": llm.kv_cache.bytes_allocated,
        "step_s": step_s,
        "step_num_tokens": [t.num_batched_tokens for t in llm.traces],
        "step_has_prefill": [any(r.phase == "prefill" for r in t.rows) for t in llm.traces],
        "forward_s": [t.timings.get("forward", 0.0) for t in llm.traces],
        "chunked_prefill": any(0 < r.num_scheduled_tokens < r.num_prompt_tokens - r.num_computed_tokens
                               for t in llm.traces for r in t.rows if r.phase == "prefill"),
    }
    if tp is not None:
        sharded = llm.tensor_parallel.sharded
        report.update({
            "all_reduce_calls": tp.stats.num_calls, "all_reduce_s": tp.stats.seconds,
            "all_reduce_bytes": tp.stats.nbytes, "step_all_reduce": step_comm, "recorded_step": record_step,
            "recorded_all_reduces": records, "agreement_checks": llm.runner.num_checks,
            "q_heads": list(sharded.shard.q_heads), "kv_heads": list(sharded.shard.kv_heads),
            "mlp_columns": list(sharded.shard.mlp_columns), "layers": sharded.layers,
            "weight_shapes": {k: [list(a), list(b)] for k, (a, b) in sharded.weight_shapes.items()},
        })
        # After the totals above are read: the probe's calls are not the run's.
        report["all_reduce_alone_ms"] = all_reduce_latency_ms(tp, [max_num_seqs, int(model.config.hidden_size)])
    return report


def all_reduce_latency_ms(tp, shape, calls: int = 100) -> float:
    """Median milliseconds of one all-reduce of a float32 ``shape`` tensor, ranks in lockstep
    and nothing else to do: the exchange alone, without the waiting a serving step adds."""
    x = paddle.ones(shape, dtype="float32")
    times = []
    for i in range(calls + 5):
        t0 = time.perf_counter()
        tp.all_reduce(x, "latency probe")
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def check_fleet_layers(tp_size: int) -> dict:
    """What Paddle's own tensor-parallel layers do on this device (run after the engine work).

    Builds ``ColumnParallelLinear`` / ``RowParallelLinear`` under ``fleet.init`` (mp degree
    ``tp_size``, ``mp_skip_c_identity`` on), loads them with this rank's slices of a known
    weight, and compares with the manual shards. Returns ``{"column": "ok" | error,
    "row": "ok" | error}``.
    """
    group = join_with_fleet(tp_size)  # what init_tensor_parallel(N, layers="paddle") does
    tp = TensorParallelGroup(group.rank, group.nranks, group, "gloo", layers="paddle")
    full = paddle.arange(8 * 16, dtype="float32").reshape([8, 16]) / 100
    x = paddle.linspace(-1, 1, 3 * 8).reshape([1, 3, 8])
    cols = full[:, tp.rank * 16 // tp_size:(tp.rank + 1) * 16 // tp_size]
    rows = full.T[tp.rank * 16 // tp_size:(tp.rank + 1) * 16 // tp_size]
    result = {}
    with paddle.no_grad():
        for kind, build, inp, want in (
                ("column", lambda ly: column_parallel(cols, None, tp, ly), x, paddle.matmul(x, cols)),
                ("row", lambda ly: row_parallel(rows, None, tp, ly, "check"),
                 paddle.matmul(x, cols), paddle.matmul(paddle.matmul(x, full), full.T))):
            try:
                got = build("paddle")(inp)
                result[kind] = "ok" if bool(paddle.allclose(got, want, atol=1e-4)) else "wrong values"
            except Exception as e:  # the finding is the error itself
                result[kind] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return result


def main(argv=None, *, before_step=None) -> int:
    """Run the families given on the command line; ``before_step(step)`` before every engine step."""
    p = argparse.ArgumentParser(prog="python -m fleetlab.lab.tp_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for rank<r>.json")
    p.add_argument("--families", default="fleet,llama",
                   help="comma-separated; 'fleet:sampled' samples (temperature 1, top-k 20) instead of greedy")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="default: the launched world size")
    p.add_argument("--workload", default="{}", help="JSON of run_family keywords (prompt_lens, max_tokens, ...)")
    p.add_argument("--check-fleet-layers", action="store_true")
    args = p.parse_args(argv)

    rank = launched_rank()
    tp_size = args.tensor_parallel_size or launched_world_size()
    workload = json.loads(args.workload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"rank": rank, "tp_size": tp_size, "families": {}}
    t0 = time.perf_counter()
    for name in [f for f in args.families.split(",") if f]:
        family, _, mode = name.partition(":")  # "fleet:sampled": temperature 1, top-k 20; "fleet:radix"
        sampling = {"sampled": {"temperature": 1.0, "top_k": 20}, "radix": {"prefix_cache": "radix"}}.get(mode, {})
        report["families"][name] = run_family(family, tp_size, before_step=before_step, **workload, **sampling)
    report["seconds"] = time.perf_counter() - t0
    if args.check_fleet_layers:
        report["fleet_layers"] = check_fleet_layers(tp_size)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    print(f"rank {rank}/{tp_size}: wrote {out / f'rank{rank}.json'} in {report['seconds']:.1f} s", flush=True)
    if tp_size > 1:
        leave_together(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
