# %% [markdown]
# # 14 · Overlap scheduling: the host prepares step N+1 while step N computes
#
# In the synchronous loop the model waits while the host schedules, prepares the batch and
# commits each step, and the host waits while the model runs. Production engines hide the
# host's part: they plan step N+1 while step N's forward runs, with *placeholders* for the
# tokens step N has not sampled yet. fleetlab has such a loop beside the synchronous one:
# `LLM(model, async_scheduling=True)`.
#
# **You will learn**
# - the host's and the model thread's timelines for a few steps, synchronous and overlapped,
#   drawn from the engine's own phase timestamps;
# - how step N+1 is planned one step ahead, and where its placeholder is filled with step N's token;
# - why a request that finished in step N costs one wasted slot in step N+1 and never an extra token;
# - what it measured on this machine's CPU, why overlapping every step is slower here, and how
#   the loop's gate decides whether to overlap at all.

# %%
# %matplotlib inline
import json

import numpy as np
from matplotlib.figure import Figure

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab import LLM, SamplingParams
from fleetlab.engine.core import EngineCore
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.lab import viz
from fleetlab.lab.viz.results import results_dir
from fleetlab.overlap import OverlapEngineCore, Timeline
from fleetlab.overlap import core as overlap_core
from fleetlab.overlap.ahead import Ahead
from fleetlab.overlap.placeholders import fill

model, tokenizer = fleetlab.models.load_tiny()
ENGINE = dict(block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, tokenizer.vocab_size, size=int(rng.integers(10, 16))).tolist() for _ in range(32)]
SP = SamplingParams(max_tokens=12, ignore_eos=True)

# %% [markdown]
# ## 1. Two loops, the same three moves
#
# The synchronous step (`EngineCore.step`): schedule, execute, update, one after the other.
# The model runner's `execute` is now two halves: `prepare` (the host's: apply the plan to the
# persistent batch, build the packed inputs and the sampling settings) and `run` (the model's:
# forward and sample). The synchronous loop calls one after the other.

# %%
viz.show_source(EngineCore.step, body_only=True)

# %%
viz.show_source(ModelRunner.execute, body_only=True)

# %% [markdown]
# The overlapped step (`OverlapEngineCore.step`) reads as the same three moves, one step apart:
# it **schedules** step N+1 (as if step N had run), **executes** (prepares N+1 on the host while
# a model thread still runs N, queues N+1 behind N on that thread, waits for N), and **updates**
# with step N's result. Its outputs come one call late: the first call returns none.

# %%
viz.show_source(OverlapEngineCore.step, body_only=True, stop="outputs, result = self._update")

# %%
viz.show_source(OverlapEngineCore._execute_ahead, body_only=True)

# %% [markdown]
# ## 2. The timelines, from the engine's own timestamps
#
# A `Timeline` listens at the engine's `on_phase` point (`llm.hooks`): each phase of each step
# becomes a span with its thread. Both loops serve the same 32 requests, five times each in
# turns (so both meet the same moments of the machine); here the overlapped loop overlaps every
# step (`llm.core.gate.always = True`: section 5 says what its gate does otherwise). The figure
# shows three steady decode steps of each loop's first run, numbered from step N's forward.

# %%
RUNS = 5


def steady_step_ms(timeline):
    """Median ms between two commits (``update`` ends) over the run's steady steps."""
    ends = [s.end for s in timeline.spans if s.name == "update"]
    return 1e3 * float(np.median(np.diff(ends)[3:-3]))


timelines, tokens, step_ms = {}, {}, {"synchronous": [], "overlapped": []}
engines = {name: LLM(model, tokenizer, async_scheduling=overlapped, **ENGINE)
           for name, overlapped in (("synchronous", False), ("overlapped", True))}
engines["overlapped"].core.gate.always = True
for llm in engines.values():
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=SP, use_tqdm=False)  # warm-up
for run in range(RUNS):
    for name in (list(engines) if run % 2 == 0 else list(engines)[::-1]):
        timeline = Timeline()
        engines[name].hooks.attach(timeline)
        outs = engines[name].generate(prompt_token_ids=prompts, sampling_params=SP, use_tqdm=False)
        engines[name].hooks.detach(timeline)
        step_ms[name].append(steady_step_ms(timeline))
        if run == 0:
            timelines[name], tokens[name] = timeline, [o.token_ids for o in outs]
for llm in engines.values():
    llm.close()
print("same tokens in both loops:", tokens["synchronous"] == tokens["overlapped"])
threads = {name: sorted({s.thread for s in t.spans if s.name == "forward"}) for name, t in timelines.items()}
print("the forward ran on:", threads)
print("decode step, median of the runs [min, max] (ms):",
      {name: f"{np.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]" for name, v in step_ms.items()})
timeline_figure = viz.draw_overlap(timelines, first_forward=4, num_steps=3)
timeline_figure

# %% [markdown]
# In the synchronous loop the model's lane has a gap between two forwards: the host schedules,
# updates the batch, builds the metadata and commits while the model does nothing. In the
# overlapped loop the host's `schedule`, `batch_update`, `metadata` and `freeze` of step N+1
# sit under step N's forward; the host queues step N+1 on the model thread and `wait`s
# (hatched) for step N and for step N+1's forward to start, then `update` commits step N while
# N+1 runs. The model thread goes from one step to the next by itself: it `fill`s step N+1's
# placeholders with step N's tokens (the thin red span before each forward) and runs it. Had the
# host woken as step N ended, both threads would want the GIL at that moment (section 5).
# The printed step times are the median of five runs of each loop and their spread: on this
# shared machine one run's drawing can make either loop look faster, so compare the medians
# (and section 5's longer measurement), not one drawing.
#
# How much of the host's work ran under a forward, counted from the spans:

# %%
def under_forward(timeline):
    """Share of the host's own phases (waits left out) that ran while a forward was running."""
    forwards = [(s.start, s.end) for s in timeline.spans if s.name == "forward"]
    host = [s for s in timeline.spans if s.name not in ("forward", "sample", "wait")]
    inside = sum(max(0.0, min(s.end, f1) - max(s.start, f0)) for s in host for f0, f1 in forwards)
    return inside / sum(s.end - s.start for s in host)


shares = {name: under_forward(t) for name, t in timelines.items()}
print({name: f"{share:.0%}" for name, share in shares.items()})

# %% [markdown]
# None of the synchronous host work runs under a forward; most of the overlapped loop's does.
# Whether that makes the loop faster depends on what the forward leaves to the host: section 5.
#
# ## 3. Planning one step ahead: placeholders
#
# When step N+1 is planned, step N has not sampled yet. `Ahead.take` makes every request of
# step N look as if it had run: `num_computed_tokens` past step N's tokens, and one
# **placeholder** (`Request.num_placeholders`) for the token step N will sample. The scheduler
# then gives a decoding request one more token, the placeholder.

# %%
viz.show_source(Ahead.take, body_only=True)

# %% [markdown]
# The runner sees a row scheduled past its known tokens and gives it a placeholder token there
# (in the synchronous loop this never happens). On the model thread, as soon as step N is done
# and just before step N+1's forward, `fill` writes step N's token into the placeholder: into
# the step's frozen copy of its rows (its penalties read that) and into the packed input ids
# the forward reads. The live batch gets the token from the next step's message, as always.

# %%
viz.show_source(ModelRunner._mark_placeholders, body_only=True)

# %%
viz.show_source(fill, start="by_request", stop="return filled")

# %% [markdown]
# Watch it on two requests: for each step, which placeholder the forward read, the token put
# there, and what the step before had sampled for that request.

# %%
fills = []


def show(token):
    return tokenizer.decode([token]) or "<eos>"


def watching_fill(prepared, result):
    n = fill(prepared, result)
    ids = prepared.inputs.input_ids.numpy()[0]
    fills.append([(rid, position, int(ids[index]), result.sampled_token_ids[rid][-1])
                  for rid, _, position, index in prepared.placeholders])
    return n


overlap_core.fill = watching_fill
with LLM(model, tokenizer, async_scheduling=True, **ENGINE) as llm:
    llm.core.gate.always = True  # every step overlapped, as in section 2
    two = llm.generate(["12+7=", "45+38="], SamplingParams(max_tokens=4), use_tqdm=False)
overlap_core.fill = fill
for step, slots in enumerate(fills):
    print(f"call {step + 1}:", ", ".join(f"request {rid} position {pos}: read {show(tok)!r}"
                                         f" (step before sampled {show(was)!r})"
                                         for rid, pos, tok, was in slots) or "no placeholder")
print("answers:", [o.text for o in two])

# %% [markdown]
# The first call plans the prompts (no placeholder). From the second on, each decode reads
# one placeholder at the position right after its known tokens, and the token there is the
# one the previous step sampled: the forward never sees a made-up token. In the last call
# both placeholders hold `<eos>`: both answers ended in the step before, and this step, planned
# before anyone knew, computes their wasted slots (section 4).
#
# ## 4. A request that finished costs one wasted slot, never an extra token
#
# A request whose last token comes in step N was already planned into step N+1 (nobody knew
# step N would finish it: EOS, a stop token, a stop string or `max_tokens`; or it was aborted
# meanwhile). Its slot in step N+1 is computed and thrown away: when step N+1 is committed,
# `Ahead.settle` leaves out every request that no longer runs as planned, so
# `Scheduler.update` never sees its token.

# %%
viz.show_source(Ahead.settle, body_only=True, stop="keep = lambda")

# %%
plans = []
with LLM(model, tokenizer, async_scheduling=True, **ENGINE) as llm:
    llm.core.gate.always = True
    schedule = llm.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    llm.scheduler.schedule = recording_schedule
    rid = llm.add_request("12+7=", SamplingParams(max_tokens=3))
    streamed = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            streamed.append(([show(t) for t in out.new_token_ids], out.finished))
planned_in = sum(rid in p.num_scheduled_tokens for p in plans)
print(f"request {rid}: 3 tokens, planned into {planned_in} steps; outputs: {streamed}")

# %% [markdown]
# Three tokens took a prefill and two decodes; the fourth plan was made while the third step
# ran, so the request sits in it too. Its outputs carry three tokens and one `finished`,
# nothing after. The cost is one slot of one step per finished request (a few percent of a
# step at batch 64), the price of not waiting for step N before planning step N+1.
#
# ## 5. What it measured here, and the gate
#
# `python -m fleetlab bench overlap` serves 64 requests decoding together on this model with three
# engines in turns (A B C, C B A, ... so all meet the same moments of the machine): the
# synchronous loop, the overlapped loop made to overlap every step (`gate.always`, as above), and
# the overlapped loop as `LLM(async_scheduling=True)` builds it, whose **gate**
# (`fleetlab.overlap.gate.OverlapGate`) measures instead of assuming: every 96 steps it runs a
# few steps each way, compares their cadence (wall time between two commits of decode steps, per
# row) and runs the faster way until the next probe (overlapping only if at least 3% faster; the
# stored run below predates that margin and counted prompt steps too). The bars are the medians of the rounds,
# the lines their range.

# %%
bench = json.loads((results_dir() / "overlap.json").read_text())
summary = bench["summary"]
med, spread, probes = summary["median"], summary["spread"], bench["gate_probes"]
LOOPS = {"sync": "synchronous", "overlap_always": "overlapped,\nevery step", "overlap": "overlapped,\ngated"}
for loop, label in LOOPS.items():
    m = med[loop]
    print(f"{label.replace(chr(10), ' '):22s} step {m['step_ms']:.2f} ms, forward+sample {m['model_ms']:.2f} ms, host "
          f"{m['host_ms']:.2f} ms, {m['tok_s']:.0f} tok/s (rounds {spread[loop]['tok_s'][0]:.0f}-"
          f"{spread[loop]['tok_s'][1]:.0f})")
print(f"round by round, tok/s over the synchronous loop's: every step {summary['paired_always_tok_s_ratio']:.2f}x, "
      f"gated {summary['paired_tok_s_ratio']:.2f}x")
print(f"the gate probed {len(probes)} times; it overlapped after {sum(p['overlap'] for p in probes)} of them")
print("command:", bench["command"])
fig_speed = Figure(figsize=(6, 2.8), layout="constrained")
ax = fig_speed.subplots()
tok = [med[loop]["tok_s"] for loop in LOOPS]
err = [[t - spread[loop]["tok_s"][0] for t, loop in zip(tok, LOOPS)],
       [spread[loop]["tok_s"][1] - t for t, loop in zip(tok, LOOPS)]]
ax.bar(list(LOOPS.values()), tok, yerr=err, capsize=4, color=["tab:blue", "tab:red", "tab:green"], gid="tok_s")
ax.set_ylabel("output tokens / s (batch 64)")
fig_speed

# %% [markdown]
# Compare each round's loops with each other (the round-by-round ratios printed above), not the
# bars alone: on a machine as loaded as the stored run's (its load is recorded with it, and the
# bars' ranges show how far the rounds spread) a round's pace moves more than the loops differ.
# Round by round, overlapping every step served fewer tokens a second than the synchronous
# loop. Paddle's eager forward of a tiny model is mostly Python between small kernels, and
# Python holds the GIL: two threads that both mostly run Python do not run at once, they take
# turns, and each turn costs a hand-over; on a 2-core machine that other work also uses, the two
# threads do not always get a core each either. The gate found in-line steps faster at most of
# its probes and ran them in line, so the loop as built kept the synchronous loop's pace. Overlap
# pays where the forward is long device work the host does not wait on: a GPU, whose kernels run
# asynchronously while the host thread is free between launches. On an H200 (torch tensors) the
# Triton backend's per-step plan, built for step N+1 while step N's 32 layers ran, was 81%
# hidden (the cell below reads that run); there the gate would find the overlapped cadence the
# faster one. The loop is right here either way (the same tokens as the synchronous loop, in
# every scenario of `tests/test_overlap_scenarios.py`, and while the gate switches).

# %%
probe = json.loads((results_dir() / "h200_overlap_plan_probe.json").read_text())
step = probe["median_us_per_step"]
print(f"H200, {probe['config']['layers']} layers, batch {probe['config']['batch']}: plan built in line "
      f"{step['inline'] / 1e3:.2f} ms a step, overlapped {step['overlapped'] / 1e3:.2f} ms, no plan at all "
      f"{step['gpu_only'] / 1e3:.2f} ms; the plan alone {step['plan_only']:.0f} µs, {probe['plan_hidden']:.0%} hidden")

# %% [markdown]
# > **In vLLM / FastDeploy.** vLLM v1's async scheduling (`--async-scheduling`) keeps a batch
# > queue of two steps in its engine core and an `AsyncScheduler` that counts
# > `num_output_placeholders` per request, as `Request.num_placeholders` here; the next step's
# > input ids are filled from the previous step's sampled tokens on the GPU, so the host never
# > reads them back in between. SGLang's overlap scheduler ("zero-overhead batch scheduling")
# > and TensorRT-LLM's overlap scheduler run the same pipeline: launch step N+1, then process
# > step N's results on the CPU. The FastDeploy code was not checked for this notebook.
# > fleetlab refuses what needs step N's result to plan step N+1 (speculative decoding,
# > structured outputs' grammar mask, tensor parallelism's schedule check, KV connectors,
# > traces), each with a `ValueError` naming the option.
#
# **Try next**
# - Run `python -m fleetlab bench overlap --batch 8` and `--batch 128`: does the share of
#   host work change the verdict?
# - Make the workload finish requests at different steps (`max_tokens` per request) and count
#   the wasted slots from the plans, as in section 4.
# - Read `fleetlab/overlap/frozen.py`: which batch state would a step read wrongly without it?
#   Remove the `freeze` call and run `tests/test_overlap_scenarios.py`.
