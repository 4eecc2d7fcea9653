"""Benchmark: prefix caching, hash chain against radix tree against none, and fcfs against lpm.

Workloads (token ids on a random-init tiny Llama, greedy with ``ignore_eos``):

- ``few_shot``: requests sharing a long prefix whose length is not a multiple of the block
  size (a few-shot preamble), each with its own question;
- ``multi_turn``: conversations where each turn's prompt is the last turn's prompt, its answer
  and a new message; turn ``t`` of every conversation runs once turn ``t - 1`` is done;
- ``unrelated``: random prompts that share nothing (the cache's overhead alone);
- ``groups`` (the scheduling comparison): several long prefixes, each shared by a group of
  requests, arriving interleaved into a pool too small to keep every prefix; run with the
  radix cache under ``fcfs`` and under ``lpm`` (longest cached prefix first).

Per run: prefill tokens computed (tokens looked up at admissions less the tokens hit, which
counts a preempted request's recomputation; with no cache, the prompts' length), hit rate,
preemptions, output tokens per second, median time to first token. Every configuration is
warmed up once untimed, then each round runs every configuration once on a fresh ``LLM``
(building it is not timed) in a rotated order; a figure is the median over rounds.

Also measured: what serving a match that ends inside a block costs either way, per token: the
radix tree copies the matched tokens' K/V (every layer, K and V), the hash chain recomputes them
in the request's first chunk (:mod:`fleetlab.lab.bench.copy_cost`, both sides alternating).

Results: ``<out>/prefix.json`` (default ``benchmarks/results``).

Run: ``OMP_NUM_THREADS=1 python -m fleetlab bench prefix [--tiny] [--rounds N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fleetlab import LLM, SamplingParams
from fleetlab.lab.bench.copy_cost import copy_against_recompute
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.models import tiny

DEFAULT_OUT = Path("benchmarks/results")
PRESETS = {  # requests per workload, shared prefix length, output tokens, rounds
    "full": dict(num_requests=24, prefix_len=150, question_len=(8, 24), max_tokens=8, turns=4, chats=6,
                 groups=4, per_group=6, group_pool_blocks=40, rounds=3, copy_rounds=200),
    "tiny": dict(num_requests=6, prefix_len=38, question_len=(3, 8), max_tokens=3, turns=2, chats=2,
                 groups=2, per_group=3, group_pool_blocks=12, rounds=1, copy_rounds=5),
}
BLOCK_SIZE = 16


def _prompts(p: dict, rng) -> dict:
    """Token-id prompts of each workload (``multi_turn`` holds each chat's new messages)."""
    rand = lambda n: rng.integers(3, 1000, size=int(n)).tolist()  # noqa: E731
    qlen = lambda: rng.integers(*p["question_len"])  # noqa: E731
    head = rand(p["prefix_len"])
    heads = [rand(p["prefix_len"]) for _ in range(p["groups"])]
    groups = [heads[g] + rand(qlen()) for i in range(p["per_group"]) for g in range(p["groups"])]  # interleaved
    return {"few_shot": [head + rand(qlen()) for _ in range(p["num_requests"])],
            "multi_turn": [[rand(qlen() + 16) for _ in range(p["turns"])] for _ in range(p["chats"])],
            "unrelated": [rand(p["prefix_len"] + qlen()) for _ in range(p["num_requests"])],
            "groups": groups}


def _run(model, workload: str, prompts, p: dict, prefix_cache, policy="fcfs") -> dict:
    """One timed run on a fresh engine; returns its figures and tokens."""
    sp = SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True)
    num_blocks = p["group_pool_blocks"] if workload == "groups" else 4096
    llm = LLM(model, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=512, num_blocks=num_blocks,
              prefix_cache=prefix_cache, scheduling_policy=policy)
    with llm:
        start = time.perf_counter()
        if workload == "multi_turn":
            outs, history = [], [[] for _ in prompts]
            for t in range(p["turns"]):
                turn = [h + chat[t] for h, chat in zip(history, prompts)]
                got = llm.generate(prompt_token_ids=turn, sampling_params=sp, use_tqdm=False)
                history = [q + o.token_ids for q, o in zip(turn, got)]
                outs += got
            prompt_lens = [len(o.prompt_token_ids) for o in outs]
        else:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            prompt_lens = [len(q) for q in prompts]
        seconds = time.perf_counter() - start
        s = llm.stats()
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    computed = s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"] if prefix_cache else sum(prompt_lens)
    return {"prefill_tokens_computed": int(computed), "prompt_tokens": int(sum(prompt_lens)),
            "hit_rate": s["prefix_cache_hit_rate"], "num_preemptions": s["num_preemptions"],
            "seconds": seconds, "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
            "ttft_median_ms": 1e3 * statistics.median(ttft), "tokens": [o.token_ids for o in outs]}


CONFIGS = [("few_shot", "hash", "fcfs"), ("few_shot", "radix", "fcfs"), ("few_shot", None, "fcfs"),
           ("multi_turn", "hash", "fcfs"), ("multi_turn", "radix", "fcfs"), ("multi_turn", None, "fcfs"),
           ("unrelated", "hash", "fcfs"), ("unrelated", "radix", "fcfs"), ("unrelated", None, "fcfs"),
           ("groups", "hash", "fcfs"), ("groups", "hash", "lpm"), ("groups", "radix", "fcfs"),
           ("groups", "radix", "lpm")]


def run_bench(preset: str, rounds: int | None, quiet: bool) -> dict:
    p = dict(PRESETS[preset])
    rounds = rounds or p["rounds"]
    model = tiny("llama", seed=0, vocab_size=1024)
    prompts = _prompts(p, np.random.default_rng(0))
    machine = MachineRecord()
    runs: dict[str, list[dict]] = {}
    with section("prefix: warm-up + rounds", (rounds + 1) * len(CONFIGS), quiet=quiet) as bar:
        for r in range(rounds + 1):  # round 0 is the untimed warm-up
            order = CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]
            for workload, cache, policy in order:
                got = _run(model, workload, prompts[workload], p, cache, policy)
                if r:
                    runs.setdefault(f"{workload}/{cache}/{policy}", []).append(got)
                bar.update(1)
    result = {"command": f"python -m fleetlab bench prefix{' --tiny' if preset == 'tiny' else ''}"
                         f" --rounds {rounds}", "preset": preset, "params": p, "block_size": BLOCK_SIZE,
              "date": datetime.date.today().isoformat(), "runs": {}}
    for key, rs in sorted(runs.items(), key=lambda kv: [f"{w}/{c}/{q}" for w, c, q in CONFIGS].index(kv[0])):
        summary = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tokens"}
        summary["same_tokens_every_round"] = all(r["tokens"] == rs[0]["tokens"] for r in rs)
        result["runs"][key] = summary
    for workload in ("few_shot", "multi_turn", "unrelated"):  # every design gives the tokens of no cache
        none = runs[f"{workload}/None/fcfs"][0]["tokens"]
        result["runs"][f"{workload}/radix/fcfs"]["same_tokens_as_no_cache"] = \
            runs[f"{workload}/radix/fcfs"][0]["tokens"] == none
        result["runs"][f"{workload}/hash/fcfs"]["same_tokens_as_no_cache"] = \
            runs[f"{workload}/hash/fcfs"][0]["tokens"] == none
    partial = p["prefix_len"] % BLOCK_SIZE
    with section("prefix: copy against recompute", 1, quiet=quiet) as bar:
        result["partial_block"] = {"tokens_per_request": partial, **copy_against_recompute(
            model, k=partial, context=p["prefix_len"] - partial, block_size=BLOCK_SIZE, rounds=p["copy_rounds"])}
        bar.update(1)
    result["machine"] = machine.close()
    return result


def table(result: dict) -> str:
    """The results as the README shows them: one row a workload/cache/policy run (markdown)."""
    rows = ["| workload | prefix cache | policy | prefill tokens computed / prompt tokens | hit rate | preemptions "
            "| output tok/s | median TTFT |", "|---|---|---|---|---|---|---|---|"]
    for key, x in result["runs"].items():
        workload, cache, policy = key.split("/")
        rows.append(f"| {workload} | {cache} | {policy} | {x['prefill_tokens_computed']:.0f} / "
                    f"{x['prompt_tokens']:.0f} | {x['hit_rate']:.2f} | {x['num_preemptions']:.0f} | "
                    f"{x['output_tokens_per_s']:.0f} | {x['ttft_median_ms']:.0f} ms |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetlab bench prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_quiet(parser)
    args = parser.parse_args(argv)
    result = run_bench("tiny" if args.tiny else "full", args.rounds, args.quiet)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "prefix.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"\n{describe(result['machine'])}\nwrote {path}", file=sys.stderr)
    return 0
