"""Compile the Hopper Gluon prefill kernel for sm_90 on a machine without a GPU, and report what
ptxas says: registers, spills, shared memory. Catches compile errors and register spills before
any GPU time is spent.

    .venv-kernels/bin/python tools/gluon_sm90_check.py [HEAD_DIM:GROUP ...] [--max-query-len N ...]

Needs Triton 3.6 (``make test-kernels`` builds ``.venv-kernels`` with it); Triton ships ptxas and
cuobjdump, so no CUDA install is needed. Pointers and strides are compiled as 16-byte aligned,
as the JIT specialises them on a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fleetlab.attention import gluon_ws_prefill as ws  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = ("q_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")


def signature(dtype: str) -> dict:
    """The kernel's runtime arguments and their Triton types."""
    sig = {name: "i32" for name in ws._gluon_ws_prefill_kernel.arg_names}
    sig |= {name: f"*{dtype}" for name in POINTERS}
    sig |= {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "scale_log2": "fp32"}
    return sig


def compile_sm90(head_dim: int, group: int, max_query_len: int, block_size: int = 16, dtype: str = "bf16"):
    """The compiled kernel and ptxas's report for one configuration (the plan's own knobs)."""
    fn = ws._gluon_ws_prefill_kernel
    knobs = dict(ws.kernel_config(head_dim, max_query_len))
    knobs.pop("persistent")
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size} | knobs
    sig = {n: t for n, t in signature(dtype).items() if n not in constexprs} | dict.fromkeys(constexprs, "constexpr")
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or n.startswith("stride_")}
    source = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, aligned)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": ws.NUM_WARPS.value, "maxnreg": ws.MAXNREG})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"],
                                capture_output=True, text=True).stderr
    regs = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])
    return knobs, kernel.metadata.shared, report, regs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["64:1", "64:8", "128:4", "128:7", "256:4"],
                        help="HEAD_DIM:GROUP")
    parser.add_argument("--max-query-len", type=int, nargs="+", default=[512, 8192],
                        help="picks the ring (see kernel_config): each length given is checked")
    args = parser.parse_args(argv)
    spilled = False
    for shape in args.shapes:
        head_dim, group = map(int, shape.split(":"))
        for max_query_len in args.max_query_len:
            knobs, shared, report, regs = compile_sm90(head_dim, group, max_query_len)
            spill = re.search(r"(\d+) bytes spill stores", report)
            spilled |= bool(spill and int(spill.group(1)))
            used = re.search(r"Used (\d+) registers", report)
            print(f"d{head_dim} group {group} chunk {max_query_len} {knobs}: shared {shared} B, "
                  f"{used.group(0) if used else '?'}, {spill.group(0) if spill else '? spills'}, "
                  f"setmaxnreg {' '.join(regs)}")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
