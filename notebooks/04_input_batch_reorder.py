# %% [markdown]
# # 04 · The InputBatch and decode-first reordering
#
# **You will learn** how an engine keeps the state of its running requests between
# steps, and why it rearranges that state every step:
#
# - the InputBatch: one row per request, every per-request buffer declared once;
# - why the rows are reordered: what the attention kernels see on the step's packed tokens;
# - holes left by finished requests, `condense()`, and the decode-first reorder: a
#   two-pointer scan that swaps rows, stepped with a slider;
# - the alternative that moves no row at all: a gather index map.

# %%
# %matplotlib inline
import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.inspect.batch import batch_snapshot
from fleetlab.lab import viz

# %% [markdown]
# ## 1. A batch with decodes, prefills and a hole
#
# Ten requests: most are decoding (their prompt is in the cache; they run 1 token), three
# are prefilling (they run their whole prompt). Then request **c** finishes and leaves a
# hole.

# %%
def make_batch():
    batch = fleetlab.InputBatch(max_num_seqs=10, max_model_len=64, max_blocks_per_seq=8)
    next_block = 0
    # (request, prompt length, tokens generated so far): 0 generated = still prefilling
    for req_id, prompt_len, generated in [("a", 6, 3), ("b", 9, 0), ("c", 5, 2), ("d", 4, 1), ("e", 12, 0),
                                          ("f", 7, 4), ("g", 5, 2), ("h", 3, 5), ("i", 10, 0), ("j", 8, 1)]:
        num_tokens = prompt_len + generated
        blocks = list(range(next_block, next_block + -(-num_tokens // 4)))
        next_block += len(blocks)
        batch.add_request(req_id, range(3, 3 + prompt_len), output_token_ids=[50] * generated,
                          num_computed_tokens=num_tokens - 1 if generated else 0, block_ids=blocks)
    batch.remove_request("c")
    batch.set_num_scheduled({"a": 1, "b": 9, "d": 1, "e": 12, "f": 1, "g": 1, "h": 1, "i": 10, "j": 1})
    return batch

batch = make_batch()
print(batch)
print(len(batch.fields), "per-request fields:", batch.fields.names())
viz.draw_batch(batch_snapshot(batch))

# %% [markdown]
# Every per-request buffer above (token ids, block table, sampling settings...) is
# declared once in a field registry. Moving a row moves *every* registered field, so no
# buffer can be forgotten: in a production engine, buffers missing from a hand-written
# swap list were a real source of bugs.
#
# ## 2. Why reorder: the step's packed tokens
#
# One step runs every scheduled token of every row as one packed sequence, row after row:
# the model's `[1, T]` input, here T = 37 tokens. Attention kernels for decode (one query
# token per row, reading a long cache) and for prefill (a chunk of query tokens) are
# different programs. A backend with one of each gives the decode kernel the tokens
# `[0, num_decode_tokens)`, the run of one-token rows at the start, and the prefill kernel
# all the rest: no per-row branching inside a kernel.
#
# Below, the step's tokens before and after the reorder, each row as wide as the tokens it
# runs. Before, only row `a` is in the decode kernel's range: the five other decodes
# (`d`, `f`, `g`, `h`, `j`) sit between or after prefill chunks, inside the prefill
# kernel's range (hatched), where a decode kernel never sees them. After the reorder the
# six decodes come first (tokens 0-5) and the prefill kernel takes tokens 6-36.

# %%
packed = make_batch()
packed.condense()
rows_before = batch_snapshot(packed)
packed.reorder_split_prefill_and_decode()
rows_after = batch_snapshot(packed)
token_axis = viz.draw_token_axis(rows_before, rows_after)
token_axis

# %% [markdown]
# That cut is what the step's `AttentionMetadata` computes from the rows' token counts:
# `num_decodes`, the leading run of one-token rows, and `num_decode_tokens`.

# %%
for name, rows in (("before", rows_before), ("after", rows_after)):
    md = fleetlab.AttentionMetadata.build(
        query_lens=[r.num_scheduled_tokens for r in rows], num_computed_tokens=[r.num_computed_tokens for r in rows],
        block_tables=[r.block_table + [-1] * (8 - len(r.block_table)) for r in rows], block_size=4)
    print(f"{name:>6} the reorder: num_decodes={md.num_decodes}, num_decode_tokens={md.num_decode_tokens} "
          f"of {md.num_tokens} tokens")

# %% [markdown]
# ## 3. Condense, then reorder, one move at a time
#
# `reorder_frames` runs exactly what the engine runs each step: `condense()` (live rows
# slide up into the holes, keeping their order), then the two-pointer scan: a left pointer
# finds the next prefill row in the decode region, a right pointer the last decode row in
# the prefill region, and they swap. Below, every frame side by side: the rows each frame
# moved are outlined in red, and the dashed line separates decodes from prefills (`d1`: a
# one-token decode, `p9`: a 9-token prefill chunk).

# %%
frames = viz.reorder_frames(make_batch())
for i, frame in enumerate(frames):
    print(i, frame.label)
reorder_strip = viz.draw_reorder_strip(frames)
reorder_strip

# %% [markdown]
# The code those frames come from, read from the installed package. `condense` finds the
# live rows (`live`) and moves them, in order, to rows `0..n-1` in one call of `move_rows`;
# `move_rows` is the single place rows move: one fancy-indexed copy per registered field
# (`for buf in self._np.values()`), so no field can be left behind.

# %%
from IPython.display import display

from fleetlab.engine.input_batch import InputBatch, two_pointer_swaps

condense_source = viz.show_source(InputBatch.condense, body_only=True)
move_source = viz.show_source(InputBatch.move_rows, start="for buf in", stop="self._req_id_to_row[")
display(condense_source, move_source)

# %% [markdown]
# The reorder asks each row whether it is a decode (`is_decode`: at most `decode_threshold`
# tokens this step), gets the swaps from `two_pointer_swaps` and applies them all in one
# `move_rows`. `two_pointer_swaps` computes what the classic scan would do without a Python
# loop: the prefill rows inside the decode region (`lefts`) each swap with a decode row from
# the right end of the prefill region (`rights`, reversed): frames 2 and 3 above.

# %%
reorder_source = viz.show_source(InputBatch.reorder_split_prefill_and_decode, body_only=True)
swaps_source = viz.show_source(two_pointer_swaps, body_only=True)
display(reorder_source, swaps_source)

# %% [markdown]
# The same frames in a player, each beside the batch as the step began: press play, or drag
# the slider. Each frame is drawn when it is shown; the cell after it times them on this
# machine against the play interval.

# %%
reorder_player = viz.player(lambda i: viz.draw_reorder_frame(frames, i), len(frames), description="frame",
                            interval_ms=1200)
reorder_player

# %%
frame_s = viz.time_frames(reorder_player, range(len(frames)))
print(f"a frame takes {np.median(frame_s):.2f} s to draw and render here (the median of {len(frame_s)}; "
      f"the slowest {max(frame_s):.2f} s); play shows one every {reorder_player.play.interval / 1000:.1f} s")

# %% [markdown]
# The whole move at once: an arrow for each request that changed rows.

# %%
viz.draw_reorder(frames[1].records, frames[-1].records, num_decodes=frames[-1].num_decodes)

# %% [markdown]
# The scan makes the fewest moves (each misplaced row moves once), but it is **not
# stable**: look at the order inside each group (`j` jumped ahead of `d`). A stable
# partition keeps the order but moves more rows (twice as many below). Both are correct,
# because the engine never trusts row order to mean anything: results go back to requests
# by id (`by_request`), or through the permutation (`unpermute`).

# %%
from fleetlab.lab.lessons.reorder import stable_reorder  # the teaching variant, kept out of the runtime class
from fleetlab.lab.lessons.row_moves import by_request, unpermute

for stable in (False, True):
    b = make_batch()
    b.condense()
    before = b.req_ids
    perm, num_decodes = stable_reorder(b) if stable else b.reorder_split_prefill_and_decode()
    moved = int((perm != np.arange(len(perm))).sum())
    print(f"stable={stable!s:<5} rows {b.req_ids}  {moved} rows moved  "
          f"unpermute gives back {list(unpermute(b.req_ids, perm)) == before}")
print("tokens run per request:", by_request(b, b.np("num_scheduled_tokens")))

# %% [markdown]
# ## 4. The alternative: move nothing, gather through an index map
#
# A newer design leaves every row where it is (holes included) and builds, each step, an
# index map: step slot `k` reads batch row `order[k]`, decodes first. The step gathers
# the few fields it needs through that map; the persistent buffers never move.

# %%
from fleetlab.lab.lessons.reorder import decode_first_order

batch = make_batch()
order, num_decodes = decode_first_order(batch)
print("order:", order.tolist(), "| decodes:", num_decodes)
print("gathered block tables (first 3 columns):")
print(batch.np("block_table")[order][:, :3])
viz.draw_gather_map(batch_snapshot(batch), order, num_decodes)

# %% [markdown]
# Which is faster depends on how many fields the step reads against how many the batch
# carries; `python -m fleetlab bench reorder` measures both.
#
# ## 5. In the engine
#
# With `reorder=True`, every `LLM` step records the row order before and after the
# reorder. A tiny random model is enough to watch it:

# %%
llm = fleetlab.LLM(fleetlab.models.tiny("fleet", seed=0), block_size=4, max_num_batched_tokens=16,
                   max_num_seqs=4, reorder=True, record_traces=True)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (3, 12, 5, 9, 4, 7)]
llm.generate(prompt_token_ids=prompts, sampling_params=fleetlab.SamplingParams(max_tokens=5, ignore_eos=True),
             use_tqdm=False)
for trace in llm.traces:
    if trace.order_before != trace.order_after:
        print(viz.describe_step(trace))

# %% [markdown]
# Notice step 0: request 2's prompt got only the last token of the step's budget, a
# prefill chunk of **1** token (`2:p1`), and the reorder counted it as a decode. That is on
# purpose: the reorder serves the attention kernels, and to a kernel a row with one query
# token *is* a decode, whatever the request's history. Step 0's packed tokens, as the
# kernels see them:

# %%
step0 = llm.traces[0]
rows_by_id = {row.request_id: row for row in step0.rows}
step0_axis = viz.draw_token_axis([rows_by_id[r] for r in step0.order_before], step0.rows)
step0_axis

# %% [markdown]
# > **In vLLM / FastDeploy** both engines keep an `InputBatch` and reorder it decode-first.
# >
# > - vLLM v1: `InputBatch` keeps rows `[0, num_reqs)` dense (`remove_request`, then
# >   `condense()`); `swap_states(i, j)` moves a row. Each attention metadata builder
# >   declares a `reorder_batch_threshold`, and the runner calls
# >   `reorder_batch_to_split_decodes_and_prefills(input_batch, scheduler_output,
# >   decode_threshold)`: rows with at most that many tokens go first, with the fewest
# >   swaps. `split_decodes_and_prefills` then gives `num_decodes`, `num_prefills`,
# >   `num_decode_tokens`, `num_prefill_tokens`: the cut in the picture above. vLLM's newer
# >   model runner (`vllm/v1/worker/gpu/`) moves no rows and gathers through an index
# >   instead, as in section 4.
# > - FastDeploy: `reorder_split_prefill_and_decode(input_batch)` runs the two-pointer scan
# >   (a row is a decode when its `seq_lens_encoder` is 0) and `InputBatch.swap_states`
# >   swaps a hand-written list of buffers; `recover_batch_index_for_output` puts the
# >   outputs back in the original order. For speculative decoding the MTP proposer's
# >   `ProposerInputBatch` must make the same swaps, row for row.

# %% [markdown]
# ## Try next
#
# - In `make_batch`, make every request a decode: how many swaps now?
# - Use `decode_threshold=4` in `reorder_frames`: rows running up to 4 tokens (say,
#   speculative decoding) count as decodes.
# - Next notebook: **05_decode_loop**, the scheduler that fills these rows.
