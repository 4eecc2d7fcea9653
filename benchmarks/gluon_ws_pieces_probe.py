"""Issue #49 probe (torch tensors, no Paddle): the warp-specialised Gluon prefill against another
copy of it and cuDNN, on stop 40's table (1 x 8k, 8 x 2k, 32 x 512, 512 after 8k cached at pages
16/64/128; GQA 7:1 and 4:1, MHA d64, d256 at pages 16/128).

    python3 benchmarks/gluon_ws_pieces_probe.py --base OLD_gluon_ws_prefill.py [--variant NAME='{"KNOB": v}' ...]
        [--rounds 3] [--quick] [--json PATH]
    python3 benchmarks/gluon_ws_pieces_probe.py --one 8,2048,0,32,8,128,16   # one shape, for Nsight Compute

Variants: ``base`` (the kernel file given, e.g. ``git show REV:fleetlab/attention/gluon_ws_prefill.py``),
``default`` (this checkout's kernel) and each ``--variant``: this checkout's kernel with those
knobs over its own ``kernel_config`` (constexprs such as ``BLOCK_N``, ``STAGES``, ``Q_SLOTS``,
the registers, or a kernel's own switches). Each shape's variants are captured as CUDA graphs
once, then timed in ``--rounds`` interleaved rounds (the order rotates each round; median of
``do_bench`` replays per round), and the median over rounds is reported: time in microseconds,
TFLOP/s, ratio to cuDNN's (> 1: faster than cuDNN; cuDNN with native GQA, on expanded heads
for MHA d64), the spread over rounds and each variant's largest absolute difference from
cuDNN's output.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import triton.testing  # noqa: E402

import fleetlab.attention as fa  # noqa: E402
from fleetlab.attention import gluon_ws_prefill as ws  # noqa: E402
from fleetlab.attention import triton_kernels as tk  # noqa: E402
from fleetlab.lab.bench import triton_attention as bt  # noqa: E402

# stop 40's table: page 16 first (the table's and the layouts'), then the larger pages
TABLE = [(r, c, x, 32, 8, 128, p) for p in (16, 64, 128) for r, c, x in ((1, 8192, 0), (8, 2048, 0), (32, 512, 0),
                                                                         (1, 512, 8192))]
LAYOUTS = [(r, c, x, h, kv, d, p) for p in (16, 128) for r, c, x, h, kv, d in bt.PREFILL_LAYOUTS]
SHAPES = sorted(TABLE + LAYOUTS, key=lambda s: s[-1] != 16)
def load_base(path: str):
    spec = importlib.util.spec_from_file_location("gluon_ws_prefill_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def plan_fn(module, flags, inputs, case, out):
    """The plan's prefill through ``module``'s kernel with ``flags`` over its own config."""
    default = module.kernel_config
    takes_group = len(inspect.signature(default).parameters) > 2  # the kernel before took no group
    fa.gluon_ws_prefill = module
    sys.modules["fleetlab.attention.gluon_ws_prefill"] = module
    module.kernel_config = lambda h, n, g=1: default(*((h, n, g) if takes_group else (h, n))) | flags
    try:
        fn, plan = bt._prefill_fn(tk, inputs, case, out)
    finally:
        module.kernel_config = default
        fa.gluon_ws_prefill = ws
        sys.modules["fleetlab.attention.gluon_ws_prefill"] = ws
    return fn, plan.launches[0].config


def run(shape, base, extra: dict, rounds: int) -> dict:
    rows, chunk, context, heads, kv, d, page = shape
    case = bt.PrefillCase(rows, chunk, context, heads, kv, d, page)
    inputs = bt.make_inputs(case.as_decode())
    variants = {"base": (base, {}), "default": (ws, {})} | {k: (ws, f) for k, f in extra.items()}
    graphs, outs, configs = {}, {}, {}
    for name, (module, flags) in variants.items():
        out = torch.full_like(inputs["query"], float("nan"))
        try:
            fn, configs[name] = plan_fn(module, flags, inputs, case, out)
            graphs[name] = graph(fn)
            outs[name] = out
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print("FAIL", shape, name, repr(e)[:800], flush=True)
    sdpa = bt._sdpa_prefill_fn(inputs, case, "cudnn", "native" if d != 64 else "expanded")
    graphs["cudnn"] = graph(sdpa)
    ref = sdpa().transpose(1, 2).reshape(inputs["query"].shape).float()
    names = list(graphs)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(triton.testing.do_bench(graphs[n].replay, warmup=10, rep=30, return_mode="median"))
    med = {n: statistics.median(t) * 1000 for n, t in times.items()}
    row = {"shape": shape, "flops": case.flops, "us": {n: round(v, 1) for n, v in med.items()},
           "tflops": {n: round(case.flops / v / 1e6) for n, v in med.items()},
           "x_cudnn": {n: round(med["cudnn"] / v, 3) for n, v in med.items() if n != "cudnn"},
           "spread": {n: round((max(t) - min(t)) / statistics.median(t), 3) for n, t in times.items()},
           "maxdiff": {n: float((o.float() - ref).abs().max()) for n, o in outs.items()},
           "configs": configs}
    del inputs, graphs, outs
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", help="another copy of gluon_ws_prefill.py (e.g. the one before a change)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="this kernel with these kernel_config knobs, e.g. ring64='{\"BLOCK_N\": 64}'")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="page 16 rows only")
    p.add_argument("--one", help="rows,chunk,context,heads,kv_heads,head_dim,page: run the current kernel on this "
                                 "shape twice and exit (for a profiler: skip the first launch)")
    args = p.parse_args()
    if args.one:
        rows, chunk, context, heads, kv, d, page = map(int, args.one.split(","))
        case = bt.PrefillCase(rows, chunk, context, heads, kv, d, page)
        inputs = bt.make_inputs(case.as_decode())
        fn, plan = bt._prefill_fn(tk, inputs, case, torch.empty_like(inputs["query"]))
        print(plan.launches[0].config, flush=True)
        fn()
        fn()
        torch.cuda.synchronize()
        return
    base = load_base(args.base)
    extra = {name: json.loads(knobs) for name, knobs in (v.split("=", 1) for v in args.variant)}
    print(torch.__version__, torch.cuda.get_device_name(), torch.backends.cudnn.version(), flush=True)
    shapes = [s for s in SHAPES if not args.quick or s[-1] == 16]
    rows = []
    for s in shapes:
        rows.append(run(s, base, extra, args.rounds))
        print(json.dumps({k: rows[-1][k] for k in ("shape", "us", "x_cudnn", "spread")}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    names = list(dict.fromkeys(n for r in rows for n in r["x_cudnn"]))
    print("shape".ljust(34), *(n.rjust(8) for n in names))
    for r in rows:
        print(str(tuple(r["shape"])).ljust(34), *(f"{r['x_cudnn'].get(n, float('nan')):8.3f}" for n in names))


if __name__ == "__main__":
    main()
