# %% [markdown]
# # 09 · Tensor parallelism: one model, two processes
#
# A model too big (or too slow) for one device is split across several: every rank holds a
# slice of each layer's attention heads and MLP columns, and the ranks add up their partial
# results after each layer's two row-parallel projections. fleetlab does it on Paddle's own
# distributed runtime (`paddle.distributed`: gloo on CPU, NCCL on GPUs), Megatron's way.
#
# **You will learn**
# - which query heads, KV heads and weight columns live on which rank, and what happens when
#   ranks outnumber KV heads;
# - why each rank's paged KV cache is smaller, and by how much;
# - the two all-reduces per layer, and what one engine step spends in them;
# - why every rank runs its own scheduler and still agrees on every block id;
# - how to launch a 2-process run — this notebook does it from a cell.

# %%
# %matplotlib inline
import json
import tempfile
from pathlib import Path

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.distributed import plan_shards
from fleetlab.distributed.launch import launch, launch_command, shell_line
from fleetlab.distributed.shard import weight_table
from fleetlab.lab.tp_worker import run_family
from fleetlab.lab.viz import tp as tpviz
from fleetlab.models import tiny

# %% [markdown]
# ## 1. Who holds what
#
# The tiny Fleet-style model has 4 query heads sharing 2 KV heads (grouped-query attention:
# heads 0–1 read KV head 0, heads 2–3 read KV head 1) and an MLP of 128 columns. With
# `tensor_parallel_size=2`, rank 0 takes query heads 0–1 and the one KV head they read; rank 1
# takes heads 2–3 and KV head 1. The fused QKV projection packs `[q | k | v]`, so a rank's
# columns come from three places of it. The MLP row: the gate and up projections' 128
# output columns split into contiguous ranges, 0–63 on rank 0 and 64–127 on rank 1 (the
# boxes name the ranges, two boxes per rank), and the down projection's *rows* split the
# same way, since it reads exactly those columns of the gate·up product.
#
# The lower panel is a larger case drawn from the same planner (`plan_shards`): a model with
# 8 query heads over the same 2 KV heads, on 4 ranks (the tiny model's 4 heads would leave
# one per rank). Each rank takes two query heads, but 2 KV heads cannot be split 4 ways:
# KV head 0 is **replicated** on ranks 0 and 1, KV head 1 on ranks 2 and 3 (a replicated
# head is drawn as one band per rank holding it, each labelled), and the MLP's columns go
# to the ranks in quarters.

# %%
model = tiny("fleet", seed=0)
cfg = model.config
plan2 = fleetlab.distributed.plan_for(model, 2)
plan4 = plan_shards(num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=128, tp_size=4)
for row in plan2.table():
    print(row)
shard_figure = tpviz.draw_shard_plan([plan2, plan4])
shard_figure

# %% [markdown]
# Every projection of a decoder layer, whole and on one rank. *Column*-parallel layers
# produce this rank's heads or columns and need no communication. *Row*-parallel layers
# (attention output, MLP down) produce a partial sum of the full hidden vector: one
# all-reduce each completes it, two per layer.

# %%
for row in weight_table(model, 2):
    print(f"{row['projection']:<12} {str(row['full']):<11} -> {str(row['per_rank']):<11} {row['split']:<7} "
          f"{row['after']:<11} {row['holds']}")

# %% [markdown]
# ## 2. KV bytes per rank
#
# Each rank caches K and V only for its own KV heads, in blocks of the same size and with
# the same block ids as every other rank. Below, the bytes one rank allocates for 64 blocks
# of 16 tokens of a 4-layer model with 8 query heads over 2 KV heads (head size 64): halved
# at 2 ranks; at 4 ranks each rank still holds one whole KV head (replicated), so the bytes
# stay where 2 ranks left them. The saving stops at the number of KV heads.

# %%
num_layers, head_dim, blocks, block_size = 4, 64, 64, 16
sizes = [1, 2, 4]
heads = [plan_shards(8, 2, head_dim, 256, n).ranks[0].num_kv_heads for n in sizes]
kv_bytes = [blocks * fleetlab.PagedKVCache.bytes_per_block(num_layers, h, head_dim, block_size, "float32")
            for h in heads]
print({f"tp={n}": f"{b / 1024:.0f} KiB ({h} KV heads)" for n, b, h in zip(sizes, kv_bytes, heads)})
tpviz.draw_kv_bytes_per_rank(sizes, kv_bytes, heads)

# %% [markdown]
# ## 3. Where the scheduler runs
#
# fleetlab's tensor-parallel program is SPMD: every rank runs the **same script**, adds the
# same requests in the same order and runs its **own** scheduler, block pool, InputBatch and
# sampler. Nothing is broadcast. That is safe because after each all-reduce every rank holds
# the same hidden states (embeddings, norms and LM head are whole on every rank), so every
# rank computes the same logits and samples the same token (greedy, or seeded: a request's
# random numbers come from its seed and token index). The scheduler never looks at the clock,
# so the same tokens lead to the same next step, the same block ids, the same block tables.
#
# A server, where requests arrive at one process, would instead run the scheduler on rank 0
# and broadcast its step message (vLLM's engine core does that). fleetlab checks its bet
# cheaply: every 16 steps (`FLEETLAB_TP_CHECK_EVERY`) the ranks all-reduce a fingerprint of
# the step's schedule and of the last sampled tokens, and stop with a clear error if they differ.
#
# ## 4. A real 2-process run, launched from this cell
#
# The cell starts `fleetlab.lab.tp_worker` on 2 ranks through Paddle's launcher — the
# same command you would type in a shell (printed below). Each rank serves the same six
# prompts on the tiny Fleet-style model and the tiny Llama, greedy, with a 10-token step
# budget (chunked prefill) and a 14-block pool (preemption), and writes what it saw to a JSON file.

# %%
work = Path(tempfile.mkdtemp(prefix="fleetlab-09-"))
args = ["fleetlab.lab.tp_worker", "--out", str(work / "out"), "--families", "fleet,llama"]
print(shell_line(launch_command(args, 2, work / "logs")))
result = launch(args, 2, log_dir=work / "logs", timeout=300, env={"FLEETLAB_TP_CHECK_EVERY": "1"})
print(f"exit code {result.returncode}, {result.seconds:.1f} s (two Python processes starting Paddle included)")
ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in range(2)]

# %% [markdown]
# The same prompts in this process, unsplit, for comparison. Every rank must produce exactly
# these tokens, hold half the KV bytes, and end with its whole pool free.

# %%
for family in ("fleet", "llama"):
    alone = run_family(family, 1)
    for r, report in enumerate(ranks):
        rep = report["families"][family]
        print(f"{family:<6} rank {r}: tokens identical to one process: {rep['tokens'] == alone['tokens']}; "
              f"KV heads {rep['kv_heads']} -> {rep['kv_cache_bytes'] / 1024:.0f} KiB "
              f"(one process: {alone['kv_cache_bytes'] / 1024:.0f} KiB); pool whole: "
              f"{rep['pool_ok'] is True and rep['num_free_blocks'] == rep['num_blocks']}; "
              f"preemptions {rep['num_preemptions']}; ranks agreed at {rep['agreement_checks']} checked steps")

# %% [markdown]
# ## 5. The all-reduces of one step
#
# Step 1 of the Fleet-style run, on each rank: six all-reduces (3 layers × attention output
# and MLP down), each summing a `[1, tokens, hidden]` float32 tensor of a few kilobytes. The
# time of a call includes waiting for the other rank to arrive with its half: two ranks
# sharing two CPU cores (with whatever else runs) rarely arrive together, so a call costs
# milliseconds here although the exchange itself is closer to a millisecond or less.

# %%
fig = tpviz.draw_step_all_reduces(ranks[0]["families"]["fleet"]["recorded_all_reduces"],
                                  title="rank 0, step 1: the all-reduces in call order")
fig

# %%
rep = [r["families"]["fleet"] for r in ranks]
share = [r["all_reduce_s"] / sum(r["step_s"]) for r in rep]
print(f"all-reduces per step: {rep[0]['step_all_reduce'][0][0]}; share of serving time inside them: "
      + ", ".join(f"rank {i} {s:.0%}" for i, s in enumerate(share)))
tpviz.draw_rank_steps(rep)

# %% [markdown]
# On this tiny model the six all-reduces take a large share of every step (the hatched
# parts; the printed shares, between a fifth and four fifths on each rank): a step's own work
# is mostly Python and small, and an all-reduce call also holds the rank that arrives first
# until the other comes, which is why the two ranks' hatched parts differ step by step.
# Splitting does not pay on a CPU. It pays when each rank's share of the matmuls costs more than the
# all-reduces — large hidden sizes on GPUs joined by NVLink, where NCCL sums a decode step's
# few kilobytes in microseconds. `python -m fleetlab bench tp` measures the 1-vs-2-process
# step time on a bigger model and writes `benchmarks/results/tp.json`.
#
# **On GPUs** the same code picks NCCL and Paddle's own `ColumnParallelLinear` /
# `RowParallelLinear` (written, not run here: Paddle 3.3's `RowParallelLinear` needs a
# collective that gloo lacks on CPU; `ColumnParallelLinear` runs on CPU when
# `mp_skip_c_identity` is on, and the tests check both facts).

# %% [markdown]
# > **In vLLM / FastDeploy** the split layers are `QKVParallelLinear` / `MergedColumnParallelLinear`
# > (column-parallel) and `RowParallelLinear` (row-parallel, ending in the all-reduce) in
# > `vllm/model_executor/layers/linear.py`, with `tensor_model_parallel_all_reduce` from
# > `vllm/distributed/communication_op.py` (it calls the tensor-parallel group's
# > `GroupCoordinator.all_reduce`, set up in `vllm/distributed/parallel_state.py`);
# > FastDeploy's `fastdeploy/model_executor/layers/linear.py`
# > has the same classes on Paddle's collectives, and both take `tensor_parallel_size`. Unlike
# > fleetlab, both run the scheduler once (vLLM's engine core) and send each step's
# > `SchedulerOutput` to every worker.

# %% [markdown]
# ## Try next
# - Launch the demo split in two: `python -m fleetlab demo --tensor-parallel-size 2` (it starts
#   itself under `paddle.distributed.launch` and prints the line it used).
# - Draw `plan_shards(32, 8, 128, 14336, 8)` — a Llama-3-8B-shaped split over 8 GPUs — and
#   check which ranks share a KV head at `tp_size=16`.
# - Kill a rank mid-run (`--kill-rank 1 --kill-at-step 3` on the worker) and read how the
#   other rank reports it; or give one rank other prompts (`--diverge-rank 1`) and watch the
#   agreement check stop the job.
# - Run `python -m fleetlab bench tp` and compare the decode step with 1 and 2 processes.
