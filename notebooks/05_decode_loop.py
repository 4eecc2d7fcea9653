# %% [markdown]
# # 05 · The decode loop: continuous batching step by step
#
# **You will learn** what the scheduler decides every step, and watch it happen:
#
# - requests arriving while others run, and joining as soon as there is room;
# - a token budget shared by prefills and decodes, and long prompts split across steps
#   (**chunked prefill**);
# - what happens when the KV cache runs out: **preemption** and recomputation;
# - who waits in the queue, and what keeps each request out (rows, budget, memory);
# - the block pool step by step: key steps side by side, and a play button for all of them.

# %%
# %matplotlib inline
import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz

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
# `serve` adds each request at its arrival step (and notes that step), and after every step
# keeps a picture of the block pool (`viz.pool_frame`: every block's state and each running
# request's block table) for the replay in section 4. Before each step it also asks the
# engine how many requests are waiting (`llm.stats()["num_requests_waiting"]`): the queue
# drawn in section 2 must be that one.

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
    """Add each request at its arrival step and run until all are done. Returns the outputs
    (by request id), each request's arrival step, and the engine's count of waiting requests
    before each step. With a list as pool_frames, append the block pool after every step."""
    outputs, arrival_steps, waiting_before, step = {}, {}, {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for prompt, max_tokens in arrivals.get(step, []):
            rid = llm.add_request(prompt, fleetlab.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            arrival_steps[rid] = step
        waiting_before[step] = llm.stats()["num_requests_waiting"]
        outputs.update({out.request_id: out for out in llm.step() if out.finished})
        if pool_frames is not None:
            pool_frames.append(viz.pool_frame(llm))
        step += 1
    return [outputs[k] for k in sorted(outputs, key=int)], arrival_steps, waiting_before


pool_frames = []
outputs, arrival_steps, waiting_before = serve(llm, arrivals, pool_frames)
traces = llm.traces
print(len(traces), "steps;", llm.stats())
for out in outputs:
    print(f"req {out.request_id}: {tokenizer.decode(out.prompt_token_ids)!r:>50} -> {out.text!r}")

# %% [markdown]
# ## 2. The whole run
#
# Top: who ran in each step (orange prefill, with its token count; blue decode; a red `x`
# where a request was preempted; `|` where it finished), and who waited: a black triangle
# where a request arrived, a thin bar through every step it waited, coloured by what kept it
# out. `viz.queue_waits` reads that from each step's trace, in the order the scheduler gives
# up admitting: a step that preempted admits nobody; then all `max_num_seqs` rows taken;
# then the token budget spent; otherwise the next prompt's blocks did not fit the free pool.
# Middle: KV blocks held per request against the pool's 14. Bottom: tokens per step against
# the budget of 16.

# %%
waits = viz.queue_waits(traces, arrival_steps, llm.config)
timeline = viz.draw_timeline(traces, waits=waits)
timeline

# %%
for wait in waits:
    if wait.reasons:
        print(wait.describe())

# %% [markdown]
# Those reasons are the exits of the scheduler's own code, read here from the installed
# package. `schedule` serves the running requests first (`_schedule_running`, which preempts
# when the pool runs dry) and admits nobody after a preemption (`if not
# out.preempted_req_ids`): the hatched red bars ("a preemption in this step").

# %%
schedule_source = viz.show_source(fleetlab.Scheduler.schedule, body_only=True)
schedule_source

# %% [markdown]
# Then the admission loop, `_schedule_waiting`. Its `while` line holds two of the reasons: it
# stops when the budget is spent (`budget > 0`) or every row is taken (`len(self.running) <
# self.max_num_seqs`). Inside, the policy picks the next request, the prefix cache says how
# many of its tokens are already cached, the chunk is cut to the budget (`n = min(remaining,
# budget)`: chunked prefill), and when `allocate_slots` cannot find the blocks the loop
# breaks: the pool reason. Only then is the request moved from `waiting` to `running`.

# %%
admission_source = viz.show_source(fleetlab.Scheduler._schedule_waiting, body_only=True,
                                   stop="self._schedule(req, n, out)")
admission_source

# %% [markdown]
# That is the admission half. The other half runs first in every step: `_schedule_running`
# gives each running request (in admission order, the oldest first) its next tokens,
# `_num_new_tokens` of them: what it has not computed yet, cut to the budget. When
# `allocate_slots` cannot find the blocks for them, the inner `while` asks the policy for a
# victim (`pick_victim`), puts the victim's already-scheduled tokens back into the budget
# and preempts it; it stops when the request fits, or when the request was itself the
# victim.

# %%
running_source = viz.show_source(fleetlab.Scheduler._schedule_running, body_only=True)
running_source

# %%
new_tokens_source = viz.show_source(fleetlab.Scheduler._num_new_tokens, body_only=True)
new_tokens_source

# %% [markdown]
# Under the default first-come-first-served policy the victim is the newest running
# request, the last of `running`; `_preempt` frees its blocks, sets its
# `num_computed_tokens` back to 0 and appends it to `waiting`, where its arrival order puts
# it back at the front (the admission key of section 2's loop).

# %%
victim_source = viz.show_source(type(llm.scheduler.policy).pick_victim)
victim_source

# %%
preempt_source = viz.show_source(fleetlab.Scheduler._preempt, body_only=True)
preempt_source

# %% [markdown]
# Read the first red `x` of the timeline with that code. After step 6 the pool has no free
# block. In step 7 request 0 comes first: its next token starts a fourth block and
# `allocate_slots` returns None, so `pick_victim` returns request 2 (the newest) and
# `_preempt` frees its three blocks. Request 0 then takes one of them (block 13), request 1
# another (block 10), and nobody is admitted: two rows run.

# %%
frame6, frame7 = (next(f for f in pool_frames if f.step == s) for s in (6, 7))
print("after step 6:", frame6.block_tables)
print("after step 7:", frame7.block_tables, "| preempted in step 7:", traces[7].preempted)

# %% [markdown]
# Things to find: the long prompt of request 1 split over steps 0-2 (chunked prefill),
# which with request 0's prompt fills step 0's budget, so request 2 waits two steps for
# tokens, not for memory. Requests 3 and 4 arrive in step 3 and wait seven steps: the first
# three requests' growing caches have taken the pool (it stays full through step 9, and in
# step 7 the scheduler even preempts request 2, the newest, to let the older ones grow).
# Requests 5 and 6 arrive in step 6 into the same full pool; once there is room, request 5
# waits one more step for the budget, and request 6, at the back of the queue, finds every
# row taken (steps 11-15). Steps mix prefill and decode throughout, and the cache fills
# until the scheduler preempts again (request 5 in step 16, request 6 in steps 18 and 21).
# A preempted request loses its blocks and later comes back to rebuild its prompt *and* the
# tokens it had already generated; a green number in its box counts the tokens it found
# still in the prefix cache (section 3 explains).
#
# Below, KV blocks held per request: each step's bars count the blocks of the requests that
# ran in it; the black line is what is still held after the step. The line drops below the
# bars exactly in the steps where a request finished (its blocks are freed at the end of
# the step: step 9, where requests 0 and 1 finish, is the clearest).

# %%
occupancy = viz.draw_kv_occupancy(traces)
occupancy

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
# The block pool after key steps, side by side: after step 6 the pool is full; in step 7
# request 2 is preempted, and of its three blocks only block 9 stays grey (free, still
# cached): blocks 10 and 13 go straight to requests 1 and 0, whose growth needed them (that
# is why 2 was preempted); in step 10 it comes back and takes block 9 from the cache
# (outlined in green); in step 16 request 5 is preempted, and in step 17 it comes back,
# takes its block 7 from the cache (outlined) and finishes in the same step, so the panel
# draws its blocks free again; in step 23 request 6 takes back five blocks of its own.
# Blocks are coloured by the request holding them, grey dotted when free but still cached
# (the number in the circle: the order they would be overwritten), white when free.

# %%
pool_strip = viz.draw_pool_strip(traces, [6, 7, 10, 16, 17, 23], pool_frames, waits=waits)
pool_strip

# %% [markdown]
# Every step in a player: press play (or drag the slider) to watch the pool grow block by
# block, empty on a preemption, and refill from the cache. The text above the pool tells
# the step: its rows in batch order (`d` decode, `p` prefill, then the tokens run), any
# reorder, preemptions and finishes, who waited and why, and what the prefix cache gave
# back (the outlined blocks).

# %%
replay = viz.player(lambda i: viz.draw_pool_step(traces, traces[i].step, pool_frames, waits=waits), len(traces),
                    interval_ms=1000)
replay

# %%
frame_s = viz.time_frames(replay, range(len(traces)))
print(f"a frame takes {np.median(frame_s):.2f} s to draw and render here (the median of {len(frame_s)}; "
      f"the slowest {max(frame_s):.2f} s); play shows one every {replay.play.interval / 1000:.1f} s")

# %% [markdown]
# ## 5. Preemption costs time, never correctness
#
# A preempted request loses its blocks and is recomputed later. Its tokens must be the
# ones it would have got with plenty of memory. Run the same arrivals on a roomy engine
# (the same patched model, 10x the blocks) and compare, noise and all: what matters is
# that both runs agree token for token.

# %%
roomy = fleetlab.LLM(llm.handle, tokenizer, **{**engine_config, "num_blocks": 140})
roomy_outputs, _, _ = serve(roomy, arrivals)
for tight, free in zip(outputs, roomy_outputs):
    print(f"req {tight.request_id}: preempted {tight.metrics['num_preemptions']}x  "
          f"{tight.text!r:<16} same as roomy: {tight.text == free.text}")
print("steps: tight", len(traces), "| roomy", len(roomy.traces), "| roomy preemptions:",
      roomy.stats()["num_preemptions"])

# %% [markdown]
# ## 6. Write the scheduler yourself
#
# You have read both halves; now write them. `fleetlab.lab.lessons.schedule_exercise` hands
# your `schedule(state)` one step's state as plain data (`ToyState`: the running requests
# in admission order, the waiting ones in the order to admit, each with `num_tokens`,
# `num_computed_tokens` and `num_blocks` held; the free blocks, the block size, the budget
# and `max_num_seqs`) and wants its plan back (`ToyPlan`: tokens per request, and whom it
# preempts). `check_schedule` replays a recorded engine run step by step: it rebuilds the
# state the engine's scheduler saw, asks your function, compares, and moves on by what the
# engine did, so it can say at which step and for which request yours first differs.
#
# The toy world is the engine's with the prefix cache off (a returning request starts from
# zero), first-come-first-served, and no speculative decoding. So first run the same
# arrivals on such an engine:

# %%
from fleetlab.lab.lessons.schedule_exercise import check_schedule

exercise_llm = fleetlab.LLM(llm.handle, tokenizer, **{**engine_config, "enable_prefix_caching": False})
_, exercise_arrivals, _ = serve(exercise_llm, arrivals)
print(len(exercise_llm.traces), "steps;", exercise_llm.stats()["num_preemptions"], "preemptions, in steps",
      [t.step for t in exercise_llm.traces if t.preempted])

# %% [markdown]
# The cell below is a working answer, about 45 lines: both loops of the real scheduler,
# with a dictionary of blocks held standing in for the block pool. Replace its body with
# your own (start from `return ToyPlan()`), run it and the check after it: the check names
# the first step and request where yours and the engine part ways.

# %%
from fleetlab.lab.lessons.schedule_exercise import ToyPlan


def toy_schedule(state, pick_victim=lambda running: running[-1]):  # the newest, as the engine's policy
    plan = ToyPlan()
    budget, free = state.max_num_batched_tokens, state.num_free_blocks
    running = list(state.running)  # admission order: the last one is the newest
    held = {r.request_id: r.num_blocks for r in running}

    def new_blocks(req, n):  # blocks still to take for the request's next n tokens
        return max(0, -(-(req.num_computed_tokens + n) // state.block_size) - held[req.request_id])

    # 1. Running requests first, oldest first; while one does not fit, preempt a victim.
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        while new_blocks(req, n) > free:
            victim = pick_victim(running)
            if running.index(victim) < i:  # already served this step: the rows after it shift down
                i -= 1
            running.remove(victim)
            budget += plan.num_scheduled_tokens.pop(victim.request_id, 0)  # its tokens go back
            free += held.pop(victim.request_id)
            plan.preempted.append(victim.request_id)
            if victim is req:
                break
        else:
            need = new_blocks(req, n)
            free, held[req.request_id] = free - need, held[req.request_id] + need
            plan.num_scheduled_tokens[req.request_id] = n
            budget -= n
            i += 1
    if plan.preempted:  # the pool is tight: admit nobody this step
        return plan
    # 2. Then waiting requests in order, while the budget, the rows and the blocks last.
    for req in state.waiting:
        if budget == 0 or len(running) == state.max_num_seqs:
            break
        n = min(req.num_tokens, budget)  # a chunk of the prompt when the budget is short
        need = -(-n // state.block_size)
        if need > free:
            break
        free -= need
        running.append(req)
        plan.num_scheduled_tokens[req.request_id] = n
        budget -= n
    return plan

# %%
mismatch = check_schedule(toy_schedule, exercise_llm, exercise_arrivals)
print("every step agrees with the engine" if mismatch is None else mismatch.describe())

# %% [markdown]
# What a mistake looks like: the same answer, but preempting the *oldest* running request
# instead of the newest. It agrees with the engine until the first step that preempts,
# and the check stops there.

# %%
def oldest_victim_schedule(state):
    return toy_schedule(state, pick_victim=lambda running: running[0])


wrong = check_schedule(oldest_victim_schedule, exercise_llm, exercise_arrivals)
print(wrong.describe())
print("engine:", wrong.engine)
print("yours: ", wrong.toy)

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
