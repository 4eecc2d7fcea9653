"""Issue 34 on a GPU: the Triton backend's per-step plan built for step N+1 while step N's layers run.

    python benchmarks/h200_overlap_plan_probe.py [--steps 60] [--layers 32] [--batch 64] [--out FILE]

A sequence of decode steps (``--batch`` rows, contexts growing by one token a step, bf16, a
Llama-8B-like layer: 32 query heads, 8 KV heads, head dim 128, and one GEMM of 4096 x 49152 per
layer standing in for its projections and MLP) with torch tensors, run two ways:

- **inline**: each step builds its plan (the host arrays uploaded, ``StepPlans``, as
  ``TritonBackend.build_metadata`` does), launches its layers, then waits for the GPU, as the
  synchronous engine does (it reads the sampled tokens before it plans the next step);
- **overlapped**: each step launches its layers, builds the next step's plan while the GPU runs
  them, then waits: the plan needs only the next step's lengths and block tables, never the
  tokens, so it can be built one step ahead.

Also timed alone: the plan (host) and a step's layers with the plan built beforehand (GPU).
Prints one JSON object and writes it to ``--out``. Needs torch, triton and a CUDA GPU.

Status: written and linted, not run yet (no device time was left when it was written); its
figures are not quoted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from fleetlab.attention import triton_kernels as tk  # noqa: E402

BS, HQ, HKV, D, HIDDEN, WIDE = 16, 32, 8, 128, 4096, 49152


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    B, L, S = args.batch, args.layers, args.steps
    max_len = args.context + 2 * S + 8
    blocks_per_row = -(-max_len // BS)
    num_blocks = B * blocks_per_row + 4
    rng = np.random.default_rng(0)
    tables_host = rng.permutation(num_blocks)[: B * blocks_per_row].reshape(B, blocks_per_row).astype(np.int32)
    key_cache = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=dt)
    value_cache = torch.randn_like(key_cache)
    weight = torch.randn(HIDDEN, WIDE, device=dev, dtype=dt) * 0.01
    x = torch.randn(B, HIDDEN, device=dev, dtype=dt)
    query = torch.randn(B, HQ, D, device=dev, dtype=dt)
    key, value = torch.randn(B, HKV, D, device=dev, dtype=dt), torch.randn(B, HKV, D, device=dev, dtype=dt)
    tables = torch.from_numpy(tables_host).to(dev)
    known: dict = {}

    def plan(step: int):
        """The host's work for ``step``: its lengths, slots and plan (what build_metadata does)."""
        lens = np.full(B, args.context + step, dtype=np.int32) + (np.arange(B, dtype=np.int32) % 64)
        pos = lens - 1
        slots = tables_host[np.arange(B), pos // BS].astype(np.int64) * BS + pos % BS
        cu = np.arange(B + 1, dtype=np.int32)
        batch = tk.PagedBatch.from_host(tables, torch.from_numpy(lens).to(dev, non_blocking=True),
                                        torch.from_numpy(cu).to(dev, non_blocking=True),
                                        torch.from_numpy(slots).to(dev, non_blocking=True), block_size=BS,
                                        num_decodes=B, cu_seqlens_q_host=cu, seq_lens_kv_host=lens)
        plans = tk.StepPlans(batch, like=tables, known=known)
        return plans.for_layer(query, key_cache)

    def layers(p_) -> None:
        h = x
        for _ in range(L):
            p_.store_kv(key, value, key_cache, value_cache)
            p_.run(query, key_cache, value_cache, scale=D ** -0.5)
            h = (h @ weight)[:, :HIDDEN]

    def inline() -> float:
        start = time.perf_counter()
        for n in range(S):
            layers(plan(n))
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / S

    def overlapped() -> float:
        start = time.perf_counter()
        nxt = plan(0)
        for n in range(S):
            cur = nxt
            layers(cur)
            if n + 1 < S:
                nxt = plan(n + 1)  # the host plans step N+1 while the GPU runs step N's layers
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / S

    def plan_only() -> float:
        start = time.perf_counter()
        for n in range(S):
            plan(n)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / S

    def gpu_only() -> float:
        plans = [plan(n) for n in range(S)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for p_ in plans:
            layers(p_)
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / S

    for f in (inline, overlapped, plan_only, gpu_only):  # warm-up: compile, plan once
        f()
    rounds = {f.__name__: [] for f in (inline, overlapped, plan_only, gpu_only)}
    for i in range(8):  # alternated, so both loops meet the same moments of the machine
        order = (inline, overlapped) if i % 2 == 0 else (overlapped, inline)
        for f in (*order, plan_only, gpu_only):
            rounds[f.__name__].append(1e6 * f())
    med = {k: statistics.median(v) for k, v in rounds.items()}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "config": vars(args),
              "median_us_per_step": med, "rounds_us": rounds,
              "overlapped_over_gpu_only": med["overlapped"] / med["gpu_only"],
              "inline_over_gpu_only": med["inline"] / med["gpu_only"],
              "plan_hidden": 1 - (med["overlapped"] - med["gpu_only"]) / max(med["inline"] - med["gpu_only"], 1e-9)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
