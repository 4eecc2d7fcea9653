# %% [markdown]
# # 05 · The decode loop: continuous batching step by step
#
# **You will learn** what the scheduler decides every step, and watch it happen:
#
# - requests arriving while others run, and joining as soon as there is room;
# - a token budget shared by prefills and decodes, and long prompts split across steps
#   (**chunked prefill**);
# - what happens when the KV cache runs out: **preemption** and recomputation;
# - a play button that replays the run step by step.

# %%
# %matplotlib inline
import fleetlab
from fleetlab import viz

# %% [markdown]
# ## 1. A deliberately small engine
#
# The trained tiny model, but a cache of only 14 blocks of 4 tokens (56 token slots), a
# budget of 16 tokens per step and at most 4 running requests. `ignore_eos=True` makes
# every request run its full `max_tokens`, so the run is long enough to watch. The price:
# the model would have stopped after its answer (its end-of-sequence token); forced on,
# it writes noise. So the texts below start with the answer (`'19'` for `12+7=`) and then
# ramble; this notebook is about the schedule, not the answers.
#
# `serve` adds each request at its arrival step and, after every step, keeps a picture of
# the block pool (`viz.pool_frame`: every block's state and each running request's block
# table) for the replay in section 3.

# %%
model, tokenizer = fleetlab.models.load_tiny()
engine_config = dict(block_size=4, num_blocks=14, max_num_batched_tokens=16, max_num_seqs=4,
                     reorder=True, record_traces=True)
llm = fleetlab.LLM(model, tokenizer, **engine_config)

# step -> requests arriving then: (prompt, max_tokens)
arrivals = {
    0: [("12+7=", 10), ("the red cat sat on the mat.", 8), ("6*7=", 12)],
    3: [("45+38=", 10), ("count 1 2 3", 12)],
    6: [("9-4=", 6), ("the dog ran to the big red house and sat down.", 6)],
}

def serve(llm, arrivals, pool_frames=None):
    """Add each request at its arrival step and run until all are done. With a list as
    pool_frames, append the block pool as it stands after every step."""
    outputs, step = {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for prompt, max_tokens in arrivals.get(step, []):
            llm.add_request(prompt, fleetlab.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for out in llm.step():
            outputs[out.request_id] = out
        if pool_frames is not None:
            pool_frames.append(viz.pool_frame(llm))
        step += 1
    return [outputs[k] for k in sorted(outputs, key=int)]


pool_frames = []
outputs = serve(llm, arrivals, pool_frames)
traces = llm.traces
print(len(traces), "steps;", llm.stats())
for out in outputs:
    print(f"req {out.request_id}: {tokenizer.decode(out.prompt_token_ids)!r:>50} -> {out.text!r}")

# %% [markdown]
# ## 2. The whole run
#
# Top: who ran in each step (orange prefill, with its token count; blue decode; a red `x`
# where a request was preempted; `|` where it finished). Middle: KV blocks held per
# request against the pool's 14. Bottom: tokens per step against the budget of 16.
#
# Things to find: the long prompt of request 1 split over steps 0-2 (chunked prefill);
# steps that mix prefill and decode; the cache filling up until the scheduler preempts
# the newest running request (request 2 in step 7, request 5 in step 16, request 6 in
# steps 18 and 21). A preempted request loses its blocks and later comes back to rebuild
# its prompt *and* the tokens it had already generated; a green number left of its box
# counts the tokens it found still in the prefix cache (section 3 explains).

# %%
viz.draw_timeline(traces)

# %%
viz.draw_kv_occupancy(traces)

# %%
viz.draw_step_tokens(traces, budget=engine_config['max_num_batched_tokens'])

# %%
for trace in traces[:10]:
    print(viz.describe_step(trace))

# %% [markdown]
# ## 3. What a preemption leaves behind
#
# Preemption frees a request's blocks, but freed full blocks keep their content in the
# prefix cache until someone needs the space (notebook 02). So a request that comes back
# often finds the start of its own sequence still there, takes those blocks back and
# computes only the rest. That is why its chunk sizes after a preemption do not add up to
# its prompt: part of it was never recomputed.

# %%
for a in viz.admissions(traces, block_size=engine_config["block_size"]):
    if a.resumed:
        print(a.describe())

# %% [markdown]
# Request 2 (a 5-token prompt) had generated 5 tokens when it was preempted in step 7. It
# comes back in step 10, finds its first block (4 tokens) cached and recomputes the other
# 6 of its 10 tokens. Request 6's 47-token prompt is preempted twice: it comes back with
# 8, then 20 of its tokens cached, and runs 20 + 16 + 11 = 47.
#
# ## 4. Replay it
#
# Press play (or drag the slider) to see the run build up one step at a time. The title
# describes the current step: its rows in batch order (`d` decode, `p` prefill, then the
# tokens run), any reorder, preemptions and finishes. The block pool at the bottom shows
# the cache after the step: blocks coloured by the request holding them (hatched `x2`
# when shared), grey dotted when free but still cached, white when free. Watch it grow
# block by block, empty on a preemption (the freed blocks turn grey, still cached), and
# the blocks a returning request takes back from the cache outlined in green (steps 10,
# 17, 20 and 23).

# %%
replay = viz.player(lambda i: viz.draw_engine_step(traces, traces[i].step, pool_frames=pool_frames,
                                                   budget=engine_config["max_num_batched_tokens"]),
                    len(traces), interval_ms=700)
replay

# %% [markdown]
# ## 5. Preemption costs time, never correctness
#
# A preempted request loses its blocks and is recomputed later. Its tokens must be the
# ones it would have got with plenty of memory. Run the same arrivals on a roomy engine
# (the same patched model, 10x the blocks) and compare, noise and all: what matters is
# that both runs agree token for token.

# %%
roomy = fleetlab.LLM(llm.handle, tokenizer, **{**engine_config, "num_blocks": 140})
roomy_outputs = serve(roomy, arrivals)
for tight, free in zip(outputs, roomy_outputs):
    print(f"req {tight.request_id}: preempted {tight.metrics['num_preemptions']}x  "
          f"{tight.text!r:<16} same as roomy: {tight.text == free.text}")
print("steps: tight", len(traces), "| roomy", len(roomy.traces), "| roomy preemptions:",
      roomy.stats()["num_preemptions"])

# %% [markdown]
# > **In vLLM / FastDeploy** this loop is the engine core and its scheduler.
# >
# > - vLLM v1: `Scheduler.schedule()` fills a token budget (`max_num_batched_tokens`) and
# >   `max_num_seqs` rows, running requests first, then waiting ones, with chunked prefill;
# >   it returns a `SchedulerOutput` (new requests in full, cached requests as what
# >   changed, `num_scheduled_tokens` per request). When `KVCacheManager.allocate_slots`
# >   fails it preempts the lowest-priority running request (the newest, under FCFS), which
# >   later comes back through the prefix cache as here. `update_from_output` advances
# >   every request from the runner's output.
# > - FastDeploy: `ResourceManagerV1.schedule()` plays that role with the blocks of its
# >   `PrefixCacheManager`, chunked prefill included. When blocks run out,
# >   `_trigger_preempt` frees running requests (last in, first out in its first versions),
# >   resets their computed tokens and puts them back at the head of the waiting queue.

# %% [markdown]
# ## Try next
#
# - `scheduling_policy="spf"` (shortest prompt first) or `"priority"`: who waits now?
# - `enable_chunked_prefill=False`: a prompt must fit the step's budget whole
#   (then `max_num_batched_tokens` must be at least `max_model_len`).
# - `num_blocks=20`: fewer preemptions, fewer steps? (Below 14 the longest request would
#   not fit even alone, and `add_request` refuses it.)
# - Next notebook: **06_performance**, what continuous batching buys.
