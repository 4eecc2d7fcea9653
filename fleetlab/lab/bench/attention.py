"""Benchmark of the tiled paged attention (the default backend) against the naive one.

Times one layer's ``fleetlab.attention.tiled.paged_attention`` call for a batch of decodes
at a fixed context and for a prefill, and the same work done row by row by
``fleetlab.attention.naive.naive_paged_attention`` (a Python loop over requests, each
gathering its own blocks); checks the two agree. Results: ``<out>/attention.json``.

Run ``python -m fleetlab bench attention [--out DIR] [-q]`` (``--help`` lists the shapes).

JSON schema (``schema_version`` 1; times in milliseconds)::

    schema_version, created, command, preset ("full" | "tiny"), elapsed_s
    machine: see fleetlab.lab.bench.machine (threads, load average, cpu_use while measuring)
    config: {num_decodes, context, prefill_tokens, heads, kv_heads, head_dim, block_size, dtype,
             repeats, malloc_tuned}
    cases: list of {case, num_reqs, query_len, num_computed, tiled_ms, tiled_best_ms, naive_ms,
                    naive_best_ms, max_diff}   (medians and bests over ``repeats`` calls)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.attention.naive import naive_paged_attention
from fleetlab.attention.tiled import paged_attention
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.lab.cpu_tuning import tune_malloc

DEFAULT_OUT = Path("benchmarks/results")


@dataclass(slots=True)
class Case:
    """One benchmark batch: ``num_reqs`` rows of ``query_len`` new tokens after ``num_computed``."""

    name: str
    num_reqs: int
    query_len: int
    num_computed: int


def build_case(case: Case, args, seed: int = 0):
    """A filled cache (blocks shuffled), the step's metadata and random queries."""
    rng = np.random.default_rng(seed)
    seq_len = case.num_computed + case.query_len
    per_req = -(-seq_len // args.block_size)
    num_blocks = case.num_reqs * per_req
    cache = PagedKVCache(1, num_blocks, args.block_size, args.kv_heads, args.head_dim, dtype=args.dtype)
    tables = rng.permutation(num_blocks).reshape(case.num_reqs, per_req)
    fill = AttentionMetadata.build([seq_len] * case.num_reqs, [0] * case.num_reqs, tables, args.block_size)
    shape = [fill.num_tokens, args.kv_heads, args.head_dim]
    cache.write(0, paddle.randn(shape).astype(args.dtype), paddle.randn(shape).astype(args.dtype),
                fill.slot_mapping)
    md = AttentionMetadata.build([case.query_len] * case.num_reqs, [case.num_computed] * case.num_reqs,
                                 tables, args.block_size)
    query = paddle.to_tensor(rng.standard_normal((md.num_tokens, args.heads, args.head_dim)).astype("float32"))
    return cache, md, query.astype(args.dtype)


def _sync() -> None:
    """Wait for queued device work (CPU runs eagerly: nothing to wait for)."""
    if not paddle.device.get_device().startswith("cpu"):
        paddle.device.synchronize()


def time_call(fn, repeats: int, tick=None) -> tuple[float, float]:
    """``(median, best)`` wall time of ``fn()`` in milliseconds, after two warm-up calls;
    ``tick()`` (a progress bar's) runs after each call, outside the timing.

    The best time is the one to trust on a shared, busy machine.
    """
    times = []
    for i in range(repeats + 2):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
        if tick is not None:
            tick()
    return 1e3 * statistics.median(times), 1e3 * min(times)


def bench_case(case: Case, args, bar=None) -> dict:
    """Time the tiled and the naive attention on one case; check they agree."""
    cache, md, query = build_case(case, args)
    kc, vc = cache.key_cache(0), cache.value_cache(0)
    scale = args.head_dim ** -0.5

    def tiled():
        return paged_attention(query, kc, vc, md, scale=scale)

    def naive():
        return naive_paged_attention(query, kc, vc, md, scale=scale)

    def timed(name, fn):
        if bar is not None:
            bar.set_postfix_str(f"{case.name}: {name}")
        return time_call(fn, args.repeats, bar.update if bar is not None else None)

    err = float((tiled().astype("float32") - naive().astype("float32")).abs().max())
    fast, slow = timed("tiled", tiled), timed("naive", naive)
    return {"case": case.name, "num_reqs": case.num_reqs, "query_len": case.query_len,
            "num_computed": case.num_computed, "tiled_ms": fast[0], "tiled_best_ms": fast[1],
            "naive_ms": slow[0], "naive_best_ms": slow[1], "max_diff": err}


def cases(args) -> list[Case]:
    """The decode batch and the prefill that ``args`` describe."""
    return [Case(f"{args.num_decodes} decodes @ ctx {args.context}", args.num_decodes, 1, args.context - 1),
            Case(f"prefill {args.prefill_tokens} tokens", 1, args.prefill_tokens, 0)]


def run(args, argv=None) -> dict:
    """Time every case, write ``<args.out>/attention.json``; returns the result."""
    start = time.perf_counter()
    machine = MachineRecord()
    todo = cases(args)
    with section("attention cases", len(todo) * 2 * (args.repeats + 2), quiet=args.quiet, unit="call") as bar:
        records = [bench_case(case, args, bar) for case in todo]  # 2 functions, repeats + 2 calls each
    config = {k: getattr(args, k) for k in ("num_decodes", "context", "prefill_tokens", "heads", "kv_heads",
                                            "head_dim", "block_size", "dtype", "repeats")}
    result = {"schema_version": 1,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m fleetlab bench attention " + " ".join(argv or []),
              "machine": machine.close(), "config": {**config, "malloc_tuned": getattr(args, "malloc_tuned", None)},
              "preset": "tiny" if args.tiny else "full",
              "cases": records, "elapsed_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def table(result: dict) -> str:
    """The printed table: per-call time of the tiled and the naive attention."""
    lines = [f"{'case':<28}{'tiled ms':>20}{'naive ms':>22}{'speedup':>9}{'max |diff|':>12}",
             f"{'':<28}{'median / best':>20}{'median / best':>22}{'(best)':>9}"]
    for r in result["cases"]:
        lines.append(f"{r['case']:<28}{r['tiled_ms']:>11.1f} / {r['tiled_best_ms']:>6.1f}"
                     f"{r['naive_ms']:>13.1f} / {r['naive_best_ms']:>6.1f}"
                     f"{r['naive_best_ms'] / r['tiled_best_ms']:>8.1f}x{r['max_diff']:>12.1e}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fleetlab bench attention", description=__doc__.splitlines()[0])
    p.add_argument("--num-decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"folder for attention.json (default {DEFAULT_OUT})")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run on small shapes (tests, smoke checks)")
    add_quiet(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.num_decodes, args.context, args.prefill_tokens, args.repeats = 4, 64, 32, 2
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    """Time the cases, print a table, write attention.json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # As `python -m fleetlab` does for every command: keep Paddle's freed CPU buffers in the
    # process (see fleetlab.lab.cpu_tuning), so `python -m fleetlab.lab.bench.attention` times the same.
    args.malloc_tuned = tune_malloc()
    print(f"paged attention, one layer: Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"block={args.block_size} {args.dtype} on {paddle.device.get_device()}", flush=True)
    result = run(args, argv)
    print(table(result))
    print(f"\n{describe(result['machine'])}")
    print(f"wrote {Path(args.out) / 'attention.json'} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
