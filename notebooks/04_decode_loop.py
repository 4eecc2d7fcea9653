# %% [markdown]
# # 04 · The decode loop: continuous batching step by step
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
import logging
import warnings

warnings.filterwarnings("ignore", category=UserWarning)  # Paddle's import-time notices
import numpy as np
import paddle

import fleetlab
from fleetlab import viz

logging.getLogger().setLevel(logging.WARNING)  # Paddle turns INFO logs on for every library
paddle.seed(0)
np.random.seed(0)

# %% [markdown]
# ## 1. A deliberately small engine
#
# The trained tiny model, but a cache of only 14 blocks of 4 tokens (56 token slots), a
# budget of 16 tokens per step and at most 4 running requests. `ignore_eos=True` makes
# every request run its full `max_tokens`, so the run is long enough to watch.

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

def serve(llm, arrivals):
    """Add each request at its arrival step and run until all are done."""
    outputs, step = {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for prompt, max_tokens in arrivals.get(step, []):
            llm.add_request(prompt, fleetlab.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for out in llm.step():
            outputs[out.request_id] = out
        step += 1
    return [outputs[k] for k in sorted(outputs, key=int)]

outputs = serve(llm, arrivals)
traces = llm.traces
print(len(traces), "steps;", llm.stats())

# %% [markdown]
# ## 2. The whole run
#
# Top: who ran in each step (orange prefill, with its token count; blue decode; a red `x`
# where a request was preempted; `|` where it finished). Middle: KV blocks held per
# request against the pool's 14. Bottom: tokens per step against the budget of 16.
#
# Things to find: the long prompt of request 6 split over steps (chunked prefill); steps
# that mix prefill and decode; the cache filling up until the scheduler preempts the
# newest request, which later comes back and recomputes its prompt *and* the tokens it
# had already generated.

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
# ## 3. Replay it
#
# Press play (or drag the slider) to see the run build up one step at a time; the title
# describes the current step: its rows in batch order (`d` decode, `p` prefill, then the
# tokens run), any reorder, preemptions and finishes.

# %%
viz.player(lambda i: viz.draw_engine_step(traces, traces[i].step, budget=engine_config["max_num_batched_tokens"]),
           len(traces), interval_ms=700)

# %% [markdown]
# ## 4. Preemption costs time, never correctness
#
# A preempted request loses its blocks and is recomputed later. Its answer must be the
# one it would have got with plenty of memory. Run the same arrivals on a roomy engine
# (the same patched model, 10x the blocks) and compare. (With `ignore_eos=True` the model
# keeps writing past its answer, so each text starts with the answer, e.g. `'19'` for
# `12+7=`, and trails off into noise: what matters here is that both runs agree.)

# %%
roomy = fleetlab.LLM(llm.handle, tokenizer, **{**engine_config, "num_blocks": 140})
roomy_outputs = serve(roomy, arrivals)
for tight, free in zip(outputs, roomy_outputs):
    print(f"req {tight.request_id}: preempted {tight.metrics['num_preemptions']}x  "
          f"{tight.text!r:<16} same as roomy: {tight.text == free.text}")
print("steps: tight", len(traces), "| roomy", len(roomy.traces), "| roomy preemptions:",
      roomy.stats()["num_preemptions"])

# %% [markdown]
# ## Try next
#
# - `scheduling_policy="spf"` (shortest prompt first) or `"priority"`: who waits now?
# - `enable_chunked_prefill=False`: a prompt must fit the step's budget whole
#   (then `max_num_batched_tokens` must be at least `max_model_len`).
# - `num_blocks=20`: fewer preemptions, fewer steps? (Below 14 the longest request would
#   not fit even alone, and `add_request` refuses it.)
# - Next notebook: **05_performance**, what continuous batching buys.
