# %% [markdown]
# # 12 · Read the engine: one request, function by function
#
# **You will learn** the path one request takes through fleetlab's own source, by calling
# each function yourself and looking at what it changed:
#
# 1. the front door and the checks at the edge (`LLM.add_request`, `InputProcessor.process`);
# 2. the plan: `Scheduler.schedule`, the blocks it takes (`KVCacheManager.allocate_slots`) and
#    the message it sends (`SchedulerOutput`);
# 3. the run: `ModelRunner.execute`, one move at a time (`update_batch`, `prepare_inputs`,
#    `forward`, `sample`), with the step's metadata and the attention that reads it;
# 4. the commit: `Scheduler.update` and the `RequestOutput` it hands back;
# 5. the name of each part in vLLM and FastDeploy, with its file.
#
# Every excerpt below is read from the installed package when the cell runs, with its file
# and line numbers (`viz.show_source`): open the file at that line and read on. The other
# notebooks explain each piece with pictures; this one strings them together in the order a
# request meets them (`python tools/read_the_engine.py` prints the same order as a table of
# files).

# %%
# %matplotlib inline
import numpy as np
from IPython.display import display

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab import LLM, SamplingParams
from fleetlab.attention.context import ForwardContext
from fleetlab.attention.naive import naive_paged_attention
from fleetlab.edge.input_processor import InputProcessor
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.sampler import Sampler
from fleetlab.inspect.batch import batch_snapshot
from fleetlab.inspect.pool import pool_snapshot
from fleetlab.kv.manager import KVCacheManager
from fleetlab.lab import viz

# %% [markdown]
# ## 0. An engine that has served a little
#
# The tiny trained model on a small engine: blocks of 4 tokens, 12 of them, at most 16
# tokens and 4 rows a step, and `backend="naive"`, the attention written to be read (section
# 7 shows it). Two prompts served first leave the pool the way a busy one looks: blocks
# freed in no particular order, some still holding a cached prefix. Then request **a**
# (`45+38=`) arrives and runs its first step, so it is decoding when the request we follow
# arrives.

# %%
model, tokenizer = fleetlab.models.load_tiny()
llm = LLM(model, tokenizer, block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4,
          backend="naive")
earlier = llm.generate(["count 3 4 5 6", "the dog ran to"], SamplingParams(max_tokens=8), use_tqdm=False)
llm.add_request("45+38=", SamplingParams(max_tokens=4), request_id="a")
llm.step()
print(llm.pool)

# %% [markdown]
# ## 1. The front door: `LLM.add_request`
#
# Three lines: check everything the user sent (`self.processor.process`, which returns the
# scheduler's `Request`), fan a request with `n > 1` out into children (`_fan_out`; here
# `n = 1`, so the request itself), queue it.

# %%
viz.show_source(LLM.add_request, body_only=True)

# %% [markdown]
# `InputProcessor.process` (`fleetlab/edge/input_processor.py`) is every check, once, at the edge: the
# id, the prompt's tokens, the sampling parameters bounded by what the engine can hold, the
# extra fields. The core behind it trusts what passes and never checks again.

# %%
viz.show_source(InputProcessor.process, body_only=True)

# %% [markdown]
# A request that cannot run is refused here, with a `ValueError` naming the request and the
# field, before anything is queued: a token the vocabulary lacks, and `max_tokens` that
# could never fit the 12-block pool.

# %%
refusals = []
for bad in (dict(prompt_token_ids=[1, 5, 999], sampling_params=SamplingParams(max_tokens=4)),
            dict(prompt="12+7=", sampling_params=SamplingParams(max_tokens=100))):
    try:
        llm.add_request(request_id="bad", **bad)
    except ValueError as err:
        refusals.append(str(err))
        print("ValueError:", err)
print("waiting:", [r.request_id for r in llm.scheduler.waiting])

# %% [markdown]
# Now the request we follow, **b**: `12+7=`, 6 tokens with `<bos>`. What the scheduler
# holds of it is a `Request` in its waiting queue, with nothing computed yet.

# %%
llm.add_request("12+7=", SamplingParams(max_tokens=4), request_id="b")
b = llm.scheduler.requests["b"]
print({name: getattr(b, name) for name in ("request_id", "prompt_token_ids", "num_computed_tokens", "status")})
print("prompt, token by token:", [tokenizer.decode([t]) or "<bos>" for t in b.prompt_token_ids])

# %% [markdown]
# ## 2. The plan: `Scheduler.schedule`
#
# `LLM.step` would now call `schedule()`, `execute()` and `update()`. We call them ourselves.
# `schedule` gives each running request its next tokens first (`_schedule_running`), then
# admits waiting requests while the budget, the rows and the pool allow
# (`_schedule_waiting`), and fills in the message for the runner (`_fill_request_data`).

# %%
viz.show_source(fleetlab.Scheduler.schedule, body_only=True)

# %% [markdown]
# The admission loop: the policy picks the next request (`admission_key`), the prefix cache
# says how many of its tokens are already in the pool (`get_computed_blocks`), the budget
# caps its chunk (`n = min(remaining, budget)`), and `allocate_slots` either finds the blocks
# or returns None, and the loop stops.

# %%
viz.show_source(fleetlab.Scheduler._schedule_waiting, start="req = min(", stop="self._schedule(req, n, out)")

# %%
plan = llm.scheduler.schedule()
print("num_scheduled_tokens:", plan.num_scheduled_tokens, "| total:", plan.total_num_scheduled_tokens,
      "of the budget", llm.scheduler.max_num_batched_tokens)

# %% [markdown]
# Request **a** runs 1 token (a decode), and **b** its whole 6-token prompt (a prefill): 7
# tokens of the 16 the step may take, so nothing is chunked. Nothing of `12+7=` was cached,
# so **b** starts from 0.
#
# ## 3. The blocks: `KVCacheManager.allocate_slots`
#
# `allocate_slots` counts the blocks the request will hold once this step's tokens are in,
# refuses (None, changing nothing) if the pool cannot give them, takes a reference on any
# prefix-cache hits, allocates the rest and registers the blocks that will be full of known
# tokens in the prefix cache.

# %%
viz.show_source(KVCacheManager.allocate_slots, body_only=True)

# %%
tables, pool_now, pool_stats = llm.block_tables(), pool_snapshot(llm.pool), fleetlab.inspect.pool.pool_stats(llm.pool)
print("block tables:", tables)
print(llm.pool)
tokens_after = {rid: llm.scheduler.requests[rid].num_computed_tokens + n
                for rid, n in plan.num_scheduled_tokens.items()}
mapping_figure = viz.draw_block_mapping(tables, pool_now, num_tokens=tokens_after, block_size=4)
mapping_figure

# %% [markdown]
# Request **b**'s 6 tokens need 2 blocks (its second one 2/4 full). The pool hands out blocks
# from the head of its free queue, the ones freed longest ago, not in id order: **b** got
# blocks 3 and 2, which still held cached prefixes of the earlier prompts, so the pool
# dropped those (2 evictions). The other grey dotted blocks are free but still cached; the
# white one is free and empty.
#
# ## 4. The message: `SchedulerOutput`
#
# The runner never sees the scheduler's `Request`. It gets a message with each new request
# in full (`scheduled_new_reqs`, sent once) and, for requests it already holds, only what
# changed (`scheduled_cached_reqs`): the token **a** sampled in the previous step (`8`), new
# block ids (none: its 8th token still fits in its second block) and the computed count.

# %%
new = plan.scheduled_new_reqs[0]
print("new:   ", {k: getattr(new, k) for k in ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens")})
print("cached:", plan.scheduled_cached_reqs)

# %% [markdown]
# ## 5. The run: `ModelRunner.execute`, one move at a time
#
# `execute` is two halves: `prepare`, the host's (apply the message to the persistent batch,
# build the step's inputs and sampling settings), then `run`, the model's (run the model,
# sample; then, with speculative decoding, draft the next tokens). The overlapped loop of
# notebook 14 runs the two halves on two threads; here they run one after the other.

# %%
viz.show_source(ModelRunner.prepare, body_only=True)

# %%
viz.show_source(ModelRunner.run, body_only=True)

# %% [markdown]
# `update_batch` drops rows the plan does not schedule, adds **b** in a new row, writes
# **a**'s new token into its row, condenses and (for backends that ask) reorders the rows
# decode-first. Here the naive backend does not ask, so the order stays: **a** in row 0,
# **b** in row 1. The rows before the reorder are what the runner shows its observers
# (`llm.hooks`, the `on_batch_order` point); after it, the batch's own order.

# %%
class RowOrder:
    """An observer of the runner's rows, condensed, before the decode-first reorder."""

    def on_batch_order(self, req_ids):
        self.req_ids = req_ids


row_order = RowOrder()
llm.hooks.attach(row_order)
result = llm.runner.update_batch(plan)
llm.hooks.detach(row_order)
rows = batch_snapshot(llm.runner.batch)
order_before, order_after = row_order.req_ids, llm.runner.batch.req_ids
print("rows before / after the reorder:", order_before, order_after)
rows_figure = viz.draw_batch(rows)
rows_figure

# %% [markdown]
# ## 6. The step's inputs: `prepare_inputs` and `AttentionMetadata.from_batch`
#
# `prepare_inputs` packs every scheduled token of every row into one sequence `[1, T]` and
# builds the metadata attention will read. The heart of it is a few numpy lines in
# `AttentionMetadata.build`: each token's row, its position in its request, and the cache
# slot its K/V go to, `block_table[p // block_size] * block_size + p % block_size`.

# %%
viz.show_source(fleetlab.AttentionMetadata.build, start="row_of_token =", stop="slot_mapping =")

# %%
inputs = llm.runner.prepare_inputs()
md = inputs.metadata
packed_ids = inputs.input_ids.numpy()[0]
row_of_token = md.token_rows_host  # each packed token's batch row
print(f"{'token':>6} {'row':>4} {'request':>8} {'position':>9} {'slot':>5}")
for tid, row, pos, slot in zip(packed_ids, row_of_token, md.positions.numpy(), md.slot_mapping.numpy()):
    print(f"{tokenizer.decode([int(tid)]) or '<bos>':>6} {row:>4} {rows[row].req_id:>8} {pos:>9} {slot:>5}")
print("cu_seqlens_q:", md.cu_seqlens_q_host, "| seq_lens_kv:", md.seq_lens_kv_host)
print("block_tables:", md.block_tables.numpy().tolist())
print("logits_indices (the packed tokens whose logits are computed):", inputs.logits_indices.tolist())

# %% [markdown]
# Seven tokens: **a**'s one decode token at position 7 (its 8th token) and **b**'s prompt at
# positions 0-5, each with its slot. Only two of them are scored: the last token of each row
# (`logits_indices`), the only places a next token is drawn.
#
# ## 7. The forward: `forward_context`, `AttentionBackend.forward`, the naive attention
#
# `ModelRunner.forward` runs the patched model on the packed tokens inside
# `forward_context(metadata, kv_cache)`: the model's own code calls attention with only the
# query, key and value, and attention finds the step through that context. The first layer
# asks the context for the backend's own metadata (`build_metadata`, once per step; every
# later layer gets the same object), then every layer calls the backend's `forward`: write
# this step's K/V into their slots, then attend.

# %%
display(viz.show_source(ForwardContext.attn_metadata, body_only=True))
viz.show_source(fleetlab.AttentionBackend.forward, body_only=True, stop="sinks=sinks)")

# %% [markdown]
# `attend` here is the naive paged attention, row by row. First the cache is seen as one
# row per slot (`keys = key_cache.reshape(...)`), so that a slot number picks a key; then,
# for each row, its query tokens (`cu_seqlens_q`), every position of its context turned
# into a slot through its block table, the keys and values gathered from those slots, a
# causal mask, a softmax.

# %%
naive_excerpt = viz.show_source(naive_paged_attention, start="keys = key_cache.reshape", stop="outputs.append(")
naive_excerpt

# %%
logits = llm.runner.forward(inputs)
top = np.argsort(-logits.numpy(), axis=-1)[:, :3]
probs = np.exp(logits.numpy() - logits.numpy().max(-1, keepdims=True))
probs /= probs.sum(-1, keepdims=True)
for i, row in enumerate(inputs.pos_row):
    ranked = ", ".join(f"{tokenizer.decode([int(t)])!r} {probs[i, t]:.2f}" for t in top[i])
    print(f"row {row} (request {rows[row].req_id}): logits {list(logits.shape)[1:]}, most likely: {ranked}")
key_cache = llm.kv_cache.key_cache(0).numpy().reshape(-1, *llm.kv_cache.key_cache(0).shape[2:])
written = np.abs(key_cache[md.slot_mapping.numpy()]).sum(axis=(1, 2)) > 0
print("layer 0's K written in the step's slots:", written.tolist())

# %% [markdown]
# Logits come back only for the two scored tokens (`[2, 55]`, one row per scored token and
# one column per vocabulary entry): the model is sure of `3` after `45+38=8` and of `1` after
# `12+7=`. Every slot of `slot_mapping` now holds a key in layer 0 (and in every other layer).
#
# ## 8. Sampling: `Sampler.sample`
#
# Both requests are greedy (temperature 0), so the sampler keeps the argmax (`chosen`); rows
# that sample (`~st.greedy`) draw from their probabilities instead, and their draws replace
# the argmax. Everything the step reads back from the device (the tokens, whether each row's
# logits were finite, logprobs when asked for) comes in one copy, `_read`: on a GPU each read
# makes the CPU wait for the device. The other names are the logprobs' (none is asked for
# here): `raw` holds the log-probabilities of the rows that asked for them (computed above
# the excerpt, after a grammar's mask but before temperature and the other
# processors); `taken(...)` gives the token each sampling row took, so that its
# logprob is the one gathered; `lp` is the module that gathers logprobs
# (`fleetlab.engine.logprobs`), and `blocks` the logprob arrays `_read` brings back with
# the tokens.

# %%
sample_excerpt = viz.show_source(Sampler.sample, start="chosen = paddle.argmax", stop="return self._read(")
sample_excerpt

# %%
sampling = llm.runner.sampling_tensors(inputs)  # each scored position's settings, read from its row
llm.runner.sample(logits, inputs, result, sampling)
print("sampled_token_ids:", result.sampled_token_ids,
      {rid: tokenizer.decode(t) for rid, t in result.sampled_token_ids.items()})

# %% [markdown]
# ## 9. The commit: `Scheduler.update` and `RequestOutput`
#
# The runner reported what it computed, keyed by request id. Only the scheduler advances a
# request, in two phases. First `_outcome` works out, changing nothing, what the step does to each
# request: the sampled tokens are looked at one at a time (each may stop the request: EOS, a stop
# token, `max_tokens`), and the KV connector hears which requests retire. Only then does `_commit`
# change anything: `num_computed_tokens` moves past the step's tokens, the tokens are appended, and a
# finished request's blocks go back to the pool. So an extension that raises leaves nothing half done.

# %%
viz.show_source(fleetlab.Scheduler.update, start="redo = requests_to_recompute", stop="return [o for o in outputs")

# %%
viz.show_source(fleetlab.Scheduler._commit, start="rid = req.request_id", stop="return None if tokens")

# %%
outputs = llm.scheduler.update(plan, result)
for out in outputs:
    print(out.request_id, "token_ids", out.token_ids, "new", out.new_token_ids, "finish_reason", out.finish_reason)
b_now = {"num_computed_tokens": b.num_computed_tokens, "output_token_ids": list(b.output_token_ids), "status": b.status}
print("b now:", b_now)

# %% [markdown]
# **b** has computed its 6 prompt tokens and holds its first output token, `1`; **a** has its
# third. These three moves are the engine core's step (`EngineCore.step`), with the observers
# after them (traces, speculative-decoding statistics). `LLM.step` runs it and hands what it
# returns to the output processor beside the core (`fleetlab/output/`): stop strings cut,
# logprobs attached, the children of an `n > 1` request folded back into their parent, and
# the text of finished requests.

# %%
from fleetlab.engine.core import EngineCore

display(viz.show_source(EngineCore.step, body_only=True))
viz.show_source(LLM.step, body_only=True)

# %%
finished, more_steps = {}, 0
while llm.has_unfinished_requests():
    more_steps += 1
    for out in llm.step():
        if out.finished:
            finished[out.request_id] = (out, more_steps)
            print(f"request {out.request_id}: {tokenizer.decode(out.prompt_token_ids)!r} -> {out.text!r} "
                  f"({out.finish_reason}, token ids {out.token_ids}) in step {more_steps} of the loop")

# %% [markdown]
# Both answers are right (`45+38=83`, `12+7=19`) and both stop at the model's end-of-text
# token (id 2, the last of their token ids): **a** in the first step of the loop, **b**
# (which still had to write `9`) in the second, each step the same three moves.
#
# ## 10. The same parts in vLLM and FastDeploy
#
# > **In vLLM / FastDeploy** each part of the path above has a counterpart. The table below
# > puts them side by side: the fleetlab column is read from the installed package (its file
# > and the line the function starts on), the vLLM v1 and FastDeploy columns were read in their
# > sources (vLLM's v1 engine; FastDeploy's v1 scheduler, `ResourceManagerV1`). Two differences
# > in shape: FastDeploy's scheduler writes a request's progress (`num_computed_tokens`) while
# > it plans, where fleetlab and vLLM advance it only when the runner's output comes back; and
# > FastDeploy's attention kernels write K/V through the block tables and sequence lengths
# > directly, with no `slot_mapping`.

# %%
from IPython.display import Markdown

from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.messages import SchedulerOutput
from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.request import Request
from fleetlab.output.parallel_sampling import ParentRequest
from fleetlab.spec_decode.rejection import RejectionSampler

# part, fleetlab, vLLM v1, FastDeploy
PARTS = [
    ("front door", LLM.add_request,
     "`LLMEngine.add_request` (`vllm/v1/engine/llm_engine.py`), under `LLM` (`vllm/entrypoints/llm.py`)",
     "`LLMEngine.add_requests` (`fastdeploy/engine/engine.py`), under `LLM` (`fastdeploy/entrypoints/llm.py`)"),
    ("checks at the edge", InputProcessor.process,
     "`InputProcessor.process_inputs` (`vllm/v1/engine/input_processor.py`)",
     "`data_processor.process_request`, then the length and stop checks of `LLMEngine.add_requests`"),
    ("`n > 1`", ParentRequest, "`ParentRequest` (`vllm/v1/engine/parallel_sampling.py`)", "–"),
    ("the scheduler's record", Request, "`Request` (`vllm/v1/request.py`)",
     "`Request` (`fastdeploy/engine/request.py`)"),
    ("plan a step", fleetlab.Scheduler.schedule, "`Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`)",
     "`ResourceManagerV1.schedule` (`fastdeploy/engine/sched/resource_manager_v1.py`)"),
    ("blocks for the step", KVCacheManager.allocate_slots,
     "`KVCacheManager.allocate_slots`, `get_computed_blocks` (`vllm/v1/core/kv_cache_manager.py`)",
     "`PrefixCacheManager.can_allocate_gpu_blocks`, `allocate_gpu_blocks`, `request_match_blocks` "
     "(`fastdeploy/cache_manager/prefix_cache_manager.py`)"),
    ("the pool", fleetlab.BlockPool, "`BlockPool.get_new_blocks`, `touch` (`vllm/v1/core/block_pool.py`)",
     "`PrefixCacheManager`: a heap of free block ids (`allocate_gpu_blocks`, `recycle_gpu_blocks`) and a radix "
     "tree of the cached ones"),
    ("the plan, as a message", SchedulerOutput,
     "`SchedulerOutput`, `NewRequestData`, `CachedRequestData` (`vllm/v1/core/sched/output.py`)",
     "a `BatchRequest` of prefill `Request` s and `ScheduledDecodeTask` / `ScheduledPreemptTask` "
     "(`resource_manager_v1.py`)"),
    ("run the step", ModelRunner.execute, "`GPUModelRunner.execute_model` (`vllm/v1/worker/gpu_model_runner.py`)",
     "`GPUModelRunner.execute_model` (`fastdeploy/worker/gpu_model_runner.py`)"),
    ("apply the plan to the batch", ModelRunner.update_batch, "`GPUModelRunner._update_states`",
     "`GPUModelRunner.insert_tasks_v1`"),
    ("the persistent batch", InputBatch, "`InputBatch` (`vllm/v1/worker/gpu_input_batch.py`)",
     "`InputBatch`, `reorder_split_prefill_and_decode` (`fastdeploy/worker/input_batch.py`)"),
    ("the step's metadata", fleetlab.AttentionMetadata.from_batch,
     "`CommonAttentionMetadata` (`vllm/v1/attention/backend.py`), `BlockTable.compute_slot_mapping` "
     "(`vllm/v1/worker/block_table.py`)",
     "`ForwardMeta` (`fastdeploy/model_executor/forward_meta.py`): `seq_lens_this_time`, `cu_seqlens_q`, "
     "`block_tables`, no `slot_mapping`"),
    ("how attention finds the step", fleetlab.forward_context, "`set_forward_context` (`vllm/forward_context.py`)",
     "the `ForwardMeta` handed down the model's forward"),
    ("the backend's plan, once per step", fleetlab.AttentionBackend.build_metadata,
     "`AttentionMetadataBuilder.build`, e.g. `FlashAttentionMetadataBuilder` "
     "(`vllm/v1/attention/backends/flash_attn.py`)",
     "`AttentionBackend.init_attention_metadata` (`fastdeploy/model_executor/layers/attention/"
     "base_attention_backend.py`)"),
    ("write K/V, then attend", fleetlab.AttentionBackend.forward, "`FlashAttentionImpl.forward` (`flash_attn.py`)",
     "`AttentionBackend.forward`, then `forward_mixed` of `AppendAttentionBackend` (`append_attn_backend.py`)"),
    ("the attention to read", naive_paged_attention, "–", "–"),
    ("sample", Sampler.sample, "`Sampler.forward` (`vllm/v1/sample/sampler.py`)",
     "`Sampler` (`fastdeploy/model_executor/layers/sample/sampler.py`)"),
    ("verify drafts", RejectionSampler, "`RejectionSampler` (`vllm/v1/sample/rejection_sampler.py`)",
     "`SpeculativeSampler` (the same `sampler.py`)"),
    ("commit the step", fleetlab.Scheduler.update, "`Scheduler.update_from_output` (`scheduler.py`)",
     "`TokenProcessor` (`fastdeploy/output/token_processor.py`): appends the tokens, stops at EOS, recycles "
     "the blocks"),
    ("what the caller gets", RequestOutput,
     "`OutputProcessor.process_outputs` (`vllm/v1/engine/output_processor.py`), then `RequestOutput` "
     "(`vllm/outputs.py`)",
     "`RequestOutput` (`fastdeploy/engine/request.py`)"),
]


def where(obj) -> str:
    """A fleetlab function or class, named with its file and first line, as the package has them now."""
    source = viz.show_source(obj)
    return f"`{source.name}` (`{source.path}`, line {source.first_line})"


table = ["| part | fleetlab | vLLM v1 | FastDeploy |", "| --- | --- | --- | --- |"]
table += [f"| {part} | {where(obj)} | {vllm} | {fastdeploy} |" for part, obj, vllm, fastdeploy in PARTS]
Markdown("\n".join(table))

# %% [markdown]
# ## Try next
#
# - Add a third request with a 30-token prompt before section 2: how is it chunked, and
#   which rows does `schedule` give the budget to?
# - Build the engine with `backend="tiled"` and `reorder=True` and re-run section 5: do the
#   rows move?
# - Pick one row of the table and read the vLLM or FastDeploy function next to fleetlab's.
# - Back to **00_why_a_kv_cache** or **01_tour** with the code in mind.
