# %% [markdown]
# # 06 · Performance
#
# **You will learn** what continuous batching buys over static batches, measured on this
# machine, and how to read fleetlab's benchmark results:
#
# - static batches against continuous batching on the tiny model: the same work, the rows
#   each leaves idle, the steps and the seconds it takes (repeated, with the spread);
# - where one engine step spends its time;
# - the stored benchmark results (`benchmarks/results/*.json`), including an H200's, and what
#   launching the Triton kernels costs the host;
# - the heart of the GPU decode kernel: its online-softmax loop over the paged cache;
# - how often a step makes the CPU wait for the device.
#
# Times on a shared CPU wobble from run to run: each timed comparison is repeated, drawn at
# its fastest run with the range of the others, and the prose claims only what holds.

# %%
# %matplotlib inline
import time

import numpy as np
from IPython.display import display

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz

# %% [markdown]
# ## 1. Static batches against continuous batching
#
# Sixteen additions on the trained tiny model, with output lengths between 4 and 40
# tokens (`ignore_eos=True` makes each request run exactly its `max_tokens`, past its
# answer: we measure work, not answers). Both runs use the same patched model, the same
# engine and the same 4 rows; only the admission differs:
#
# - **static**: hand the engine 4 requests, wait until *all* of them finish, then the next 4.
#   A batch is as slow as its longest request, and rows sit idle meanwhile;
# - **continuous**: hand it all 16; a new request takes a row the step after one frees.
#
# After a warm-up run, the two take turns three times (static, continuous, static, ...), so
# a burst of other work on the machine is as likely to slow either. Each run is timed twice:
# wall-clock seconds, what a user waits (including any time another program held the CPU),
# and the CPU seconds this process spent (`time.process_time()`), which other programs do
# not inflate.

# %%
model, tokenizer = fleetlab.models.load_tiny()
handle = fleetlab.patch_model(model)
rng = np.random.default_rng(0)
prompts = [f"{a}+{b}=" for a, b in rng.integers(10, 100, size=(16, 2))]
params = [fleetlab.SamplingParams(max_tokens=int(n), ignore_eos=True) for n in rng.integers(4, 41, size=16)]
engine_config = dict(block_size=8, max_num_batched_tokens=256, max_num_seqs=4)

def run_static(batch_size=4):
    llm = fleetlab.LLM(handle, tokenizer, record_traces=True, **engine_config)
    start, cpu, outputs = time.perf_counter(), time.process_time(), []
    for i in range(0, len(prompts), batch_size):
        outputs += llm.generate(prompts[i:i + batch_size], params[i:i + batch_size], use_tqdm=False)
    return viz.run_record("static batches of 4", outputs, start, time.perf_counter(), llm.stats()["num_steps"],
                          cpu_s=time.process_time() - cpu), llm

def run_continuous():
    llm = fleetlab.LLM(handle, tokenizer, record_traces=True, **engine_config)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return viz.run_record("continuous batching", outputs, start, time.perf_counter(), llm.stats()["num_steps"],
                          cpu_s=time.process_time() - cpu), llm

with fleetlab.LLM(handle, tokenizer, **engine_config) as warm_up:  # the first steps pay one-off costs
    warm_up.generate(prompts[:4], fleetlab.SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
runs, engines = [], {}
for _ in range(3):
    for run_once in (run_static, run_continuous):
        record, engines[run_once] = run_once()
        runs.append(record)
for run in runs:
    print(f"{run.name:<20} {run.wall_s:5.2f} s wall  {run.cpu_s:5.2f} s CPU  {run.tokens_per_s:6.0f} tokens/s  "
          f"{run.num_steps} steps")
static_llm, continuous_llm = engines[run_static], engines[run_continuous]
best = viz.fastest_runs(runs)
static, continuous = best["static batches of 4"], best["continuous batching"]
viz.draw_run_comparison(runs)

# %% [markdown]
# The two runs' batch rows, step by step, on the same axis. Each box is a row running a
# request (in its colour, its id written where it enters the row); hatched grey boxes are
# rows sitting idle. Under static batching every batch waits for its longest request: the
# rows of the short ones go idle until the whole batch is done. Under continuous batching a
# new request takes a free row the next step, so rows stay busy until the queue runs dry at
# the end.

# %%
rows_figure = viz.draw_batching_comparison(
    {"static batches of 4": static_llm.traces, "continuous batching": continuous_llm.traces}, num_rows=4)
rows_figure

# %% [markdown]
# Both compute exactly the same tokens, in exactly the same steps every run, and continuous
# batching needs about a third fewer **steps**: no row sits idle behind its batch's longest
# request. In CPU time, continuous batching's best run needs less than static batching's
# best (the second panel); single runs wobble around that (the whiskers), and wall-clock
# seconds, what a user waits, also carry whatever else the machine did meanwhile: compare
# their whiskers before reading much into one run. How far the seconds follow the steps depends
# on the machine: on this CPU, with a 1M-parameter model, a step's cost grows with the rows
# in it, so static batching's idle rows make some of its steps cheaper; on a GPU a step of
# 4 rows costs about as much as a step of 1 (the weights are read once either way; notebook
# 00 measured the same effect here), so there time follows the step count. The step count
# is the part of the result that carries over to real hardware.
#
# ## 2. Where a step's time goes
#
# Each trace records the time spent in scheduling, updating the InputBatch, building the
# attention metadata, the model's forward pass, sampling and the scheduler's update (here,
# the last continuous run's steps).

# %%
viz.draw_step_timings(continuous_llm.traces)

# %%
totals = {part: sum(t.timings.get(part, 0.0) for t in continuous_llm.traces) for part in viz.TIMING_PARTS}
whole = sum(totals.values())
shares = {part: seconds / whole for part, seconds in totals.items()}
for part, seconds in totals.items():
    print(f"{part:>12}: {1e3 * seconds:7.1f} ms  ({shares[part]:.0%})")
print(f"the engine's own parts (all but the forward): {1 - shares['forward']:.0%}")
handle.unpatch()

# %% [markdown]
# The model's forward pass takes most of the steps' time, even on this tiny model; the engine's
# own parts (scheduling, the batch update, the metadata, sampling, the scheduler's update)
# share the rest, the printed percentage. Shrinking that share matters most on a GPU, where
# a forward is far faster than here but the engine's Python is not: `python -m fleetlab
# bench` times the engine's overhead per step at batch 4 and 64 (the bench panel below).
#
# %% [markdown]
# ## 3. Stored results
#
# `python -m fleetlab bench` (or `make bench`) measures the engine and writes JSON into
# `benchmarks/results/` of the fleetlab checkout: `bench.json` for the engine on this kind
# of machine, and other files for kernel benchmarks run elsewhere (a GPU, for instance).
# `viz.results_dir()` finds that folder from the installed package, wherever the notebook
# runs (set `FLEETLAB_RESULTS` to read another). What each panel shows, with the figures
# README quotes:
#
# - **engine vs static batches of generate**: output tokens per second of fleetlab's `LLM`
#   against PaddleFormers' own `generate` in static batches of 16, on the same mixed
#   workload, for the two model sizes README lists (Llama 1.0M and 3.4M parameters);
# - **KV memory that holds a real token**: how much of the allocated KV memory actually
#   holds tokens when it is paged, padded to the longest request, or reserved for the
#   maximum length (notebook 02 in numbers);
# - **shared-prefix workload**: prompts that share a long prefix, prefix cache off and on;
# - **where an engine step's time goes**: milliseconds per step by part, at batch 4 and 64.
#   The stored run (22.7 ms a step at batch 4) has its own workload (64-128-token prompts,
#   48 tokens out, 16-token blocks) and another day's machine load, so compare its shares
#   (the forward against the rest) with section 2's, not its milliseconds: milliseconds
#   measured live move with whatever else the machine is doing;
# - **decode attention** (the H200 kernel file): how fast each implementation reads the KV
#   cache as the context grows, against two reference lines explained in the legend, timed
#   under CUDA-graph replay (a CUDA graph records a sequence of kernel launches once and
#   replays it in one call, so the CPU's launch costs drop out: the GPU's time alone; the
#   file also has each implementation's
#   eager clock, drawn by `viz.draw_decode_bandwidth(..., clock="eager")`).
#
# If there are no results, the cell says so; section 1 measured a small comparison anyway.

# %%
results = viz.load_results()
print("results from", viz.results_dir())
if not results:
    print("No benchmark results there yet: run `python -m fleetlab bench` to create them.")
result_figures = {}
for name, data in results.items():
    if not isinstance(data, dict):
        continue
    machine = data.get("machine") or data.get("environment") or {}
    print(f"{name}.json:", {k: machine[k] for k in ("processor", "device", "cpu_count") if k in machine})
    for kind, figure in (("summary", viz.draw_bench_summary(data)), ("bandwidth", viz.draw_decode_bandwidth(data))):
        if figure is not None:
            result_figures[name, kind] = figure
            display(figure)

# %% [markdown]
# Reading the bandwidth panels (CUDA-graph replay: the GPU's time alone): the paged Triton
# kernel (red) reads through the block table as fast as SDPA (PyTorch's fused
# `scaled_dot_product_attention`) on contiguous memory (green)
# from batch 16 up, far faster at batch 1 (it splits a long context over the GPU's
# multiprocessors: 3.35 TB/s at 32k tokens against SDPA's 0.35), and at least 2.6 times as
# fast as gathering the blocks into a copy first (blue). The dotted grey line, an older copy
# of the same kernel timed in the same run, lies on the red one: on the GPU the two kernels
# read alike; what changed is the host's side (the next figure). With long
# contexts at batch 64 and up it even reads a little faster than the dashed line, a plain
# `torch.sum` over 2 GiB on the same card: that line is a simple kernel to compare with,
# not a limit. The solid line
# is the H200's spec-sheet peak (4.8 TB/s), which nothing crosses.
#
# Bandwidth is the GPU's side. The host's side is what issuing the kernels costs the CPU,
# layer after layer, while the GPU waits for work. The Triton backend plans once per step, in
# its `build_metadata` (notebook 03 shows it: kernel settings, context splits, grids, scratch
# buffers), and each layer's call only looks its plan up and launches. Left, the host time
# per call on the H200 for the decode shapes stored as `decode_issue_shapes` (the GPU held busy, so no call waits
# for it); right, a whole 32-layer decode step launched from Python against the same launches
# replayed as one CUDA graph.

# %%
from fleetlab.lab.viz.triton import draw_launch_costs

kernel_results = results.get("h200_triton")
launch_figure = draw_launch_costs(kernel_results) if kernel_results else None
if launch_figure is None:
    print("no Triton kernel results in", viz.results_dir())
else:
    host = {clock: [r[clock] for r in kernel_results["decode_issue_shapes"]]
            for clock in ("triton_host_us", "layer_host_us", "before_host_us", "sdpa_host_us")}
    for clock, values in host.items():
        print(f"{clock:>15}: {min(values):5.1f}-{max(values):5.1f} µs per call")
    for step in kernel_results["decode_step"]:
        print(f"decode step {step['batch']} x {step['context']} (+{step['prefill_chunk']} prefill): eager "
              f"{step['eager_step_ms']:.2f} ms, one CUDA graph {step['graph_step_ms']:.2f} ms "
              f"({step['graph_speedup']:.2f}x)")
    display(launch_figure)

# %% [markdown]
# One attention call costs the host 10-22 µs and a whole layer's call (the plan lookup,
# storing the step's K/V, the attention) 32-49 µs, against 71-146 µs for the older kernels
# that planned on every call, and 30-53 µs for one call of torch's SDPA. A graph of the whole
# step pays only where the host is the slower side: at 4 × 4k, the smallest batch, the step
# takes 1.45 ms launched from Python and 0.91 ms as one graph (1.6x); the larger batches are
# within 5% of their graph, and a single row at 32k context within 14%.
#
# ## 4. Inside the GPU decode kernel
#
# On a GPU, fleetlab's `backend="triton"` runs three Triton kernels over the same paged
# cache this notebook's CPU backend uses: `store_kv` writes each token's K/V to its slot,
# `_decode_kernel` handles the decode rows, `_prefill_kernel` the prefill chunks (that is
# why this backend asks for decode-first rows). Triton is not installed on a CPU machine,
# so here we only *read* the decode kernel; it was tested and timed on an NVIDIA H200 (on
# torch tensors), and its numbers are the `h200_triton` panel in section 3.
#
# One program handles one (row, group of KV heads, split of the context). Read it with
# four ideas:
#
# 1. **GQA (grouped-query attention: several query heads share one KV head, notebook 09)
#    and multi-token rows for free**: the tile's rows are (query token, query head)
#    pairs of one batch row, so each K/V tile is read from memory once for all the query
#    heads sharing a KV head and for all the row's query tokens (a speculative-decoding
#    verify row has `k + 1` of them, each masked causally against the others);
# 2. **paging inside the loop**: `_kv_tile_offsets` turns logical positions into cache
#    addresses through the block table — no gather into a contiguous copy first, which is
#    why paging costs almost nothing (at least 2.6 times as fast as gather-then-SDPA on the
#    H200, section 3); only
#    keys inside the row's context are loaded, so stale slots can hold anything, even NaN;
# 3. **online softmax**: a running max `m`, a running sum `l` and an accumulator `acc` let
#    the program stream over the context once;
# 4. **split-K**: when a batch is too small to fill the GPU, the context is split over
#    several programs, each writing a partial result and its log-sum-exp; a second launch
#    merges them (`_merge_splits`, flash-decoding), one program per query head, started
#    early on Hopper (a programmatic dependent launch) so that it waits on the GPU rather
#    than behind the first launch. Multi-token rows merge inside the same launch: the last
#    split to finish does it.
#
# Ideas 2 and 3 are the program's loop over its share of the context: the twenty lines
# below, and the fold they call, read from the kernel file as it is now.

# %%
loop = viz.source_excerpt("_decode_kernel", "fleetlab.attention.triton_kernels", start="m = tl.full",
                          stop="_online_softmax(")
fold = viz.source_excerpt("_online_softmax", "fleetlab.attention.triton_kernels", body_only=True)
print(loop)
print()
print(fold)

# %% [markdown]
# That is the loop every decode program runs: before it, the program loads its row's
# queries (one tile row per query token and query head); after it, it normalizes
# `acc / l` and stores the output, or, when the context was split, writes its partial result
# for the merge. Read the rest in the file the excerpt names: `_kv_tile_offsets` (paging
# in two lines), `_decode_kernel` around this loop, `_merge_splits` (the split-K merge) and
# `_prefill_kernel` (the same loop with a causal mask) are in
# [fleetlab/attention/triton_kernels.py](../fleetlab/attention/triton_kernels.py), and
# `decode_attention` there picks tiles, splits and launches for a batch.

# %% [markdown]
# ### On Hopper, prefill takes a warp-specialised kernel
#
# Prefill is compute-bound, and there the loop above leaves the tensor cores idle while the
# same warps load tiles and run the softmax. On an H100/H200 the plan picks
# `fleetlab/attention/gluon_ws_prefill.py` instead (Triton's Gluon layer, in the style of
# FlashAttention-3): one CTA per multiprocessor walks the (query tile, KV head, row) items; a
# **producer** warpgroup only copies Q and the K/V tiles through the block table into a ring
# of shared-memory buffers, and two **consumer** warpgroups only compute, each on 64 rows,
# talking through mbarriers (`ready`: a buffer is filled; `empty`: both consumers have read
# it). Each consumer issues `S_j = Q K_j^T` before `O += P_{j-1} V_{j-1}`, so the softmax of
# one tile runs while the tensor cores finish the previous one. Its loop, read from the file,
# then what it did on the H200 (causal FLOPs per second, CUDA-graph replay, page 16):

# %%
print(viz.source_excerpt("_attend", "fleetlab.attention.gluon_ws_prefill", start="for j in range(1, num_tiles)",
                         stop="p_prev = gl.convert_layout"))
gluon_run = results.get("h200_gluon_prefill", {})  # the H200 run of this kernel (benchmarks/results)
prefill_rows = [r for r in gluon_run.get("prefill", []) + gluon_run.get("prefill_layouts", []) if r["block_size"] == 16]
for r in prefill_rows:
    print(f"{r['rows']:>2} x {r['chunk']:>4} after {r['context']:>4}, {r['num_heads']:>2}/{r['num_kv_heads']} "
          f"d{r['head_dim']}: {r['config']['kernel']} {r['triton_tflops']:3.0f} TFLOP/s, "
          f"{r['ratio_vs_sdpa_best']:.2f}x the fastest SDPA ({r['sdpa_best']})")

# %% [markdown]
# On one long prompt (1 × 8k) it comes within a tenth of cuDNN, the fastest SDPA backend on
# contiguous K/V (0.92x); a chunk after 8k cached tokens beats every SDPA backend (1.5x, cuDNN
# needs an explicit mask there). Many shorter prompts (8 × 2k, 32 × 512) stay at 0.70-0.71x.
# Hiding each item's start and end did not help them: issuing the next item's first `S` under
# this item's last `P V`, and FA3's ping-pong of the two consumers, were each measured slower
# on an H100 (README, issue #49). The profile of 32 × 512 says why: it is bound by memory, not
# the tensor cores. The walk takes the longest tiles first across every (row, KV head) pair,
# so each round re-reads all their K/V, more than the L2 holds, and DRAM moves 2.2 times the
# bytes the shape needs. Other head layouts land between: 0.84-0.92x at head dim 64 and 128,
# 0.74x at head dim 256. The earlier portable kernels (`before` in the JSON, commit 3d58b26)
# ran the three causal shapes at 0.58-0.61x.

# %% [markdown]
# ## 5. How often a step waits for the device
#
# On a GPU the CPU queues kernels and runs ahead. Reading a result back (`.numpy()`,
# `.item()`, `int(t)`, `if t:`) makes the CPU wait until every queued kernel has finished,
# and the GPU then sits idle until the CPU has planned and queued the next step: each read
# serialises the two. Uploads do not wait, but each costs a launch and a copy. So a good
# engine step reads once (the sampled token ids) and uploads a bounded number of arrays,
# however many requests or layers it runs. `fleetlab.syncs.count_syncs()` counts both, with
# the call site of each, here on the CPU (nothing waits here, but the calls are the same):

# %%
from fleetlab.syncs import count_syncs, describe

counts = []
with fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=64) as llm:
    for prompt in ["count 12", "45+38=", "the old man", "7*8=", "count 50", "12+7="]:
        llm.add_request(prompt, fleetlab.SamplingParams(max_tokens=8))
    while llm.has_unfinished_requests():
        with count_syncs() as log:
            llm.step()
        counts.append((log.num_reads, log.num_uploads))
print("(reads, uploads) per step:", counts)
print(describe(log))

# %% [markdown]
# One read per step (the sampler's), and between five and ten uploads whether it runs six
# prompts or one decode: five every step (the attention metadata and the tiled attention's
# plan, each in one copy per dtype, and the input ids with the positions to score in one)
# and one for each of the InputBatch's five device fields that changed since the step before
# (the block tables when a row starts a block, the sampling settings when rows join, leave
# or move; a host-side comparison is far cheaper than a copy). `tests/test_gpu_readiness.py`
# holds every step to that budget, for the reference and Triton backends' host code; with a
# draft model for speculative decoding a step reads twice (the accepted tokens, then the new
# drafts).

# %% [markdown]
# > **In vLLM / FastDeploy** the same measurements have names of their own.
# >
# > - vLLM measures these with `vllm bench throughput` (offline, like section 1) and
# >   `vllm bench serve` (a server under load: TTFT, TPOT, throughput). Its Triton attention
# >   backend reads the paged cache in one `unified_attention` kernel (a 2-D grid, or a 3-D
# >   one that splits the context and reduces the parts, as `_merge_splits` does here);
# >   its step timings show up in its profiler and metrics, and its async scheduling hides
# >   the one device read per step that section 5 counts.
# > - FastDeploy's main GPU attention backend is `AppendAttentionBackend`: CUDA kernels
# >   that append the step's K/V to the paged cache and attend over it, for the decode and
# >   prefill parts of a mixed batch.

# %% [markdown]
# ## Try next
#
# - `max_num_seqs=8` for both runs, or output lengths all equal: when does static
#   batching catch up?
# - Run `python -m fleetlab bench` (or `make bench`) and re-run section 3.
# - Read `_prefill_kernel` the same way: where does the causal mask come in?
# - Back to **01_tour** with what you know now.
