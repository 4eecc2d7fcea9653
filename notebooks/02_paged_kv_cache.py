# %% [markdown]
# # 02 · The paged KV cache
#
# **You will learn** how an engine stores keys and values for many requests of unknown
# length without reserving memory for the longest one:
#
# - blocks, block tables, and the slot where each token's K/V live;
# - prefix sharing: two requests holding the same blocks, counted by reference;
# - free-but-cached blocks and eviction in least-recently-used order, and the pool's own code
#   for each (`KVCacheManager.allocate_slots`, `BlockPool.allocate` and `free`);
# - one prompt with three answers (`n = 3`): the children's block tables sharing the prompt,
#   beside the paged-attention paper's copy-on-write fork;
# - the other prefix-cache design, a radix tree (`prefix_cache="radix"`), drawn from a live
#   engine as requests insert and split it, beside the hash chain on the same requests, and
#   where each wins;
# - how much memory paging wastes compared with padding, and how many blocks a memory budget
#   buys, with sliders to explore it.

# %%
# %matplotlib inline
import random

import numpy as np
from matplotlib.figure import Figure

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.inspect.pool import pool_stats
from fleetlab.lab import viz
from fleetlab.prefix_cache.hash_chain import HashChainCache

# %% [markdown]
# ## 1. Blocks, block tables, slots
#
# The cache is cut into blocks of `block_size` token slots. A `BlockPool` hands out block
# ids and counts their owners; a prefix cache beside it (here vLLM's hash chain) remembers
# which blocks hold which prompt prefix. A request owns a list of block ids, its **block table**:
# logical block `j` of the request (its tokens `j * block_size` onwards) lives in physical
# block `block_table[j]`. So token `p` lives in slot
# `block_table[p // block_size] * block_size + p % block_size`.
#
# A pool that has been serving for a while hands out blocks in whatever order they were
# freed. We imitate that history: take every block once and give them back in a random
# order. Then request **a**, 13 tokens long, gets its 4 blocks.

# %%
cache = HashChainCache(block_size=4)
pool = fleetlab.BlockPool(num_blocks=16, block_size=4, prefix_cache=cache)
history = pool.allocate(16)
random.Random(0).shuffle(history)
pool.free(history)  # the free queue is now in a random order

system = list(range(100, 110))  # a 10-token "system prompt" that every request starts with
a = system + [1, 2, 3]
a_blocks = pool.allocate(-(-len(a) // 4))  # ceil(13 / 4) = 4 blocks
positions = np.arange(len(a))
slots = np.array(a_blocks)[positions // 4] * 4 + positions % 4
print("a's block table:", a_blocks)
print("positions:", positions)
print("slots:    ", slots)
viz.draw_block_mapping({"a": a_blocks}, pool, num_tokens={"a": len(a)}, block_size=4)

# %% [markdown]
# Each arrow is one entry of the block table. Consecutive tokens share a block, so the
# slots count up by one inside a block and jump wherever the table jumps. The shaded part
# of each logical block is how full it is: only a request's *last* block can be partly
# empty, and that is all the memory paging wastes.
#
# ## 2. Sharing a prefix
#
# A request's life in the pool: `cache.lookup` (which of my prompt's full blocks are already
# cached?), `pool.touch` (take a reference on those), `pool.allocate` the rest, and once the
# model has written a block full, `cache.cache_blocks` so later requests can find it. The model has
# now written **a**'s K/V: its 3 full blocks become shareable.

# %%
newly_cached = cache.cache_blocks(a, a_blocks, num_cached_blocks=0, num_full_blocks=len(a) // 4)
print(f"{newly_cached} of a's blocks are now cached (findable by their tokens)")

# %% [markdown]
# Request **b** has the same system prompt. Blocks are matched by a key that chains the
# block's tokens with *all the tokens before it* (attention looks back, so the same tokens
# after a different prefix have different K/V). b's first two blocks match; the third
# holds `108, 109` followed by other tokens, so it does not.

# %%
b = system + [7, 8, 9, 9, 9]
hits = cache.lookup(b)
pool.touch(hits)
b_blocks = hits + pool.allocate(-(-len(b) // 4) - len(hits))
print("b reuses", hits, "and holds", b_blocks)
print(pool_stats(pool))
shared_mapping = viz.draw_block_mapping({"a": a_blocks, "b": b_blocks}, pool, num_tokens={"a": len(a), "b": len(b)},
                                        block_size=4)
shared_mapping

# %% [markdown]
# Two arrows end in each of the two shared blocks (hatched): a's and b's logical blocks 0
# and 1 are the same physical memory, computed once. The pool as a grid, one square per
# block, shows the same thing from the pool's side: the shared blocks are marked `x2`,
# their reference count.

# %%
viz.draw_block_pool(pool, {"a": a_blocks, "b": b_blocks})

# %% [markdown]
# In the engine those calls are one method, `KVCacheManager.allocate_slots`, read here from
# the installed package (the engine's `lookup` is `get_computed_blocks`, called just before
# it). A hit on a free cached block costs a free block too (`revived`); if the pool cannot
# supply everything it returns None and changes nothing; otherwise it takes a reference on the
# hits (`self.pool.touch([*hits, *pinned])`, before allocating, so the allocation cannot evict
# them; `pinned` is the block a match that ends inside a block copies from, section 5),
# allocates the rest (`self.pool.allocate(num_new_blocks)`) and registers the blocks this step
# fills with known tokens (`_cache_known_blocks`, which calls `cache_blocks`).

# %%
from fleetlab.kv.manager import KVCacheManager

allocate_slots_source = viz.show_source(KVCacheManager.allocate_slots, start="revived =")
allocate_slots_source

# %% [markdown]
# ## 3. Freeing, reviving, evicting
#
# When a request finishes its blocks go back to the free queue, but a full block **keeps
# its cached content** until the pool needs it for something else. The queue is in
# least-recently-freed order (the number in a grey block is the order in which the pool
# would overwrite it: 1 first), and a request's blocks are freed tail first, so the head of
# a prefix, the part most likely to be shared, survives longest.

# %%
pool.free(a_blocks)
pool.free(b_blocks)
viz.draw_block_pool(pool, title="a and b finished: free, but still cached")

# %% [markdown]
# The two methods behind that, from the pool's file: `free` drops one reference per block,
# walking the table backwards (`reversed(ids)`), and a block whose count reaches 0 joins the
# tail of the free queue (unless the prefix cache `keeps` it: the radix tree of section 5
# does), still holding its cached key. `allocate` pops blocks from the head of the queue
# (`popitem(last=False)`: the least recently freed) and only then tells the prefix cache to
# drop whatever key a block still had (`forget`): eviction is lazy, it happens when the block
# is reused.

# %%
from IPython.display import display

free_source = viz.show_source(fleetlab.BlockPool.free, start="for block_id in reversed(ids)")
allocate_source = viz.show_source(fleetlab.BlockPool.allocate, start="blocks = [self._free.popitem",
                                  stop="evicted = cache_call(")
display(free_source, allocate_source)

# %% [markdown]
# Request **c** starts with the same system prompt, after a and b have left. Its lookup
# still finds the two cached blocks and *revives* them (outlined in green below). Then a
# big request takes every free block: the other cached blocks are evicted, their content
# forgotten.

# %%
c = system + [4, 4]
hits = cache.lookup(c)
pool.touch(hits)  # revives them: out of the free queue, reference count 1
c_blocks = hits + pool.allocate(-(-len(c) // 4) - len(hits))
print("c found", hits, "still cached after a and b left")
big = pool.allocate(pool.num_free_blocks)  # someone needs every free block
print(pool_stats(pool))
viz.draw_block_pool(pool, {"c": c_blocks, "big": big}, revived=hits,
                    title="c revived 2 cached blocks (green);\n"
                          "a big request took every other block: cached ones evicted")

# %% [markdown]
# ## 4. One prompt, three answers: parallel sampling (`n = 3`)
#
# `SamplingParams(n=3)` asks for three sampled continuations of one prompt. fleetlab does it
# vLLM v1's way: the front door fans the request out into three child requests (`0_<id>`,
# `1_<id>`, `2_<id>`, each with its own seed) that are queued together and admitted in the
# same step. The first child computes the whole prompt and, as its blocks fill with known
# tokens, registers them in the prefix cache at once; the next children find the prompt's
# full blocks there. Here the prompt `a red cat` is 10 tokens: 2 full blocks of 4, and 2 more
# in a third, partial block.

# %%
model, tokenizer = fleetlab.models.load_tiny()
llm = fleetlab.LLM(model, tokenizer, block_size=4, num_blocks=24, record_traces=True)
prompt = "a red cat"
llm.add_request(prompt, fleetlab.SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=12))
llm.step()
at_prompt = llm.block_tables()
first_step = llm.traces[-1]
computed = {row.request_id: row.num_scheduled_tokens for row in first_step.rows}
print("prompt tokens:", len(tokenizer.encode(prompt)), "| computed in the first step:", computed)
print("block tables:", at_prompt)
for _ in range(5):
    llm.step()
now = llm.block_tables()
kv_tokens = {child: llm.scheduler.requests[child].num_computed_tokens for child in now}
print("5 steps later:", now, "| tokens in the cache:", kv_tokens)
fork_figure = viz.draw_parallel_sampling(at_prompt, now, len(tokenizer.encode(prompt)), kv_tokens, 4, computed)
fork_figure

# %%
answers = {}
while llm.has_unfinished_requests():
    for out in llm.step():
        if out.finished:
            answers[out.index] = out.text
print({i: prompt + answers[i] for i in sorted(answers)})

# %% [markdown]
# Left, fleetlab's tables. After the prompt's step the three children hold blocks 0 and 1
# together (`x3`: one copy in memory, three references), and each holds a third block of its
# own (outlined in green for the two later children): the first child computed all 10 prompt
# tokens, the other two only the last 2, the part of the prompt no full block holds. Five
# tokens later each child's own blocks have grown; the shared ones are full and will never be
# written again, so nothing a child writes can reach another.
#
# Right, what the paged-attention paper (Kwon et al., 2023) does instead: it computes the
# prompt once, then *forks* the block table, so after the prompt's step all three children
# point at the same three blocks, the partial one included (`2 x3`). When a child writes into
# a block it shares (its first output token goes into block 2), it gets a copy of it first
# (dashed), and the last child to write keeps the original: copy-on-write. From then on the
# two layouts hold the same blocks.
#
# What each does better:
#
# - **copy-on-write** computes the prompt's last, partial block once instead of once per child
#   (here 10 prompt tokens instead of 14), and it can fork at any point, not only after the
#   prompt: beam search forks sequences in the middle of their output, sharing what they
#   generated so far;
# - **the prefix cache** needs nothing new: no fork, no copy step before attention, no block
#   ever written by two sequences, and every other feature (chunked prefill, preemption,
#   speculative decoding) sees three ordinary requests. The price is at most `block_size`
#   prompt tokens per extra child, computed again (a whole block when the prompt ends on a
#   block boundary: a cache hit never covers a whole prompt).

# %% [markdown]
# ## 5. The other design: a radix tree
#
# The hash chain keeps one key per full block. SGLang's RadixAttention keeps the same
# knowledge as a **radix tree** over token ids: each node's edge is a run of whole blocks
# (pages) and holds their block ids; the path from the root spells the prefix their K/V
# belong to. `LLM(prefix_cache="radix")` swaps it in (`"hash"` is the default, `None` turns
# sharing off); the pool, the scheduler and the attention are the same.
#
# Three requests arrive one after the other: **p** (a sentence), **q** (the same sentence,
# another ending), **r** (a different sentence, same first words). Each is drawn one step
# after its arrival, while it runs (its prompt computed, its full blocks inserted): a node a
# running request holds is blue, a node only the cache keeps is grey. **q**'s insert *splits*
# p's edge after the 4 blocks they share (`<bos>the old man sat`); **r**'s splits it again
# after 2.

# %%
from fleetlab.lab.viz.radix import draw_prefix_tree, hash_chain_nodes, radix_nodes

model, tokenizer = fleetlab.models.load_tiny()
tree_prompts = {"p": "the old man sat by the road.", "q": "the old man sat on a bench.",
                "r": "the old dog ran far away."}
engines = {design: fleetlab.LLM(model, tokenizer, block_size=4, num_blocks=64, prefix_cache=design)
           for design in ("radix", "hash")}
tree_figure = Figure(figsize=(12, 3.4), layout="constrained")
tree_axes = tree_figure.subplots(1, 3, width_ratios=[1, 1.6, 2.2])
trees = {}
for ax, (rid, text) in zip(tree_axes, tree_prompts.items()):
    for design, engine in engines.items():
        engine.add_request(text, fleetlab.SamplingParams(max_tokens=3, ignore_eos=True), request_id=rid)
        engine.step()  # the prompt is computed and its full blocks inserted: drawn while it runs
        nodes = (radix_nodes if design == "radix" else hash_chain_nodes)(engine.pool.prefix_cache, engine.pool)
        trees[design, rid] = nodes
        while engine.has_unfinished_requests():
            engine.step()
    draw_prefix_tree(trees["radix", rid], ax=ax, decode=tokenizer.decode, title=f"radix tree once {rid!r} runs")
tree_figure

# %% [markdown]
# The same three requests through the hash chain: the same tree of full blocks, one node per
# block. What the radix tree stores as one edge is a chain of keys here, each naming its
# parent. The radix tree holds two blocks more: the *tail pages* of p and q, their partly
# filled last blocks (p's edge ends in one of 3 tokens, q's in one of 2), kept when they
# finished; the hash chain keys full blocks only.

# %%
draw_prefix_tree(trees["hash", "r"], decode=tokenizer.decode, title="hash chain after p, q, r")

# %%
design_hits = {}
for design, engine in engines.items():
    s = engine.stats()
    design_hits[design] = s["prefix_cache_hit_tokens"]
    print(f"{design:>5}: hit {s['prefix_cache_hit_tokens']} of {s['prefix_cache_query_tokens']} prompt tokens, "
          f"{pool_stats(engine.pool).num_cached_blocks} blocks cached")
    engine.close()

# %% [markdown]
# **Where the two differ: a match that ends inside a block.** Both designs share the same
# whole blocks. The hash chain keys whole blocks, so its match stops at a block boundary: r
# shares 9 tokens with p (`<bos>the old `), 2 blocks and one token of the third, and that
# token is computed again (q: 17 shared, 4 blocks, the 17th computed again). The radix tree
# matches token by token: past the whole pages it finds the cached page whose head continues
# the match (`lookup_partial`), and the engine **copies** those tokens' K/V into the request's
# own first new block, on every layer, before the step's forward. So the radix tree hit 2
# tokens more above, one for q and one for r; at most `block_size - 1` a request.
#
# A request that finishes leaves its last, partly filled block in the tree too (a *tail
# page*: in the pictures, the last node of an edge with fewer than 4 tokens per block). That
# is what a chat's next turn passes through: its prompt is the last prompt, the answer and a
# new message. Below, with blocks of 16 tokens: turn 1 wrote the K/V of its 29 prompt tokens
# and 11 of its 12 answer tokens (the last one sampled is never fed back), 40 tokens, 2 full
# blocks and 8 tokens of a third. Turn 2's prompt starts with those 40 tokens.

# %%
chat = {}
for design in ("hash", "radix"):
    with fleetlab.LLM(model, tokenizer, block_size=16, prefix_cache=design) as engine:
        greedy = fleetlab.SamplingParams(max_tokens=12, ignore_eos=True)
        first = engine.generate("the old man sat by the road.", greedy, use_tqdm=False)[0]
        again = first.prompt_token_ids + first.token_ids + tokenizer.encode(" and then?")[1:]  # (no second <bos>)
        before = engine.stats()["prefix_cache_hit_tokens"]
        second = engine.generate(prompt_token_ids=[again], sampling_params=greedy, use_tqdm=False)[0]
        hit = engine.stats()["prefix_cache_hit_tokens"] - before
        chat[design] = (hit, len(again) - hit, second.token_ids)
        print(f"{design:>5}: turn 2's prompt of {len(again)} tokens: {hit} from the cache, {len(again) - hit} computed")

# %% [markdown]
# The hash chain gave turn 2 the 32 tokens of the 2 full blocks; the radix tree 40: the 32,
# and the 8 of turn 1's tail page, copied. The answers are the same tokens (the tests hold
# every such case to the model's own full forward, under chunking, preemption, `n > 1`,
# speculation and the overlapped loop).
#
# The copy happens inside the step: each layer writes the step's K/V, then applies the step's
# copies, then attends. So requests admitted *together* copy from each other too: a block one
# of them fills in this very step lends its head to the next, as a full block is shared whole
# in the same step.
#
# **Where the two are equal**: a shared prefix that ends on a block boundary; prompts that
# share nothing; the first request of a group (there is nothing to copy from yet). And the
# copy is not free: two indexed operations per layer and per tensor (K, V), whatever the
# number of tokens. On this CPU with the tiny model, a copied token cost about what a
# recomputed one does (README "Prefix caching" gives both, measured side by side); the copy
# saves work that grows with the model, the copy's cost does not.
#
# The tree's pieces, from `fleetlab/prefix_cache/radix.py`: `cache_blocks` walks the tree and
# hangs new pages where the walk stops, `_split` cuts an edge in two, and `evict` gives back
# unreferenced pages from the least recently released leaves, tail first; `lookup_partial`
# picks the page to copy from.

# %%
from fleetlab.prefix_cache.radix import RadixCache

display(viz.show_source(RadixCache._split, body_only=True), viz.show_source(RadixCache.evict, body_only=True),
        viz.show_source(RadixCache.lookup_partial, body_only=True))

# %% [markdown]
# **Where each design wins**, measured side by side in one run (`python -m fleetlab bench
# prefix`, stored in `benchmarks/results/prefix.json`): on few-shot prompts sharing a prefix
# of 150 tokens (9 blocks and 6 tokens) the radix tree computes fewer prompt tokens than the
# hash chain (every request after the first copies the prefix's last 6 tokens),
# on multi-turn chats too (each turn copies the last turn's tail page), and on unrelated
# prompts neither helps (their throughputs, below, were timed on a shared machine: README
# gives its load). What moves the numbers most is the **scheduler**: with groups of requests
# sharing a prefix arriving interleaved into a pool too small for every prefix, admitting the
# longest cached prefix first (`scheduling_policy="lpm"`) keeps each prefix in use while its
# group runs, where first-come-first-served evicts it between them; it does so with either cache.

# %%
import json
from pathlib import Path

results_file = Path(fleetlab.__file__).resolve().parents[1] / "benchmarks" / "results" / "prefix.json"
if results_file.exists():
    stored = json.loads(results_file.read_text())
    print(f"{'workload/cache/policy':>24} {'prefill computed':>17} {'hit rate':>9} {'out tok/s':>10} {'TTFT ms':>8}")
    for key, r in stored["runs"].items():
        print(f"{key:>24} {r['prefill_tokens_computed']:>8.0f} / {r['prompt_tokens']:<6.0f} {r['hit_rate']:>9.2f} "
              f"{r['output_tokens_per_s']:>10.1f} {r['ttft_median_ms']:>8.0f}")


# %% [markdown]
# ## 6. Memory: paging against padding
#
# Without paging, an engine either pads every request of a batch to the longest one or
# reserves `max_model_len` slots per request up front. Paging rounds each request up to
# a whole block and no more. For three requests of 23, 41 and 7 tokens:

# %%
viz.draw_memory_waste([23, 41, 7], block_size=16, max_model_len=128)

# %% [markdown]
# A slot is not small. It holds one token's K and V in every layer: for the tiny model of
# notebook 01 (4 layers, 2 KV heads of 32 dims, float32) that is 2 KiB per token; for a
# 7B-class model in bfloat16 (32 layers, 8 KV heads of 128 dims) it is 128 KiB.

# %%
for name, (layers, kv_heads, head_dim, dtype) in {
        "tiny Llama": (4, 2, 32, "float32"), "7B-class": (32, 8, 128, "bfloat16")}.items():
    per_token = fleetlab.PagedKVCache.bytes_per_block(layers, kv_heads, head_dim, 1, dtype)
    print(f"{name:>10}: {per_token / 1024:.0f} KiB per token")

# %% [markdown]
# So the pool's size follows from memory. `LLM(memory_utilization=u)` does what vLLM's
# `gpu_memory_utilization` does: of the device's memory (on a CPU, of a `memory_budget_bytes`
# you state) the engine may use the share `u`; it runs one forward of
# `max_num_batched_tokens` tokens to find the peak of everything else (weights, activations)
# and gives the rest to blocks of `bytes_per_block = block_size x bytes per token`. Left
# alone, the pool holds `max_num_seqs` sequences of `max_model_len` tokens (README "Sizing
# the pool" says why).

# %%
with fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=256, memory_utilization=0.5,
                  memory_budget_bytes=64 * 2**20) as sized:
    sizing, sized_stats = sized.kv_sizing, sized.stats()
per_token = sizing.bytes_per_block // 16
left = sizing.budget_bytes - sizing.profile_peak_bytes
print(f"0.5 x 64 MiB = {sizing.budget_bytes / 2**20:.1f} MiB; a forward of {sizing.profiled_tokens} tokens peaks at "
      f"{sizing.profile_peak_bytes / 2**20:.1f} MiB (the weights included)")
print(f"left for KV: {left / 2**20:.1f} MiB / ({per_token} bytes a token x 16) = {sizing.num_blocks} blocks, "
      f"{sizing.num_blocks * 16} tokens")


# %% [markdown]
# ## 7. Explore
#
# Move the sliders: block size and three prompt lengths. The pool gets
# `ceil(192 / block_size)` blocks: 192 token slots when the block size divides 192, a few
# more otherwise (the title says how many). Three prompts of at most 64 tokens never hold
# more than 192 tokens, yet with large blocks they may not fit: each one rounds up to
# whole blocks. Try block size 25 with three 64-token prompts: they need 9 blocks (225
# slots) and the pool has 8 (200); the picture says so. Small blocks waste almost nothing
# but mean longer block tables (more ids to store and look up); large blocks waste more in
# each request's last block (the hatched part of its last square). vLLM's default is 16
# tokens a block, FastDeploy's 64 (see the box below): larger blocks give shorter tables and
# longer contiguous reads to the attention kernels, at the price of that last-block waste,
# which stays small next to requests of hundreds or thousands of tokens.

# %%
def paging_picture(block_size, prompt_a, prompt_b, prompt_c):
    lengths = {"a": prompt_a, "b": prompt_b, "c": prompt_c}
    pool = fleetlab.BlockPool(num_blocks=-(-192 // block_size), block_size=block_size)
    need = {req: -(-n // block_size) for req, n in lengths.items()}
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_pool, ax_waste = fig.subplots(1, 2, width_ratios=[2.2, 1])
    title = f"pool: {pool.num_blocks} blocks x {block_size} = {pool.num_blocks * block_size} token slots"
    if sum(need.values()) <= pool.num_free_blocks:
        tables = {req: pool.allocate(n) for req, n in need.items()}
        # each request's last block holds only what is left of its prompt: shade the rest as empty
        last = {tables[req][-1]: (n - (need[req] - 1) * block_size) / block_size for req, n in lengths.items()}
        ncols = min(24, max(4, round((1.9 * pool.num_blocks) ** 0.5)))  # a grid about as wide as the panel
        viz.draw_block_pool(pool, tables, ncols=ncols, ax=ax_pool, title=title, fill=last)
    else:
        ax_pool.axis("off")
        ax_pool.set_title(title, fontsize=9)
        ax_pool.text(0.5, 0.5, f"does not fit: the prompts need {sum(need.values())} blocks of {block_size}\n"
                     f"({sum(need.values()) * block_size} slots), the pool has {pool.num_blocks}",
                     ha="center", va="center", color="#c0392b", fontsize=11, transform=ax_pool.transAxes)
    viz.draw_memory_waste(list(lengths.values()), block_size, max_model_len=64, ax=ax_waste)
    return fig


# %% [markdown]
# Two settings drawn once, for reading without the sliders: their starting point (block
# size 8, prompts of 23, 41 and 7 tokens), then block size 25 with three 64-token prompts,
# which do not fit.

# %%
paging_start = paging_picture(8, 23, 41, 7)
paging_start

# %%
paging_tight = paging_picture(25, 64, 64, 64)
paging_tight

# %%
explore = viz.LiveFigure(paging_picture, viz.int_sliders(
    block_size=(1, 32, 1, 8), prompt_a=(1, 64, 1, 23), prompt_b=(1, 64, 1, 41), prompt_c=(1, 64, 1, 7)))
explore

# %% [markdown]
# > **In vLLM / FastDeploy** this is the KV cache manager.
# >
# > - vLLM v1: `BlockPool` holds `KVCacheBlock`s (each with a reference count and, once full,
# >   a block hash chained to its parent's) and a free queue, `FreeKVCacheBlockQueue`, in
# >   LRU order with lazy eviction, as here. `KVCacheManager` is the scheduler's view:
# >   `get_computed_blocks` (prefix-cache hits), `allocate_slots`, `free`, handing back
# >   `KVCacheBlocks`. The runner turns block tables into a per-token `slot_mapping` each
# >   step. Its default block size is 16.
# > - FastDeploy: `PrefixCacheManager` owns the GPU blocks and the prefix tree over them
# >   (and can swap blocks to CPU); the scheduler, `ResourceManagerV1`, asks it for blocks.
# >   Its default block size is 64 (`EngineArgs.block_size`).
# > - SGLang's `RadixCache` (`python/sglang/srt/mem_cache/radix_cache.py`) is the other
# >   classic design: a radix tree whose edges are runs of token ids, each token pointing at
# >   its own KV slot (page size 1). A lookup walks the tree down to the last token a prompt
# >   shares with anything cached; a node splits where two prompts part; eviction takes the
# >   least recently used leaves, so a shared stem outlives its branches. What each does
# >   better: the tree shares *every* common token (section 2's **b** would share all 10
# >   system-prompt tokens, not the 8 of two full blocks) and holds branching conversations
# >   naturally; the hash chain finds a block with one dictionary lookup, allocates and frees
# >   whole blocks, and lets kernels read a block's slots as one contiguous run instead of
# >   one index per token. With a page size above 1, SGLang's tree matches whole pages only,
# >   as the hash chain matches whole blocks: that is fleetlab's `prefix_cache="radix"`
# >   (section 5), and SGLang's `lpm` schedule policy is fleetlab's `scheduling_policy="lpm"`.

# %% [markdown]
# ## Try next
#
# - Set `block_size` to 1 and to 32 above: which layout wins, and by how much?
# - In section 2, make `system` 12 tokens long instead of 10: how many blocks do **a** and
#   **b** share now, and why?
# - Next notebook: **03_attention_patching**, how the model itself is made to read and write these blocks.
