# %% [markdown]
# # 08 · Speculative decoding: draft cheaply, verify in one forward
#
# **You will learn** how an engine gets several tokens out of one forward pass of a big
# model, without changing what it writes:
#
# - the idea: a cheap **proposer** guesses `k` tokens; the **target** model scores all of
#   them in one step (a *verify row* of `k + 1` query tokens) and keeps the longest run it
#   agrees with, plus one token of its own;
# - each step drawn as drafts **accepted**, **rejected**, and the target's **bonus** or
#   **recovered** token, for a draft model and for prompt lookup (`ngram`);
# - the draft model's own batch, the `ProposerInputBatch`, moving row for row with the
#   main `InputBatch` when it is reordered decode-first;
# - how many drafts to ask for: acceptance and target forwards per token against `k` (a slider);
# - **rejection sampling**: why sampled text keeps exactly the target's distribution, checked
#   on a histogram.

# %%
# %matplotlib inline
import numpy as np
from matplotlib.figure import Figure

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz
from fleetlab.lab.bench.spec import measure, spec_config, trained_prompts
from fleetlab.spec_decode.proposer_batch import ProposerInputBatch, proposer_fields

# %% [markdown]
# ## 1. Turn it on
#
# The shipped tiny Llama (4 layers) has a smaller sibling trained on the same text: a
# 2-layer **draft** model with the same character tokenizer. `speculative_config` names
# the proposer (`"draft"` or `"ngram"`) and `k`, the drafts per step
# (`num_speculative_tokens`). The engine patches the draft model too and gives it its own
# paged KV cache. Greedy decoding must give exactly the tokens of plain decoding; only the
# number of steps changes.

# %%
model, tokenizer = fleetlab.models.load_tiny()
draft_model, _ = fleetlab.models.load_tiny_draft()
prompts = ["count 12", "the old man", "45+38=", "is the cat"]
params = fleetlab.SamplingParams(max_tokens=24)  # greedy; the model ends its answers with EOS
engine = dict(block_size=4, record_traces=True)

with fleetlab.LLM(model, tokenizer, **engine) as plain:
    plain_outputs = plain.generate(prompts, params, use_tqdm=False)
draft_spec = {"method": "draft", "num_speculative_tokens": 4, "model": draft_model}
with fleetlab.LLM(model, tokenizer, **engine, speculative_config=draft_spec) as llm:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
for out, ref in zip(outputs, plain_outputs):
    print(f"{tokenizer.decode(out.prompt_token_ids)!r:>14} -> {out.text!r:<22} same as plain: {out.text == ref.text}")
print(f"engine steps: plain {plain.stats()['num_steps']}, speculative {stats['num_steps']}")
print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in stats.items()
       if key.startswith(("num_draft", "num_accepted", "spec_"))})

# %% [markdown]
# Same texts, in 5 steps instead of 19. The draft model proposed 48 tokens and the target
# accepted 44 of them (`spec_acceptance_rate` 0.92); a verify step yields 4.67 tokens on
# average (`spec_mean_acceptance_length`: the accepted drafts plus the target's own token).
# `spec_acceptance_by_position` is the acceptance of the 1st, 2nd, ... draft of a step: a
# later draft counts only if every draft before it was accepted, so later positions are
# accepted less often (here 1.0, 0.92, 0.92, 0.83).
#
# ## 2. Every step, drawn
#
# One line per step and request. Grey: the tokens the request had kept before this step.
# Then what this step did: the drafts the target **accepted** (green), the drafts it
# **rejected** (red, struck through), and the one token the target adds itself: a
# **bonus** token (blue) when it accepted every draft, or a **recovered** token (purple)
# in place of the first draft it rejected, drawn in that draft's slot, under it. The first
# step of each request is its prompt's prefill, which samples one plain token (light blue)
# and lets the draft model propose.

# %%
steps_draft = viz.draw_spec_steps(llm.traces, tokenizer, prompts=dict(zip([o.request_id for o in outputs], prompts)),
                                  title="draft model, k = 4")
steps_draft

# %% [markdown]
# Request 0 (`'count 12'`) gets its 13 tokens in 4 target forwards: the prefill, then two
# steps in which the target accepts all four drafts and adds a bonus token (5 tokens a
# step), then a step that ends at the EOS; the two drafts after the EOS are cut. In
# request 1 (`'the old man'`), step 3, the draft model guessed `' bed'` (*sat by the
# bed.*, a sentence the corpus allows); the target kept the space, rejected `bed`, and
# wrote its own `r` of *road* in its place (recovered). `'45+38='` needs only 2 forwards
# for its 3 tokens: the prefill's `8`, then `3` and the EOS accepted at once.
#
# **Prompt lookup** (`method="ngram"`) needs no model at all: it finds the last few tokens
# (`prompt_lookup_min` to `prompt_lookup_max` of them) earlier in the request's own text and
# proposes what followed them there. On the tiny model's short answers that rarely works:

# %%
ngram_spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
with fleetlab.LLM(model, tokenizer, **engine, speculative_config=ngram_spec) as ngram_llm:
    ngram_outputs = ngram_llm.generate(prompts[:2], params, use_tqdm=False)
    ngram_stats = ngram_llm.stats()
with fleetlab.LLM(model, tokenizer, **engine) as plain_two:  # the same two prompts, decoded plainly
    plain_two.generate(prompts[:2], params, use_tqdm=False)
print(f"same as plain: {[o.text for o in ngram_outputs] == [o.text for o in plain_outputs[:2]]}, "
      f"acceptance {ngram_stats['spec_acceptance_rate']:.2f}, steps {ngram_stats['num_steps']} "
      f"(plain decoding of these two prompts: {plain_two.stats()['num_steps']})")
viz.draw_spec_steps(ngram_llm.traces, tokenizer, prompts=dict(zip(["0", "1"], prompts[:2])), title="ngram, k = 4")

# %% [markdown]
# Same texts again, but 16 steps instead of the 18 that plain decoding of these two prompts
# takes: only 11% of the drafts are accepted. In
# `'count 12'` prompt lookup copies the number it saw last (`12`, then `13`, ...) whenever
# the text ends in a space, so it gets the next number's `1` right and its second digit
# wrong: 13 tokens in 9 forwards. The sentence copies words of the prompt (`man`, `old`)
# that never come next: nearly every draft is rejected (18 tokens in 16 forwards).
# Rejected drafts cost nothing in correctness, only the slots they took in the step.
#
# Where text repeats, prompt lookup pays. A tiny *random* model decoding greedily soon
# falls into a loop, so its own earlier tokens predict the next ones (no tokenizer here:
# the cells show token ids):

# %%
looping_model = fleetlab.models.tiny("llama", seed=0)
looping_prompt = [17, 5, 33, 9, 21] * 3
with fleetlab.LLM(looping_model, **engine, speculative_config=ngram_spec) as loop_llm:
    loop_output = loop_llm.generate(prompt_token_ids=[looping_prompt], use_tqdm=False,
                                    sampling_params=fleetlab.SamplingParams(max_tokens=32, ignore_eos=True))[0]
    loop_stats = loop_llm.stats()
print(f"acceptance {loop_stats['spec_acceptance_rate']:.2f}, {len(loop_output.token_ids)} tokens in "
      f"{loop_stats['num_steps']} steps")
viz.draw_spec_steps(loop_llm.traces, max_previous=12, title="ngram on a looping random model, k = 4")

# %% [markdown]
# Every draft is accepted (1.00) and the model needs 14 forwards for 32 tokens instead of
# 32. The drafts grow with the loop: prompt lookup proposes what followed an earlier
# occurrence of the text's last tokens, and early in a run of one repeated token no earlier
# occurrence is followed by four more tokens yet, so it proposes the one or two there are;
# in steps 7 and 8 the run is long enough and each carries all four drafts plus a bonus.
# (fleetlab takes the most recent match that is followed by `k` tokens, else the earliest;
# vLLM takes the earliest occurrence of the longest match.) Step 8's bonus token is `62`,
# new to the text: the loop has moved on, so step 9 has nothing to copy (it samples one
# plain token), and the drafts grow again with the new run.
#
# ## 3. The proposer's batch moves with the main batch, row for row
#
# The draft model keeps per-request state of its own: how far *its* KV cache is computed,
# and the drafts it proposed. fleetlab keeps that state in a `ProposerInputBatch`, one row
# per row of the main `InputBatch`. Every step the main batch drops finished requests,
# condenses, and reorders decode-first; a verify row (`1 + k` query tokens) counts as a
# decode, since `reorder_threshold` is `k + 1`. If the proposer's rows did not make the
# same moves, the draft model would read another request's state. So the proposer keeps
# that state as *fields of the main batch* (`proposer_fields(k)`, registered like any other
# field): the batch's one row move carries them with the rest, and the `ProposerInputBatch`
# is the proposer's view of them under its own names.
#
# Built by hand below with `k = 3`: five requests run; `c` just finished. Rows `a`, `d`, `f`
# verify drafts (4 tokens each), `b` and `e` run prompt chunks.

# %%
K = 3
fields = fleetlab.DEFAULT_FIELDS.copy()
for field in proposer_fields(K):  # the draft proposer's state, as fields of the main batch
    fields.register(field)
batch = fleetlab.InputBatch(max_num_seqs=6, max_model_len=64, max_blocks_per_seq=16, fields=fields)
proposer_batch = ProposerInputBatch(batch)
# request: (prompt, generated so far, drafts to verify, prompt chunk when prefilling)
requests = {"a": ("count 12", " 13", " 14", None), "b": ("the old man", "", "", 12), "c": ("45+38=", "83", "", None),
            "d": ("is the cat", " blue", "? y", None), "e": ("the red cat sat on the mat.", "", "", 8),
            "f": ("count 57", " 58", " 59", None)}
next_block = 0
for rid, (prompt, generated, drafts, _) in requests.items():
    ids, out = tokenizer.encode(prompt), tokenizer.encode(generated, add_bos=False)
    num_blocks = -(-(len(ids) + len(out) + K) // 4)
    row = batch.add_request(rid, ids, output_token_ids=out, num_computed_tokens=len(ids) + len(out) - 1 if out else 0,
                            block_ids=range(next_block, next_block + num_blocks))
    next_block += num_blocks
    if drafts:  # the draft model proposed these last step, writing K/V for all but the last
        draft_ids = tokenizer.encode(drafts, add_bos=False)
        batch.set_spec_tokens(rid, draft_ids)
        proposer_batch.set_drafts(row, draft_ids)
        proposer_batch.num_computed_tokens[row] = len(ids) + len(out) + K - 1
batch.remove_request("c")
batch.set_num_scheduled({rid: 1 + K if drafts else chunk for rid, (_, _, drafts, chunk) in requests.items()
                         if rid != "c"})
lockstep_before = viz.lockstep_rows(batch, proposer_batch, decode_threshold=K + 1)
batch.condense()
_, num_decodes = batch.reorder_split_prefill_and_decode(decode_threshold=K + 1)
lockstep_after = viz.lockstep_rows(batch, proposer_batch, decode_threshold=K + 1)
lockstep_figure = viz.draw_lockstep(lockstep_before, lockstep_after, tokenizer=tokenizer, num_decodes=num_decodes)
lockstep_figure

# %% [markdown]
# `condense()` slides `d`, `e` and `f` up into `c`'s hole; the decode-first scan then
# swaps `b` (a prefill) with `f` (a verify row), so the three verify rows lead and the
# decode kernel gets tokens 0-11. The proposer's fields made the same four moves (same
# arrows, same rows outlined), being fields of the batch that moved: each request's
# draft-model state moved with it. Its
# numbers differ from the main batch's on purpose: the draft model's cache is ahead of
# the target's (request `a`: 14 against 11, `k` = 3 ahead), because while proposing it ran
# the newest token and wrote the K/V of its first `k - 1` drafts, which the target computes
# only in this step. After the target verifies, the draft's count rolls
# back to what the target kept (`ProposerInputBatch.num_computed_tokens`), as the
# target's own `num_computed_tokens` rolls back past rejected drafts.
#
# The same holds in the running engine. Below, six requests share a budget of 16 tokens
# with `reorder=True`, so verify rows and prompt chunks meet in one step and the reorder
# has work to do. The proposer's view reads the runner's own batch
# (`llm.proposer.batch.main is llm.runner.batch`), so there is no second copy to fall out
# of step; after every step we keep both halves of every row in the order the step ran
# them. Both halves of a row show the same moment, the step's start: the main batch still
# holds its counts as the step began (the next step's message updates them), and for the
# proposer we take its counts and drafts just before the step
# (`viz.draft_state`), so its column shows the drafts this step verifies, as in the
# picture above (request `a`: 14 against 11).

# %%
live_prompts = ["count 3", "the big dog ran to the old red house and sat down by the road.", "12+7=",
                "is the fox", "a happy girl sang near the tree and the small bird sang too.", "count 80"]
live_spec = {"method": "draft", "num_speculative_tokens": K, "model": draft_model}
with fleetlab.LLM(model, tokenizer, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, reorder=True,
                  record_traces=True, speculative_config=live_spec) as live:
    for p in live_prompts:
        live.add_request(p, fleetlab.SamplingParams(max_tokens=16))
    live_frames = []
    while live.has_unfinished_requests():
        as_began = viz.draft_state(live.proposer.batch)  # the draft model's counts and drafts before the step
        live.step()
        assert live.proposer.batch.main is live.runner.batch  # one set of rows: nothing to replay
        live_frames.append(viz.lockstep_rows(live.runner.batch, live.proposer.batch, decode_threshold=K + 1,
                                             proposer_state=as_began))
    live_traces = live.traces
moves = [t.step for t in live_traces if t.order_before != t.order_after]
print(f"{len(live_traces)} steps, each row's draft state with its request; the reorder moved rows in steps {moves}")
for t in live_traces:
    if t.step in moves:
        print(f"  step {t.step}: rows before the reorder {t.order_before} -> after {t.order_after}")


def live_frame(i, fig=None):
    t = live_traces[i]
    return viz.draw_lockstep(None, live_frames[i], tokenizer=tokenizer, num_decodes=t.num_decodes, fig=fig,
                             title=f"step {t.step} as it began, rows as it ran them: before the reorder "
                                   f"{t.order_before}, after {t.order_after}")


live_strip = Figure(figsize=(13, 5.2), layout="constrained")
for panel, i in zip(live_strip.subfigures(2, 1), (5, 7)):
    live_frame(i, fig=panel)
live_strip

# %% [markdown]
# Above, steps 5 and 7. In step 7 requests 2 and 3 each verify three drafts (4 tokens) and
# request 4 runs an 8-token chunk of its long prompt; the reorder swapped rows 1 and 2 so
# both verify rows lead, and the proposer's rows went with them. Each verify row's draft
# model is `k` = 3 tokens ahead of the target, as request `a` was above. (In step 5 a 4-token chunk of
# a prompt counts as a decode: to the kernels a row of at most `k + 1` query tokens is one,
# whatever its history, as notebook 04 showed for 1-token chunks.)
#
# Every step in a player (it starts at step 7; press play or drag the slider), its frames
# timed on this machine against the play interval:

# %%
live_player = viz.player(live_frame, len(live_frames), start=7, interval_ms=1000)
live_player

# %%
frame_s = viz.time_frames(live_player, range(len(live_frames)))
print(f"a frame takes {np.median(frame_s):.2f} s to draw and render here (the median of {len(frame_s)}; "
      f"the slowest {max(frame_s):.2f} s); play shows one every {live_player.play.interval / 1000:.1f} s")

# %% [markdown]
# ## 4. How many drafts? Acceptance and forwards against `k`
#
# More drafts per step can save more target forwards, but each extra draft is less likely
# to be accepted: draft `i` counts only if drafts `1..i-1` were accepted too. Below, the
# same prompts (kinds the model was trained on: counting and sentences) at each `k` from 1
# to 8, measured now on this machine. *Target forwards per output token* is counted per
# request: the steps a request was scheduled in, divided by the tokens it got (1.0 without
# speculation, for a prompt that fits one step). The figure after the numbers is drawn at
# `k = 4`; the slider after it draws each `k`'s acceptance by draft position.

# %%
sweep_prompts = [tokenizer.encode(p) for p in trained_prompts(6, 6)]
greedy = fleetlab.SamplingParams(max_tokens=32)
sweep_off = measure(model, sweep_prompts, greedy, block_size=4)
sweep = [measure(model, sweep_prompts, greedy, spec=spec_config("draft", k, draft=draft_model), block_size=4)
         for k in range(1, 9)]
for run in sweep:
    print(f"k={run['k']}: acceptance {run['acceptance_rate']:.2f}, {run['mean_acceptance_length']:.2f} tokens per "
          f"verify step, {run['forwards_per_token']:.2f} target forwards per token, {run['num_steps']} steps, "
          f"same tokens as off: {run['token_ids'] == sweep_off['token_ids']}")
sweep_figure = viz.draw_spec_sweep(sweep, sweep_off, k=4)
sweep_figure

# %%
explore = viz.LiveFigure(lambda k: viz.draw_spec_sweep(sweep, sweep_off, k=k), viz.int_sliders(k=(1, 8, 1, 4)))
explore

# %% [markdown]
# Acceptance falls as `k` grows, from 0.95 at `k = 1` to 0.64 at `k = 8`, though not at
# every step: `k = 5` (0.80) sits above `k = 4` (0.78) in this run (at `k = 4` the four
# positions get 0.97, 0.76, 0.71, 0.68). Yet each step still yields more tokens, so
# target forwards per token keep falling: 0.56 at `k = 1`, 0.33 at `k = 4` (a third of
# plain decoding), 0.26 at `k = 8`. The curve flattens because the answers are short (a
# counting answer is 13 tokens): past `k = 5` most extra drafts would land after the EOS.
#
# Fewer target forwards is not the same as less time. A step now also runs the draft model
# `k` times, and on this tiny model a forward costs mostly fixed overhead per call, so the
# 2-layer draft's forward costs a large fraction of the 4-layer target's. The step traces
# split each step's time:

# %%
for run in (sweep_off, sweep[3]):
    ms = run["ms_per_step"]
    print(f"{run['name']:>9}: {run['num_steps']:>3} steps x {ms['total']:5.1f} ms = {1000 * run['wall_s']:6.1f} ms "
          f"(target forward {ms['forward']:.1f} ms, drafting {ms['propose']:.1f} ms per step)")

# %% [markdown]
# A speculative step costs the target's verify forward (several tokens per row instead of
# one) plus `k` forwards of the draft, and drafting alone costs about as much as the
# target's forward or more. So a third of the steps need not take less time here: compare
# the totals. The saving grows with the gap between the two models: a draft a hundredth
# the size of its target, on a GPU where a decode forward is bound by reading the weights,
# costs a few percent of a target forward. `python -m fleetlab bench spec` measures the
# wall-clock speed-up properly (interleaved rounds, both proposers, a repetitive workload
# for prompt lookup); README's *Speculative decoding* section has its figures.
#
# ## 5. Sampling: rejection sampling keeps the target's distribution
#
# Greedy verification is easy: accept a draft when it is the target's argmax. With
# sampling, accepting only drafts the target *would have drawn* is not enough: which token
# it would have drawn is random. Leviathan et al. (2023) and Chen et al. (2023) accept
# draft `x` with probability `min(1, p(x) / q(x))`, where `p` is the target's distribution
# and `q` the proposer's; on rejection they draw from the residual `max(0, p - q)`,
# renormalized. Then, for every token `y`,
#
# P(output = y) = q(y) min(1, p(y)/q(y)) + P(reject) max(0, p(y) - q(y)) / Σ max(0, p - q) = p(y),
#
# because the first term is `min(q(y), p(y))`, and `P(reject) = 1 - Σ min(p, q) = Σ max(0, p - q)`:
# the output is distributed exactly as the target's own sample, whatever the proposer is.
# fleetlab's proposers draft greedily, so `q` is a point mass on the draft `d`: accept `d`
# with probability `p(d)`, else draw from `p` without `d`.
#
# Check it: after `"the old man sat"` the model writes a space, then the first letter of a
# preposition (*by*, *on*, *near*, *under*), a real four-way choice. 2,000 seeded samples
# at temperature 1 with speculation off and 2,000 with the draft model proposing that
# letter (`k = 1`), against `p` read from the model's own logits:

# %%
from collections import Counter

from fleetlab.patching.parity import full_forward_logits

context = "the old man sat"
space = tokenizer.encode(" ", add_bos=False)[0]
logits = full_forward_logits(model, tokenizer.encode(context + " "))[-1]  # the model's own forward, unpatched
probs = np.exp(logits - logits.max())  # temperature 1 (token_histogram normalizes)
num_samples = 2000
sampling_runs = {"speculation off": (None, 0),
                 "draft model, k = 1": ({**draft_spec, "num_speculative_tokens": 1}, 10**6)}
letters = {}
for label, (spec, first_seed) in sampling_runs.items():
    sps = [fleetlab.SamplingParams(max_tokens=3, temperature=1.0, seed=first_seed + i, ignore_eos=True)
           for i in range(num_samples)]
    with fleetlab.LLM(model, tokenizer, block_size=4, max_num_seqs=256, max_num_batched_tokens=2048,
                      record_traces=spec is not None, speculative_config=spec) as sampler_llm:
        outs = sampler_llm.generate([context] * num_samples, sps, use_tqdm=False)
        if spec is not None:
            drafted = Counter(viz.token_label(r.draft_token_ids[0], tokenizer) for t in sampler_llm.traces
                              for r in t.rows if r.draft_token_ids)
            sampled_acceptance = sampler_llm.stats()["spec_acceptance_rate"]
    # the letter after the space (the first token is a space in all but a handful of samples)
    letters[label] = [o.token_ids[1] for o in outs if o.token_ids[0] == space]
hist = viz.token_histogram(letters, probs)
print(f"drafts proposed: {dict(drafted)}; accepted {sampled_acceptance:.0%}")
histogram = viz.draw_token_histogram(hist, tokenizer, title=f"the letter after {context!r} + ' '")
histogram

# %% [markdown]
# The draft model proposed `o` (*on*) in 1,998 of the 2,000 samples, and the target accepted
# it in 28% of them, as often as its own `p('o') = 0.28` says. When it rejected `o` it drew
# from the residual, `p` with `o` taken out and renormalized, so rejected rows gave `b`, `n`
# and `u` in proportion to `p`, and never `o`. Together they match the target's
# probabilities as closely as plain sampling does: both chi-square statistics are far below
# the 0.1% critical value. A wrong rule would not: accepting every draft gives `o` every
# time, and redrawing from `p` itself after a rejection gives `o` too often
# (`tests/test_spec_decoding.py` checks that its chi-square test catches both).
#
# The rule is three small functions of `RejectionSampler`, read from the installed package.
# `draw` takes two uniforms per sampled position (`u[:, 0]` to draw a token, `u[:, 1]` to
# accept), reads `p(draft)` from the probabilities, and returns both the redrawn token and
# the accept bit; `accept` is the whole acceptance test for a point-mass draft, `u < p(draft)`;
# `residual` is `max(0, p - q)` for that `q`: `p` with the draft's entry zeroed
# (`inverse_cdf` renormalizes as it draws).

# %%
from IPython.display import display

from fleetlab.spec_decode.rejection import RejectionSampler

rejection_sources = {name: viz.show_source(getattr(RejectionSampler, name), body_only=True)
                     for name in ("draw", "accept", "residual")}
for excerpt in rejection_sources.values():
    display(excerpt)

# %% [markdown]
# > **In vLLM / FastDeploy**
# >
# > - **Configuration**: fleetlab's `speculative_config` names follow both engines.
# >   vLLM's `SpeculativeConfig` has `method`, `num_speculative_tokens`,
# >   `prompt_lookup_min` / `prompt_lookup_max`; FastDeploy's has `method`,
# >   `num_speculative_tokens`, `num_model_steps`, `min_ngram_size` / `max_ngram_size`.
# > - **Proposers**: fleetlab's `Proposer` registry (`fleetlab/spec_decode/proposer.py`) with
# >   `NgramProposer` and `DraftModelProposer`. vLLM v1: `NgramProposer`
# >   (`vllm/v1/spec_decode/ngram_proposer.py`: the longest suffix match found by a KMP
# >   scan, at its earliest occurrence), `DraftModelProposer` (`draft_model.py`),
# >   `EagleProposer` (`eagle.py`, drafting from the target's hidden states). FastDeploy:
# >   `Proposer` (`fastdeploy/spec_decode/base.py`), `NgramProposer` (`ngram.py`, the
# >   `ngram_match` op) and `MTPProposer` (`mtp.py`: a multi-token-prediction layer with
# >   its own KV cache).
# > - **The proposer's batch**: fleetlab's `ProposerInputBatch` is a group of fields the
# >   proposer registers on the main `InputBatch`, moved by its one row move. FastDeploy's `ProposerInputBatch`
# >   (`fastdeploy/worker/input_batch.py`), which `MTPProposer` builds from the target's
# >   batch, swaps its rows through its own hand-written `swap_states` list, the kind of list
# >   that can forget a buffer. vLLM's proposers keep no per-request batch that must be
# >   reordered: they gather their inputs from the runner's batch and the step's metadata.
# > - **Verify rows are decodes**: fleetlab's `decode_threshold = k + 1`; vLLM's attention
# >   metadata builders set `reorder_batch_threshold = 1 + num_speculative_tokens`;
# >   FastDeploy's reorder counts a row as a decode when its `seq_lens_encoder` is 0.
# > - **Verification**: fleetlab's `RejectionSampler` (`draw`, `accept`, `residual`); vLLM's
# >   `RejectionSampler` (`vllm/v1/sample/rejection_sampler.py`: bonus tokens, recovered
# >   tokens drawn from `max(0, p - q)`); FastDeploy's `speculate_verify` op.
# > - **Scheduling**: fleetlab uses vLLM's names: `SchedulerOutput.scheduled_spec_decode_tokens`,
# >   `KVCacheManager.allocate_slots(..., num_lookahead_tokens)`, and rejected drafts come
# >   off `num_computed_tokens` when the scheduler takes the runner's output.
# > - **Metrics**: fleetlab's `stats()` keys match vLLM's `SpecDecodingStats`
# >   (`vllm/v1/spec_decode/metrics.py`: `num_drafts`, `num_draft_tokens`,
# >   `num_accepted_tokens`, `num_accepted_tokens_per_pos`).

# %% [markdown]
# ## Try next
#
# - Section 1 with `{"method": "draft", "num_speculative_tokens": 8, ...}`: how many steps
#   now, and where do the extra drafts land?
# - Sample instead of greedy (`temperature=0.8, seed=...`): acceptance drops, the texts
#   change, their distribution does not.
# - In section 2's looping example, set `prompt_lookup_min` and `prompt_lookup_max` to 1:
#   a one-token suffix matches far more often. Do more drafts get accepted, or fewer?
# - Register your own proposer (`fleetlab.spec_decode.proposer.register_proposer`), say one that
#   always proposes a space: what acceptance does it get on sentences?
# - Next notebook: **09_tensor_parallel**.
