"""Decode attention bandwidth on a GPU: the Triton paged kernel against torch SDPA.

For each (batch, context) every row decodes one token over a context of ``context``
tokens held in a paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
whose blocks are handed out in shuffled order. Three ways to do the same attention:

- ``triton``: ``fleetlab.attention.triton_kernels.decode_attention`` on the paged cache;
- ``gather+sdpa``: gather each row's blocks into contiguous K/V, then torch SDPA
  (what a framework without a paged kernel does every step);
- ``sdpa``: torch SDPA on K/V already contiguous (no paging: the bar to reach).

The figure of merit is the effective K/V read bandwidth: bytes of K and V the
attention must read (``2 * batch * context * num_kv_heads * head_dim * elem``) over the
median time (``triton.testing.do_bench``, which flushes the L2 cache before each run).
GQA is handed to SDPA as ``group`` query rows per kv head (the same softmax, no K/V
repeat), so SDPA reads each K/V byte once too.

Run on a machine with a CUDA GPU, torch and triton (no Paddle needed)::

    python -m fleetlab.bench.triton_decode --json h200_triton.json [--errors errors.json] [--tune]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import math
import platform
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

BATCHES = (1, 16, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_TOKENS = 4 * 1024 * 1024  # skip (batch, context) pairs holding more tokens than this
MIN_FOOTPRINT = 512 * 1024**2  # K/V bytes one timed graph touches (the H200's L2 is 60 MB)


@dataclass(slots=True)
class DecodeCase:
    """One timed shape: ``batch`` rows decoding over ``context`` cached tokens each."""

    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def kv_bytes(self) -> int:
        elem = 4 if self.dtype == "float32" else 2
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class KernelKnobs:
    """Tuning knobs of the decode kernel (see ``decode_attention``)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


def make_inputs(case: DecodeCase, seed: int = 0) -> dict:
    """Random query and paged cache on the GPU; block ids shuffled across rows."""
    import torch

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_row = math.ceil(case.context / case.block_size)
    num_blocks = case.batch * blocks_per_row
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    block_tables = perm.view(case.batch, blocks_per_row).to(torch.int32)
    query = torch.randn(case.batch, case.num_heads, case.head_dim, device="cuda", dtype=dtype, generator=gen)
    seq_lens = torch.full((case.batch,), case.context, device="cuda", dtype=torch.int32)
    return {"query": query, "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": block_tables, "seq_lens_kv": seq_lens}


def _gather(cache, block_tables, case: DecodeCase):
    """Paged cache -> contiguous-per-row ``[B, Hkv, L, D]`` view (one gather copy)."""
    rows = cache[block_tables.long()]  # [B, blocks, bs, Hkv, D]
    rows = rows.view(case.batch, -1, case.num_kv_heads, case.head_dim)[:, : case.context]
    return rows.transpose(1, 2)


def _sdpa_decode(query, key, value, case: DecodeCase):
    """Decode through SDPA, the GQA group as query rows: ``[B, Hkv, group, D]``."""
    import torch.nn.functional as F

    group = case.num_heads // case.num_kv_heads
    q = query.view(case.batch, case.num_kv_heads, group, case.head_dim)
    out = F.scaled_dot_product_attention(q, key, value, scale=case.head_dim ** -0.5)
    return out.reshape(case.batch, case.num_heads, case.head_dim)


def _triton_fn(inputs: dict, case: DecodeCase, knobs: KernelKnobs, out):
    from fleetlab.attention import triton_kernels as tk

    def run():
        return tk.decode_attention(
            inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
            inputs["seq_lens_kv"], max_seq_len=case.context, scale=case.head_dim ** -0.5, out=out,
            block_n=knobs.block_n, num_warps=knobs.num_warps, num_stages=knobs.num_stages,
            programs_per_sm=knobs.programs_per_sm)

    return run


def _median_ms(fn, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def _graph_ms(fns, rep: int = 100) -> float:
    """Median time of one call: replays of a CUDA graph that runs every ``fn`` once.

    The graph takes host launch costs out; ``fns`` work on distinct input sets whose
    K/V together exceed the L2 cache several times, so small shapes are not timed
    from L2 (``do_bench`` also flushes L2 before each replay).
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile kernels, fill the allocator
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = _median_ms(graph.replay, rep=rep) / len(fns)
    del graph
    return ms


def input_sets(case: DecodeCase) -> list[dict]:
    """Enough independent input sets that their K/V span ``MIN_FOOTPRINT`` bytes."""
    return [make_inputs(case, seed=i) for i in range(max(1, math.ceil(MIN_FOOTPRINT / case.kv_bytes)))]


def _max_err_vs_fp32_sdpa(inputs: dict, out, case: DecodeCase, rows: int = 8) -> float:
    """Max abs difference from fp32 SDPA on the gathered K/V, over the first ``rows`` rows."""
    import dataclasses

    sub = dataclasses.replace(case, batch=min(rows, case.batch))
    tables = inputs["block_tables"][: sub.batch]
    key = _gather(inputs["key_cache"], tables, sub).float()
    value = _gather(inputs["value_cache"], tables, sub).float()
    ref = _sdpa_decode(inputs["query"][: sub.batch].float().contiguous(), key, value, sub)
    return float((out[: sub.batch].float() - ref).abs().max())


def bench_case(case: DecodeCase, knobs: KernelKnobs, *, baselines: bool = True) -> dict:
    """Time one shape three ways (CUDA graphs); check the Triton output against fp32 SDPA.

    ``triton_eager_ms`` is the plain ``do_bench`` time of one call, host launch cost
    included where the GPU outruns the host (small shapes).
    """
    import torch

    sets = input_sets(case)
    outs = [torch.empty_like(s["query"]) for s in sets]
    runs = [_triton_fn(s, case, knobs, o) for s, o in zip(sets, outs)]
    runs[0]()
    row = asdict(case) | {
        "kv_bytes": case.kv_bytes,
        "input_sets": len(sets),
        "max_abs_err_vs_fp32_sdpa": _max_err_vs_fp32_sdpa(sets[0], outs[0], case),
        "triton_ms": _graph_ms(runs),
        "triton_eager_ms": _median_ms(runs[0]),
    }
    if baselines:
        contiguous = [(_gather(s["key_cache"], s["block_tables"], case).contiguous(),
                       _gather(s["value_cache"], s["block_tables"], case).contiguous()) for s in sets]
        row["sdpa_ms"] = _graph_ms([
            (lambda s=s, k=k, v=v: _sdpa_decode(s["query"], k, v, case)) for s, (k, v) in zip(sets, contiguous)])
        del contiguous
        row["gather_sdpa_ms"] = _graph_ms([
            (lambda s=s: _sdpa_decode(s["query"], _gather(s["key_cache"], s["block_tables"], case),
                                      _gather(s["value_cache"], s["block_tables"], case), case))
            for s in sets])
    for name in ("triton", "triton_eager", "sdpa", "gather_sdpa"):
        if f"{name}_ms" in row:
            row[f"{name}_tbps"] = case.kv_bytes / (row[f"{name}_ms"] * 1e-3) / 1e12
    if baselines:
        row["speedup_vs_gather_sdpa"] = row["gather_sdpa_ms"] / row["triton_ms"]
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    del sets, outs, runs
    torch.cuda.empty_cache()
    return row


def host_overhead_us(case: DecodeCase, knobs: KernelKnobs, calls: int = 300) -> dict:
    """Wall-clock microseconds per call of a tiny decode, issued back to back (host-bound)."""
    import time

    import torch

    inputs = make_inputs(case)
    out = torch.empty_like(inputs["query"])
    key = _gather(inputs["key_cache"], inputs["block_tables"], case).contiguous()
    value = _gather(inputs["value_cache"], inputs["block_tables"], case).contiguous()
    fns = {"triton": _triton_fn(inputs, case, knobs, out),
           "sdpa": lambda: _sdpa_decode(inputs["query"], key, value, case)}
    result = asdict(case) | {}
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        result[f"{name}_us_per_call"] = (time.perf_counter() - start) / calls * 1e6
    return result


def bench_prefill(rows: int, chunk: int, context: int, knobs: list[tuple[int, int, int, int]]) -> list[dict]:
    """Prefill kernel throughput: ``rows`` chunks of ``chunk`` queries after ``context`` cached tokens.

    ``knobs``: (block_m, block_n, num_warps, num_stages) settings to time. With no
    context, torch SDPA (causal, contiguous K/V) does the same work for comparison.
    """
    import torch
    import torch.nn.functional as F

    from fleetlab.attention import triton_kernels as tk

    case = DecodeCase(rows, context + chunk)
    inputs = make_inputs(case)
    q = torch.randn(rows * chunk, case.num_heads, case.head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, rows + 1, device="cuda", dtype=torch.int32) * chunk
    out = torch.empty_like(q)
    seen = chunk * context + chunk * (chunk + 1) // 2  # keys seen, summed over one row's queries
    flops = 4 * rows * case.num_heads * case.head_dim * seen
    results = []
    for bm, bn, warps, stages in knobs:
        def run(bm=bm, bn=bn, warps=warps, stages=stages):
            tk.prefill_attention(q, inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
                                 inputs["seq_lens_kv"], cu, first_row=0, num_rows=rows, max_query_len=chunk,
                                 scale=case.head_dim ** -0.5, out=out, block_m=bm, block_n=bn,
                                 num_warps=warps, num_stages=stages)
        row = {"rows": rows, "chunk": chunk, "context": context, "knobs": [bm, bn, warps, stages]}
        try:
            row["triton_ms"] = _graph_ms([run], rep=50)
            row["triton_tflops"] = flops / (row["triton_ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        results.append(row)
    if context == 0:
        group = case.num_heads // case.num_kv_heads
        qs = q.view(rows, chunk, case.num_heads, case.head_dim).transpose(1, 2)
        ks = _gather(inputs["key_cache"], inputs["block_tables"], case).contiguous()
        vs = _gather(inputs["value_cache"], inputs["block_tables"], case).contiguous()
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        sdpa_ms = _graph_ms([lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)], rep=50)
        results.append({"rows": rows, "chunk": chunk, "context": 0, "sdpa_causal_ms": sdpa_ms,
                        "sdpa_causal_tflops": flops / (sdpa_ms * 1e-3) / 1e12})
    return results


PREFILL_KNOBS = [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3)]


def measure_ceilings() -> dict:
    """Device memory ceilings: a large copy (read+write) and a large read (sum)."""
    import torch

    src = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(functools.partial(dst.copy_, src))
    read_ms = _median_ms(functools.partial(torch.sum, src, dtype=torch.float32))
    nbytes = src.numel() * src.element_size()
    return {"copy_read_plus_write_tbps": 2 * nbytes / (copy_ms * 1e-3) / 1e12,
            "read_sum_tbps": nbytes / (read_ms * 1e-3) / 1e12}


def tune(cases: list[DecodeCase], grid: list[KernelKnobs]) -> list[dict]:
    """Time every knob setting on every case (Triton only, CUDA graphs, inputs built once)."""
    import torch

    rows = []
    for case in cases:
        sets = input_sets(case)
        outs = [torch.empty_like(s["query"]) for s in sets]
        for knobs in grid:
            row = asdict(case) | {"knobs": asdict(knobs)}
            try:
                row["triton_ms"] = _graph_ms([_triton_fn(s, case, knobs, o) for s, o in zip(sets, outs)], rep=50)
                row["triton_tbps"] = case.kv_bytes / (row["triton_ms"] * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile (e.g. out of shared memory)
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            log.info("tune %s", row)
        del sets, outs
        torch.cuda.empty_cache()
    return rows


def _best_knobs(rows: list[dict], top: int = 3) -> list[str]:
    """One line per tuned case: its ``top`` fastest knob settings."""
    lines = []
    for key in sorted({(r["batch"], r["context"]) for r in rows}):
        ok = sorted((r for r in rows if (r["batch"], r["context"]) == key and "triton_tbps" in r),
                    key=lambda r: -r["triton_tbps"])
        best = ", ".join(f"{tuple(r['knobs'].values())}: {r['triton_tbps']:.2f}" for r in ok[:top])
        lines.append(f"tune b={key[0]} ctx={key[1]} (block_n, warps, stages, progs/SM): {best}")
    return lines


def tuning_cases(quick: bool) -> list[DecodeCase]:
    cases = [DecodeCase(64, 2048), DecodeCase(256, 2048), DecodeCase(64, 8192), DecodeCase(1, 32768),
             DecodeCase(16, 8192)]
    return cases[:2] if quick else cases


def tuning_grid(quick: bool) -> list[KernelKnobs]:
    if quick:
        return [KernelKnobs(bn, 4, s, 2) for bn in (32, 64) for s in (2, 3)]
    grid = [KernelKnobs(bn, w, s, 2) for bn in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]
    return grid + [KernelKnobs(64, 4, 3, p) for p in (1, 4, 8)] + [KernelKnobs(64, 4, 2, p) for p in (4, 8)]


def environment() -> dict:
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _table(rows: list[dict]) -> str:
    head = (f"{'batch':>5} {'context':>7} | {'triton':>7} {'gath+sdpa':>9} {'sdpa':>7} TB/s | "
            f"{'x gather':>8} {'x sdpa':>6} | {'eager':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['batch']:>5} {r['context']:>7} | {r['triton_tbps']:>7.2f} {r.get('gather_sdpa_tbps', 0):>9.2f} "
            f"{r.get('sdpa_tbps', 0):>7.2f}      | {r.get('speedup_vs_gather_sdpa', 0):>8.2f} "
            f"{r.get('speedup_vs_sdpa', 0):>6.2f} | {r['triton_eager_tbps']:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--errors", help="JSON of max errors written by tests/test_triton_kernels.py")
    parser.add_argument("--tune", action="store_true", help="also sweep the kernel's knobs")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--knobs", default="", help="block_n,num_warps,num_stages,programs_per_sm")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    knobs = KernelKnobs(*map(int, args.knobs.split(","))) if args.knobs else KernelKnobs()
    result = {"environment": environment(), "case_defaults": asdict(DecodeCase(1, 1)),
              "knobs": asdict(knobs), "ceilings": measure_ceilings()}
    if args.errors:
        with open(args.errors) as f:
            result["max_error_vs_dense_reference"] = json.load(f)
    batches, contexts = ((1, 64, 256), (512, 2048, 32768)) if args.quick else (BATCHES, CONTEXTS)
    rows = []
    for b in batches:
        for c in contexts:
            if b * c <= MAX_TOKENS:
                rows.append(bench_case(DecodeCase(b, c), knobs))
                log.info("%s", rows[-1])
    result["decode_bandwidth"] = rows
    result["host_overhead"] = host_overhead_us(DecodeCase(1, 512), knobs)
    goal = [r for r in rows if r["batch"] >= 64 and r["context"] >= 2048]
    if goal:
        result["goal_check"] = {
            "min_triton_tbps_batch64_ctx2k_up": min(r["triton_tbps"] for r in goal),
            "min_speedup_vs_gather_sdpa_batch64_ctx2k_up": min(r["speedup_vs_gather_sdpa"] for r in goal),
        }
    result["prefill"] = bench_prefill(4, 2048, 2048, PREFILL_KNOBS) + bench_prefill(1, 8192, 0, PREFILL_KNOBS)
    if args.tune:
        result["tuning"] = tune(tuning_cases(args.quick), tuning_grid(args.quick))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ceilings"]))
    for case_rows in _best_knobs(result.get("tuning", [])):
        print(case_rows)
    print(_table(rows))
    if "goal_check" in result:
        print(json.dumps(result["goal_check"]))
    print(json.dumps(result["host_overhead"]))
    for r in result["prefill"]:
        print("prefill", json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
