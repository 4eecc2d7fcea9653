# %% [markdown]
# # 02 · The paged KV cache
#
# **You will learn** how an engine stores keys and values for many requests of unknown
# length without reserving memory for the longest one:
#
# - blocks, block tables, and the slot where each token's K/V live;
# - prefix sharing: two requests holding the same blocks, counted by reference;
# - free-but-cached blocks and eviction in least-recently-used order;
# - how much memory paging wastes compared with padding, with sliders to explore it.

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

from matplotlib.figure import Figure

# %% [markdown]
# ## 1. Blocks, block tables, slots
#
# The cache is cut into blocks of `block_size` token slots. A request owns a list of block
# ids, its **block table**; the blocks need not be contiguous. Token `p` of the request
# lives in slot `block_table[p // block_size] * block_size + p % block_size`.

# %%
block_size = 4
block_table = np.array([5, 2, 9])
positions = np.arange(10)
slots = block_table[positions // block_size] * block_size + positions % block_size
print("positions:", positions)
print("slots:    ", slots)
viz.draw_block_tables({"a": block_table.tolist()}, {"a": 10}, block_size)

# %% [markdown]
# The shaded part of each cell is how full the block is. Only a request's *last* block can
# be partly empty: that is all the memory paging wastes.
#
# ## 2. Sharing a prefix
#
# A `BlockPool` hands out block ids and counts their owners. A request's life:
# `lookup` (which of my prompt's full blocks are already cached?), `touch` (take a
# reference on those), `allocate` the rest, and once the model has written a block full,
# `cache_blocks` so later requests can find it. Request **a** starts with a 10-token
# "system prompt":

# %%
pool = fleetlab.BlockPool(num_blocks=16, block_size=4)
system = list(range(100, 110))  # 10 tokens that every request starts with

a = system + [1, 2, 3]
a_blocks = pool.lookup(a)  # nothing cached yet
a_blocks += pool.allocate(-(-len(a) // 4) - len(a_blocks))
# ... the model runs and writes a's K/V; its 3 full blocks can now be shared:
pool.cache_blocks(a, a_blocks, num_cached_blocks=0, num_full_blocks=len(a) // 4)
print("a holds blocks", a_blocks)

# %% [markdown]
# Request **b** has the same system prompt. Blocks are matched by a key that chains the
# block's tokens with *all the tokens before it* (attention looks back, so the same tokens
# after a different prefix have different K/V). b's first two blocks match; the third
# holds `108, 109` followed by other tokens, so it does not.

# %%
b = system + [7, 8, 9, 9, 9]
hits = pool.lookup(b)
pool.touch(hits)
b_blocks = hits + pool.allocate(-(-len(b) // 4) - len(hits))
print("b reuses", hits, "and holds", b_blocks)
print(pool.stats())
viz.draw_block_pool(pool, {"a": a_blocks, "b": b_blocks})

# %% [markdown]
# ## 3. Freeing, reviving, evicting
#
# When a request finishes its blocks go back to the free queue, but a full block **keeps
# its cached content** until the pool needs it for something else. The queue is in
# least-recently-freed order (the number in a grey block is its place: 0 is reused first),
# and a request's blocks are freed tail first, so the head of a prefix, the part most
# likely to be shared, survives longest.

# %%
pool.free(a_blocks)
pool.free(b_blocks)
viz.draw_block_pool(pool, title="a and b finished: free, but still cached")

# %%
c = system + [4, 4]
hits = pool.lookup(c)
pool.touch(hits)  # revives them: out of the free queue, reference count 1
c_blocks = hits + pool.allocate(-(-len(c) // 4) - len(hits))
print("c found", hits, "still cached after a and b left")
big = pool.allocate(pool.num_free_blocks)  # someone needs every free block
print(pool.stats())
viz.draw_block_pool(pool, {"c": c_blocks, "big": big}, title="a big request takes every free block: cached ones are evicted")

# %% [markdown]
# ## 4. Memory: paging against padding
#
# Without paging, an engine either pads every request of a batch to the longest one or
# reserves `max_model_len` slots per request up front. Paging rounds each request up to
# a whole block and no more. For three requests of 23, 41 and 7 tokens:

# %%
viz.draw_memory_waste([23, 41, 7], block_size=16, max_model_len=128)

# %% [markdown]
# A slot is not small. It holds one token's K and V in every layer: for the tiny model of
# notebook 00 (4 layers, 2 KV heads of 32 dims, float32) that is 2 KiB per token; for a
# 7B-class model in bfloat16 (32 layers, 8 KV heads of 128 dims) it is 128 KiB.

# %%
for name, (layers, kv_heads, head_dim, dtype) in {
        "tiny Llama": (4, 2, 32, "float32"), "7B-class": (32, 8, 128, "bfloat16")}.items():
    per_token = fleetlab.PagedKVCache.bytes_per_block(layers, kv_heads, head_dim, 1, dtype)
    print(f"{name:>10}: {per_token / 1024:.0f} KiB per token")


# %% [markdown]
# ## 5. Explore
#
# Move the sliders: block size and three prompt lengths. The pool has room for 192 token
# slots whatever the block size. Small blocks waste almost nothing but mean longer block
# tables (more ids to store and look up); large blocks waste more in each request's last
# block. Real engines settle around 16.

# %%
def paging_picture(block_size, prompt_a, prompt_b, prompt_c):
    lengths = {"a": prompt_a, "b": prompt_b, "c": prompt_c}
    pool = fleetlab.BlockPool(num_blocks=192 // block_size, block_size=block_size)
    tables = {req: pool.allocate(-(-n // block_size)) for req, n in lengths.items()}
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_pool, ax_waste = fig.subplots(1, 2, width_ratios=[2.2, 1])
    viz.draw_block_pool(pool, tables, ncols=16, ax=ax_pool)
    viz.draw_memory_waste(list(lengths.values()), block_size, max_model_len=64, ax=ax_waste)
    return fig

viz.LiveFigure(paging_picture, viz.int_sliders(
    block_size=(1, 32, 1, 8), prompt_a=(1, 64, 1, 23), prompt_b=(1, 64, 1, 41), prompt_c=(1, 64, 1, 7)))

# %% [markdown]
# ## Try next
#
# - Set `block_size` to 1 and to 32 above: which layout wins, and by how much?
# - In section 2, make `system` 12 tokens long instead of 10: how many blocks do **a** and
#   **b** share now, and why?
# - Next notebook: **03_input_batch_reorder**, the table of running requests.
