# %% [markdown]
# # 00 · Why a KV cache: prefill and decode
#
# **You will learn** the two ideas every later notebook builds on, measured live on a tiny
# model:
#
# 1. a language model writes one token at a time, each computed from **all** the tokens
#    before it (attention);
# 2. the **keys and values** of earlier tokens never change, so an engine keeps them (the
#    **KV cache**) and each new token costs one token's work instead of the whole sequence's;
# 3. **prefill** (one pass over a whole prompt) against **decode** (one token per pass), and
#    why an engine packs many requests' decodes into one pass;
# 4. the order of the notebooks after this one, and the words each of them explains.
#
# Every number below is measured when the cell runs. Times are the CPU time this process
# spends (`time.process_time()`): what the computation costs, which other programs on a
# shared machine inflate far less than wall-clock time. They are taken after a warm-up run
# and repeated; each curve shows the fastest run with a band up to the slowest, and the prose
# only claims what holds across runs.

# %%
# %matplotlib inline
import time

import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz
from fleetlab.patching.parity import full_forward_logits

# %% [markdown]
# ## 1. One token at a time
#
# fleetlab ships a tiny Llama (4 layers, about a million parameters) trained on sums,
# counting and short sentences, with a *character* tokenizer: one character is one token.
# A model's forward pass takes a sequence of tokens and returns, at every position, scores
# (*logits*) for the token that comes next. Generating text is a loop: run the sequence,
# take the best next token at the last position, append it, run again.
#
# This is the plain loop, with nothing cached: every pass runs the whole sequence so far. It
# stops when the model writes its end-of-text token (`<eos>`).

# %%
model, tokenizer = fleetlab.models.load_tiny()
prompt = tokenizer.encode("count 1 ")  # <bos> and 8 characters
ids = list(prompt)
while ids[-1] != tokenizer.eos_token_id:
    logits = full_forward_logits(model, ids)  # [len(ids), vocab]: a pass over the whole sequence
    ids.append(int(logits[-1].argmax()))
    print(f"pass over {len(ids) - 1:>2} tokens -> {viz.token_label(ids[-1], tokenizer)!r:>7}   "
          f"{tokenizer.decode(ids)!r}")
no_cache_ids = ids[len(prompt):]

# %% [markdown]
# ## 2. Attention looks back, and the past does not change
#
# In every layer, each token's vector is turned into a **query**, a **key** and a **value**.
# A token's query is compared with the keys of every token up to itself, and the values
# are mixed by those scores: that is attention, the only place where tokens see each other.
# Causal: a token never looks at a later one. Row `i` below is token `i`'s query; the cells
# are the tokens whose key and value it reads.

# %%
labels = [viz.token_label(t, tokenizer) for t in ids[:12]]
viz.draw_attention_pattern(labels)

# %% [markdown]
# The newest token (last row) needs the key and value of every earlier token. But nothing a
# token computes depends on later tokens, so the keys and values of the first 11 tokens are
# exactly those of the previous pass. The logits show it: run the sequence with and without
# its last token; every position they share gets the same logits, to float rounding.

# %%
shorter = full_forward_logits(model, ids[:11])
longer = full_forward_logits(model, ids[:12])
prefix_diff = float(np.abs(longer[:11] - shorter).max())
print(f"largest change of the first 11 positions' logits when a 12th token is appended: {prefix_diff:.1e}")

# %% [markdown]
# So recomputing them is wasted work. An engine keeps each layer's keys and values of every
# token it has run (the **KV cache**), and each new pass runs only the new token: its query
# attends to the cached keys and values, and its own key and value join the cache.
#
# ## 3. With a KV cache: the same tokens, one token's work each
#
# `fleetlab.LLM` is an engine with a KV cache. Serve the same prompt (greedy, as above) and
# count the tokens each step runs: the first step, the **prefill**, runs the 9 prompt tokens
# in one pass; every later step, a **decode**, runs one. To measure, we let it write 100
# tokens: `ignore_eos=True` keeps it going past `<eos>` (what it writes there is noise; the
# work is the same), so every run does the same work.

# %%
num_new = 100
params = fleetlab.SamplingParams(max_tokens=num_new, ignore_eos=True)  # greedy by default


def timed_generation(llm, params=params):
    """Serve the prompt alone, timing every engine step; returns (token ids, CPU seconds per step)."""
    llm.add_request(prompt_token_ids=prompt, sampling_params=params)
    seconds, done = [], {}
    while llm.has_unfinished_requests():
        start = time.process_time()
        done.update({o.request_id: o for o in llm.step() if o.finished})
        seconds.append(time.process_time() - start)
    return next(iter(done.values())).token_ids, seconds


with fleetlab.LLM(model, tokenizer, record_traces=True, enable_prefix_caching=False) as llm:
    timed_generation(llm, fleetlab.SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up: one-off costs
    runs = [timed_generation(llm) for _ in range(3)]
    steps_of_one_run = llm.traces[-len(runs[-1][1]):]
# (leaving the `with` gives the model its own attention back, for the plain passes below)
cached_ids = runs[0][0]
cached_tokens = [t.num_batched_tokens for t in steps_of_one_run]
print("tokens run per step:", cached_tokens[:6], "...", f"({len(cached_tokens)} steps)")
print(f"same first {len(no_cache_ids)} tokens (up to <eos>) as the loop without a cache:",
      cached_ids[:len(no_cache_ids)] == no_cache_ids)
print("the three timed runs agree token for token:", all(r[0] == cached_ids for r in runs))

# %% [markdown]
# Without the cache, the 100th new token would need a pass over 108 tokens; with it, one.
# In time: a step without the cache costs what a forward pass over the whole sequence costs
# (measured next, for lengths 1 to 128), and a step with the cache costs a decode step (the
# three runs above, timed step by step).

# %%
sizes = [1, 2, 4, 8, 16, 32, 64, 128]
sequences = {n: (prompt * 20)[:n] for n in sizes}  # any tokens: a pass's time depends on how many
for n in sizes:  # warm-up passes
    full_forward_logits(model, sequences[n])
pass_s = np.zeros((7, len(sizes)))  # [repeats, sizes]
for r in range(pass_s.shape[0]):  # the sizes take turns, so a burst of load on the machine hits them alike
    for k, n in enumerate(sizes):
        start = time.process_time()
        full_forward_logits(model, sequences[n])
        pass_s[r, k] = time.process_time() - start

# Decode steps, by the length of the sequence they attend to, in stretches of 10 tokens: the
# fastest step of each stretch, per run.
decode_s = np.array([r[1][1:] for r in runs])  # [runs, decode steps]; step 0 was the prefill
decode_lengths = len(prompt) + 1 + np.arange(decode_s.shape[1])
starts = np.arange(10, decode_lengths[-1], 10)
decode_binned = np.array([[row[(decode_lengths >= lo) & (decode_lengths < lo + 10)].min() for lo in starts]
                          for row in decode_s])
lengths = [8, 16, 32, 64, 128]
no_cache_work = [len(prompt) + k for k in range(num_new)]  # the whole sequence, every time
cache_figure = viz.draw_cache_cost(no_cache_work, cached_tokens, lengths,
                                   pass_s[:, [sizes.index(n) for n in lengths]], starts + 5, decode_binned,
                                   clock="CPU")
cache_figure

# %%
pass_ms = {n: 1e3 * float(pass_s[:, k].min()) for k, n in enumerate(sizes)}  # the fastest of the runs
decode_ms = 1e3 * decode_binned.min(axis=0)  # per stretch of 10 tokens
print(f"work: {sum(no_cache_work)} tokens without the cache, {sum(cached_tokens)} with it")
print("CPU ms of a pass over n tokens:", {n: round(ms, 1) for n, ms in pass_ms.items()})
print(f"CPU ms of a decode step, by stretch: {decode_ms.min():.1f} to {decode_ms.max():.1f} "
      f"(lengths {starts[0]} to {decode_lengths[-1]})")

# %% [markdown]
# The work is a triangle against a flat line: without the cache the model runs 5,850 tokens
# to write 100, with it 108 (the 9-token prefill, then 99 one-token steps; the last token
# needs no pass after it). In time, a decode step stays nearly flat as the sequence grows
# (reading a few more cached keys costs little), while a pass over the whole sequence grows
# with its length: by 128 tokens it costs more than a decode step. Near the start the
# cached line sits *above* "no cache": a bare pass over a short sequence is cheaper than an
# engine decode step. Why, measured next: each step's trace times its parts (wall clock),
# and a bare one-token pass is timed on the same clock beside them.
#
# On this tiny model the time gap stays far smaller than the work gap, because a pass
# costs mostly a fixed overhead (Python and kernel launches for a few dozen small
# operations) whatever it carries. A real model's pass is dominated by its arithmetic, and
# there the time gap follows the work gap.

# %%
from matplotlib.figure import Figure

# The engine's forward and a bare pass take turns, round by round: a burst of load on a shared
# machine then hits both alike, and the fastest of each still compares.
early, bare_wall = [], []
for _ in range(6):
    with fleetlab.LLM(model, tokenizer, record_traces=True, enable_prefix_caching=False) as llm:
        timed_generation(llm, fleetlab.SamplingParams(max_tokens=12, ignore_eos=True))
        early += [t for t in llm.traces[2:]]  # short decode steps (the first two: prefill and warm-up)
    for _ in range(3):  # the model has its own attention back here
        start = time.perf_counter()
        full_forward_logits(model, sequences[8])  # a bare pass over a short sequence, without a cache
        bare_wall.append(time.perf_counter() - start)
engine_forward_ms = 1e3 * min(t.timings["forward"] for t in early)
host_parts = [p for p in ("schedule", "batch_update", "metadata", "sample", "update") if p in early[0].timings]
host_ms = {p: 1e3 * min(t.timings[p] for t in early) for p in host_parts}
bare_ms = 1e3 * min(bare_wall)
crossing = next((n for n in lengths if pass_ms[n] > float(np.median(decode_ms))), None)
print(f"engine decode step, fastest of {len(early)} short ones: forward {engine_forward_ms:.2f} ms, "
      f"the engine's own work {sum(host_ms.values()):.2f} ms ({', '.join(f'{p} {v:.2f}' for p, v in host_ms.items())})")
print(f"bare pass over 8 tokens, no cache: {bare_ms:.2f} ms; a bare pass costs more than a decode step "
      f"from {crossing} tokens on")
split = Figure(figsize=(7.5, 1.9), layout="constrained")
ax = split.add_subplot()
ax.barh(1, engine_forward_ms, color="#4e79a7", label="the engine's forward (paged attention)", gid="split:forward")
ax.barh(1, sum(host_ms.values()), left=engine_forward_ms, color="#f28e2b",
        label="the engine's own work (schedule, batch, metadata, sample, update)", gid="split:host")
ax.barh(0, bare_ms, color="#bab0ac", label="a bare pass over 8 tokens (no cache)", gid="split:bare")
ax.set_yticks([0, 1], ["bare pass", "engine step"])
ax.set_xlabel("wall ms (fastest of each)")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
split

# %% [markdown]
# The engine's own work (scheduling, updating its batch, building the metadata, sampling,
# committing) is the small part of its step; the forward is most of it, and that forward costs
# about what a bare pass over a short sequence costs (within a factor of two; which of the two
# is faster moves with the machine's load), although it carries one token where the bare pass
# carries eight, because its attention takes the paged path (write the new K/V into their
# slots, gather every cached key through the block table, a plan for the tiled kernels)
# where the bare pass attends over a few contiguous tokens. That fixed cost stays while the
# bare pass grows with the sequence, so the lines cross (the printed length).
#
# ### What the cache costs: bytes per token
#
# The cache holds, for every token and every layer, a key and a value vector for each KV
# head: `2 x layers x kv_heads x head_dim x bytes per number`. From the model's config:

# %%
import paddle

cfg = model.config
head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
dtype_bytes = paddle.empty([1], dtype=model.parameters()[0].dtype).element_size()
kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes
print(f"this model: 2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {head_dim} x "
      f"{dtype_bytes} bytes = {kv_bytes_per_token:,} bytes per token")
llama8b = dict(layers=32, heads=32, kv_heads=8, head_dim=128, params=8.0e9, dtype_bytes=2)  # Llama-3-8B's shape, bf16
llama8b_kv = 2 * llama8b["layers"] * llama8b["kv_heads"] * llama8b["head_dim"] * llama8b["dtype_bytes"]
print(f"a Llama-3-8B-shaped model in bf16: {llama8b_kv:,} bytes = {llama8b_kv / 2**10:.0f} KiB per token; "
      f"a 4,096-token request holds {4096 * llama8b_kv / 2**30:.2f} GiB, "
      f"64 of them {64 * 4096 * llama8b_kv / 2**30:.0f} GiB")

# %% [markdown]
# Here 2 KiB per token (float32, tiny); for a real 8B model 128 KiB, so 64 requests of
# 4,096 tokens hold 32 GiB of cache next to 16 GB of weights. The cache, not the model, is
# what runs out first as requests grow: the scarce resource every later notebook manages.
#
# ## 4. Prefill against decode
#
# The same measurement, read the other way: one forward pass over `n` tokens, and its cost
# per token. A prompt is known in full when it arrives, so the engine runs all its tokens in
# one pass, the **prefill**. Output tokens exist one at a time, so each needs a pass of its
# own, a **decode** step.

# %%
pass_figure = viz.draw_pass_cost(sizes, pass_s, clock="CPU")
pass_figure

# %%
per_token = {n: ms / n for n, ms in pass_ms.items()}
print(f"a pass of 8 tokens costs {pass_ms[8] / pass_ms[1]:.1f}x a pass of 1, a pass of 64 tokens "
      f"{pass_ms[64] / pass_ms[1]:.1f}x; per token, 64 in one pass are {per_token[1] / per_token[64]:.0f}x cheaper")
params_count = sum(int(np.prod(p.shape)) for p in model.parameters())
for n in (1, 64):
    print(f"a pass of {n:>2} token(s): about {2 * params_count * n / 1e6:.0f} MFLOP of matrix products on "
          f"{4 * params_count / 2**20:.1f} MiB of float32 weights read: {2 * n / 4:.1f} FLOP per byte")

# %% [markdown]
# A pass of 64 tokens costs a few times a pass of one token, not 64 times: per token, prefill
# is more than ten times cheaper than decode here (the printed ratio). The reason carries over to real
# hardware. Every pass reads all the model's weights from memory, whatever it carries, and
# does about 2 floating-point operations per weight for each token: a one-token pass does
# half an operation per byte it reads. An H200 can do a few hundred operations in the time it
# reads one byte (its spec sheet: about 1,000 dense bf16 TFLOP/s against 4.8 TB/s), so a
# decode pass leaves its arithmetic units almost idle and is bound by **memory traffic**; a
# long prefill pass is bound by **compute**.
#
# That is the engine's opportunity: a decode step for 8 requests at once is a pass of 8
# tokens, which costs less than two passes of 1 (the printed ratio), and yields 8 tokens. So
# an engine keeps many requests running together, one row each, and runs all their decodes
# (and the prefills of newcomers) in every step. Everything else it does follows from that:
# memory for many KV caches of unknown length, a scheduler deciding who runs, a batch whose
# rows come and go.
#
# ### Batching shares the weights, not the KV cache
#
# A decode step for `B` requests reads the weights once for all of them, but each request's
# own cache: `weights + B x context x KV bytes per token`. Its arithmetic is about
# `2 x parameters` per token, plus attention's `4 x layers x heads x head_dim x context`.
# For the Llama-3-8B shape above, against the H200's figures: its memory read bandwidth as
# measured in this project (`benchmarks/results/h200_triton.json`), and its spec sheet's
# dense bf16 compute. A step is memory-bound while its arithmetic intensity (FLOP per byte
# read) sits under the ridge, peak FLOP/s / bandwidth.

# %%
from matplotlib.ticker import FuncFormatter

h200 = viz.load_results()["h200_triton"]
bandwidth = h200["ceilings"]["read_sum_tbps"] * 1e12  # bytes/s, measured
peak_flops = 989e12  # H200 dense bf16, spec sheet
ridge = peak_flops / bandwidth
batches = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256])
weights = llama8b["params"] * llama8b["dtype_bytes"]
attn_flops = 4 * llama8b["layers"] * llama8b["heads"] * llama8b["head_dim"]  # per token, per context position


def decode_step(batch, context):
    """(bytes read, FLOP, lower bound on seconds) of one decode step of `batch` requests."""
    bytes_read = weights + batch * context * llama8b_kv
    flops = batch * (2 * llama8b["params"] + attn_flops * context)
    return bytes_read, flops, max(bytes_read / bandwidth, flops / peak_flops)


contexts = [512, 4096, 32768]
roofline = Figure(figsize=(11.0, 3.3), layout="constrained")
ax_bytes, ax_rate = roofline.subplots(1, 2)
kv_read = [b * 4096 * llama8b_kv / 1e9 for b in batches]
ax_bytes.bar(range(len(batches)), [weights / 1e9] * len(batches), color="#bab0ac", label="weights (read once)",
             gid="bytes:weights")
ax_bytes.bar(range(len(batches)), kv_read, bottom=weights / 1e9, color="#4e79a7",
             label="KV caches (one per request)", gid="bytes:kv")
ax_bytes.set_xticks(range(len(batches)), [str(b) for b in batches])
ax_bytes.set_xlabel("requests in the decode step (context 4,096 each)")
ax_bytes.set_ylabel("GB read per step")
ax_bytes.set_title("what a decode step reads", fontsize=9)
ax_bytes.legend(fontsize=7, frameon=False)
for context in contexts:
    intensity = [decode_step(b, context)[1] / decode_step(b, context)[0] for b in batches]
    ax_rate.plot(batches, intensity, marker="o", markersize=3, label=f"context {context:,}", gid=f"intensity:{context}")
ax_rate.axhline(ridge, color="#e15759", linestyle="--", linewidth=1,
                label=f"ridge: {ridge:.0f} FLOP/byte (above: compute-bound)")
ax_rate.set_xscale("log", base=2)
ax_rate.set_yscale("log")
ax_rate.set_xticks(batches, [str(b) for b in batches])
ax_rate.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax_rate.set_xlabel("requests in the decode step")
ax_rate.set_ylabel("FLOP per byte read")
ax_rate.set_title("arithmetic intensity of a decode step (H200 roofline)", fontsize=9)
ax_rate.legend(fontsize=7, frameon=False, loc="lower right")
roofline

# %%
for context in contexts:
    best = max(b / decode_step(b, context)[2] for b in batches)
    limit = bandwidth / (context * llama8b_kv)  # tokens/s when the KV reads alone fill the bandwidth
    print(f"context {context:>6,}: at most {best:8,.0f} tokens/s at batch {batches[-1]}; the KV reads alone cap it "
          f"at {limit:8,.0f}; intensity at batch {batches[-1]}: "
          f"{decode_step(batches[-1], context)[1] / decode_step(batches[-1], context)[0]:.0f} FLOP/byte")

# %% [markdown]
# Left: the weights are 16 GB read once per step whatever the batch, and the caches grow
# with it: from 32 requests of 4,096 tokens on, the step reads more KV than weights. Right:
# batching raises the intensity only while the weights dominate what is read. With short
# contexts (512) it keeps climbing, to about half the ridge at 256 requests; at 4,096 and
# 32,768 it flattens far below it, where the KV reads take over: however large the batch,
# a long-context decode step stays memory-bound, and its tokens per second are capped by the bandwidth divided by the KV
# bytes each token's attention reads. That is why the KV cache's size per token, and the
# memory it takes, decide how many requests an engine can serve.
#
# ## 5. The road ahead
#
# Each notebook opens one piece of such an engine, in this order, so that every word is
# explained before a later notebook uses it:
#
# - `01_tour`: the engine at work: an **engine step**, the **scheduler**, the **token budget**
#   (`max_num_batched_tokens`) and the **rows** (`max_num_seqs`), **continuous batching**, KV
#   **blocks**, **prefix caching**, the **InputBatch**;
# - `02_paged_kv_cache`: the **block pool**, **block tables**, a token's **slot** and
#   `slot_mapping`, reference counts, eviction, paging against padding;
# - `03_attention_patching`: how the model itself reads and writes the paged cache:
#   **patching**, the **forward context**, `AttentionMetadata` (positions, `cu_seqlens_q`,
#   `slot_mapping`), parity with the model's own forward (the **oracle**);
# - `04_input_batch_reorder`: the InputBatch's rows, `condense()`, the **decode-first
#   reorder** and `num_decodes`;
# - `05_decode_loop`: the scheduler step by step: the **waiting queue**, **chunked
#   prefill**, **preemption**;
# - `06_performance`: **static** against **continuous batching**, measured; where a step's
#   time goes; the GPU kernel;
# - `07_prototyping`: your own attention backend and scheduling policy; **TTFT** and **TPOT**;
# - `08_speculative_decoding`: a **draft** proposes, the **target** verifies: several tokens
#   per pass;
# - `09_tensor_parallel`: one model split over processes: **shards**, **all-reduce**;
# - `10_serving`: the engine behind an OpenAI-compatible server: streaming, latency under load;
# - `11_structured_outputs`: output held to a JSON schema or a grammar: a **token mask** each step;
# - `12_read_the_engine`: one request through the engine's own functions, called one at a time,
#   and each part's name in vLLM and FastDeploy.

# %% [markdown]
# > **In vLLM / FastDeploy** the same two phases carry the same names. vLLM's v1 scheduler
# > treats a prompt's tokens and a decode's one token alike (each request gets its
# > `num_scheduled_tokens` in a step), so one step mixes prefills and decodes, as fleetlab's
# > does. FastDeploy's `ForwardMeta` gives each row `seq_lens_this_time` (the tokens it runs
# > in this step), `seq_lens_encoder` (its prompt tokens in this step, 0 for a decode) and
# > `seq_lens_decoder` (the tokens it already has in the cache).

# %% [markdown]
# ## Try next
#
# - Generate from a longer prompt (`"the red cat sat on the mat. the dog"`): how many tokens
#   does the prefill step run, and does a decode step cost more than before?
# - Time a pass of 256 tokens: the tiny model refuses positions past 128 (its
#   `max_position_embeddings`).
# - Next notebook: **01_tour**, the engine serving several requests at once.
