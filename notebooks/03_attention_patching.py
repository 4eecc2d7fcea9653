# %% [markdown]
# # 03 · Attention patching
#
# **You will learn** how fleetlab runs a model library's *own* model on its paged
# attention without editing the model's code:
#
# - what `fleetlab.patch_model` changes in a PaddleFormers model, and which layer gets which id;
# - why attention needs a *forward context*, and what it holds;
# - how to prove the patch changes nothing: logits against the unpatched model (the oracle);
# - the Fleet/Megatron-style variant: swapping each layer's `core_attention`, and the
#   1-based `layer_number` trap.
#
# We use tiny *random* models here (built in milliseconds): parity does not need a trained
# model, only the same weights on both sides.

# %%
# %matplotlib inline
import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz
from fleetlab.patching.parity import paged_greedy, reference_greedy

# %% [markdown]
# ## 1. A PaddleFormers model, before
#
# A tiny `LlamaForCausalLM`. PaddleFormers picks each layer's attention function by name
# (`config._attn_implementation`), and each attention module knows its 0-based `layer_idx`.

# %%
model = fleetlab.models.tiny("llama", seed=0)
print(type(model).__name__, "| attention:", model.config._attn_implementation)
for name, layer in model.named_sublayers():
    if name.endswith("self_attn"):
        print(f"  {name:<24} layer_idx={layer.layer_idx}")

# %% [markdown]
# First the oracle: greedy decoding with the model's own full forward pass, recomputing
# the whole sequence for every new token. Three prompts of random token ids.

# %%
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (5, 11, 8)]
ref_tokens, ref_logits = reference_greedy(model, prompts, max_new_tokens=8)
print("oracle tokens:", ref_tokens)

# %% [markdown]
# ## 2. Patch it
#
# `patch_model` registers fleetlab's attention function with PaddleFormers, points the
# model at it, turns the library's own KV cache off (fleetlab owns the cache), and tags
# every attention module with its layer id and backend. It returns a **handle**; the
# handle's `layer_ids` says which module writes which layer of the paged cache.

# %%
handle = fleetlab.patch_model(model)
print(handle)
print("attention:", model.config._attn_implementation, "| library cache:", model.config.use_cache)
print(viz.format_patch_table(handle))

# %%
viz.draw_layer_map(handle)

# %% [markdown]
# The model's signature has no room for a block table, so patched attention reads the
# step's metadata and the cache from a **forward context** that the engine opens around
# each forward pass. Without one, it refuses to guess:

# %%
import paddle

try:
    model(input_ids=paddle.to_tensor([prompts[0]]))
except RuntimeError as err:
    print("RuntimeError:", str(err)[:160], "...")

# %% [markdown]
# What the context holds for one step that prefills our three prompts together, packed
# into one sequence of 24 tokens: each token's position *within its own request*, where
# its K/V go (`slot_mapping`, one slot per token, from the block tables of notebook 02),
# and where each request's tokens start (`cu_seqlens_q`: cumulative query lengths, so
# request `i`'s tokens are `[cu_seqlens_q[i], cu_seqlens_q[i + 1])` of the packed sequence).
# The three requests' blocks are scattered over a cache of 8 blocks, as they are in a
# pool that has been serving for a while: request 0 holds blocks 7 and 2, request 1
# blocks 4, 0 and 5, request 2 blocks 6 and 1.

# %%
block_tables = [[7, 2, -1], [4, 0, 5], [6, 1, -1]]  # -1: no block
md = fleetlab.AttentionMetadata.build(query_lens=[5, 11, 8], num_computed_tokens=[0, 0, 0],
                                      block_tables=block_tables, block_size=4)
print("positions   ", md.positions.numpy())
print("slot_mapping", md.slot_mapping.numpy())
print("cu_seqlens_q", md.cu_seqlens_q_host)

# %% [markdown]
# Read `slot_mapping` with the picture below: token `p` of a request goes to slot
# `block_table[p // 4] * 4 + p % 4`. Request 0's first four tokens land in block 7
# (slots 28-31) and its fifth in block 2 (slot 8), so the slots jump wherever the block
# table jumps; within a block they count up.

# %%
tables = {req: [b for b in row if b >= 0] for req, row in enumerate(block_tables)}
viz.draw_block_mapping(tables, 8, num_tokens={0: 5, 1: 11, 2: 8}, block_size=4)

# %% [markdown]
# Those numbers come from a few numpy lines of `AttentionMetadata.build`, read here from the
# installed file: `row_of_token` repeats each row's index once per query token, `positions`
# adds each token's offset in its row to the tokens the row already has in the cache, and
# `slot_mapping` is the formula above, `blocks * block_size + positions % block_size`, with
# `blocks` looked up in the row's block table at `positions // block_size`.

# %%
build_excerpt = viz.show_source(fleetlab.AttentionMetadata.build, start="row_of_token =", stop="slot_mapping =")
build_excerpt

# %% [markdown]
# That is the metadata every backend shares. A backend can add a plan of its own, once per
# step: the first attention layer of a step asks the forward context for the backend's
# metadata (`attn_metadata` below), which calls the backend's `build_metadata` on the shared
# metadata and keeps the result, so every later layer of the step gets the same object. The
# base class's `build_metadata` returns the shared metadata as it is (`return common`); the
# Triton backend (second excerpt, read from its file without importing Triton) plans its
# kernels there, once per step: `StepPlans` holds the kernel settings, grids and scratch
# buffers every layer then only launches with. Then each layer
# calls `forward`: **write** the step's K/V into their slots (`kv_cache.write(...,
# metadata.slot_mapping)`), and only then **attend** (`self.attend(...)`), so a row can read
# a block that another row of the same step has just filled.

# %%
from IPython.display import display

from fleetlab.attention.context import ForwardContext

step_excerpts = [viz.show_source(ForwardContext.attn_metadata, body_only=True),
                 viz.source_excerpt("TritonBackend.build_metadata", "fleetlab.attention.triton_backend",
                                    body_only=True),
                 viz.show_source(fleetlab.AttentionBackend.forward, body_only=True, stop="sinks=sinks)")]
for excerpt in step_excerpts:
    display(excerpt)

# %% [markdown]
# And what `attend` computes with that metadata, in the plainest form fleetlab has
# (`backend="naive"`, `naive_paged_attention`), the loop over the rows: a row's query tokens
# are `query[cu[row]:cu[row + 1]]`; every position of its context becomes a slot through its
# block table (the same formula as `slot_mapping`); the keys and values are gathered from
# those slots (`paddle.gather`); the causal mask (`visible = pos <= q_pos`) hides the
# positions after each query token; a softmax mixes the values. The default backend
# (`"tiled"`) does the same in batched tiles; the tests hold the two to the same numbers.

# %%
from fleetlab.attention.naive import naive_paged_attention

naive_excerpt = viz.show_source(naive_paged_attention, start="keys = key_cache.reshape", stop="outputs.append(")
naive_excerpt

# %% [markdown]
# ### The packed step's mask
#
# That loop never lets a query see another row's keys, and inside a row it hides only the
# positions after the query. Drawn for a whole step, that is the step's attention mask:
# the packed queries down, every row's context across. Here it is for a real mixed step of
# an engine: requests 0 and 1 decode while request 2's 14-token prompt runs its second
# chunk (a budget of 8 tokens a step). A forward pre-hook on the first attention layer (a
# Paddle hook; nothing in the engine changes) reads each step's `AttentionMetadata` from
# the forward context while it is open, and `viz.packed_mask` turns its `cu_seqlens_q`,
# `seq_lens_kv` and block tables into the mask.

# %%
from fleetlab.attention.context import get_forward_context

mask_model = fleetlab.models.tiny("llama", seed=0)
mask_llm = fleetlab.LLM(mask_model, block_size=4, max_num_batched_tokens=8, record_traces=True)
first_attention = next(layer for name, layer in mask_model.named_sublayers() if name.endswith("self_attn"))
step_masks = []  # one per forward: the hook runs once per step, in the first layer
hook = first_attention.register_forward_pre_hook(
    lambda layer, inputs: step_masks.append(viz.packed_mask(get_forward_context().metadata)))
mask_params = fleetlab.SamplingParams(max_tokens=6, ignore_eos=True)
mask_prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (5, 3, 14)]
for ids in mask_prompts[:2]:
    mask_llm.add_request(prompt_token_ids=ids, sampling_params=mask_params)
mask_llm.step()  # step 0: both short prompts
mask_llm.add_request(prompt_token_ids=mask_prompts[2], sampling_params=mask_params)
mask_llm.step()  # step 1: two decodes and the long prompt's first chunk of 6
mask_llm.step()  # step 2: two decodes and its second chunk, after the 6 now cached
hook.remove()
mixed = mask_llm.traces[2]
for row in mixed.rows:
    print(f"req {row.request_id}: {row.phase:<7} {row.num_scheduled_tokens} token(s) after "
          f"{row.num_computed_tokens} cached")
mixed_mask = step_masks[2]
mixed_mask.row_labels = [row.request_id for row in mixed.rows]  # the rows in the order the step ran them
viz.draw_packed_mask(mixed_mask, title="step 2's attention mask: two decode rows and a prefill chunk")

# %% [markdown]
# Block-diagonal: each row's queries see only their own row's keys, so 8 packed tokens
# behave as three separate sequences. A decode row is one query that sees its whole
# context: its cached tokens (pale) and the token it writes this step. The chunk's 6
# queries all see the 6 positions cached by step 1, and among this step's own keys each
# sees itself and those before it: a lower triangle. Of the 8 x 24 pairs only 7 + 5 + 57 =
# 69 are visible, which is why no kernel builds this matrix: the naive loop above runs row
# by row, the tiled backend gathers only each row's own keys into its tiles, and
# FlashAttention's variable-length API takes the rows' query and context lengths (as
# cumulative sums, like `cu_seqlens_q`) instead of a mask.

# %% [markdown]
# ## 3. Parity: oracle against paged
#
# `paged_greedy` decodes the same prompts through the patched model: one packed prefill
# step, then one packed decode step per token, on a fresh paged cache whose block ids are
# shuffled (so a layout bug cannot hide behind contiguous blocks). Every logit sits on the
# diagonal. The worst difference per step (right, one colour per request) sits a few times
# above the dashed line, one float32 rounding step at the size of these logits (float32's
# epsilon times the largest logit), and under ten such steps everywhere: the two sides add
# the same numbers in different orders, through a few layers, so the rounding of each
# addition adds up. A layout bug would show as a difference of the logits' own size, about
# a million times higher on this axis.

# %%
paged_tokens, paged_logits = paged_greedy(handle, prompts, max_new_tokens=8, block_size=4)
print(viz.greedy_table(ref_tokens, paged_tokens))
parity_figure = viz.draw_logits_parity(ref_logits, paged_logits)
parity_figure

# %% [markdown]
# `unpatch()` puts everything back; the model is exactly what it was.

# %%
handle.unpatch()
print("attention:", model.config._attn_implementation)
again, _ = reference_greedy(model, prompts, max_new_tokens=8)
print("same oracle tokens after unpatch:", again == ref_tokens)

# %% [markdown]
# ## 4. Fleet/Megatron-style models: module surgery
#
# Megatron-style models (and PaddleFleet) have no attention registry. Instead each decoder
# layer's attention holds a `core_attention` sub-layer that receives already-rotated q/k/v
# and only does softmax attention. That is the seam: replace that one sub-layer and
# everything else (projections, RoPE, norms, MLP) stays the model's own code.

# %%
fleet = fleetlab.models.tiny("fleet", seed=0)
print(fleet.decoder.layers[0])
print("layer_number of each layer:", [layer.layer_number for layer in fleet.decoder.layers])

# %% [markdown]
# Note `layer_number`: Megatron and Fleet count layers **from 1**. A paged cache is
# indexed **from 0**. Using `layer_number` directly as the cache index (as a production
# engine's first version did) shifts every layer by one and sends the last layer past the
# end. fleetlab uses `layer_number - 1` and checks the ids are exactly `0..L-1`.

# %%
fleet_ref_tokens, fleet_ref_logits = reference_greedy(fleet, prompts, max_new_tokens=8)
fleet_handle = fleetlab.patch_model(fleet)
print(fleet.decoder.layers[0].self_attention)
print(viz.format_patch_table(fleet_handle))

# %%
viz.draw_layer_map(fleet_handle)

# %%
from fleetlab.patching.fleet import check_layer_ids

one_based = {name: layer_id + 1 for name, layer_id in fleet_handle.layer_ids.items()}
try:
    check_layer_ids(one_based)
except ValueError as err:
    print("ValueError:", err)

# %%
fleet_tokens, fleet_logits = paged_greedy(fleet_handle, prompts, max_new_tokens=8)
print(viz.greedy_table(fleet_ref_tokens, fleet_tokens))
fleet_handle.unpatch()
viz.draw_logits_parity(fleet_ref_logits, fleet_logits)

# %% [markdown]
# > **In vLLM / FastDeploy** this is the *third-party model backend*.
# >
# > - vLLM's Transformers modeling backend (`TransformersForCausalLM`) registers its own
# >   function in Hugging Face Transformers' attention interface, as
# >   `ALL_ATTENTION_FUNCTIONS["vllm"]`, and finds the layer's vLLM `Attention` by the
# >   module's `layer_idx`. The step's metadata reaches it through `set_forward_context` /
# >   `get_forward_context` (our `forward_context`); the metadata holds `slot_mapping` and
# >   `query_start_loc` (our `cu_seqlens_q`).
# > - FastDeploy's PaddleFormers backend (`PaddleFormersModelBase`) does the same in
# >   PaddleFormers: it registers `fastdeploy_append_attention_forward` under the name
# >   `"fastdeploy"`, sets `_attn_implementation = "fastdeploy"`, picks the layer's attention
# >   by `layer_idx` and reads the step's `ForwardMeta`. Its PaddleFleet variant
# >   (`PaddleFleetModelBase`) does section 4's surgery: each layer's `DotProductAttention`
# >   becomes a `FastDeployAttention` that carries its own layer id.

# %% [markdown]
# ## Try next
#
# - Patch another family: `fleetlab.models.tiny("gemma3")` or `"gpt_oss"` mix sliding-window
#   and full layers (see `handle.sliding_windows`); GPT-OSS adds attention sinks.
# - Re-run `paged_greedy` with `block_size=1` or `16`: the paged layout changes completely,
#   the logits must not.
# - Next notebook: **04_input_batch_reorder**, the table of running requests whose tokens each step packs.
