# %% [markdown]
# # 13 · KV beyond one engine: connectors, a restart, a host tier, prefill/decode
#
# Until now a request's KV cache was born and died inside one engine. A **KV connector** is
# the seam through which it leaves (a *producer* saves or sends it) or enters (a *consumer*
# loads or receives it): a directory another engine reads after a restart, a host-memory tier
# under the block pool, or a second process that only decodes. fleetlab's engine calls a
# connector at a few named points of a step and nowhere else.
#
# **You will learn**
# - the two roles and which call the scheduler and the attention layers make at each point of a step;
# - how a restarted engine answers a repeated prompt from a `shared_storage` directory;
# - which layer's blocks move when (a recording connector written here, in a dozen lines);
# - the lifetimes of blocks in the saving and the loading pool;
# - what happens when a load fails: the request is recomputed and still writes the same tokens;
# - an offload tier under a pool half the working set's size, and its hit rate;
# - the block-id handshake of prefill/decode disaggregation, a request waiting for its K/V
#   outside the decode side's batch, and what the stored two-rank benchmark measured (bytes
#   per token, inter-token latency, every step of both ranks beside one engine's).

# %%
# %matplotlib inline
import contextlib
import io
import json
import tempfile
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out (first: before Paddle)

# isort: split
import fleetlab.attention.backend
from fleetlab import LLM, SamplingParams
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.scheduler import Scheduler
from fleetlab.kv_transfer import KVCacheSpec
from fleetlab.kv_transfer.block_store import BlockStoreConnector, LoadError
from fleetlab.kv_transfer.offload import OffloadConnector
from fleetlab.kv_transfer.paddle_distributed import PaddleDistributedConnector
from fleetlab.kv_transfer.shared_storage import SharedStorageConnector
from fleetlab.lab.viz import kv_transfer as kvviz
from fleetlab.lab.viz import show_source
from fleetlab.lab.viz.results import results_dir
from fleetlab.models import tiny
from fleetlab.patching.parity import reference_greedy

model = tiny("fleet", seed=0)
BS, MAX_NEW = 4, 5
SP = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
prompt = [int(t) for t in range(5, 23)]  # 18 tokens: 4 full blocks of 4 and 2 tokens over
want, _ = reference_greedy(model, [prompt], MAX_NEW)  # the model's own full forward, no cache

# %% [markdown]
# ## 1. Two roles, nine calls
#
# `LLM(kv_transfer_config={"connector": NAME, "role": ..., **options})` picks a connector from
# the one `Registry`. A **producer** saves (or sends) the K/V it computes; a **consumer** loads
# (or receives) K/V it did not compute; `"both"` does both. With no config the engine still
# makes every call, to the base class, whose calls do nothing (the *null connector*).
#
# The **scheduler side** runs in `Scheduler.schedule`: at admission it asks how many tokens past the
# pool's own prefix hits the connector can load (`get_num_new_matched_tokens`; they are counted as
# computed and get blocks), tells it which blocks they land in (`update_state_after_alloc`), and
# at the end of the step plans the loads and saves (`build_connector_meta`):

# %%
show_source(Scheduler._schedule_waiting, start="num_external", stop="update_state_after_alloc")

# %% [markdown]
# The **worker side**: the runner hands the plan over before the forward and collects what
# finished after it; each attention layer waits for its loaded K/V before it writes and reads the
# cache, and saves right after writing:

# %%
show_source(ModelRunner.run, start="start_load_kv", stop="get_finished")

# %%
show_source(fleetlab.attention.backend.AttentionBackend.forward, start="connector =", stop="save_kv_layer")

# %% [markdown]
# ## 2. A prototyper's connector: record every call
#
# To *see* the calls, subclass the `shared_storage` connector and note each call (and, for the
# two per-layer calls, the pool blocks that layer moved). That is all a connector needs: override
# the calls you care about, pass it as `connector=`.

# %%
class RecordingStorage(SharedStorageConnector):
    """shared_storage that keeps (call, layer, block ids moved) of every call."""

    name = "recording_storage"

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.records = []

    def wait_for_layer_load(self, layer_id):
        self.records.append(("wait_for_layer_load", layer_id, [b for t in self._meta.loads for b in t.block_ids]))
        super().wait_for_layer_load(layer_id)

    def save_kv_layer(self, layer_id, kv_cache, attn_metadata):
        self.records.append(("save_kv_layer", layer_id, [b for t in self._meta.saves for b in t.block_ids]))
        super().save_kv_layer(layer_id, kv_cache, attn_metadata)


def noting(call):
    def method(self, *args):
        self.records.append((call, None, []))
        return getattr(SharedStorageConnector, call)(self, *args)
    return method


for call in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "start_load_kv",
             "wait_for_save", "get_finished", "request_finished"):
    setattr(RecordingStorage, call, noting(call))


class Computed:
    """An observer: the tokens each request ran through the model, step by step."""

    def __init__(self):
        self.steps = []

    def on_step(self, sched, result, outputs):
        self.steps.append(dict(sched.num_scheduled_tokens))

    def total(self, rid):
        return sum(s.get(rid, 0) for s in self.steps)


def engine(role, path, connector=RecordingStorage):
    llm = LLM(model, block_size=BS, num_blocks=16, max_num_batched_tokens=32, record_traces=True,
              kv_transfer_config={"connector": connector, "role": role, "path": path})
    llm.observers.append(Computed())
    return llm


def answer(llm, rid):
    llm.add_request(prompt_token_ids=prompt, sampling_params=SP, request_id=rid)
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    return outs[0].token_ids


# %% [markdown]
# ## 3. A restarted engine answers from the directory
#
# Engine A (producer) answers the prompt and saves each full block, layer by layer, under an
# empty directory. It is closed; engine B, a new engine (as after a restart, or in another
# process) pointed at the same directory as a consumer, gets the same prompt.

# %%
store = Path(tempfile.mkdtemp(prefix="fleetlab-kv-"))
a = engine("producer", store)
tokens_a = answer(a, "A")
files = sorted(store.rglob("layer_*.safetensors"))
a.close()
b = engine("consumer", store)
tokens_b = answer(b, "B")
b.close()
prompt_computed = {"A: empty directory": a.observers[-1].steps[0]["A"],
                   "B: restarted, loads": b.observers[-1].steps[0]["B"]}
print(f"{len(files)} files saved by A; B loaded {b.kv_connector.stats.loaded_tokens} tokens")
print("prompt tokens computed in the first step:", prompt_computed, "| same tokens:", tokens_a == tokens_b == want[0])

# %% [markdown]
# A saved 15 files: 3 layers for each of the prompt's 4 full blocks, and for the fifth block,
# which its new tokens filled later. B loaded the prompt's 16 and computed only the last 2
# prompt tokens: a connector never offers the last token, because one token must run through
# the model to give the logits of the first new token. The tokens equal the full forward's. The
# count comes from the scheduler-side call of the block-store connectors (shared storage and offload):

# %%
show_source(BlockStoreConnector.get_num_new_matched_tokens)

# %%
fig_restart = Figure(figsize=(6, 2.4), layout="constrained")
ax = fig_restart.subplots()
names = list(prompt_computed)
ax.barh(names, [prompt_computed[n] for n in names], color="tab:orange", label="computed", gid="computed")
ax.barh(names[1:], [b.kv_connector.stats.loaded_tokens], left=[prompt_computed[names[1]]], color="tab:blue",
        label="loaded from the directory", gid="loaded")
ax.set_xlabel(f"prompt tokens (of {len(prompt)})")
ax.invert_yaxis()
ax.legend(fontsize=8, loc="lower right")
fig_restart

# %% [markdown]
# ## 4. Which layer's blocks moved when
#
# The first step of each engine, from the recording connector's own records. In A's step the
# scheduler plans the saves (`build_connector_meta`), then each layer writes its K/V and
# `save_kv_layer` copies that layer of blocks 0–3 out, layer 0 first. In B's step the loads were
# planned at admission; each layer's `wait_for_layer_load` copies that layer of the stored blocks
# into B's freshly allocated blocks *just before the layer attends*, so layer 0 can compute while
# layer 1 would still be loading on a real transport. B, a consumer, saves nothing.

# %%
def first_step(records):
    end = next(i for i, r in enumerate(records) if r[0] == "get_finished")
    return records[:end + 1]


steps = {"A (producer), step 0": first_step(a.kv_connector.records),
         "B (consumer), step 0": first_step(b.kv_connector.records)}
fig_calls = kvviz.draw_connector_calls(steps, model.config.num_layers)
fig_calls

# %%
show_source(SharedStorageConnector.write)

# %% [markdown]
# ## 5. A load that fails is recomputed
#
# A connector must never serve K/V it cannot vouch for. Here the store's last layer cannot be
# read (`LoadError`): the connector reports the blocks through `get_finished`, the scheduler
# sends every request holding one of them back to be recomputed from its prompt, and the
# request still writes exactly the tokens of the full forward.

# %%
class FailingStorage(RecordingStorage):
    """A directory whose last layer cannot be read."""

    name = "failing_storage"

    def read(self, key, layer_id):
        if layer_id == self.spec.num_layers - 1:
            raise LoadError("disk on fire")
        return super().read(key, layer_id)


c = engine("consumer", store, FailingStorage)
with contextlib.redirect_stderr(io.StringIO()) as log:  # the connector's warning, shown below
    tokens_c = answer(c, "C")
print("the connector logged:", log.getvalue().strip())
c_steps = [s.get("C", 0) for s in c.observers[-1].steps]
failed = c.kv_connector.stats.failed_loads, c.stats()["num_preemptions"]
c.close()
print("tokens computed per step:", c_steps, "| failed loads, recomputes:", failed, "| same tokens:",
      tokens_c == want[0])

# %% [markdown]
# The first step ran the last 2 prompt tokens over K/V that turned out incomplete; its result
# is thrown away, the request goes back to waiting (one preemption), and the next step runs
# all 18 prompt tokens itself. The failed request is never offered the store again.

# %% [markdown]
# ## 6. Both pools' block lifetimes
#
# Blocks in use after each step, in the saving engine, the loading one and the one whose load
# failed. `shared_storage` writes synchronously inside the layer, so its `request_finished`
# returns False and the blocks go back to the pool the step the request retires. A connector whose
# send outlives the step would return True, and the scheduler would keep the blocks until
# `get_finished` names the request. The `paddle_distributed` producer needs no such wait: it
# sends each layer inside the step of the prompt's last chunk, so when the request retires its
# sends are done (or it tells the decode side it refuses), and it returns False too:

# %%
show_source(PaddleDistributedConnector.request_finished)

# %%
fig_pools = kvviz.draw_pool_use({"A (saves)": a.traces, "B (loads)": b.traces, "C (load fails)": c.traces})
engines = {"A": a, "B": b, "C": c}
pool_end = {name: (llm.pool.num_free_blocks, llm.pool.num_blocks) for name, llm in engines.items()}
pool_used = {name: [t.num_blocks - t.num_free_blocks for t in llm.traces] for name, llm in engines.items()}
print("blocks in use after each step:", pool_used)
print("free / total blocks at the end:", pool_end)
fig_pools

# %% [markdown]
# A and B lie on top of each other: loading changes where the K/V comes from, not how many
# blocks a request holds. 5 blocks for the 18-token prompt, a sixth in step 3 as the new
# tokens outgrow the fifth, all 16 free again after the step the request retires. C holds none
# after its first step (the blocks with the failed load went back when the request was sent to
# be recomputed), then follows the same curve one step later. Every pool ends with every block free.

# %% [markdown]
# ## 7. An offload tier under a pool half the working set
#
# Four 20-token prompts, each asked twice in turn, in a pool of 12 blocks of 4: each request
# holds 6 blocks (20 prompt tokens + 4 new), so the four make 24, twice the pool. By the time a
# prompt comes back the pool has handed its blocks to others: its own prefix cache hits
# nothing. The `offload` connector copies every full block to host memory as it is computed
# (write-through) and brings it back on a hit.

# %%
prompts = [[int(t) for t in range(3 + 20 * i, 23 + 20 * i)] for i in range(4)]
order = [0, 1, 2, 3] * 2
offload_sp = SamplingParams(max_tokens=4, ignore_eos=True)
hit_rates, offload_tokens = {}, {}
for name, kv in (("pool alone", None), ("pool + offload", {"connector": "offload", "capacity_bytes": 10**7})):
    llm = LLM(model, block_size=BS, num_blocks=12, max_num_seqs=1, kv_transfer_config=kv)
    offload_tokens[name] = [o.token_ids for o in llm.generate(prompt_token_ids=[prompts[i] for i in order],
                                                               sampling_params=offload_sp, use_tqdm=False)]
    hit_rates[name] = {"pool": llm.stats()["prefix_cache_hit_rate"], "host tier": llm.kv_connector.stats.hit_rate}
    llm.close()
offload_want, _ = reference_greedy(model, prompts, 4)
print(hit_rates, "| same tokens:", all(t == [offload_want[i] for i in order] for t in offload_tokens.values()))

# %%
fig_offload = Figure(figsize=(6, 2.6), layout="constrained")
ax = fig_offload.subplots()
for i, tier in enumerate(("pool", "host tier")):
    ax.bar([j + 0.38 * i for j in range(2)], [hit_rates[n][tier] for n in hit_rates], 0.36, label=tier,
           gid=f"hit:{tier}")
ax.set_xticks([0.19, 1.19], list(hit_rates))
ax.set_ylabel("prefix hit rate (tokens)")
ax.set_ylim(0, 1)
ax.legend(fontsize=8)
for bars in ax.containers:
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
fig_offload

# %% [markdown]
# The pool alone hits nothing. The host tier serves 16 of each repeat's 20 prompt tokens (4 of
# its 5 blocks: the fifth holds the last token, which must run), so over all eight requests
# 64 of 160 prompt tokens: a hit rate of 0.4. Both runs write the full forward's tokens. A
# step's copies join the tier, and the LRU trims it to `capacity_bytes`, once the forward is done:

# %%
show_source(OffloadConnector.flush)

# %% [markdown]
# The stored benchmark (`python -m fleetlab bench kv`, a larger model, 192-token prompts)
# measured the TTFT of the repeats too, and of a restarted engine loading from a directory:

# %%
kv_results = json.loads((results_dir() / "kv.json").read_text())
for name, run in kv_results["offload"]["runs"].items():
    print(f"{name:15} repeat TTFT median {run['repeat_ttft_median_ms']:5.1f} ms   "
          f"host-tier hit rate {run.get('tier_hit_rate', 0):.2f}")
restart = kv_results["shared_storage"]["ttft_median_ms"]
print("restarted engine TTFT median:", {k: round(v, 1) for k, v in restart.items()}, "ms")

# %% [markdown]
# ## 8. Prefill on one rank, decode on another: the handshake
#
# The `paddle_distributed` connector puts a prefill engine (producer) and a decode engine
# (consumer) on two ranks of a `paddle.distributed.launch` job (gloo send/recv on CPU; NCCL on
# GPUs is written but unrun here). Requests arrive at the decode side. Admitting one, it counts
# every token but the last as loadable and allocates their blocks; the request then **waits for
# remote KV** (`WAITING_FOR_REMOTE_KVS`): it holds its blocks but is skipped by every step while
# the other requests keep decoding. The handshake, the token ids and **the decode side's own
# block ids** (FastDeploy's `send_cache_info_to_prefill`), goes out on the decode side's *link
# thread*, the one thread there that touches the transport. The prefill side runs the prompt
# and, as each layer writes its K/V, sends that layer's K/V with the decode-side slots it goes
# to. Once every layer is in hand the link thread completes the request's future; at the next
# step the scheduler lets the request join the batch, each layer's K/V is written into its
# blocks right before that layer attends, and the decode side computes the last prompt token
# and samples the first output token itself. Section 10 runs such a pair from a cell; first the
# drawing and the code:

# %%
fig_handshake = kvviz.draw_handshake(model.config.num_layers)
fig_handshake

# %%
show_source(Scheduler._take_remote_kvs)

# %%
show_source(PaddleDistributedConnector.wait_for_layer_load)

# %%
show_source(PaddleDistributedConnector.save_kv_layer)

# %% [markdown]
# ## 9. What the two-rank benchmark measured
#
# From `benchmarks/results/kv.json` (`python -m fleetlab bench kv`, this 2-core machine, the
# tiny model above). Bytes moved per token match `2 × layers × kv_heads × head_dim × dtype
# bytes` exactly (only K/V crosses; the wire adds a small header per layer). The mixed workload
# (200-token prompts arriving while short requests decode) ran three times, the pair and one
# engine (chunked prefill, 64 tokens a step) in turn inside each run; the bars are the medians of
# the three runs and the lines their spread. The pair's decode inter-token latency is lower than
# one engine's, at the median and at p99: a long prompt waits for its K/V outside the decode
# rank's batch, so no decode step carries a prompt chunk. The long prompts' time to first token
# is lower on the pair too: the prefill rank runs each prompt in one step of up to 512 tokens,
# where one engine runs it in four chunks of 60, each a step beside the decodes; the K/V's
# crossing and the decode rank's next step cost less than the three steps saved. Both ranks
# share two cores with the rest of the machine; the gains reported for separating the phases
# (DistServe, Splitwise) come with each side on devices of its own.
# %%
show_source(KVCacheSpec.bytes_per_block.fget)

# %%
pd = kv_results["paddle_distributed"]
spec = KVCacheSpec(model.config.num_layers, BS, model.config.num_kv_heads,
                                        model.config.head_dim, "float32")
formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
mixed, spread = pd["mixed"], pd["mixed_spread"]
fig_bench = Figure(figsize=(11, 3), layout="constrained")
ax1, ax2, ax3 = fig_bench.subplots(1, 3, width_ratios=[1, 2, 1.3])
ax1.bar(["measured", "2·L·H·D·4"], [pd["bytes_per_token"], formula], color=["tab:blue", "0.6"], gid="bytes")
ax1.set_ylabel("bytes moved per token")
setups = ("one engine", "pair")


def bars_with_spread(ax, x, figure, **kw):
    med = [spread[n][figure][0] for n in setups]
    err = [[med[i] - spread[n][figure][1] for i, n in enumerate(setups)],
           [spread[n][figure][2] - med[i] for i, n in enumerate(setups)]]
    return ax.bar(x, med, yerr=err, capsize=3, **kw)


for i, q in enumerate(("itl_p50_ms", "itl_p99_ms")):
    bars_with_spread(ax2, [j + 0.38 * i for j in range(2)], q, width=0.36, label=q.split("_")[1], gid=f"itl:{q}")
ax2.set_xticks([0.19, 1.19], ["one engine (chunked prefill)", "prefill + decode pair"])
ax2.set_ylabel("decode inter-token latency (ms)")
ax2.legend(fontsize=8)
bars_with_spread(ax3, [0, 1], "long_ttft_median_ms", color=["tab:gray", "tab:green"], gid="ttft")
ax3.set_xticks([0, 1], ["one engine", "pair"])
ax3.set_ylabel("long-prompt TTFT median (ms)")
print(f"bytes/token {pd['bytes_per_token']} vs formula {formula}; medians of {len(pd['mixed_runs'])} runs:",
      {n: {k: round(spread[n][k][0], 1) for k in spread[n]} for n in setups},
      "| pair / one engine:", {k: round(v, 2) for k, v in spread["pair_over_one_engine"].items()},
      "| same tokens:", all(r["identical_tokens"] for r in pd["mixed_runs"]))
fig_bench

# %% [markdown]
# The middle run, step by step, from each engine's own clock (a `StepClock` observer in
# `fleetlab/serving/disagg/mixed.py`; both ranks read one machine's monotonic clock). On one
# engine, every long prompt that arrives (▼) turns the next steps orange: they run up to 60
# prompt tokens beside the four decode rows, and each takes longer than a decode-only step (the
# medians are printed below the figure), so the short requests' next tokens wait. On the
# pair the prompts run on the prefill rank, one step each; the decode rank only ever runs decode
# rows (its hatched steps ran while some request, short or long, waited there for its K/V), and
# a long prompt's first token (★) comes with the decode rank's first step after its K/V is in.

# %%
fig_timelines = kvviz.draw_timelines(mixed["timeline"])


def median_step_ms(run, prompt_steps: bool) -> float:
    spans = [b - a for a, b, prompt, *_ in run["timeline"] if (prompt > 0) == prompt_steps]
    return float(np.median(spans)) if spans else float("nan")


step_ms = {lane: {kind: median_step_ms(run, kind == "prompt") for kind in ("prompt", "decode")}
           for lane, run in mixed["timeline"].items()}
print("median step (ms):", {lane: {k: round(v, 1) for k, v in d.items()} for lane, d in step_ms.items()},
      "| long-prompt TTFT median (ms):", {n: round(mixed[n]["long_ttft_median_ms"]) for n in ("one engine", "pair")})
fig_timelines

# %% [markdown]
#
# %% [markdown]
# ## 10. A pair, live from this cell
#
# The cell starts `fleetlab.serving.disagg.mixed` on 2 ranks through Paddle's launcher, as
# notebook 09 starts its tensor-parallel ranks (the command is printed below): the tiny Llama, 4
# short requests decoding, 4 long prompts of 120 tokens arriving one every 8 decode steps. Rank 0
# serves it as the pair's decode rank, then as one engine alone with chunked prefill (32 tokens a
# step); rank 1 is the prefill rank. Between two of its steps the prefill rank polls the decode rank for the
# handshakes queued meanwhile and takes them all (`fleetlab.serving.disagg.prefill.serve`), so
# prompts that arrive close together share its steps.

# %%
from fleetlab.distributed.launch import launch, launch_command, shell_line
from fleetlab.serving.disagg.mixed import collect

live_args = ["fleetlab.serving.disagg.mixed", "--model-overrides", "{}", "--long-len", "120", "--budget", "32",
             "--short-tokens", "16"]
live_dir = Path(tempfile.mkdtemp(prefix="fleetlab-13-"))
print(shell_line(launch_command(live_args, 2, live_dir / "logs")))
live_run = launch(live_args, 2, log_dir=live_dir / "logs", timeout=300)
live = collect(live_run.output, live_run.worker_logs.get(1, ""))
print(f"exit code {live_run.returncode}, {live_run.seconds:.1f} s; tokens identical on the pair and one engine: "
      f"{live['identical_tokens']}")
for name in ("one engine", "pair"):
    print(f"{name:10}  long-prompt TTFT median {live[name]['long_ttft_median_ms']:6.1f} ms   decode ITL p50 / p99 "
          f"{live[name]['itl_p50_ms']:5.1f} / {live[name]['itl_p99_ms']:5.1f} ms")

# %% [markdown]
# Each long prompt's way through the pair, on rank 0's clock (one machine, one monotonic clock
# for both ranks): it waits until the prefill rank's next step starts (grey), runs there in one
# step (orange: the prefill rank decodes nothing, so its token budget, `--prefill-budget`, takes
# a whole prompt), its K/V crosses layer by layer *inside* that step, and from that step's end
# it waits for the decode rank's next step (blue; none when the last layer was in before the
# prefill rank had finished sampling, and the decode rank's step started first), and that step
# (green) writes the K/V into its blocks, runs the last prompt token and samples the first
# token (★).

# %%
fig_paths = kvviz.draw_request_paths(live["long_requests"])


def part_ms(p, part):
    """One part of a long prompt's path, in ms (the blue part is 0 when the decode step began first)."""
    if part in ("prefill", "join"):
        return p[part][1] - p[part][0]
    return p["prefill"][0] - p["arrive"] if part == "wait" else max(p["join"][0] - p["prefill"][1], 0.0)


parts = {part: float(np.median([part_ms(p, part) for p in live["long_requests"].values()]))
         for part in ("wait", "prefill", "transfer", "join")}
print("median ms per part:", {k: round(v, 1) for k, v in parts.items()})
fig_paths

# %% [markdown]
# Why the split pays is notebook 00's lesson (section 4, prefill against decode). A prefill
# step does the arithmetic of many tokens on one read of the weights: it is compute-bound, and
# it runs best in big steps. A decode step reads the weights and every request's cache for one
# token each: it is memory-bound, and what its requests feel is its length. One engine has one
# token budget for both: small, and a long prompt is cut into chunks that each cost a whole
# step beside the decode rows and stretch their inter-token latency (section 9's orange steps);
# large, and a decode step that carries a prompt takes longer still. The pair gives each phase
# its own engine: the decode rank's steps never carry a prompt, and the prefill rank runs each
# prompt in one step. What is left to pay is the hand-over: the K/V on the wire and the wait for
# the decode rank's next step, the blue and green parts above. On this shared 2-core machine the
# two ranks also compete for the same cores, so the live figures above move from run to run;
# section 9's stored run says how they compare over several runs.

# %% [markdown]
# > **In vLLM / FastDeploy / SGLang**
# >
# > - **vLLM** v1: `KVConnectorBase_V1` in `vllm/distributed/kv_transfer/kv_connector/v1/base.py`, with the
# >   same scheduler-side (`get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`,
# >   `request_finished`) and worker-side calls (`start_load_kv`, `wait_for_layer_load`, `save_kv_layer`,
# >   `wait_for_save`, `get_finished`); vLLM builds one instance per side. Its `SharedStorageConnector`
# >   (`shared_storage_connector.py`, renamed `ExampleConnector` later) keys a folder per prompt hash;
# >   `OffloadingConnector` (`offloading_connector.py`) is the CPU tier; `NixlConnector` and
# >   `P2pNcclConnector` move K/V between prefill and decode instances.
# > - **FastDeploy**: `--splitwise-role prefill | decode` splits the phases; the decode side sends its block
# >   ids to the prefill side (`splitwise_connector.py`), and the cache messager
# >   (`fastdeploy/cache_manager/cache_messager.py`) sends the cache layer by layer as it is computed.
# > - **SGLang**: PD disaggregation in `python/sglang/srt/disaggregation/`, a bootstrap server
# >   (`BaseKVBootstrapServer`) through which the prefill and decode sides find each other; HiCache's
# >   `HiRadixCache` (`python/sglang/srt/mem_cache/hiradix_cache.py`) keeps a host-memory tier under the
# >   GPU radix cache.

# %% [markdown]
# **Try next**
# - Point two engines in two terminals at one `shared_storage` path: the second answers the first's prompts.
# - Give the offload tier a `capacity_bytes` of a few blocks and watch `stats.extra["evicted_blocks"]`.
# - Make `RecordingStorage` sleep in `wait_for_layer_load` and see the step time grow layer by layer.
# - Run the real pair: `python -m fleetlab disagg --model tiny --port 8000`, then stream from it with `openai`.
