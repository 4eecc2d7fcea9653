"""Triton paged attention on a GPU, side by side with torch SDPA on contiguous K/V.

Every case keeps its K/V in a paged cache ``[num_blocks, block_size, num_kv_heads,
head_dim]`` whose blocks are handed out in shuffled order, and times, in one run:

- ``triton``: ``fleetlab.attention.triton_kernels`` on the paged cache;
- ``sdpa``: torch SDPA on K/V already contiguous (no paging: the bar to reach);
- ``gather_sdpa`` (decode table): gather each row's blocks, then SDPA (what a framework
  without a paged kernel does every step);
- ``before`` (with ``--before FILE``): the same calls into an older copy of the kernels
  module. The old kernels had no multi-token decode: rows of several query tokens went
  to their prefill kernel, so that is what ``before`` times there.

Sections of the JSON:

- ``decode_bandwidth``: one query token per row, 32 query / 8 KV heads, head_dim 128,
  batch x context; ``decode_shapes``: other head layouts (GQA ratio 1 and 8, MHA with
  head_dim 64). Figure of merit: K/V bytes the attention must read over the median time
  (TB/s). GQA is handed to SDPA as ``group`` query rows per kv head (the same softmax,
  no K/V repeat), so SDPA reads each K/V byte once too.
- ``multi_token_decode``: rows of 1, 2, 4, 8 query tokens over the same contexts
  (speculative verification); the K/V bytes are the same whatever the tokens per row.
- ``prefill``: causal prefill (1 x 8k, 8 x 2k, 32 x 512 tokens) and a 512-token chunk
  after 8k cached tokens; figure of merit: causal FLOPs (``4 * H * D`` per visible
  query-key pair) over the median time (TFLOP/s). SDPA runs with its flash backend
  forced (``sdpa``) and with its default choice (``sdpa_default``); a chunk after a
  context uses SDPA's lower-right causal mask.

Times are medians of CUDA-graph replays (``triton.testing.do_bench``, which flushes the L2
cache before each replay); small decode shapes rotate over several input sets whose
K/V together exceed the L2 cache several times.

Run on a machine with a CUDA GPU, torch and triton (no Paddle needed)::

    python -m fleetlab.bench.triton_attention --json h200_triton.json \
        [--errors errors.json] [--before old_triton_kernels.py] [--previous old.json] [--tune [decode,prefill]]

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
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

BATCHES = (1, 16, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_TOKENS = 4 * 1024 * 1024  # skip (batch, context) pairs holding more tokens than this
MIN_FOOTPRINT = 512 * 1024**2  # K/V bytes one timed graph touches (the H200's L2 is 60 MB)
# (name, num_heads, num_kv_heads, head_dim) of the other decode layouts, and their (batch, context)
LAYOUTS = (("gqa1", 32, 32, 128), ("gqa8", 32, 4, 128), ("mha_d64", 16, 16, 64))
LAYOUT_SHAPES = ((1, 32768), (16, 2048), (64, 8192), (128, 1024))
MULTI_QUERY_LENS = (1, 2, 4, 8)
MULTI_SHAPES = ((64, 2048), (8, 8192))
# (rows, chunk, context)
PREFILL_SHAPES = ((1, 8192, 0), (8, 2048, 0), (32, 512, 0), (1, 512, 8192))


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
    spec.loader.exec_module(module)
    return module


def make_inputs(case: DecodeCase, seed: int = 0) -> dict:
    """Random queries and paged cache on the GPU; block ids shuffled across rows.

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


def _decode_fn(tk, inputs: dict, case: DecodeCase, out, knobs: dict | None = None, *, old: bool = False):
    """A no-argument call of module ``tk``'s decode on ``inputs`` (``old``: the old kernels' API)."""
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
            inputs["seq_lens_kv"])
    scale = case.head_dim ** -0.5
    knobs = knobs or {}
    if case.query_len == 1:
        return lambda: tk.decode_attention(*args, max_seq_len=case.context, scale=scale, out=out, **knobs)
    if old:  # no multi-token decode then: such rows were prefill rows
        return lambda: tk.prefill_attention(*args, inputs["cu_seqlens_q"], first_row=0, num_rows=case.batch,
                                            max_query_len=case.query_len, scale=scale, out=out)
    return lambda: tk.decode_attention(*args, max_seq_len=case.context, scale=scale, out=out,
                                       num_rows=case.batch, cu_seqlens_q=inputs["cu_seqlens_q"],
                                       max_query_len=case.query_len, **knobs)


def _decode_config(tk, case: DecodeCase, knobs: dict | None = None) -> dict | None:
    """The decode knobs ``tk`` picks for ``case`` (``decode_config``, then ``knobs``), and its split plan."""
    if not hasattr(tk, "decode_config"):
        return None
    import torch

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    group = case.num_heads // case.num_kv_heads
    cfg = tk.decode_config(case.head_dim, group, case.num_kv_heads, 4 if case.dtype == "float32" else 2,
                           case.query_len, True, case.batch, case.context, num_sms)
    cfg = cfg._replace(**{k: v for k, v in (knobs or {}).items() if k in cfg._fields})
    row = cfg._asdict()
    if "num_splits" in (knobs or {}):
        row["num_splits"] = knobs["num_splits"]
    elif not getattr(cfg, "may_split", True):
        row["num_splits"] = 1
    else:
        programs = case.num_kv_heads // cfg.heads_per_program
        whole = {"whole_waves": not cfg.latency_kernel} if hasattr(cfg, "latency_kernel") else {}
        row["num_splits"] = tk.plan_decode_splits(case.batch, programs, case.context, block_n=cfg.block_n,
                                                  num_sms=num_sms, programs_per_sm=cfg.programs_per_sm, **whole)[0]
    return row


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
    sub = dataclasses.replace(case, batch=min(rows, case.batch))
    tables = inputs["block_tables"][: sub.batch]
    key = _gather(inputs["key_cache"], tables, sub).float()
    value = _gather(inputs["value_cache"], tables, sub).float()
    ref = _sdpa_decode(inputs["query"][: sub.batch].float().contiguous(), key, value, sub)
    return float((out[: sub.batch].float() - ref).abs().max())


def _safe_ms(fns, rep: int = 100) -> float | str:
    try:
        return _graph_ms(fns, rep=rep)
    except Exception as exc:  # noqa: BLE001 - a setting that does not compile or run: record it
        return f"{type(exc).__name__}: {exc}"[:300]


def bench_decode(case: DecodeCase, tk, before=None, *, gather: bool = False, knobs: dict | None = None) -> dict:
    """Time one decode shape (CUDA graphs): fleetlab's kernel, SDPA on contiguous K/V, before."""
    import torch

    sets = input_sets(case)
    outs = [torch.empty_like(s["query"]) for s in sets]
    runs = [_decode_fn(tk, s, case, o, knobs) for s, o in zip(sets, outs)]
    runs[0]()
    row = asdict(case) | {"kv_bytes": case.kv_bytes, "input_sets": len(sets)}
    row["config"] = _decode_config(tk, case, knobs)
    if case.query_len == 1:
        row["max_abs_err_vs_fp32_sdpa"] = _max_err_vs_fp32_sdpa(sets[0], outs[0], case)
    row["triton_ms"] = _graph_ms(runs)
    if case.query_len == 1:
        contiguous = [(_gather(s["key_cache"], s["block_tables"], case).contiguous(),
                       _gather(s["value_cache"], s["block_tables"], case).contiguous()) for s in sets]
        row["sdpa_ms"] = _graph_ms([
            (lambda s=s, k=k, v=v: _sdpa_decode(s["query"], k, v, case)) for s, (k, v) in zip(sets, contiguous)])
        del contiguous
        if gather:
            row["gather_sdpa_ms"] = _graph_ms([
                (lambda s=s: _sdpa_decode(s["query"], _gather(s["key_cache"], s["block_tables"], case),
                                          _gather(s["value_cache"], s["block_tables"], case), case))
                for s in sets])
    if before is not None:
        row["before_ms"] = _safe_ms([_decode_fn(before, s, case, o, old=True) for s, o in zip(sets, outs)])
    for name in ("triton", "sdpa", "gather_sdpa", "before"):
        if isinstance(row.get(f"{name}_ms"), float):
            row[f"{name}_tbps"] = case.kv_bytes / (row[f"{name}_ms"] * 1e-3) / 1e12
    if "sdpa_ms" in row:
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    if "gather_sdpa_ms" in row:
        row["speedup_vs_gather_sdpa"] = row["gather_sdpa_ms"] / row["triton_ms"]
    if isinstance(row.get("before_ms"), float):
        row["speedup_vs_before"] = row["before_ms"] / row["triton_ms"]
    del sets, outs, runs
    torch.cuda.empty_cache()
    return row


def _sdpa_prefill_fn(inputs: dict, case: PrefillCase, backend: str):
    """Causal SDPA on contiguous K/V (heads repeated for GQA): ``backend`` 'flash' or 'default'."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dcase = case.as_decode()
    group = case.num_heads // case.num_kv_heads
    q = inputs["query"].view(case.rows, case.chunk, case.num_heads, case.head_dim).transpose(1, 2).contiguous()
    k = _gather(inputs["key_cache"], inputs["block_tables"], dcase).repeat_interleave(group, 1).contiguous()
    v = _gather(inputs["value_cache"], inputs["block_tables"], dcase).repeat_interleave(group, 1).contiguous()
    mask = None if case.context == 0 else causal_lower_right(case.chunk, case.context + case.chunk)

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if backend == "flash" else contextlib.nullcontext():
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def _sdpa_default_backend(inputs: dict, case: PrefillCase) -> str:
    """Which backend SDPA picks by default for this prefill (``torch._fused_sdp_choice``)."""
    import torch
    from torch.nn.attention import SDPBackend

    q = inputs["query"].view(case.rows, case.chunk, case.num_heads, case.head_dim).transpose(1, 2).contiguous()
    k = torch.empty(case.rows, case.num_heads, case.context + case.chunk, case.head_dim, device=q.device, dtype=q.dtype)
    try:
        return SDPBackend(int(torch._fused_sdp_choice(q, k, k, is_causal=case.context == 0))).name
    except Exception as exc:  # noqa: BLE001 - a private helper: record what went wrong
        return f"unknown ({type(exc).__name__})"


def _prefill_fn(tk, inputs: dict, case: PrefillCase, out, knobs: dict | None = None):
    return lambda: tk.prefill_attention(
        inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
        inputs["seq_lens_kv"], inputs["cu_seqlens_q"], first_row=0, num_rows=case.rows,
        max_query_len=case.chunk, scale=case.head_dim ** -0.5, out=out, **(knobs or {}))


def bench_prefill(case: PrefillCase, tk, before=None) -> dict:
    """Time one prefill shape: fleetlab's kernel, SDPA (flash forced, and default), before."""
    import torch

    inputs = make_inputs(case.as_decode())
    out = torch.empty_like(inputs["query"])
    row = asdict(case) | {"flops": case.flops}
    row["triton_ms"] = _graph_ms([_prefill_fn(tk, inputs, case, out)], rep=50)
    ref = _sdpa_prefill_fn(inputs, case, "default")()
    row["max_abs_err_vs_sdpa"] = float(
        (out.view(case.rows, case.chunk, case.num_heads, -1).transpose(1, 2).float() - ref.float()).abs().max())
    row["sdpa_default_backend"] = _sdpa_default_backend(inputs, case)
    row["sdpa_ms"] = _safe_ms([_sdpa_prefill_fn(inputs, case, "flash")], rep=50)
    row["sdpa_default_ms"] = _safe_ms([_sdpa_prefill_fn(inputs, case, "default")], rep=50)
    if before is not None:
        row["before_ms"] = _safe_ms([_prefill_fn(before, inputs, case, out)], rep=50)
    for name in ("triton", "sdpa", "sdpa_default", "before"):
        if isinstance(row.get(f"{name}_ms"), float):
            row[f"{name}_tflops"] = case.flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    if isinstance(row.get("sdpa_ms"), float):
        row["ratio_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    if isinstance(row.get("sdpa_default_ms"), float):
        row["ratio_vs_sdpa_default"] = row["sdpa_default_ms"] / row["triton_ms"]
    if isinstance(row.get("before_ms"), float):
        row["speedup_vs_before"] = row["before_ms"] / row["triton_ms"]
    del inputs, out
    torch.cuda.empty_cache()
    return row


def host_overhead_us(case: DecodeCase, tk, calls: int = 300) -> dict:
    """Wall-clock microseconds per call of a tiny decode, issued back to back (host-bound)."""
    import time

    import torch

    inputs = make_inputs(case)
    out = torch.empty_like(inputs["query"])
    key = _gather(inputs["key_cache"], inputs["block_tables"], case).contiguous()
    value = _gather(inputs["value_cache"], inputs["block_tables"], case).contiguous()
    fns = {"triton": _decode_fn(tk, inputs, case, out),
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

PREFILL_GRID = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 4)]  # (block_m, block_n, warps, stages)
# Decode shapes whose contexts get split (fewer than two programs per multiprocessor): where
# the split count, the merge and launch gaps decide the time. (batch, context, heads, kv heads, dim)
TUNE_DECODE = ((1, 32768, 32, 8, 128), (1, 32768, 16, 16, 64), (16, 2048, 16, 16, 64), (16, 2048, 32, 8, 128))
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
        for bn in (64, 128):
            for stages in (3, 4, 5):
                for warps in (4, 8):
                    for n in split_counts(case, h):
                        knobs = {"heads_per_program": h, "block_n": bn, "num_stages": stages, "num_warps": warps,
                                 "latency_kernel": False}
                        grid.append(knobs | ({} if n is None else {"num_splits": n}))
    return grid


@contextlib.contextmanager
def _merge_skipped(tk):
    """Diagnostic: split decodes launch no merge (their output is wrong): the splits' own time."""
    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    saved = tk._decode_merge_kernel, tk._decode_reduce_kernel
    tk._decode_merge_kernel = tk._decode_reduce_kernel = _NoLaunch()
    try:
        yield
    finally:
        tk._decode_merge_kernel, tk._decode_reduce_kernel = saved


def _tune_decode_case(tk, case: DecodeCase) -> list[dict]:
    """Stage 1: the main kernel's knobs (default merge). Stage 2: the 5 best, with every merge
    and with no merge at all (how much of the time the merge takes). SDPA in the same run."""
    import torch

    sets = input_sets(case)
    outs = [torch.empty_like(s["query"]) for s in sets]

    def timed(knobs: dict, stage: str) -> dict:
        ms = _safe_ms([_decode_fn(tk, s, case, o, knobs) for s, o in zip(sets, outs)], rep=30)
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
        with _merge_skipped(tk):
            rows.append(timed(best["knobs"] | {"merge_in_launch": False}, "no-merge"))
    contiguous = [(_gather(s["key_cache"], s["block_tables"], case).contiguous(),
                   _gather(s["value_cache"], s["block_tables"], case).contiguous()) for s in sets]
    sdpa_ms = _graph_ms([(lambda s=s, k=k, v=v: _sdpa_decode(s["query"], k, v, case))
                         for s, (k, v) in zip(sets, contiguous)], rep=30)
    for r in rows:
        r["sdpa_ms"] = sdpa_ms
        if isinstance(r["triton_ms"], float):
            r["speedup_vs_sdpa"] = sdpa_ms / r["triton_ms"]
    return rows


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
    for shape in (PREFILL_SHAPES[:1] if quick else PREFILL_SHAPES) if "prefill" in sections else ():
        case = PrefillCase(*shape)
        inputs = make_inputs(case.as_decode())
        out = torch.empty_like(inputs["query"])
        for bm, bn, warps, stages in PREFILL_GRID:
            knobs = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            ms = _safe_ms([_prefill_fn(tk, inputs, case, out, knobs)], rep=30)
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
    shape_keys = [k for k in ("batch", "context", "rows", "chunk", "num_kv_heads", "head_dim", "num_heads")
                  if k in (rows[0] if rows else {})]
    for key in sorted({tuple(r[k] for k in shape_keys) for r in rows}):
        ok = sorted((r for r in rows if tuple(r[k] for k in shape_keys) == key and metric in r),
                    key=lambda r: -r[metric])
        best = ", ".join(f"{r.get('stage', '')} {r['knobs']}: {r[metric]:.2f}"
                         + (f" ({r['speedup_vs_sdpa']:.2f}x sdpa)" if "speedup_vs_sdpa" in r else "")
                         for r in ok[:top])
        lines.append(f"tune {dict(zip(shape_keys, key))}: {best}")
    return lines


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


def _load_errors(pattern: str) -> dict:
    """Worst errors from the test suite's JSON files (one per pytest-xdist worker): the max of each key."""
    worst: dict[str, float] = {}
    for path in sorted(glob.glob(pattern + "*")):
        with open(path) as f:
            for key, value in json.load(f).items():
                worst[key] = max(worst.get(key, 0.0), float(value))
    return dict(sorted(worst.items()))


def _previous(path: str) -> dict:
    """The headline numbers of an earlier results file (the kernels before this change)."""
    with open(path) as f:
        old = json.load(f)
    keep = ("layout", "batch", "context", "num_heads", "num_kv_heads", "head_dim", "query_len", "triton_tbps",
            "sdpa_tbps", "before_tbps")
    return {
        "environment": old.get("environment"),
        **{section: [{k: r[k] for k in keep if k in r} for r in old.get(section, [])]
           for section in ("decode_bandwidth", "decode_shapes", "multi_token_decode")},
        "prefill": [r for r in old.get("prefill", []) if "triton_tflops" in r or "sdpa_causal_tflops" in r],
    }


def goal_check(result: dict) -> dict:
    """The issue's targets, read off this run."""
    decode = [r for r in result.get("decode_bandwidth", []) + result.get("decode_shapes", [])
              if "speedup_vs_sdpa" in r]
    prefill = [r for r in result.get("prefill", []) if "ratio_vs_sdpa" in r]
    one_row = [r for r in result.get("decode_bandwidth", []) if r["batch"] == 1 and r["context"] == 32768]
    check = {}
    if decode:
        worst = min(decode, key=lambda r: r["speedup_vs_sdpa"])
        check["decode_min_ratio_vs_sdpa"] = worst["speedup_vs_sdpa"]
        check["decode_min_ratio_shape"] = {k: worst[k] for k in ("batch", "context", "num_heads", "num_kv_heads",
                                                                 "head_dim")}
        check["decode_shapes_below_0.95"] = sum(r["speedup_vs_sdpa"] < 0.95 for r in decode)
        check["decode_shapes"] = len(decode)
    if one_row:
        check["decode_1x32k_tbps"] = one_row[0]["triton_tbps"]
    for r in prefill:
        check[f"prefill_{r['rows']}x{r['chunk']}+{r['context']}_ratio_vs_sdpa_flash"] = r["ratio_vs_sdpa"]
    return check


def _decode_table(rows: list[dict]) -> str:
    head = (f"{'layout':>16} {'batch':>5} {'ctx':>6} {'q':>2} | {'triton':>6} {'sdpa':>6} {'before':>6} TB/s | "
            f"{'x sdpa':>6} {'x before':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        layout = f"{r['num_heads']}/{r['num_kv_heads']} d{r['head_dim']}"
        lines.append(
            f"{layout:>16} {r['batch']:>5} {r['context']:>6} {r['query_len']:>2} | {r['triton_tbps']:>6.2f} "
            f"{r.get('sdpa_tbps', 0):>6.2f} {r.get('before_tbps', 0):>6.2f}      | "
            f"{r.get('speedup_vs_sdpa', 0):>6.2f} {r.get('speedup_vs_before', 0):>8.2f}")
    return "\n".join(lines)


def _prefill_table(rows: list[dict]) -> str:
    head = f"{'prefill':>16} | {'triton':>6} {'flash':>6} {'sdpa*':>6} {'before':>6} TFLOP/s | {'x flash':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['rows']:>4} x {r['chunk']:>5} +{r['context']:>5} | {r['triton_tflops']:>6.0f} "
            f"{r.get('sdpa_tflops', 0):>6.0f} {r.get('sdpa_default_tflops', 0):>6.0f} "
            f"{r.get('before_tflops', 0):>6.0f}         | {r.get('ratio_vs_sdpa', 0):>7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results (rewritten after each section)")
    parser.add_argument("--errors", help="FLEETLAB_TRITON_ERRORS path of tests/test_triton_kernels.py "
                                         "(files PATH* are merged: one per pytest-xdist worker)")
    parser.add_argument("--before", help="an older triton_kernels.py to time side by side as 'before'")
    parser.add_argument("--previous", help="an earlier results JSON whose headline numbers to carry along")
    parser.add_argument("--tune", nargs="?", const="decode,prefill", default="",
                        help="also sweep the kernels' knobs (optionally: decode, prefill or both, comma-separated)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--sections", default="decode,shapes,multi,prefill",
                        help="comma-separated: decode, shapes, multi, prefill")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    tk = load_kernels()
    before = load_kernels(args.before) if args.before else None
    sections = set(args.sections.split(","))
    result = {"environment": environment(), "case_defaults": asdict(DecodeCase(1, 1)),
              "ceilings": measure_ceilings(), "before": args.before and "an older copy of triton_kernels.py, "
              "timed in this run with the same calls (multi-token rows: its prefill kernel)"}
    if args.errors:
        result["max_error_vs_dense_reference"] = _load_errors(args.errors)
    if args.previous:
        result["previous_results"] = _previous(args.previous)

    def save():
        result["goal_check"] = goal_check(result)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    batches, contexts = ((1, 16, 128), (512, 32768)) if args.quick else (BATCHES, CONTEXTS)
    if "decode" in sections:
        result["decode_bandwidth"] = []
        for b in batches:
            for c in contexts:
                if b * c <= MAX_TOKENS:
                    result["decode_bandwidth"].append(bench_decode(DecodeCase(b, c), tk, before, gather=True))
                    log.info("%s", result["decode_bandwidth"][-1])
        result["host_overhead"] = host_overhead_us(DecodeCase(1, 512), tk)
        save()
    if "shapes" in sections:
        result["decode_shapes"] = []
        for name, heads, kv_heads, head_dim in LAYOUTS:
            for b, c in LAYOUT_SHAPES[1:3] if args.quick else LAYOUT_SHAPES:
                row = bench_decode(DecodeCase(b, c, heads, kv_heads, head_dim), tk, before)
                result["decode_shapes"].append({"layout": name} | row)
                log.info("%s", result["decode_shapes"][-1])
            save()
    if "multi" in sections:
        result["multi_token_decode"] = []
        for b, c in MULTI_SHAPES[:1] if args.quick else MULTI_SHAPES:
            for q in MULTI_QUERY_LENS:
                result["multi_token_decode"].append(bench_decode(DecodeCase(b, c, query_len=q), tk, before))
                log.info("%s", result["multi_token_decode"][-1])
        single = {(r["batch"], r["context"]): r["triton_ms"] for r in result["multi_token_decode"]
                  if r["query_len"] == 1}
        for r in result["multi_token_decode"]:
            r["time_vs_one_token"] = r["triton_ms"] / single[(r["batch"], r["context"])]
        save()
    if "prefill" in sections:
        result["prefill"] = []
        for shape in PREFILL_SHAPES[:2] if args.quick else PREFILL_SHAPES:
            result["prefill"].append(bench_prefill(PrefillCase(*shape), tk, before))
            log.info("%s", result["prefill"][-1])
            save()
    if args.tune:
        result["tuning"] = {}
        tune(tk, args.quick, result["tuning"], save, tuple(args.tune.split(",")))
    save()

    print(json.dumps(result["ceilings"]))
    for key, metric in (("decode", "triton_tbps"), ("prefill", "triton_tflops")):
        for line in _best(result.get("tuning", {}).get(key, []), metric):
            print(line)
    rows = result.get("decode_bandwidth", []) + result.get("decode_shapes", []) + result.get("multi_token_decode", [])
    if rows:
        print(_decode_table(rows))
    if result.get("prefill"):
        print(_prefill_table(result["prefill"]))
    print(json.dumps(result["goal_check"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
