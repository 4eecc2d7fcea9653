"""What tensor parallelism costs and saves on 2 GPUs, measured with torch + NCCL (not Paddle).

Run with ``torchrun --nproc_per_node 2 tools/gpu_tp_costs.py OUT.json`` on a 2-GPU host.
Measures (bf16, CUDA events, median of 50 after 10 warm-ups):

- all-reduce latency of a ``[tokens, hidden]`` tensor, what a row-parallel layer sums;
- one Llama-3-8B-shaped decoder layer's matmuls (hidden 4096, 32 q / 8 KV heads of 128,
  MLP 14336) whole (tp=1) and one rank's half (tp=2), at several token counts.

fleetlab's own tensor-parallel path on GPUs (Paddle + NCCL) is not run here; these figures
say what the split would have to beat.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def timed(fn, iters=50, warm=10):
    for _ in range(warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2] * 1e3  # microseconds


def layer_matmuls(tokens, tp, hidden=4096, heads=32, kv=8, d=128, ffn=14336):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w_qkv = torch.randn(hidden, (heads + 2 * kv) * d // tp, device="cuda", dtype=torch.bfloat16)
    w_o = torch.randn(heads * d // tp, hidden, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(hidden, 2 * ffn // tp, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(ffn // tp, hidden, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(tokens, heads * d // tp, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(tokens, ffn // tp, device="cuda", dtype=torch.bfloat16)

    def run():
        x @ w_qkv
        a @ w_o
        x @ w_up
        m @ w_down
    return timed(run)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "all_reduce_us": {}, "layer_matmul_us": {}}
    for hidden in (4096, 8192):
        for tokens in (1, 16, 64, 256, 2048):
            t = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            out["all_reduce_us"][f"{tokens}x{hidden}"] = timed(lambda t=t: dist.all_reduce(t))
    if rank == 0:
        for tokens in (1, 64, 256, 2048):
            out["layer_matmul_us"][str(tokens)] = {"tp1": layer_matmuls(tokens, 1), "tp2": layer_matmuls(tokens, 2)}
        json.dump(out, open(sys.argv[1], "w"), indent=1)
        print(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
