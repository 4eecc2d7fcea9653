"""``python -m fleetlab demo``: serve a batch of prompts on the shipped tiny model.

It prints each answer (arithmetic is checked), a timeline of which request ran a
prefill chunk (P) or a decode (D) in each step, and the engine's figures: throughput,
KV-cache utilization, prefix-cache hit rate and preemptions.

``--tensor-parallel-size N`` splits the model over N processes. Started plainly, the demo
starts itself again under ``python -m paddle.distributed.launch --nproc_per_node N`` (it
prints that line); rank 0 prints, and adds what its shard holds and what the all-reduces cost.

A progress bar on stderr counts the requests as they finish (``-q``: none; none either
under tensor parallelism, where the launcher passes rank 0's output on line by line).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import NoReturn

import paddle

from fleetlab import LLM, SamplingParams
from fleetlab.distributed.group import init_tensor_parallel, launched_rank, launched_world_size, leave_together
from fleetlab.distributed.launch import launch, launch_command, shell_line
from fleetlab.models import load_tiny
from fleetlab.models.corpus import make_prompts


def check(prompt: str, answer: str) -> str:
    """A tick or a cross for arithmetic prompts, blank for the rest."""
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for op, fn in ops.items():
        if prompt.endswith("=") and op in prompt:
            a, b = prompt[:-1].split(op)
            want = fn(int(a), int(b))
            return "ok" if answer.strip() == str(want) else f"want {want}"
    return ""


def timeline(traces, request_ids, width: int = 60) -> list[str]:
    """One text line per request: P prefill chunk, D decode, x preempted, . waiting."""
    lines = []
    for rid in request_ids:
        cells, finished = [], False
        for t in traces[:width]:
            row = next((r for r in t.rows if r.request_id == rid), None)
            if rid in t.preempted:
                cells.append("x")
            elif row is not None:
                cells.append("D" if row.phase == "decode" else "P")
            else:
                cells.append(" " if finished else ".")
            finished = finished or rid in t.finished
        lines.append("".join(cells))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetlab demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes (started through paddle.distributed.launch)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (stderr)")
    args = p.parse_args(argv)
    tp_size = args.tensor_parallel_size
    if tp_size > 1:
        if launched_world_size() == 1:
            return _relaunch(argv, tp_size)
        init_tensor_parallel(tp_size)  # before the model is built: on GPUs each rank takes its own device
        if launched_rank() != 0:  # every rank serves; rank 0 alone reports
            return _serve_quietly(args)

    model, tok = load_tiny()
    num_params = _num_params(model)  # before LLM keeps only this rank's shard of it
    llm = LLM(model, tok, block_size=args.block_size, num_blocks=args.num_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              record_traces=True, tensor_parallel_size=tp_size)
    prompts = make_prompts(args.num_prompts, args.seed)
    split = f", split over {tp_size} ranks" if tp_size > 1 else ""
    print(f"fleetlab demo: {len(prompts)} prompts, tiny trained Llama ({num_params / 1e6:.2f}M parameters{split}), "
          f"KV pool of {args.num_blocks} blocks x {args.block_size} tokens, "
          f"{args.max_num_seqs} rows, budget {args.max_num_batched_tokens} tokens/step\n", flush=True)
    t0 = time.perf_counter()
    # A rank's output reaches the terminal through the launcher, which reads it line by line: a
    # bar would arrive as one line per update, so only a single process draws one.
    outs = llm.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=not args.quiet and tp_size == 1)
    elapsed = time.perf_counter() - t0

    width = max(len(pr) for pr in prompts)
    for pr, out in zip(prompts, outs):
        print(f"  {pr:<{width}} -> {out.text!r:<32} {check(pr, out.text):>8}  [{out.finish_reason}]")
    print("\nWho ran in each step (P prefill chunk, D decode, x preempted, . waiting):")
    ids = [o.request_id for o in outs]
    for rid, line in zip(ids, timeline(llm.traces, ids)):
        print(f"  req {rid:>3} |{line}|")

    s = llm.stats()
    n_tokens = sum(len(o.token_ids) for o in outs)
    peak = max(1 - t.num_free_blocks / t.num_blocks for t in llm.traces)
    print(f"\n  {n_tokens} tokens in {elapsed:.2f} s over {s['num_steps']} steps: "
          f"{n_tokens / elapsed:.0f} output tokens/s on {_device()}")
    print(f"  KV cache: peak {peak:.0%} of blocks in use; prefix-cache hit rate "
          f"{s['prefix_cache_hit_rate']:.0%}; preemptions {s['num_preemptions']}")
    right = sum(check(p_, o.text) == "ok" for p_, o in zip(prompts, outs))
    total = sum(check(p_, o.text) != "" for p_, o in zip(prompts, outs))
    print(f"  arithmetic right: {right}/{total}")
    if llm.tensor_parallel is not None:
        _report_tensor_parallel(llm, elapsed, num_params, _num_params(model))
        leave_together(0)
    return 0


def _num_params(model) -> int:
    return sum(int(w.numel()) for w in model.parameters())


def _relaunch(argv, tp_size: int) -> int:
    """Run this demo again on ``tp_size`` ranks through Paddle's launcher, streaming rank 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_dir = tempfile.mkdtemp(prefix="fleetlab-tp-demo-")
    print("starting one process per rank:\n  " + shell_line(launch_command(["fleetlab", "demo", *argv], tp_size,
                                                                           log_dir)) + "\n", flush=True)
    result = launch(["fleetlab", "demo", *argv], tp_size, log_dir=log_dir, stream=True, timeout=3600)
    if result.returncode:
        print(f"\ntensor-parallel demo failed (exit {result.returncode}); every rank's log: {log_dir}/workerlog.*",
              file=sys.stderr)
    return result.returncode


def _serve_quietly(args) -> NoReturn:
    """A rank other than 0: serve the same prompts (same steps, same all-reduces), print nothing; leave
    with the others."""
    model, tok = load_tiny()
    llm = LLM(model, tok, block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size)
    llm.generate(make_prompts(args.num_prompts, args.seed), SamplingParams(max_tokens=24), use_tqdm=False)
    leave_together(0)


def _report_tensor_parallel(llm, elapsed: float, num_params: int, rank_params: int) -> None:
    """Rank 0's shard (``rank_params`` of the model's ``num_params``), its KV cache and the all-reduces."""
    state = llm.tensor_parallel
    tp, sharded = state.tp, state.sharded
    plan = sharded.plan
    full_kv = llm.kv_cache.bytes_allocated * plan.num_kv_heads // sharded.num_kv_heads
    print(f"\n  tensor parallel: {tp.size} ranks on {tp.backend} ({sharded.layers} layers); rank {tp.rank} holds "
          f"query heads {list(sharded.shard.q_heads)} of {plan.num_heads}, KV heads {list(sharded.shard.kv_heads)} "
          f"of {plan.num_kv_heads}, MLP columns {sharded.shard.mlp_columns[0]}:{sharded.shard.mlp_columns[1]} "
          f"of {plan.intermediate_size}: {rank_params / 1e6:.2f}M of the {num_params / 1e6:.2f}M "
          f"parameters (embeddings, norms and the LM head stay whole on every rank)")
    print(f"  KV cache on this rank: {llm.kv_cache.bytes_allocated / 1024:.0f} KiB "
          f"(one process would hold {full_kv / 1024:.0f} KiB); block tables identical on every rank")
    steps = llm.stats()["num_steps"]
    print(f"  all-reduces: {len(sharded.row_parallel)} per step ({len(sharded.row_parallel) // 2} layers x 2), "
          f"{tp.stats.num_calls} in all, {tp.stats.seconds:.2f} s = {tp.stats.seconds / elapsed:.0%} of the run "
          f"({tp.stats.seconds / max(1, tp.stats.num_calls) * 1e3:.2f} ms each); the ranks agreed on "
          f"all {llm.runner.num_checks} checked steps (of {steps})")


def _device() -> str:
    return paddle.device.get_device()
