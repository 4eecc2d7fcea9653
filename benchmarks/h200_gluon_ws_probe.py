"""Issue #37 probe on an H200 (torch tensors, no Paddle): the warp-specialised Gluon prefill kernel
in each ring configuration against the portable Triton kernel and cuDNN's SDPA, on the issue's shapes.

    python3 benchmarks/h200_gluon_ws_probe.py [--quick]

Times: CUDA-graph replay (``fleetlab.lab.bench.triton_attention._graph_ms``, median of 50 replays,
inputs sized past the L2). cuDNN runs on contiguous K/V with the query heads' own K/V (GQA
expanded), causal. Prints one line per shape: each variant's time in microseconds, its ratio
to cuDNN (cuDNN time / variant time, > 1: faster) and its largest difference from the portable
kernel's output.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from fleetlab.attention import gluon_ws_prefill as ws  # noqa: E402
from fleetlab.attention import triton_kernels as tk  # noqa: E402
from fleetlab.lab.bench import triton_attention as bt  # noqa: E402

# (rows, chunk, context, heads, kv_heads, head_dim, page)
SHAPES = [(1, 8192, 0, 32, 8, 128, 16), (8, 2048, 0, 32, 8, 128, 16), (32, 512, 0, 32, 8, 128, 16),
          (8, 2048, 0, 32, 8, 128, 64), (8, 2048, 0, 32, 8, 128, 128), (1, 512, 8192, 32, 8, 128, 16),
          (1, 6144, 0, 28, 4, 128, 128), (4, 3072, 0, 32, 8, 128, 128), (16, 700, 0, 32, 8, 128, 128),
          (2, 4096, 0, 16, 16, 64, 128), (4, 2048, 0, 16, 4, 256, 128)]
RINGS = {64: [{"BLOCK_N": 128, "STAGES": 4, "Q_SLOTS": 2}],
         128: [{"BLOCK_N": 128, "STAGES": 3, "Q_SLOTS": 1}, {"BLOCK_N": 64, "STAGES": 4, "Q_SLOTS": 2}],
         256: [{"BLOCK_N": 32, "STAGES": 4, "Q_SLOTS": 1}]}
RINGS = {d: [r | {"persistent": p} for r in rings for p in (True, False)] for d, rings in RINGS.items()}


def run(shape):
    rows, chunk, context, heads, kv, d, page = shape
    case = bt.PrefillCase(rows, chunk, context, heads, kv, d, page)
    inputs = bt.make_inputs(case.as_decode())
    times, outs = {}, {}
    default_cfg = ws.kernel_config
    regs = {k: v for k, v in default_cfg(d, chunk).items() if k.endswith("_REGS")}
    variants = [("portable", "0", None)] + [
        (f"ws{c['BLOCK_N']}x{c['STAGES']}q{c['Q_SLOTS']}{'p' if c['persistent'] else 'g'}", "1", regs | c)
        for c in RINGS[d]]
    for name, env, cfg in variants:
        os.environ["FLEETLAB_GLUON_PREFILL"] = env
        ws.kernel_config = (lambda h, n, _c=cfg: _c) if cfg else default_cfg
        out = torch.full_like(inputs["query"], float("nan"))
        try:
            fn, plan = bt._prefill_fn(tk, inputs, case, out)
            times[name] = bt._graph_ms([fn], rep=50)
            outs[name] = out.float()
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print("FAIL", shape, name, repr(e)[:1500], flush=True)
    ws.kernel_config = default_cfg
    sdpa = bt._sdpa_prefill_fn(inputs, case, "cudnn", "expanded")
    times["cudnn"] = bt._graph_ms([sdpa], rep=50)
    ref = sdpa().transpose(1, 2).reshape(outs["portable"].shape).float()
    line = {k: round(v * 1000, 1) for k, v in times.items()}
    ratios = {k: round(times["cudnn"] / v, 3) for k, v in times.items() if k != "cudnn"}
    diffs = {k: float((o - ref).abs().max()) for k, o in outs.items()}
    tflops = {k: round(case.flops / (v * 1e-3) / 1e12) for k, v in times.items()}
    print(shape, "us", line, "x_cudnn", ratios, "TFLOP/s", tflops, "maxdiff_vs_cudnn",
          {k: f"{v:.3g}" for k, v in diffs.items()}, flush=True)
    del inputs
    torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the first three shapes only")
    args = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), torch.backends.cudnn.version(), flush=True)
    for s in SHAPES[:3] if args.quick else SHAPES:
        run(s)
