# %% [markdown]
# # 07 · Prototyping: your own attention backend and scheduling policy
#
# **You will learn** how to try an idea on the engine without touching its code:
#
# 1. write an attention backend in a cell (decodes and prefills on two code paths, the
#    decode path recording how spread out each layer's attention is), register it, and
#    check its tokens against the default (tiled) backend;
# 2. compare two scheduling policies on the same workload: a timeline of each run and the
#    latency percentiles users feel, time to first token (TTFT) and time per output
#    token (TPOT);
# 3. write a scheduling policy of your own in a few lines, register it, and run it.

# %%
# %matplotlib inline
import collections

import numpy as np
from matplotlib.figure import Figure

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.attention.backend import AttentionBackend
from fleetlab.attention.tiled import paged_attention
from fleetlab.engine.policies import SchedulingPolicy, register_policy
from fleetlab.inspect.latency import latency_stats
from fleetlab.lab import viz

# %% [markdown]
# ## 1. A model and a workload
#
# The trained tiny model, and requests that arrive over the first steps: a mix of long
# sentences and short sums. `serve` adds each request at its arrival step and notes that
# step (the latency figures in section 3 count from it). `ignore_eos=True` makes every
# request run its full `max_tokens`, so every run does the same amount of work.

# %%
model, tokenizer = fleetlab.models.load_tiny()

# step -> requests arriving then: (prompt, max_tokens[, request id])
arrivals = {
    0: [("the dog ran to the big red house and sat down.", 8), ("the red cat sat on the mat and ate.", 8),
        ("12+7=", 6)],
    1: [("3+4=", 6), ("6*7=", 6), ("45+38=", 6)],
    3: [("count 1 2 3", 8), ("a cat and a dog sat in the sun by the red house.", 6), ("9-4=", 6)],
    5: [("23+19=", 6), ("8*8=", 6)],
}
engine_config = dict(block_size=4, num_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                     record_traces=True)

def serve(llm, arrivals):
    """Add each request at its arrival step, run until all are done.
    Returns (outputs in arrival order, {request id: arrival step})."""
    outputs, arrival_steps, step = {}, {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for prompt, max_tokens, *request_id in arrivals.get(step, []):
            params = fleetlab.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            rid = llm.add_request(prompt, params, request_id=request_id[0] if request_id else None)
            arrival_steps[rid] = step
        outputs.update({out.request_id: out for out in llm.step() if out.finished})
        step += 1
    return [outputs[rid] for rid in arrival_steps], arrival_steps


# %% [markdown]
# ## 2. An attention backend in a cell
#
# A backend subclasses `AttentionBackend` and implements `attend(query, key_cache,
# value_cache, metadata, scale=...)`: `query` is the step's packed queries `[T, heads,
# head_dim]`, the caches are one layer's `[num_blocks, block_size, kv_heads, head_dim]`,
# already holding this step's keys and values (the base class's `forward` wrote them).
# Class attributes tell the engine what the backend needs:
#
# - `requires_reorder = True`: the engine puts decode rows first, so rows
#   `[0, metadata.num_decodes)` are decodes (one query token each) and their queries are
#   the first `num_decodes` tokens. That is what makes a two-path backend easy.
# - `supports_sliding_window = False`, `supports_sinks = False`: our decode path ignores
#   both, so we say so; patching a model that needs them then fails with a clear error
#   instead of computing something wrong.
#
# **Decodes** take our own path, a dozen lines: gather each row's keys and values through
# its block table, softmax, weighted sum, and on the way the **entropy** of each head's
# attention, divided by its maximum `log(context length)` (1 = spread evenly over the
# whole context, 0 = all on one key), averaged per layer. **Prefills** go to the
# reference kernel `paged_attention` with a metadata of just the prefill rows. The plan
# (slots to gather, masks, that metadata) depends only on the step, so the first layer
# of a step builds it and the others reuse it.

# %%
import paddle


class SplitBackend(AttentionBackend):
    """Decodes on our own path (recording attention entropy), prefills on the reference kernel."""

    name = "split"
    requires_reorder = True          # decode rows first
    supports_sliding_window = False  # our decode path ignores windows and sinks
    supports_sinks = False

    def __init__(self):
        super().__init__()
        self.entropy = collections.defaultdict(list)  # layer id -> mean normalized entropy, per step
        self._plan = (None,)

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        if self._plan[0] is not metadata:  # first layer of a new step
            self._plan = (metadata, *self.plan(metadata))
        _, nd, slots, visible, prefill_metadata = self._plan
        outs = []
        if nd:
            outs.append(self.decode(layer_id, query[:nd], key_cache, value_cache, slots, visible, scale))
        if prefill_metadata is not None:
            outs.append(paged_attention(query[nd:], key_cache, value_cache, prefill_metadata, scale=scale))
        return paddle.concat(outs) if len(outs) == 2 else outs[0]

    @staticmethod
    def plan(md):
        """Decode rows' cache slots [nd, L] and visible keys [nd, 1, L]; the prefill rows' metadata."""
        nd, q_lens, seq_lens = md.num_decodes, md.query_lens_host, md.seq_lens_kv_host
        tables = md.block_tables.numpy()  # host copy, once per step
        pos = np.arange(int(seq_lens[:nd].max(initial=1)))
        slots = tables[:nd, pos // md.block_size] * md.block_size + pos % md.block_size
        visible = pos[None, :] < seq_lens[:nd, None]
        prefill = None
        if nd < len(seq_lens):
            prefill = fleetlab.AttentionMetadata.build(q_lens[nd:], seq_lens[nd:] - q_lens[nd:], tables[nd:],
                                                       md.block_size)
        return nd, paddle.to_tensor(np.where(visible, slots, 0)), paddle.to_tensor(visible[:, None]), prefill

    def decode(self, layer_id, q, key_cache, value_cache, slots, visible, scale):
        """One query per row: q [B, H, D] -> [B, H, D]."""
        B, H, D = q.shape
        kv_heads = key_cache.shape[2]

        def gather(cache):  # [B, H, L, D]; each KV head serves H / kv_heads query heads
            rows = paddle.gather(cache.reshape([-1, kv_heads, D]), slots.flatten())
            return rows.reshape([B, -1, kv_heads, D]).transpose([0, 2, 1, 3]).repeat_interleave(H // kv_heads, 1)

        k, v = gather(key_cache), gather(value_cache)
        scores = paddle.matmul(q.unsqueeze(2) * scale, k, transpose_y=True).squeeze(2)  # [B, H, L]
        probs = paddle.nn.functional.softmax(paddle.where(visible, scores, paddle.full_like(scores, -1e30)), -1)
        entropy = -(probs * paddle.log(probs + 1e-30)).sum(-1)  # [B, H] nats
        context = visible.astype("float32").sum(-1).clip(min=2)  # [B, 1]
        self.entropy[layer_id].append(float((entropy / paddle.log(context)).mean()))
        return paddle.matmul(probs.unsqueeze(2), v).squeeze(2)


fleetlab.register_attention_backend("split", SplitBackend)  # by name, as LLM(backend="split") asks for it
print("attention backends:", fleetlab.attention.backend.ATTENTION_BACKENDS.names())

# %% [markdown]
# ## 3. Check it against the tiled backend
#
# Serve the same workload twice, once per backend, and compare the greedy tokens. The
# budget of 16 tokens per step makes many steps carry decodes *and* prefill chunks, so
# both paths run in the same step (counted below from the traces).

# %%
runs = {}
for backend in ["tiled", "split"]:
    llm = fleetlab.LLM(model, tokenizer, backend=backend, **engine_config)
    outputs, _ = serve(llm, arrivals)
    runs[backend] = (llm, outputs)
    llm.handle.unpatch()  # the next backend patches the model afresh

reference_tokens = [o.token_ids for o in runs["tiled"][1]]
split_tokens = [o.token_ids for o in runs["split"][1]]
print(viz.greedy_table(reference_tokens, split_tokens, decode=tokenizer.decode))
print("same tokens as the reference:", split_tokens == reference_tokens)
split_llm = runs["split"][0]
both = sum(t.num_decodes > 0 and t.num_decodes < len(t.rows) for t in split_llm.traces)
print(f"steps that ran both paths: {both} of {len(split_llm.traces)}")

# %% [markdown]
# Same tokens: the decode path is right (for these prompts; a parity test in `tests/` is
# the next step before trusting it further). Now what it recorded: each layer's attention
# entropy over the decode steps.

# %%
for layer_id, values in sorted(split_llm.handle.backend.entropy.items()):
    print(f"layer {layer_id}: mean normalized entropy {np.mean(values):.2f} over {len(values)} decode steps")

# %% [markdown]
# A value near 1 means the heads spread their attention almost evenly over the context; a
# lower one, that they pick out a few keys (in a trained model, often the `<bos>` token
# or the digits being added). Which layers spread, which ones pick? That is the kind of
# question a recording backend answers in a few lines.
#
# ## 4. Two scheduling policies on the same workload
#
# `fcfs` admits waiting requests in arrival order; `spf` (shortest prompt first) admits
# the shortest waiting prompt. Both run the same requests to the same tokens; what changes
# is who waits. `latency_stats` measures, for each request:
#
# - **TTFT**, time to first token: from its arrival to its first output token;
# - **TPOT**, time per output token: `(finish - first token) / (tokens - 1)`.
#
# Each in two clocks. **Steps** come from the traces: they do not depend on how busy the
# CPU is, so they show exactly what the policy changed. **Milliseconds** come from
# `time.perf_counter` (in `RequestOutput.metrics`): what a user feels, but noisy on a
# shared machine, and a step that batches a long prefill takes longer than a decode-only
# one. So after a warm-up run (the first steps of a process pay one-off costs), each policy
# runs three times, taking turns, and every figure below in milliseconds keeps all three.

# %%
handle = fleetlab.patch_model(model)  # one patched model for every run below
with fleetlab.LLM(handle, tokenizer, **engine_config) as warm_up:
    serve(warm_up, arrivals)
policy_runs, stats = {}, {"fcfs": [], "spf": []}
for _ in range(3):
    for policy in ["fcfs", "spf"]:
        llm = fleetlab.LLM(handle, tokenizer, scheduling_policy=policy, **engine_config)
        outputs, arrival_steps = serve(llm, arrivals)
        policy_runs[policy] = llm
        stats[policy].append(latency_stats(outputs, llm.traces, arrival_steps))
prompt_lens = {o.request_id: len(o.prompt_token_ids) for o in outputs}  # the same in every run
for policy, runs in stats.items():
    steps = {(s.ttft_steps.p50, s.tpot_steps.p50) for s in runs}
    ttft_ms = [1e3 * s.ttft_s.p50 for s in runs]
    tpot_ms = [1e3 * s.tpot_s.p50 for s in runs]
    print(f"{policy}: {len(policy_runs[policy].traces)} steps, {policy_runs[policy].stats()['num_preemptions']} "
          f"preemptions; p50 TTFT {runs[0].ttft_steps.p50:g} steps, p50 TPOT {runs[0].tpot_steps.p50:g} steps "
          f"(the same in all {len(runs)} runs: {len(steps) == 1}); in ms, p50 TTFT {min(ttft_ms):.0f}-"
          f"{max(ttft_ms):.0f}, p50 TPOT {min(tpot_ms):.1f}-{max(tpot_ms):.1f}")

# %% [markdown]
# The two timelines (the last run of each), one above the other: a black triangle where a
# request arrived, a thin bar through every step it waited, coloured by what kept it out
# (read from each step's trace, as in notebook 05); a red `x` is a preemption (the cache
# holds 16 blocks of 4 tokens, not enough for two long sentences at once); a green number
# in a box counts the tokens a request found in the prefix cache when it was admitted.
# Both timelines list the requests in the same order (by id, top down), so a lane is the
# same request in both.

# %%
waits = {policy: viz.queue_waits(llm.traces, arrival_steps, llm.config) for policy, llm in policy_runs.items()}
policy_figure = Figure(figsize=(12, 8.5), layout="constrained")
axes = policy_figure.subplots(2, 1, sharex=True)
for ax, (policy, llm) in zip(axes, policy_runs.items()):
    viz.draw_timeline(llm.traces, ax=ax, title=f"scheduling_policy={policy!r}", waits=waits[policy],
                      request_ids=sorted(arrival_steps, key=int))
axes[0].set_xlim(-0.6, max(llm.traces[-1].step for llm in policy_runs.values()) + 0.6)  # the longer run
policy_figure

# %%
for policy in waits:
    for wait in waits[policy]:
        if wait.request_id in ("0", "1", "2", "7") and wait.reasons:
            print(f"{policy:>4}: {wait.describe()}")

# %% [markdown]
# Under `fcfs` request 0's long prompt runs first and fills the first steps' budget, so
# request 1, the other long sentence, waits two steps for tokens and starts beside it in
# step 2. As both grow the cache runs dry, and in step 4 the scheduler preempts request 1,
# the newest. Request 1 then waits at the head of the queue while the pool stays full
# (steps 5-9), and `fcfs` lets nobody pass it: the short sums that arrived in steps 0 and
# 1 queue behind both until request 0 finishes. That is **head-of-line blocking**.
#
# Under `spf` the sum `12+7=` (request 2) goes first in step 0, and request 1, at 36 tokens
# shorter than request 0's 47, takes the rest of the budget. Request 0 waits: for the
# budget, then for room in the pool, then for a row, while every short sum that arrives
# passes it; it starts in step 16. Request 7, the longest sentence (49 tokens), waits
# longer still.

# %% [markdown]
# A preempted request does not always start from scratch: its full blocks stay in the
# prefix cache until someone needs the space (notebooks 02 and 05), so when it comes back
# it takes back what is left and computes only the rest. Its chunks after a preemption
# therefore add up to less than its length. Under `fcfs`, request 1 (36 tokens) comes back
# in step 10 with 12 of them cached and runs chunks of 16 and 8; a request preempted while
# decoding may find all but its newest token cached and decode at once.

# %%
for policy, llm in policy_runs.items():
    for a in viz.admissions(llm.traces, block_size=engine_config["block_size"]):
        if a.resumed:
            print(f"{policy:>4}: {a.describe()}")


# %% [markdown]
# Who gained and who paid, request by request:

# %%
print("req  prompt tokens  TTFT steps: fcfs -> spf")
for fcfs, spf in zip(stats["fcfs"][0].requests, stats["spf"][0].requests):
    print(f"{fcfs.request_id:>3}  {prompt_lens[fcfs.request_id]:>13}  {fcfs.ttft_steps:>17} -> {spf.ttft_steps}")

# %%
viz.draw_latency(stats)


# %% [markdown]
# Reading the bars (each the median of the three runs, with a whisker from the fastest to
# the slowest): `spf` cuts the median TTFT (most requests are short and no longer wait
# behind long prompts), but the long sentences (requests 0 and 7 above) wait longer than
# under `fcfs`: a policy moves latency between requests. The step panels have no whiskers:
# steps are the same in every run. In milliseconds TTFT follows the steps: the middle of the
# three `spf` runs' medians is below the middle of the `fcfs` runs' (a single run on a busy
# machine can land anywhere in its whisker). TPOT's median is 1.0 step under both policies (a
# request decodes in every step after its first token, unless it loses steps to a
# preemption), so the policies do not differ there; in milliseconds TPOT moves with what
# shared the steps (a decode that rides along with a big prefill chunk waits for it) and
# with the machine, as the whiskers show. With 11 requests, p99 is essentially the slowest
# one.
#
# ## 5. A policy of your own
#
# A policy has two methods: `admission_key(request, step)` (the waiting request with the
# smallest key is admitted next) and `pick_victim(running)` (who is preempted when the
# cache is full; the default takes the newest). Here is **round robin by user**: with
# request ids `"user/n"`, every user's first request goes before anyone's second, so one
# user sending a burst cannot make everyone else wait behind it.

# %%
class RoundRobinByUser(SchedulingPolicy):
    """Users take turns: everyone's 1st request, then everyone's 2nd, ... (request ids "user/n")."""

    name = "round-robin"

    def __init__(self):
        self.turn = {}                        # request id -> its rank among its user's requests
        self.seen = collections.Counter()     # user -> requests seen so far

    def admission_key(self, request, step):
        if request.request_id not in self.turn:
            user = request.request_id.split("/")[0]
            self.turn[request.request_id] = self.seen[user]
            self.seen[user] += 1
        return (self.turn[request.request_id], request.arrival_order)


register_policy("round-robin", RoundRobinByUser)  # now scheduling_policy="round-robin" works

# %% [markdown]
# A user called `bulk` sends six sums at step 0; `alice` and `bob` send one each a step
# later. Two requests run at a time.

# %%
user_arrivals = {0: [(f"{10 + i}+{20 + i}=", 8, f"bulk/{i}") for i in range(6)],
                 1: [("3+4=", 8, "alice/0")], 2: [("6*7=", 8, "bob/0")]}
user_config = {**engine_config, "num_blocks": 32, "max_num_seqs": 2}
for policy in ["fcfs", "round-robin"]:
    llm = fleetlab.LLM(handle, tokenizer, scheduling_policy=policy, **user_config)
    outputs, arrival_steps = serve(llm, user_arrivals)
    by_request = {r.request_id: r.ttft_steps for r in latency_stats(outputs, llm.traces, arrival_steps).requests}
    print(f"{policy:>11}: TTFT in steps", by_request)
handle.unpatch()

# %% [markdown]
# Under `fcfs` Alice and Bob wait for the whole burst; under `round-robin` they are
# admitted as soon as a row frees up, and `bulk` pays for it: its later requests start
# about 8 steps later.

# %% [markdown]
# > **In vLLM / FastDeploy** the same two extension points exist.
# >
# > - Attention: a vLLM backend is an `AttentionBackend` class naming its implementation
# >   (an `AttentionImpl`) and its `AttentionMetadataBuilder`; the builder's
# >   `reorder_batch_threshold` asks for decode-first rows, as `requires_reorder` and
# >   `reorder_threshold` do here, and `split_decodes_and_prefills` hands it the two
# >   ranges. FastDeploy's backends (`AppendAttentionBackend` and others) subclass its own
# >   `AttentionBackend` and read the step's `ForwardMeta`.
# > - Scheduling: vLLM's scheduler takes `--scheduling-policy fcfs` or `priority` (with a
# >   `priority` per request). Another policy plugs in as a scheduler class:
# >   `SchedulerConfig.scheduler_cls` (`--scheduler-cls mod.MyScheduler`, or the class
# >   itself) replaces `vllm.v1.core.sched.scheduler.Scheduler`, typically by subclassing it
# >   and overriding what it needs, such as the order of its `waiting` queue; vLLM warns
# >   that this interface is not public and may change between versions. fleetlab's
# >   `SchedulingPolicy` is the smaller seam: two methods, and the scheduler stays as it is.
# >   FastDeploy's `ResourceManagerV1` decides admission and preemption order in its own
# >   code.

# %% [markdown]
# ## Try next
#
# - Set `reorder_threshold = 4` on `SplitBackend` so short chunks count as decodes too, and
#   extend its decode path to a few queries per row (each sees keys up to its own position);
#   check the tokens again.
# - Record something else per layer: the share of attention on the `<bos>` token, or the
#   distance to the most attended key.
# - Write "longest waiting first" with `step - request.enqueue_step`, or give
#   `RoundRobinByUser` a `pick_victim` that preempts the user with the most running requests.
# - `scheduling_policy="priority"` with `llm.add_request(..., priority=...)`: who gets the
#   low TTFT now?
