# %% [markdown]
# # 11 · Structured outputs: a grammar's mask, kept in the row
#
# **You will learn** how an engine makes a model write JSON that fits a schema (or text that
# matches a regular expression, or one of a list of choices), and where it keeps what that needs:
#
# - the **token bitmask**: at every step a request's grammar **matcher** says which tokens may
#   come next, and the sampler sets every other logit to `-inf` before it picks, greedy or not;
# - the matcher is per-request state like any other: a field of the **InputBatch** row, so it
#   moves with its row through condense, the decode-first reorder and preemption;
# - with **speculative decoding**, each draft position gets its own mask: a draft the grammar
#   refuses is rejected by it, and the matcher only ever keeps the tokens the scheduler committed;
# - where vLLM and FastDeploy keep the same state.

# %%
# %matplotlib inline
import json

import jsonschema
import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab import LLM, SamplingParams
from fleetlab.lab import viz
from fleetlab.lab.viz import structured as sviz
from fleetlab.structured_output.backend import GrammarMatcher
from fleetlab.structured_output.examples import SCHEMAS
from fleetlab.structured_output.processor import StructuredOutputsProcessor

# %% [markdown]
# ## 1. A vocabulary that can spell the output
#
# A grammar can only choose among the tokens the model has. The shipped tiny model writes one
# character per token, and its alphabet has no `{`, `}`, `"`, `[` or `]`: it cannot write JSON at
# all. The engine finds that out when it compiles the constraint, and refuses the request at once,
# naming what is missing, instead of letting it run to `max_tokens`:

# %%
shipped_model, shipped_tokenizer = fleetlab.models.load_tiny()
with LLM(shipped_model, shipped_tokenizer) as llm:
    try:
        llm.generate(["1+1="], SamplingParams(structured_outputs={"json_object": True}), use_tqdm=False)
    except ValueError as err:
        refusal = str(err)
print(refusal)

model, tokenizer = fleetlab.models.tiny_json()
vocab_size = tokenizer.vocab_size
labels = sviz.token_labels(tokenizer, vocab_size)
print(f"tiny_json: {vocab_size} tokens: 4 special ones, then {tokenizer.chars!r}")

# %% [markdown]
# So this notebook uses `fleetlab.models.tiny_json()`: a tiny Llama with **random weights** over
# the shipped alphabet plus upper case and `{}[]"_\`. Unconstrained it writes noise; constrained,
# it can only write what the grammar allows, so every output it finishes is valid, whatever its
# weights.
#
# ## 2. One request, step by step
#
# `SamplingParams(structured_outputs=...)` takes vLLM's fields: `json` (a schema), `regex`,
# `choice`, `grammar` or `json_object`. Here a schema with a name of at most 8 characters and an
# age from 0 to 120, written compactly (`disable_any_whitespace`: a random model would otherwise
# write whitespace for ever, which JSON allows). After every step we read the row's
# `grammar_bitmask` field, the mask the sampler just used, one bit per token.

# %%
person = {"json": SCHEMAS["person"], "disable_any_whitespace": True}
print(json.dumps(SCHEMAS["person"]))
with LLM(model, tokenizer, block_size=4) as llm:
    rid = llm.add_request("name and age: ", SamplingParams(max_tokens=64, structured_outputs=person))
    masks, chosen = [], []
    while llm.has_unfinished_requests():
        outputs = llm.step()
        if not outputs:  # nothing ran: the request waited for its grammar to compile
            continue
        (out,) = outputs
        batch = llm.runner.batch
        masks.append(sviz.allowed_tokens(batch.np("grammar_bitmask")[batch.row_of(rid), 0], vocab_size))
        chosen.append(out.new_token_ids[0])
masks = np.array(masks)
jsonschema.validate(json.loads(out.text), SCHEMAS["person"])
print(f"{out.text!r} ({out.finish_reason}), valid for the schema; {len(masks)} steps")
mask_figure = sviz.draw_mask_steps(masks, chosen, labels)
mask_figure

# %% [markdown]
# One row per step, the whole vocabulary across. Where the grammar leaves no choice, the mask
# allows exactly one token and the model's preference does not matter: `{"name":"` is forced
# character by character (steps 0-8). Inside the string the mask opens to 83 tokens, every
# character but the newline (a JSON string cannot hold a raw control character), and the random
# model picks `Z` eight times; after the eighth, `maxLength` leaves only the closing `"`. The age
# allows digits, then after `44` only `}`: a third digit would pass 120. Last, the output is
# complete and the mask allows EOS alone.
#
# The masking is a logits processor the sampler calls before temperature, top-k and top-p. Its
# code, read from the package as it runs:

# %%
mask_source = viz.show_source(StructuredOutputsProcessor.__call__)
mask_source

# %% [markdown]
# Unconstrained steps pay one comparison over the rows' `structured_output` field. In a step with
# constrained rows, the masks of all of them go to the device in **one** upload, and only those
# rows of the logits are touched (`apply_token_bitmask` gathers them, masks, scatters back).
#
# ## 3. The grammar state moves with its row
#
# A request's grammar state (its compiled grammar and its matcher) is one Python object, a
# `StructuredOutputRequest`, that the request carries from arrival. The runner writes it into the
# row's `structured_output` field, an *object field* of the InputBatch: every row move (condense,
# the decode-first reorder) moves it like any other field. Below, request `a` finishes, so the
# late request `d` takes its row 0 with a prefill, and the reorder puts the decodes first: the
# constrained `c` moves from row 2 to row 0.

# %%
with LLM(model, tokenizer, block_size=4, max_num_batched_tokens=16, reorder=True, record_traces=True) as llm:
    llm.add_request("hi ", SamplingParams(max_tokens=3), request_id="a")
    llm.add_request("12+7=", SamplingParams(max_tokens=20), request_id="b")
    llm.add_request("name and age: ", SamplingParams(max_tokens=64, structured_outputs=person), request_id="c")
    compiling = llm.scheduler.requests["c"].waiting_on
    if compiling is not None:  # wait for c's grammar: the same steps on a busy machine as on an idle one
        compiling.result()
    while "a" in llm.scheduler.requests or not llm.traces:
        llm.step()
    llm.add_request("a prompt that arrives late", SamplingParams(max_tokens=4), request_id="d")
    batch = llm.runner.batch
    state_c, row_before = batch.np("structured_output")[batch.row_of("c")], batch.row_of("c")
    llm.step()
    trace = llm.traces[-1]
    phases = {r.request_id: r.phase for r in trace.rows}
    rows = {}
    for rid in trace.order_after:
        state = batch.np("structured_output")[batch.row_of(rid)]
        kind = "no constraint" if state is None else f"{state.params.kind} grammar"
        rows[rid] = (rid, f"{phases[rid]}, {kind}", state is not None)
    row_after = batch.row_of("c")
    same_object = batch.np("structured_output")[row_after] is state_c is llm.scheduler.requests["c"].extra[
        "structured_output"]
print(f"step {trace.step}: rows before the reorder {trace.order_before}, after {trace.order_after}")
print(f"c: row {row_before} -> row {row_after}; the same StructuredOutputRequest object: {same_object}")
rows_figure = sviz.draw_rows_moving([rows[r] for r in trace.order_before], [rows[r] for r in trace.order_after])
rows_figure

# %% [markdown]
# The object moved; nothing was copied or rebuilt. **Preemption** is the same story: a preempted
# request leaves the batch, and when it comes back the scheduler resends it in full, with the same
# object in its batch fields. Its matcher has kept exactly the tokens the request had committed,
# so the recomputed request goes on where it was. Here a pool of 24 blocks of 4 tokens cannot
# hold four requests at once:

# %%
class Resends:
    """An observer: each request the scheduler resends with tokens already committed."""

    def __init__(self, llm):
        self.llm, self.seen = llm, []

    def on_step(self, scheduler_output, runner_output, outputs):
        for new in scheduler_output.scheduled_new_reqs:
            state = new.extra.get("structured_output")
            if new.output_token_ids and state is not None:
                self.seen.append((scheduler_output.step, new.req_id, len(new.output_token_ids),
                                  state.matcher.num_accepted_tokens, state is self.llm.scheduler.requests[
                                      new.req_id].extra["structured_output"]))


with LLM(model, tokenizer, block_size=4, num_blocks=24) as llm:
    resends = Resends(llm)
    llm.observers.append(resends)
    preempted = llm.generate([f"request {i}: " for i in range(4)],
                             SamplingParams(max_tokens=40, structured_outputs=person), use_tqdm=False)
    num_preemptions = llm.stats()["num_preemptions"]
for step, rid, committed, in_matcher, same in resends.seen:
    print(f"step {step}: request {rid} resent with {committed} committed tokens; its matcher holds "
          f"{in_matcher}; the same object: {same}")
print(f"{num_preemptions} preemptions; outputs: {[o.text for o in preempted]}")

# %% [markdown]
# ## 4. Speculative decoding: one mask per draft position
#
# A verify row scores `k + 1` positions: after the last token, and after each of the `k` drafts.
# Each position needs the mask of the grammar *after the drafts before it*. So the matcher accepts
# the drafts the grammar allows, fills a mask after each, and rolls them back (llguidance's
# `rollback`) before anything is sampled:

# %%
drafts_source = viz.show_source(GrammarMatcher.fill_bitmask_with_drafts)
drafts_source

# %% [markdown]
# A draft the grammar refuses gets no bit in its own position's mask, so the target can never
# accept it (greedy: it is not the argmax of the masked logits; sampled: its probability is 0),
# and the masks after it are never used. To see it, the draft model below has the target's own
# weights but no grammar: it proposes what the model would write unconstrained.

# %%
draft_model, _ = fleetlab.models.tiny_json()
spec = {"method": "draft", "model": draft_model, "num_speculative_tokens": 4}


class VerifyRows:
    """An observer: every verify row's drafts, masks and result, and what its matcher holds after."""

    def __init__(self, llm):
        self.llm, self.rows = llm, []

    def on_step(self, scheduler_output, runner_output, outputs):
        batch = self.llm.runner.batch
        for r in self.llm.traces[-1].rows:
            if r.draft_token_ids:
                row = batch.row_of(r.request_id)
                self.rows.append({"step": scheduler_output.step, "drafts": list(r.draft_token_ids),
                                  "accepted": r.num_accepted_tokens, "kept": list(r.token_ids),
                                  "masks": sviz.allowed_tokens(batch.np("grammar_bitmask")[row], vocab_size),
                                  "in_matcher": batch.np("structured_output")[row].matcher.num_accepted_tokens,
                                  "committed_before": r.num_computed_tokens - r.num_prompt_tokens + 1})


with LLM(model, tokenizer, block_size=4, record_traces=True, speculative_config=spec) as llm:
    watch = VerifyRows(llm)
    llm.observers.append(watch)
    (spec_out,) = llm.generate(["name and age: "], SamplingParams(max_tokens=64, structured_outputs=person),
                               use_tqdm=False)
    spec_stats = llm.stats()
print(f"with speculation: {spec_out.text!r}; without: {out.text!r}; the same: {spec_out.text == out.text}")
print(f"drafts {spec_stats['num_draft_tokens']}, accepted {spec_stats['num_accepted_tokens']}")
for v in watch.rows:
    v["refused"] = [i + 1 for i, d in enumerate(v["drafts"]) if not v["masks"][i, d]]  # 1-based draft numbers
    print(f"step {v['step']:2d}: drafts {''.join(labels[t] for t in v['drafts'])!r:8} accepted {v['accepted']}, "
          f"kept {''.join(labels[t] for t in v['kept'])!r:8} grammar refused draft {v['refused'] or '-'}")

# %% [markdown]
# The same text as without speculation. Most steps keep one token: the unconstrained drafts
# (mostly `Z`) are refused by the grammar at once, and the position's own mask picks the token.
# Two steps show all of it: one in which the grammar allows three of the four drafts, and one in
# which it allows the first and refuses the second. Drawn for the first of them, the step's masks
# as the row's `grammar_bitmask` field holds them:

# %%
verify = next(v for v in watch.rows if v["accepted"] >= 2 and v["refused"])
verify_figure = sviz.draw_verify_masks(verify["masks"], verify["drafts"], verify["accepted"], verify["kept"], labels)
print(f"step {verify['step']}: the matcher holds {verify['in_matcher']} tokens after the step, the request's "
      f"{verify['committed_before']} committed before it")
verify_figure

# %% [markdown]
# The name already had five `Z`s, so three more drafts fit in `maxLength` 8: their positions'
# masks allow them (green rings), the target agrees and keeps them. After the eighth character the
# grammar allows only `"`, so the fourth draft is refused by its own mask (red ring) and the
# target writes `"` there; the last mask row is all ones and never used. During the step the
# matcher took the three drafts to fill the masks after them, then **rolled them back**: after the
# step it holds only the tokens committed before it. It takes this step's four at the next step,
# from the row's committed output (`StructuredOutputRequest.matcher_at`), so a draft the target
# rejected never enters it.
#
# > **In vLLM / FastDeploy** the same state lives elsewhere, and the difference is instructive.
# > **vLLM** (`vllm/v1/structured_output/`) keeps each request's grammar with the *scheduler's*
# > `Request` (`request.structured_output_request.grammar`: first the future of its compile on the
# > `StructuredOutputManager`'s thread pool; the request sits in `WAITING_FOR_FSM` and the
# > scheduler admits the others meanwhile). Each step the scheduler fills the bitmask
# > (`StructuredOutputManager.grammar_bitmask`, one row per draft position plus one, with the same
# > accept-fill-rollback walk over the drafts) and sends it with the request ids; the GPU runner
# > (`apply_grammar_bitmask`) maps ids to its InputBatch rows and masks the logits. The matcher
# > advances in the scheduler, on the tokens it commits. **FastDeploy** keeps the matchers in its
# > sampler (`fastdeploy/model_executor/layers/sample/sampler.py`: `GuidedDecoding.logits_processors`,
# > one slot per batch index, each the future of its compile until done), fills the token bitmask by
# > slot, and accepts each step's sampled token there (`update_output_tokens`); its backends are
# > xgrammar and llguidance (`fastdeploy/model_executor/guided_decoding/`). fleetlab keeps the
# > matcher in the row itself, so it moves with condense and reorder like the block table does, and
# > brings it to the row's committed tokens each step.
#
# ## Try next
#
# - Swap `person` for `{"regex": "[0-9]{3}-[a-z]{2}"}` or `{"choice": ["yes", "no"]}` in section 2,
#   or for a schema of your own (`SCHEMAS` has four more), and watch the masks.
# - Drop `disable_any_whitespace` and give it `max_tokens=64`: where does the random model spend
#   its tokens?
# - Run `python -m fleetlab bench structured`: compile time per schema, the cost of a mask, and the
#   time per step with 0 %, 25 % and 100 % of the rows constrained.
# - Serve the JSON model (`fleetlab.serving.ServerThread`) and ask it with the `openai` client's
#   `response_format`, as `tests/test_serving_structured.py` does.
