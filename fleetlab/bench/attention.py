"""Benchmark of the reference paged attention: vectorized against a per-request loop.

Times one layer's ``paged_attention`` call for a batch of decodes at a fixed context and
for a prefill, and the same work done the slow way (a Python loop over requests, each
gathering its own blocks). Run ``python -m fleetlab.bench.attention --help``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
import paddle

from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.attention.tiled import paged_attention
from fleetlab.cpu_tuning import tune_malloc
from fleetlab.kv.paged_cache import PagedKVCache


@dataclass(slots=True)
class Case:
    """One benchmark batch: ``num_reqs`` rows of ``query_len`` new tokens after ``num_computed``."""

    name: str
    num_reqs: int
    query_len: int
    num_computed: int


def naive_paged_attention(query, key_cache, value_cache, metadata, *, scale):
    """The slow baseline: a Python loop over requests, one small attention each (no window/sinks).

    Shapes as :func:`fleetlab.attention.tiled.paged_attention`.
    """
    num_heads = query.shape[1]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = num_heads // num_kv_heads
    cu, seq_lens = metadata.cu_seqlens_q_host, metadata.seq_lens_kv_host
    outs = []
    for r in range(metadata.num_reqs):
        start, end, seq_len = int(cu[r]), int(cu[r + 1]), int(seq_lens[r])
        blocks = metadata.block_tables[r, : -(-seq_len // metadata.block_size)].astype("int64")
        k = paddle.gather(key_cache, blocks).reshape([-1, num_kv_heads, head_dim])[:seq_len]
        v = paddle.gather(value_cache, blocks).reshape([-1, num_kv_heads, head_dim])[:seq_len]
        k = paddle.repeat_interleave(k.astype("float32"), group, axis=1).transpose([1, 2, 0])  # [Hq, D, L]
        v = paddle.repeat_interleave(v.astype("float32"), group, axis=1).transpose([1, 0, 2])  # [Hq, L, D]
        q = query[start:end].astype("float32").transpose([1, 0, 2]) * scale  # [Hq, n, D]
        scores = paddle.matmul(q, k)
        qpos = paddle.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        scores = paddle.where(paddle.arange(seq_len).unsqueeze(0) <= qpos, scores,
                              paddle.full([], float("-inf"), "float32"))
        out = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), v)
        outs.append(out.transpose([1, 0, 2]))
    return paddle.concat(outs).astype(query.dtype)


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


def time_call(fn, repeats: int) -> tuple[float, float]:
    """``(median, best)`` wall time of ``fn()`` in milliseconds, after two warm-up calls.

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
    return 1e3 * statistics.median(times), 1e3 * min(times)


def bench_case(case: Case, args) -> dict:
    """Time the vectorized reference and the per-request loop on one case; check they agree."""
    cache, md, query = build_case(case, args)
    kc, vc = cache.key_cache(0), cache.value_cache(0)
    scale = args.head_dim ** -0.5

    def fast():
        return paged_attention(query, kc, vc, md, scale=scale)

    def slow():
        return naive_paged_attention(query, kc, vc, md, scale=scale)

    err = float((fast().astype("float32") - slow().astype("float32")).abs().max())
    vec, loop = time_call(fast, args.repeats), time_call(slow, args.repeats)
    return {"case": case.name, "vectorized_ms": vec[0], "vectorized_best_ms": vec[1],
            "loop_ms": loop[0], "loop_best_ms": loop[1], "max_diff": err}


def run(args) -> list[dict]:
    """Time every case; returns one record per case."""
    cases = [
        Case(f"{args.num_decodes} decodes @ ctx {args.context}", args.num_decodes, 1, args.context - 1),
        Case(f"prefill {args.prefill_tokens} tokens", 1, args.prefill_tokens, 0),
    ]
    return [bench_case(case, args) for case in cases]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tune-malloc", action="store_true",
                   help="keep freed large buffers in the process (glibc mallopt): Paddle's CPU "
                        "allocator otherwise maps and unmaps every large tensor, and page faults "
                        "can dominate a CPU run")
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Print a table: per-call time of the vectorized reference and of the per-request loop."""
    args = parse_args(argv)
    tuned = tune_malloc() if args.tune_malloc else False
    print(f"reference paged attention, one layer: Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"block={args.block_size} {args.dtype} on {paddle.device.get_device()}"
          f"{', malloc tuned' if tuned else ''}")
    print(f"{'case':<28}{'vectorized ms':>20}{'per-request loop ms':>22}{'speedup':>9}{'max |diff|':>12}")
    print(f"{'':<28}{'median / best':>20}{'median / best':>22}{'(best)':>9}")
    for r in run(args):
        print(f"{r['case']:<28}{r['vectorized_ms']:>11.1f} / {r['vectorized_best_ms']:>6.1f}"
              f"{r['loop_ms']:>13.1f} / {r['loop_best_ms']:>6.1f}"
              f"{r['loop_best_ms'] / r['vectorized_best_ms']:>8.1f}x{r['max_diff']:>12.1e}")


if __name__ == "__main__":
    main()
