"""Triton paged attention on a GPU, side by side with torch SDPA on contiguous K/V.

Every case keeps its K/V in a paged cache ``[num_blocks, block_size, num_kv_heads,
head_dim]`` whose blocks are handed out in shuffled order, and times, in one run:

- ``triton``: ``fleetlab.attention.triton_kernels`` as the backend calls it: planned
  once (``plan_decode`` / ``plan_prefill`` / ``StepPlans``), then ``AttentionPlan.run``;
- ``sdpa``: torch SDPA on K/V already contiguous (no paging: the bar to reach);
- ``gather_sdpa`` (decode table): gather each row's blocks, then SDPA (what a framework
  without a paged kernel does every step);
- ``before`` (with ``--before FILE``): the same calls into an older copy of the kernels
  module, through its one-call functions (which plan on every call). Rows of several query
  tokens go to its prefill kernel (kernels older than multi-token decode have no other
  way), so that is what ``before`` times there.

Each decode implementation is timed three ways:

- graph (``<impl>_ms``): median of CUDA-graph replays (``triton.testing.do_bench``, which
  flushes the L2 cache before each replay): GPU time alone, no host;
- eager (``<impl>_eager_ms``): calls issued back to back from Python with no sync between,
  as an engine calls attention layer after layer; CUDA events around rounds of calls,
  median round: the slower of host and GPU decides;
- host (``<impl>_host_us``): wall time to issue one call while the GPU is held busy by a
  sleep kernel, so that no call waits for it: the host's cost of a call alone.

Small shapes rotate over several input sets whose K/V together exceed the L2 cache
several times (the layers of a model).

Sections of the JSON:

- ``decode_bandwidth``: one query token per row, 32 query / 8 KV heads, head_dim 128,
  batch x context; ``decode_shapes``: other head layouts (GQA ratio 1 and 8, MHA with
  head_dim 64); ``decode_issue_shapes``: the shapes of issue #24's table and held-out
  layouts (40/8 heads, MQA 32/1, head_dim 256). Figure of merit: K/V bytes the attention
  must read over the time (TB/s). GQA is handed to SDPA as ``group`` query rows per kv
  head (the same softmax, no K/V repeat), so SDPA reads each K/V byte once too.
  ``layer_host_us``: host time of one whole layer call of the backend's path
  (``StepPlans.for_layer``, ``store_kv``, ``run``).
- ``multi_token_decode``: rows of 1, 2, 4, 8 query tokens over the same contexts
  (speculative verification); the K/V bytes are the same whatever the tokens per row.
- ``prefill``: causal prefill (1 x 8k, 8 x 2k, 32 x 512 tokens) and a 512-token chunk
  after 8k cached tokens, at page sizes 16, 64 and 128; figure of merit: causal FLOPs
  (``4 * H * D`` per visible query-key pair) over the graph time (TFLOP/s). SDPA runs
  with each backend forced (flash, cuDNN, memory-efficient), GQA native and expanded, and
  with its default choice; ``sdpa_best`` is the fastest of them.
- ``decode_step``: a whole decode step of a 32-layer model's attention (plan, then each
  layer's ``store_kv`` and ``run``), eager against one CUDA graph of the whole step.

Run on a machine with a CUDA GPU, torch and triton (no Paddle needed)::

    python -m fleetlab.lab.bench.triton_attention --json h200_triton.json \
        [--errors errors.json] [--before old_triton_kernels.py] [--tune [decode,prefill]]

``--sections none --tune decode`` runs only the decode sweep: the split-context shapes of
``TUNE_DECODE``, each knob setting, then the best ones with every way of merging their
splits and with no merge at all (a diagnostic whose output is wrong: the splits' own time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import glob
import importlib
import importlib.util
import json
import logging
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

BATCHES = (1, 16, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_TOKENS = 4 * 1024 * 1024  # skip (batch, context) pairs holding more tokens than this
MIN_FOOTPRINT = 512 * 1024**2  # K/V bytes one timed round touches (the H200's L2 is 60 MB)
# (name, num_heads, num_kv_heads, head_dim) of the other decode layouts, and their (batch, context)
LAYOUTS = (("gqa1", 32, 32, 128), ("gqa8", 32, 4, 128), ("mha_d64", 16, 16, 64))
LAYOUT_SHAPES = ((1, 32768), (16, 2048), (64, 8192), (128, 1024))
# issue #24's table and held-out layouts: (batch, context, num_heads, num_kv_heads, head_dim)
ISSUE_SHAPES = ((4, 4096, 32, 8, 128), (32, 8192, 32, 1, 128), (32, 4096, 16, 4, 256), (128, 1024, 16, 16, 64),
                (64, 2048, 32, 8, 128), (1, 32768, 32, 8, 128), (24, 3000, 40, 8, 128), (512, 1024, 32, 8, 128))
MULTI_QUERY_LENS = (1, 2, 4, 8)
MULTI_SHAPES = ((64, 2048), (8, 8192))
# (rows, chunk, context)
PREFILL_SHAPES = ((1, 8192, 0), (8, 2048, 0), (32, 512, 0), (1, 512, 8192))
PAGE_SIZES = (16, 64, 128)
# issue #37's other head layouts: (rows, chunk, context, num_heads, num_kv_heads, head_dim)
PREFILL_LAYOUTS = ((1, 6144, 0, 28, 4, 128), (4, 3072, 0, 32, 8, 128), (16, 700, 0, 32, 8, 128),
                   (2, 4096, 0, 16, 16, 64), (4, 2048, 0, 16, 4, 256))
LAYOUT_PAGES = (128,)  # the "layouts" section: beyond the pages of 16 the prefill section runs them at
# whole decode steps: (batch, context, prefill chunk after the decodes, 0: none)
STEP_SHAPES = ((4, 4096, 0), (64, 2048, 0), (1, 32768, 0), (32, 2048, 512))
STEP_LAYERS = 32
HOST_CALLS = 50  # calls per host-time round
SLEEP_CYCLES = 2 * 10**7  # GPU cycles a host-time round holds the GPU busy for (~10 ms), doubled if short


@dataclass(slots=True)
class DecodeCase:
    """One timed decode shape: ``batch`` rows of ``query_len`` tokens over ``context`` tokens each."""

    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    query_len: int = 1

    @property
    def kv_bytes(self) -> int:
        elem = 4 if self.dtype == "float32" else 2
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class PrefillCase:
    """One timed prefill shape: ``rows`` chunks of ``chunk`` tokens after ``context`` cached ones."""

    rows: int
    chunk: int
    context: int = 0
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def flops(self) -> int:
        seen = self.chunk * self.context + self.chunk * (self.chunk + 1) // 2  # visible pairs per row and head
        return 4 * self.rows * self.num_heads * self.head_dim * seen

    def as_decode(self) -> DecodeCase:
        return DecodeCase(self.rows, self.context + self.chunk, self.num_heads, self.num_kv_heads, self.head_dim,
                          self.block_size, self.dtype, self.chunk)


def load_kernels(path: str | None = None):
    """fleetlab's kernels module, or (``path``) another copy of it loaded from a file."""
    if path is None:
        return importlib.import_module("fleetlab.attention.triton_kernels")
    spec = importlib.util.spec_from_file_location("fleetlab_triton_kernels_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def make_inputs(case: DecodeCase, seed: int = 0, block_tables=None) -> dict:
    """Random queries and paged cache on the GPU; block ids shuffled across rows (or ``block_tables``).

    Row ``i``'s ``query_len`` query tokens are the last of its ``context`` tokens.
    """
    import torch

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_row = math.ceil(case.context / case.block_size)
    num_blocks = case.batch * blocks_per_row
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    if block_tables is None:
        perm = torch.randperm(num_blocks, device="cuda", generator=gen)
        block_tables = perm.view(case.batch, blocks_per_row).to(torch.int32)
    query = torch.randn(case.batch * case.query_len, case.num_heads, case.head_dim, device="cuda", dtype=dtype,
                        generator=gen)
    seq_lens = torch.full((case.batch,), case.context, device="cuda", dtype=torch.int32)
    cu = torch.arange(case.batch + 1, device="cuda", dtype=torch.int32) * case.query_len
    return {"query": query, "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": block_tables, "seq_lens_kv": seq_lens, "cu_seqlens_q": cu}


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


def decode_plan(tk, inputs: dict, case: DecodeCase, knobs: dict | None = None):
    """``tk``'s decode plan for ``case`` on ``inputs`` (made once, as ``build_metadata`` does)."""
    geometry = tk.LayerGeometry.of(inputs["query"], inputs["key_cache"])
    multi = case.query_len > 1
    return tk.plan_decode(geometry, inputs["block_tables"], inputs["seq_lens_kv"],
                          num_tokens=case.batch * case.query_len, max_seq_len=case.context, num_rows=case.batch,
                          cu_seqlens_q=inputs["cu_seqlens_q"] if multi else None, max_query_len=case.query_len,
                          **(knobs or {}))


def _run_fn(plan, inputs: dict, out, scale: float):
    q, kc, vc = inputs["query"], inputs["key_cache"], inputs["value_cache"]
    return lambda: plan.run(q, kc, vc, scale=scale, out=out)


def _before_decode_fn(before, inputs: dict, case: DecodeCase, out):
    """A call of an older kernels module's one-call decode (multi-token rows: its prefill kernel)."""
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
            inputs["seq_lens_kv"])
    scale = case.head_dim ** -0.5
    if case.query_len == 1:
        return lambda: before.decode_attention(*args, max_seq_len=case.context, scale=scale, out=out)
    return lambda: before.prefill_attention(*args, inputs["cu_seqlens_q"], first_row=0, num_rows=case.batch,
                                            max_query_len=case.query_len, scale=scale, out=out)


# ---------------------------------------------------------------------------------
# Three clocks: graph replay (GPU only), eager back to back, host alone
# ---------------------------------------------------------------------------------


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


def _eager_ms(fns, min_calls: int = 64, rounds: int = 7) -> float:
    """Median time per call of calls issued back to back from Python (no graph, no sync
    between), cycling over ``fns`` as a model cycles over its layers: CUDA events around
    each round, the median round."""
    import torch

    for fn in fns:
        fn()
    calls = max(min_calls, len(fns))
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _host_us(fns, calls: int = HOST_CALLS, rounds: int = 5) -> float:
    """Host microseconds per call: the wall time to issue ``calls`` calls while a sleep
    kernel holds the GPU, so that no call waits for the device. A round in which the
    sleep ended before the last call was issued is repeated with a longer sleep."""
    import torch

    for fn in fns:
        fn()
    cycles, times = SLEEP_CYCLES, []
    while len(times) < rounds:
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        asleep = torch.cuda.Event()
        asleep.record()
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        elapsed = time.perf_counter() - start
        if asleep.query():  # the GPU woke up (and ran calls) before the host finished: not host time alone
            cycles *= 2
            torch.cuda.synchronize()
            continue
        times.append(elapsed / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _safe(timer, *args, **kwargs) -> float | str:
    try:
        return timer(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a setting that does not compile or run: record it
        return f"{type(exc).__name__}: {exc}"[:300]


def _three_clocks(row: dict, name: str, fns, *, eager: bool = True) -> None:
    """``row[name_ms]`` (graph), ``row[name_eager_ms]`` and ``row[name_host_us]`` for ``fns``."""
    row[f"{name}_ms"] = _safe(_graph_ms, fns)
    if eager:
        row[f"{name}_eager_ms"] = _safe(_eager_ms, fns)
        row[f"{name}_host_us"] = _safe(_host_us, fns)


def input_sets(case: DecodeCase) -> list[dict]:
    """Enough independent input sets that their K/V span ``MIN_FOOTPRINT`` bytes."""
    return [make_inputs(case, seed=i) for i in range(max(1, math.ceil(MIN_FOOTPRINT / case.kv_bytes)))]


def _max_err_vs_fp32_sdpa(inputs: dict, out, case: DecodeCase, rows: int = 8) -> float:
    """Max abs difference from fp32 SDPA on the gathered K/V, over the first ``rows`` rows."""
    sub = dataclasses.replace(case, batch=min(rows, case.batch))
    tables = inputs["block_tables"][: sub.batch]
    key = _gather(inputs["key_cache"], tables, sub).float()
    value = _gather(inputs["value_cache"], tables, sub).float()
    ref = _sdpa_decode(inputs["query"][: sub.batch].float().contiguous(), key, value, sub)
    return float((out[: sub.batch].float() - ref).abs().max())


def _layer_host_us(tk, case: DecodeCase, sets: list[dict]) -> float:
    """Host time of one layer call on the backend's path: ``StepPlans.for_layer``, the step's
    K/V stored through the plan, the plan run (single-token rows)."""
    import torch

    first = sets[0]
    last = case.context - 1  # each row's new token: the last of its context
    slots = first["block_tables"][:, last // case.block_size].long() * case.block_size + last % case.block_size
    lens_host = [case.context] * case.batch
    batch = tk.PagedBatch.from_host(first["block_tables"], first["seq_lens_kv"], first["cu_seqlens_q"], slots,
                                    block_size=case.block_size, num_decodes=case.batch,
                                    cu_seqlens_q_host=list(range(case.batch + 1)), seq_lens_kv_host=lens_host)
    plans = tk.StepPlans(batch, like=first["seq_lens_kv"])
    key = torch.randn(case.batch, case.num_kv_heads, case.head_dim, device="cuda", dtype=first["query"].dtype)
    scale = case.head_dim ** -0.5

    def layer(s):
        plan = plans.for_layer(s["query"], s["key_cache"])
        plan.store_kv(key, key, s["key_cache"], s["value_cache"])
        return plan.run(s["query"], s["key_cache"], s["value_cache"], scale=scale)

    return _host_us([functools.partial(layer, s) for s in sets])


def bench_decode(case: DecodeCase, tk, before=None, *, gather: bool = False, knobs: dict | None = None) -> dict:
    """Time one decode shape: fleetlab's plan, SDPA on contiguous K/V, (gather + SDPA), before."""
    import torch

    sets = input_sets(case)
    outs = [torch.empty_like(s["query"]) for s in sets]
    scale = case.head_dim ** -0.5
    plans = [decode_plan(tk, s, case, knobs) for s in sets]
    runs = [_run_fn(p, s, o, scale) for p, s, o in zip(plans, sets, outs)]
    runs[0]()
    row = asdict(case) | {"kv_bytes": case.kv_bytes, "input_sets": len(sets)}
    row["config"] = plans[0].launches[0].config
    row["launches"] = [launch.name for launch in plans[0].launches]
    if case.query_len == 1:
        row["max_abs_err_vs_fp32_sdpa"] = _max_err_vs_fp32_sdpa(sets[0], outs[0], case)
        row["layer_host_us"] = _layer_host_us(tk, case, sets)
    _three_clocks(row, "triton", runs)
    if case.query_len == 1:
        contiguous = [(_gather(s["key_cache"], s["block_tables"], case).contiguous(),
                       _gather(s["value_cache"], s["block_tables"], case).contiguous()) for s in sets]
        _three_clocks(row, "sdpa", [(lambda s=s, k=k, v=v: _sdpa_decode(s["query"], k, v, case))
                                    for s, (k, v) in zip(sets, contiguous)])
        del contiguous
        if gather:
            row["gather_sdpa_ms"] = _graph_ms([
                (lambda s=s: _sdpa_decode(s["query"], _gather(s["key_cache"], s["block_tables"], case),
                                          _gather(s["value_cache"], s["block_tables"], case), case))
                for s in sets])
    if before is not None:
        _three_clocks(row, "before", [_before_decode_fn(before, s, case, o) for s, o in zip(sets, outs)])
    _ratios(row, case.kv_bytes)
    del sets, outs, runs, plans
    torch.cuda.empty_cache()
    return row


def _ratios(row: dict, kv_bytes: int) -> None:
    """Bandwidths and the ratios against SDPA and before, for each clock that ran."""
    for name in ("triton", "sdpa", "gather_sdpa", "before"):
        for clock in ("", "_eager"):
            ms = row.get(f"{name}{clock}_ms")
            if isinstance(ms, float):
                row[f"{name}{clock}_tbps"] = kv_bytes / (ms * 1e-3) / 1e12
    for clock, prefix in (("", ""), ("_eager", "eager_")):
        mine = row.get(f"triton{clock}_ms")
        for other in ("sdpa", "gather_sdpa", "before"):
            theirs = row.get(f"{other}{clock}_ms")
            if isinstance(mine, float) and isinstance(theirs, float):
                row[f"{prefix}speedup_vs_{other}"] = theirs / mine


# ---------------------------------------------------------------------------------
# Prefill: every SDPA backend, page sizes 16 / 64 / 128
# ---------------------------------------------------------------------------------


def _sdpa_prefill_fn(inputs: dict, case: PrefillCase, backend: str, gqa: str):
    """Causal SDPA on contiguous K/V: ``backend`` 'flash', 'cudnn', 'efficient' (forced) or
    'default'; ``gqa`` 'native' (``enable_gqa``) or 'expanded' (K/V heads repeated)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dcase = case.as_decode()
    group = case.num_heads // case.num_kv_heads
    q = inputs["query"].view(case.rows, case.chunk, case.num_heads, case.head_dim).transpose(1, 2).contiguous()
    k = _gather(inputs["key_cache"], inputs["block_tables"], dcase)
    v = _gather(inputs["value_cache"], inputs["block_tables"], dcase)
    if gqa == "expanded":
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    k, v = k.contiguous(), v.contiguous()
    length = case.context + case.chunk
    kwargs = {"enable_gqa": gqa == "native"}
    if case.context == 0:
        kwargs["is_causal"] = True
    elif backend == "cudnn":  # an explicit mask: the lower-right causal bias has no cuDNN kernel
        kwargs["attn_mask"] = torch.ones(case.chunk, length, dtype=torch.bool, device=q.device).tril(case.context)
    else:
        kwargs["attn_mask"] = causal_lower_right(case.chunk, length)
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(backend)

    def run():
        with sdpa_kernel([chosen]) if chosen is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


SDPA_PREFILL = [(b, g) for b in ("flash", "cudnn", "efficient", "default") for g in ("native", "expanded")]


def _prefill_fn(tk, inputs: dict, case: PrefillCase, out, knobs: dict | None = None):
    geometry = tk.LayerGeometry.of(inputs["query"], inputs["key_cache"])
    plan = tk.plan_prefill(geometry, inputs["block_tables"], inputs["seq_lens_kv"], inputs["cu_seqlens_q"],
                           num_tokens=case.rows * case.chunk, first_row=0, num_rows=case.rows,
                           max_query_len=case.chunk, **(knobs or {}))
    return _run_fn(plan, inputs, out, case.head_dim ** -0.5), plan


def _before_prefill_fn(before, inputs: dict, case: PrefillCase, out):
    return lambda: before.prefill_attention(
        inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
        inputs["seq_lens_kv"], inputs["cu_seqlens_q"], first_row=0, num_rows=case.rows,
        max_query_len=case.chunk, scale=case.head_dim ** -0.5, out=out)


def bench_sdpa_prefill(case: PrefillCase) -> dict:
    """Every SDPA backend on one prefill shape (contiguous K/V), and the fastest."""
    import torch

    inputs = make_inputs(case.as_decode())
    row = {}
    for backend, gqa in SDPA_PREFILL:
        row[f"sdpa_{backend}_{gqa}_ms"] = _safe(_graph_ms, [_sdpa_prefill_fn(inputs, case, backend, gqa)], rep=50)
    timed = {k[len("sdpa_"):-len("_ms")]: v for k, v in row.items() if isinstance(v, float)}
    best = min(timed, key=timed.get)
    row |= {"sdpa_best": best, "sdpa_best_ms": timed[best],
            "sdpa_best_tflops": case.flops / (timed[best] * 1e-3) / 1e12}
    flash = [v for k, v in timed.items() if k.startswith("flash")]
    if flash:
        row["sdpa_flash_best_ms"] = min(flash)
    del inputs
    torch.cuda.empty_cache()
    return row


def bench_prefill(case: PrefillCase, tk, sdpa: dict, before=None, knobs: dict | None = None) -> dict:
    """Time one prefill shape at one page size against the SDPA timings of its shape."""
    import torch

    inputs = make_inputs(case.as_decode())
    out = torch.empty_like(inputs["query"])
    row = asdict(case) | {"flops": case.flops}
    fn, plan = _prefill_fn(tk, inputs, case, out, knobs)
    row["config"] = plan.launches[0].config
    row["triton_ms"] = _safe(_graph_ms, [fn], rep=50)
    ref = _sdpa_prefill_fn(inputs, case, "default", "expanded")()
    row["max_abs_err_vs_sdpa"] = float(
        (out.view(case.rows, case.chunk, case.num_heads, -1).transpose(1, 2).float() - ref.float()).abs().max())
    if before is not None and case.block_size == PAGE_SIZES[0]:
        row["before_ms"] = _safe(_graph_ms, [_before_prefill_fn(before, inputs, case, out)], rep=50)
    row |= sdpa
    for name in ("triton", "before", "sdpa_flash_best"):
        if isinstance(row.get(f"{name}_ms"), float):
            row[f"{name}_tflops"] = case.flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    if isinstance(row["triton_ms"], float):
        row["ratio_vs_sdpa_best"] = row["sdpa_best_ms"] / row["triton_ms"]
        if "sdpa_flash_best_ms" in row:
            row["ratio_vs_sdpa_flash"] = row["sdpa_flash_best_ms"] / row["triton_ms"]
        if isinstance(row.get("before_ms"), float):
            row["speedup_vs_before"] = row["before_ms"] / row["triton_ms"]
    del inputs, out
    torch.cuda.empty_cache()
    return row


def bench_prefill_one_page(shape: tuple) -> dict:
    """A causal shape with one page per row (``block_size`` = the chunk): every unmasked
    tile is contiguous, so the gap to the paged rows is what paging costs this kernel."""
    case = PrefillCase(*shape)
    return bench_prefill(dataclasses.replace(case, block_size=case.chunk), load_kernels(),
                         bench_sdpa_prefill(case))


def bench_plan_overlap(tk, case: DecodeCase, chunk: int = 0, steps: int = 20, rounds: int = 5,
                       num_layers: int = STEP_LAYERS) -> dict:
    """Issue #34 item 5: ``steps`` decode steps of ``num_layers`` layers, each step synced at its
    end (as an engine reads its sampled tokens), with the step's ``StepPlans`` built in line
    before its layers (A) against built for step N+1 on a host thread while step N's layers
    are issued and run (B). The batch is the same each step, so the plans are too; A and B
    alternate, ``rounds`` each; wall time per step, median over rounds."""
    import concurrent.futures

    import torch

    b, layers = _step_layers(case, chunk, num_layers)
    batch = tk.PagedBatch.from_host(b["block_tables"], b["seq_lens_kv"], b["cu_seqlens_q"], b["slot_mapping"],
                                    block_size=case.block_size, num_decodes=case.batch,
                                    cu_seqlens_q_host=b["cu_host"], seq_lens_kv_host=b["lens_host"])
    scale, known = case.head_dim ** -0.5, {}

    def make_plans():
        return tk.StepPlans(batch, like=b["seq_lens_kv"], known=known)

    def attend_all(plans):
        for layer in layers:
            plan = plans.for_layer(layer["query"], layer["key_cache"])
            plan.store_kv(layer["key"], layer["value"], layer["key_cache"], layer["value_cache"])
            plan.run(layer["query"], layer["key_cache"], layer["value_cache"], scale=scale, out=layer["out"])

    def inline():
        for _ in range(steps):
            attend_all(make_plans())
            torch.cuda.synchronize()

    def overlapped(pool):
        pending = pool.submit(make_plans)
        for _ in range(steps):
            plans = pending.result()
            pending = pool.submit(make_plans)  # step N+1's plan while step N runs
            attend_all(plans)
            torch.cuda.synchronize()
        pending.result()

    def prebuilt(plans):
        for _ in range(steps):
            attend_all(plans)
            torch.cuda.synchronize()

    attend_all(make_plans())
    torch.cuda.synchronize()
    plans = make_plans()
    times: dict = {"inline": [], "overlapped": [], "prebuilt": []}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(rounds):
            for name, fn in (("inline", inline), ("overlapped", lambda: overlapped(pool)),
                             ("prebuilt", lambda: prebuilt(plans))):
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3 / steps)
    builds = []
    for _ in range(20):
        start = time.perf_counter()
        make_plans()
        builds.append((time.perf_counter() - start) * 1e6)
    row = asdict(case) | {"prefill_chunk": chunk, "num_layers": num_layers, "steps": steps,
                          "plan_us": statistics.median(builds)}
    for name, t in times.items():
        row[f"{name}_step_ms"] = statistics.median(t)
    row["overlap_saves_ms"] = row["inline_step_ms"] - row["overlapped_step_ms"]
    row["plan_hidden_fraction"] = row["overlap_saves_ms"] / max(row["inline_step_ms"] - row["prebuilt_step_ms"], 1e-9)
    return row


# ---------------------------------------------------------------------------------
# A whole decode step: every layer's attention, eager against one CUDA graph
# ---------------------------------------------------------------------------------


def _step_layers(case: DecodeCase, chunk: int, num_layers: int) -> tuple[dict, list[dict]]:
    """The step's batch (``case.batch`` decode rows, then one ``chunk``-token prefill row after
    ``case.context - chunk`` cached tokens when ``chunk``) and ``num_layers`` layers, each with
    its own caches, queries, new K/V and output; the block tables are shared."""
    import torch

    rows = case.batch + (1 if chunk else 0)
    full = dataclasses.replace(case, batch=rows)
    first = make_inputs(full, seed=0)
    q_lens = [1] * case.batch + ([chunk] if chunk else [])
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    tables, bs = first["block_tables"], case.block_size
    pos = torch.cat([torch.arange(case.context - n, case.context, device="cuda") for n in q_lens])
    row_of = torch.repeat_interleave(torch.arange(rows, device="cuda"), torch.tensor(q_lens, device="cuda"))
    slots = tables[row_of, pos // bs].long() * bs + pos % bs
    batch = {"block_tables": tables, "seq_lens_kv": first["seq_lens_kv"],
             "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32, device="cuda"), "slot_mapping": slots,
             "cu_host": cu, "lens_host": [case.context] * rows, "num_tokens": cu[-1]}
    layers = []
    for i in range(num_layers):
        inputs = first if i == 0 else make_inputs(full, seed=i, block_tables=tables)
        dtype = inputs["query"].dtype
        layer = {k: inputs[k] for k in ("key_cache", "value_cache")}
        layer["query"] = torch.randn(cu[-1], case.num_heads, case.head_dim, device="cuda", dtype=dtype)
        layer["key"] = torch.randn(cu[-1], case.num_kv_heads, case.head_dim, device="cuda", dtype=dtype)
        layer["value"] = torch.randn_like(layer["key"])
        layer["out"] = torch.empty_like(layer["query"])
        layers.append(layer)
    return batch, layers


def bench_decode_step(tk, case: DecodeCase, chunk: int = 0, num_layers: int = STEP_LAYERS) -> dict:
    """One engine step's attention over ``num_layers`` layers: ``StepPlans`` made (as
    ``build_metadata`` does), then per layer ``for_layer``, ``store_kv``, ``run``. Timed
    eager (events around whole steps, the plan included) and as one CUDA graph of every
    layer's launches (planned before capture)."""
    import torch

    b, layers = _step_layers(case, chunk, num_layers)
    batch = tk.PagedBatch.from_host(b["block_tables"], b["seq_lens_kv"], b["cu_seqlens_q"], b["slot_mapping"],
                                    block_size=case.block_size, num_decodes=case.batch,
                                    cu_seqlens_q_host=b["cu_host"], seq_lens_kv_host=b["lens_host"])
    scale = case.head_dim ** -0.5
    known: dict = {}

    def attend_all(plans):
        for layer in layers:
            plan = plans.for_layer(layer["query"], layer["key_cache"])
            plan.store_kv(layer["key"], layer["value"], layer["key_cache"], layer["value_cache"])
            plan.run(layer["query"], layer["key_cache"], layer["value_cache"], scale=scale, out=layer["out"])

    def step():
        attend_all(tk.StepPlans(batch, like=b["seq_lens_kv"], known=known))

    row = asdict(case) | {"prefill_chunk": chunk, "num_layers": num_layers, "num_tokens": b["num_tokens"]}
    step()  # compiles, and learns the model's geometry
    row["eager_step_ms"] = _eager_ms([step], min_calls=10)
    row["host_step_us"] = _host_us([step], calls=3)
    start = time.perf_counter()
    plans = tk.StepPlans(batch, like=b["seq_lens_kv"], known=known)
    row["plan_us"] = (time.perf_counter() - start) * 1e6
    attend_all(plans)  # every launch of these plans compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend_all(plans)
    row["graph_step_ms"] = _median_ms(graph.replay, rep=100)
    row["graph_speedup"] = row["eager_step_ms"] / row["graph_step_ms"]
    row["host_us_per_layer"] = row["host_step_us"] / num_layers
    del graph
    return row


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


# ---------------------------------------------------------------------------------
# Tuning sweeps (--tune): where the kernels' default tables come from
# ---------------------------------------------------------------------------------

# (block_m, block_n, warps, stages, page_tiles, warp_specialize)
PREFILL_GRID = [(128, 64, 8, 5, True, False), (128, 64, 8, 5, False, False), (128, 32, 4, 4, True, False),
                (128, 64, 4, 3, True, False), (128, 64, 8, 3, True, False), (128, 128, 8, 2, True, False),
                (128, 128, 8, 3, True, False), (64, 64, 4, 3, True, False), (128, 64, 8, 3, True, True),
                (128, 128, 8, 2, True, True)]
# Decode shapes whose contexts get split (fewer than two programs per multiprocessor): where
# the split count, the merge and launch gaps decide the time. (batch, context, heads, kv heads, dim)
TUNE_DECODE = ((1, 32768, 32, 8, 128), (1, 32768, 16, 16, 64), (16, 2048, 16, 16, 64), (16, 2048, 32, 8, 128),
               (32, 4096, 16, 4, 256))
# How a split decode merges: (merge_in_launch, pdl, merge_slice); pdl 1 lets the merge in at
# the split kernel's start, 2 once its K/V are read
MERGES = ((False, 0, 0), (False, 1, 0), (False, 0, 1), (False, 1, 1), (False, 2, 1), (True, 0, 0))


def _heads_options(case: DecodeCase) -> list[int]:
    """KV heads per program worth timing: up to 4 for MHA, up to 2 for GQA."""
    top = 4 if case.num_heads == case.num_kv_heads else 2
    return [h for h in (1, 2, 4) if h <= top and case.num_kv_heads % h == 0 and case.head_dim * h <= 256]


def split_counts(case: DecodeCase, heads: int, num_sms: int = 132) -> list[int | None]:
    """Split counts worth timing (None: the planner's own), with the count that makes exactly
    one program per multiprocessor where one exists."""
    counts = [None, 16, 32, 48, 64] if case.batch == 1 else [None, 1, 2, 4]
    programs = case.batch * case.num_kv_heads // heads
    if num_sms % programs == 0 and num_sms // programs not in counts:
        counts.append(num_sms // programs)
    return counts


def decode_grid(case: DecodeCase) -> list[dict]:
    """Main-kernel knob settings worth timing for one split decode shape (merge: the default)."""
    grid = [{"latency_kernel": True, "num_splits": n} for n in split_counts(case, 1)
            if case.head_dim * 2 <= 256 and n != 1]
    for h in _heads_options(case):
        for bn in (32, 64) if case.head_dim * h > 128 else (64, 128):
            for stages in (3, 4, 5):
                for warps in (4, 8):
                    for n in split_counts(case, h):
                        knobs = {"heads_per_program": h, "block_n": bn, "num_stages": stages, "num_warps": warps,
                                 "latency_kernel": False}
                        grid.append(knobs | ({} if n is None else {"num_splits": n}))
    return grid


def _tune_decode_case(tk, case: DecodeCase) -> list[dict]:
    """Stage 1: the main kernel's knobs (default merge). Stage 2: the 5 best, with every merge
    and with no merge at all (the plan's split launch alone: how much of the time the merge
    takes). SDPA in the same run."""
    import torch

    sets = input_sets(case)
    outs = [torch.empty_like(s["query"]) for s in sets]
    scale = case.head_dim ** -0.5

    def timed(knobs: dict, stage: str, merge: bool = True) -> dict:
        try:
            plans = [decode_plan(tk, s, case, knobs) for s in sets]
            if not merge:
                plans = [dataclasses.replace(p, launches=p.launches[:1]) for p in plans]
            ms = _safe(_graph_ms, [_run_fn(p, s, o, scale) for p, s, o in zip(plans, sets, outs)], rep=30)
        except (ValueError, TypeError) as exc:  # a setting the planner refuses for this shape
            ms = f"{type(exc).__name__}: {exc}"[:300]
        row = asdict(case) | {"stage": stage, "knobs": knobs, "triton_ms": ms}
        if isinstance(ms, float):
            row["triton_tbps"] = case.kv_bytes / (ms * 1e-3) / 1e12
        log.info("tune %s", row)
        return row

    rows = [timed({}, "default")]
    rows += [timed(knobs, "kernel") for knobs in decode_grid(case)]
    ranked = sorted((r for r in rows if "triton_tbps" in r), key=lambda r: -r["triton_tbps"])
    for best in ranked[:5]:
        for merge_in_launch, pdl, merge_slice in MERGES:
            if best["knobs"].get("latency_kernel") and (merge_in_launch or merge_slice):
                continue
            rows.append(timed(best["knobs"] | {"merge_in_launch": merge_in_launch, "pdl": pdl,
                                               "merge_slice": merge_slice}, "merge"))
        rows.append(timed(best["knobs"] | {"merge_in_launch": False}, "no-merge", merge=False))
    contiguous = [(_gather(s["key_cache"], s["block_tables"], case).contiguous(),
                   _gather(s["value_cache"], s["block_tables"], case).contiguous()) for s in sets]
    sdpa_ms = _graph_ms([(lambda s=s, k=k, v=v: _sdpa_decode(s["query"], k, v, case))
                         for s, (k, v) in zip(sets, contiguous)], rep=30)
    for r in rows:
        r["sdpa_ms"] = sdpa_ms
        if isinstance(r["triton_ms"], float):
            r["speedup_vs_sdpa"] = sdpa_ms / r["triton_ms"]
    return rows


def _tuned_prefill_ms(tk, inputs: dict, case: PrefillCase, out, knobs: dict) -> float:
    return _graph_ms([_prefill_fn(tk, inputs, case, out, knobs)[0]], rep=30)


def tune(tk, quick: bool, result: dict, save=lambda: None, sections=("decode", "prefill")) -> dict:
    """Time knob settings on the shapes the default tables were chosen for (Triton only, CUDA
    graphs, inputs built once). Rows go to ``result["decode"]`` / ``result["prefill"]``;
    ``save`` runs after each shape."""
    import torch

    result.setdefault("decode", [])
    result.setdefault("prefill", [])
    for shape in (TUNE_DECODE[:1] if quick else TUNE_DECODE) if "decode" in sections else ():
        result["decode"] += _tune_decode_case(tk, DecodeCase(*shape))
        torch.cuda.empty_cache()  # the shape's input sets are gone with the call
        save()
    shapes = [PrefillCase(*s, block_size=p) for s in PREFILL_SHAPES for p in PAGE_SIZES]
    for case in (shapes[:1] if quick else shapes) if "prefill" in sections else ():
        inputs = make_inputs(case.as_decode())
        out = torch.empty_like(inputs["query"])
        for bm, bn, warps, stages, page_tiles, ws in PREFILL_GRID:
            knobs = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
                     "page_tiles": page_tiles, "warp_specialize": ws}
            ms = _safe(_tuned_prefill_ms, tk, inputs, case, out, knobs)
            row = asdict(case) | {"knobs": knobs, "triton_ms": ms}
            if isinstance(ms, float):
                row["triton_tflops"] = case.flops / (ms * 1e-3) / 1e12
            result["prefill"].append(row)
            log.info("tune %s", row)
        del inputs, out
        torch.cuda.empty_cache()
        save()
    return result


def _best(rows: list[dict], metric: str, top: int = 3) -> list[str]:
    """One line per tuned shape: its ``top`` fastest knob settings."""
    lines = []
    shape_keys = [k for k in ("batch", "context", "rows", "chunk", "num_kv_heads", "head_dim", "num_heads",
                              "block_size") if k in (rows[0] if rows else {})]
    for key in sorted({tuple(r[k] for k in shape_keys) for r in rows}):
        ok = sorted((r for r in rows if tuple(r[k] for k in shape_keys) == key and metric in r),
                    key=lambda r: -r[metric])
        best = ", ".join(f"{r.get('stage', '')} {r['knobs']}: {r[metric]:.2f}"
                         + (f" ({r['speedup_vs_sdpa']:.2f}x sdpa)" if "speedup_vs_sdpa" in r else "")
                         for r in ok[:top])
        lines.append(f"tune {dict(zip(shape_keys, key))}: {best}")
    return lines


# ---------------------------------------------------------------------------------
# The run: sections, the issue's targets, tables
# ---------------------------------------------------------------------------------


def environment() -> dict:
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _load_errors(pattern: str) -> dict:
    """Worst errors from the test suite's JSON files (one per pytest-xdist worker): the max of each key."""
    worst: dict[str, float] = {}
    for path in sorted(glob.glob(pattern + "*")):
        with open(path) as f:
            for key, value in json.load(f).items():
                worst[key] = max(worst.get(key, 0.0), float(value))
    return dict(sorted(worst.items()))


def goal_check(result: dict) -> dict:
    """Issue #24's targets, read off this run."""
    decode = [r for s in ("decode_bandwidth", "decode_shapes", "decode_issue_shapes") for r in result.get(s, [])
              if "speedup_vs_sdpa" in r]
    check: dict = {}
    if decode:
        for key, name in (("speedup_vs_sdpa", "graph"), ("eager_speedup_vs_sdpa", "eager")):
            rows = [r for r in decode if key in r]
            worst = min(rows, key=lambda r: r[key])
            check[f"decode_{name}_min_ratio_vs_sdpa"] = worst[key]
            check[f"decode_{name}_min_ratio_shape"] = {k: worst[k] for k in ("batch", "context", "num_heads",
                                                                             "num_kv_heads", "head_dim")}
            check[f"decode_{name}_shapes_below_0.95"] = sum(r[key] < 0.95 for r in rows)
        check["decode_shapes"] = len(decode)
        host = [r["triton_host_us"] for r in decode if isinstance(r.get("triton_host_us"), float)]
        layer = [r["layer_host_us"] for r in decode if isinstance(r.get("layer_host_us"), float)]
        check["decode_max_host_us_per_attention_call"] = max(host, default=None)
        check["decode_max_host_us_per_layer_call"] = max(layer, default=None)
    one_row = [r for r in result.get("decode_bandwidth", []) if r["batch"] == 1 and r["context"] == 32768]
    if one_row:
        check["decode_1x32k_tbps"] = one_row[0]["triton_tbps"]
    for r in result.get("prefill", []) + result.get("prefill_layouts", []):
        if "ratio_vs_sdpa_best" in r:
            heads = f"_{r['num_heads']}/{r['num_kv_heads']}d{r['head_dim']}" if (
                r["num_heads"], r["num_kv_heads"], r["head_dim"]) != (32, 8, 128) else ""
            key = f"prefill_{r['rows']}x{r['chunk']}+{r['context']}{heads}_page{r['block_size']}"
            check[f"{key}_ratio_vs_sdpa_best"] = r["ratio_vs_sdpa_best"]
    for r in result.get("decode_step", []):
        check[f"step_{r['batch']}x{r['context']}+{r['prefill_chunk']}_graph_speedup"] = r["graph_speedup"]
    return check


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, float) else "-"


def _decode_table(rows: list[dict]) -> str:
    head = (f"{'layout':>12} {'batch':>5} {'ctx':>6} {'q':>2} | {'graph TB/s: triton':>18} {'sdpa':>5} {'x':>5} "
            f"| {'eager: triton':>13} {'sdpa':>5} {'x':>5} | {'host us: triton':>15} {'layer':>5} {'sdpa':>5} "
            f"{'before':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        layout = f"{r['num_heads']}/{r['num_kv_heads']} d{r['head_dim']}"
        lines.append(
            f"{layout:>12} {r['batch']:>5} {r['context']:>6} {r['query_len']:>2} | "
            f"{_fmt(r.get('triton_tbps'), '>18.2f')} {_fmt(r.get('sdpa_tbps'), '>5.2f')} "
            f"{_fmt(r.get('speedup_vs_sdpa'), '>5.2f')} | {_fmt(r.get('triton_eager_tbps'), '>13.2f')} "
            f"{_fmt(r.get('sdpa_eager_tbps'), '>5.2f')} {_fmt(r.get('eager_speedup_vs_sdpa'), '>5.2f')} | "
            f"{_fmt(r.get('triton_host_us'), '>15.1f')} {_fmt(r.get('layer_host_us'), '>5.1f')} "
            f"{_fmt(r.get('sdpa_host_us'), '>5.1f')} {_fmt(r.get('before_host_us'), '>6.1f')}")
    return "\n".join(lines)


def _prefill_table(rows: list[dict]) -> str:
    head = (f"{'prefill':>16} {'heads':>9} {'page':>4} | {'triton':>6} {'before':>6} {'flash':>6} {'best':>6} "
            f"TFLOP/s | {'x best':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['rows']:>4} x {r['chunk']:>5} +{r['context']:>5} "
            f"{'{}/{} d{}'.format(r['num_heads'], r['num_kv_heads'], r['head_dim']):>9} {r['block_size']:>4} | "
            f"{_fmt(r.get('triton_tflops'), '>6.0f')} {_fmt(r.get('before_tflops'), '>6.0f')} "
            f"{_fmt(r.get('sdpa_flash_best_tflops'), '>6.0f')} {_fmt(r.get('sdpa_best_tflops'), '>6.0f')}         | "
            f"{_fmt(r.get('ratio_vs_sdpa_best'), '>6.2f')} ({r.get('sdpa_best')})")
    return "\n".join(lines)


def _step_table(rows: list[dict]) -> str:
    lines = [f"{'step (32 layers)':>22} | {'eager ms':>8} {'graph ms':>8} {'x':>5} | {'host us/layer':>13} "
             f"{'plan us':>7}"]
    for r in rows:
        lines.append(f"{r['batch']:>5} x {r['context']:>6} +{r['prefill_chunk']:>4} | {r['eager_step_ms']:>8.3f} "
                     f"{r['graph_step_ms']:>8.3f} {r['graph_speedup']:>5.2f} | {r['host_us_per_layer']:>13.1f} "
                     f"{r['plan_us']:>7.0f}")
    return "\n".join(lines)


def _decode_cases(sections: set, quick: bool) -> list[tuple[str, DecodeCase, dict]]:
    """(section, case, extra row fields) of every decode shape the run times."""
    cases = []
    batches, contexts = ((1, 16, 128), (512, 32768)) if quick else (BATCHES, CONTEXTS)
    if "decode" in sections:
        cases += [("decode_bandwidth", DecodeCase(b, c), {}) for b in batches for c in contexts
                  if b * c <= MAX_TOKENS]
    if "shapes" in sections:
        cases += [("decode_shapes", DecodeCase(b, c, h, kv, d), {"layout": name})
                  for name, h, kv, d in LAYOUTS for b, c in (LAYOUT_SHAPES[1:3] if quick else LAYOUT_SHAPES)]
    if "issue" in sections:
        cases += [("decode_issue_shapes", DecodeCase(b, c, h, kv, d), {})
                  for b, c, h, kv, d in (ISSUE_SHAPES[:2] if quick else ISSUE_SHAPES)]
    if "multi" in sections:
        cases += [("multi_token_decode", DecodeCase(b, c, query_len=q), {})
                  for b, c in (MULTI_SHAPES[:1] if quick else MULTI_SHAPES) for q in MULTI_QUERY_LENS]
    return cases


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results (rewritten after each shape)")
    parser.add_argument("--errors", help="FLEETLAB_TRITON_ERRORS path of tests/test_triton_kernels.py "
                                         "(files PATH* are merged: one per pytest-xdist worker)")
    parser.add_argument("--before", help="an older triton_kernels.py to time side by side as 'before'")
    parser.add_argument("--tune", nargs="?", const="decode,prefill", default="",
                        help="also sweep the kernels' knobs (optionally: decode, prefill or both, comma-separated)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--sections", default="decode,shapes,issue,multi,prefill,step",
                        help="comma-separated: decode, shapes, issue, multi, prefill, step, and off by default "
                             "layouts (issue #37's head layouts), onepage (one page per row), overlap "
                             "(issue #34: plans built on a host thread)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every row as it is measured")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    tk = load_kernels()
    before = load_kernels(args.before) if args.before else None
    sections = set(args.sections.split(","))
    result = {"environment": environment(), "case_defaults": asdict(DecodeCase(1, 1)),
              "ceilings": measure_ceilings(), "before": args.before and "an older copy of triton_kernels.py, "
              "timed in this run through its one-call functions (multi-token rows: its prefill kernel)",
              "clocks": {"graph": "median CUDA-graph replay, GPU time alone (<impl>_ms)",
                         "eager": "calls back to back from Python, no sync between, events around rounds of "
                                  "calls (<impl>_eager_ms)",
                         "host": f"wall time to issue a call while a sleep kernel holds the GPU, median of "
                                 f"rounds of {HOST_CALLS} calls (<impl>_host_us)"}}
    if args.errors:
        result["max_error_vs_dense_reference"] = _load_errors(args.errors)

    def save():
        result["goal_check"] = goal_check(result)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    decode_cases = _decode_cases(sections, args.quick)
    prefill_shapes = (PREFILL_SHAPES[:2] if args.quick else PREFILL_SHAPES) if "prefill" in sections else ()
    layouts = (PREFILL_LAYOUTS[:1] if args.quick else PREFILL_LAYOUTS) if "prefill" in sections else ()
    step_shapes = (STEP_SHAPES[:2] if args.quick else STEP_SHAPES) if "step" in sections else ()
    total = len(decode_cases) + len(prefill_shapes) * (1 + len(PAGE_SIZES)) + 2 * len(layouts) + len(step_shapes)
    with tqdm(total=total, desc="triton attention bench", unit="shape", file=sys.stderr) as bar:
        for section, case, extra in decode_cases:
            result.setdefault(section, []).append(extra | bench_decode(case, tk, before,
                                                                       gather=section == "decode_bandwidth"))
            log.info("%s", result[section][-1])
            bar.update()
            save()
        for r in result.get("multi_token_decode", []):
            single = [o for o in result["multi_token_decode"] if (o["batch"], o["context"], o["query_len"]) ==
                      (r["batch"], r["context"], 1)]
            r["time_vs_one_token"] = r["triton_ms"] / single[0]["triton_ms"]
        for shape in prefill_shapes:
            sdpa = bench_sdpa_prefill(PrefillCase(*shape))
            bar.update()
            for page in PAGE_SIZES:
                result.setdefault("prefill", []).append(bench_prefill(PrefillCase(*shape, block_size=page), tk,
                                                                      sdpa, before))
                log.info("%s", result["prefill"][-1])
                bar.update()
            save()
        for shape in layouts:
            case = PrefillCase(*shape)
            result.setdefault("prefill_layouts", []).append(bench_prefill(case, tk, bench_sdpa_prefill(case), before))
            log.info("%s", result["prefill_layouts"][-1])
            bar.update(2)
            save()
        for batch, context, chunk in step_shapes:
            result.setdefault("decode_step", []).append(bench_decode_step(tk, DecodeCase(batch, context), chunk))
            log.info("%s", result["decode_step"][-1])
            bar.update()
            save()
        if "layouts" in sections:  # issue #37's other head layouts at larger pages
            for shape in PREFILL_LAYOUTS:
                rows, chunk, context, heads, kv_heads, dim = shape
                sdpa = bench_sdpa_prefill(PrefillCase(rows, chunk, context, heads, kv_heads, dim))
                for page in LAYOUT_PAGES:
                    result.setdefault("prefill_layouts", []).append(
                        bench_prefill(PrefillCase(rows, chunk, context, heads, kv_heads, dim, page), tk, sdpa))
                    log.info("%s", result["prefill_layouts"][-1])
                save()
        if "onepage" in sections:  # the causal shapes with one page per row
            for shape in PREFILL_SHAPES[:3]:
                result.setdefault("prefill_one_page", []).append(bench_prefill_one_page(shape))
                save()
        if "overlap" in sections:  # issue #34 item 5
            for batch, context, chunk in STEP_SHAPES[:2]:
                result.setdefault("plan_overlap", []).append(bench_plan_overlap(tk, DecodeCase(batch, context),
                                                                                chunk))
                log.info("%s", result["plan_overlap"][-1])
                save()
    if args.tune:
        result["tuning"] = {}
        tune(tk, args.quick, result["tuning"], save, tuple(args.tune.split(",")))
    save()

    print(json.dumps(result["ceilings"]))
    for key, metric in (("decode", "triton_tbps"), ("prefill", "triton_tflops")):
        for line in _best(result.get("tuning", {}).get(key, []), metric):
            print(line)
    rows = [r for s in ("decode_bandwidth", "decode_shapes", "decode_issue_shapes", "multi_token_decode")
            for r in result.get(s, [])]
    if rows:
        print(_decode_table(rows))
    for key in ("prefill", "prefill_layouts", "prefill_one_page"):
        if result.get(key):
            print(_prefill_table(result[key]))
    for r in result.get("plan_overlap", []):
        print(json.dumps(r))
    if result.get("decode_step"):
        print(_step_table(result["decode_step"]))
    print(json.dumps(result["goal_check"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
