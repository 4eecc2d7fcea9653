"""Write the notebooks in ``notebooks/`` from the cell lists below (outputs stripped).

    .venv/bin/python tools/build_notebooks.py            # rewrite every notebook
    .venv/bin/python tools/build_notebooks.py 02 04      # only those whose name starts so

The ``.ipynb`` files are what is committed and tested; this script is a convenient way
to edit them as Python text. Cell ids are derived from the notebook name and position, so
rebuilding an unchanged notebook rewrites the same bytes.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"

SETUP = """\
%matplotlib inline
import logging
import warnings

warnings.filterwarnings("ignore", category=UserWarning)  # Paddle's import-time notices
import numpy as np
import paddle

import fleetlab
from fleetlab import viz

logging.getLogger().setLevel(logging.WARNING)  # Paddle turns INFO logs on for every library
paddle.seed(0)
np.random.seed(0)"""


def setup(extra: str = ""):
    """The first code cell: inline plots, imports, seeds (plus ``extra`` imports)."""
    text = SETUP + ("\n\n" + textwrap.dedent(extra).strip() if extra.strip() else "")
    return new_code_cell(text)


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip())


# --------------------------------------------------------------------------- 00
TOUR = [
    md("""
    # 00 · A tour of fleetlab

    **You will learn** how an inference engine serves many requests at once, by following a
    handful of prompts through fleetlab on a tiny model trained for this project:

    1. the model on its own: the answers the engine must not change;
    2. `fleetlab.LLM`: the same prompts served together;
    3. what happened inside: who ran in which step, and where their keys and values lived;
    4. the pieces you can open next, one notebook each.

    Everything runs on a CPU in seconds. The cells only *use* fleetlab: the engine's code
    lives in the `fleetlab` package, one small file per idea.
    """),
    setup(),
    md("""
    ## 1. The model on its own

    fleetlab ships a tiny Llama (a real PaddleFormers `LlamaForCausalLM`) trained on
    arithmetic and short sentences, with a *character* tokenizer: one character is one
    token, so every token can be read by eye.
    """),
    code("""
    model, tokenizer = fleetlab.models.load_tiny()
    num_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    print(f"{type(model).__name__}: {num_params / 1e6:.2f}M parameters, "
          f"{model.config.num_hidden_layers} layers, vocabulary {tokenizer.vocab_size}")
    print("'12+7=' ->", tokenizer.encode("12+7="), "(1 is <bos>)")
    """),
    md("""
    Before any engine, ask the model itself. `complete` runs the model's plain forward pass
    over the whole sequence for every new token, with no cache at all: slow, but there is
    nothing in it to get wrong. It is our **oracle**. (The model is small and not always
    right. That does not matter here: the engine's job is to reproduce the model, right or
    wrong.)
    """),
    code("""
    from fleetlab.models.pretrained import complete

    prompts = ["45+38=", "23+19=", "3+4=", "6*7=", "count 3 4 5", "the dog"]
    expected = complete(model, tokenizer, prompts, max_new_tokens=12)
    for prompt, answer in zip(prompts, expected):
        print(f"{prompt!r:>15} -> {answer!r}")
    """),
    md("""
    ## 2. Serve them together with `fleetlab.LLM`

    `LLM` patches the model's attention so it reads and writes a **paged KV cache**, sizes
    a **block pool** for that cache, and runs a loop of **engine steps**. In each step the
    **scheduler** picks which requests run and how many tokens each, within a token budget
    (`max_num_batched_tokens`) and a number of rows (`max_num_seqs`). We also ask it to keep
    a trace of every step, to draw it afterwards.
    """),
    code("""
    llm = fleetlab.LLM(model, tokenizer, block_size=4, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=4,
                       record_traces=True)
    params = fleetlab.SamplingParams(max_tokens=12)  # greedy decoding, as the oracle
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, want in zip(outputs, expected):
        prompt = tokenizer.decode(out.prompt_token_ids)
        print(f"req {out.request_id}: {prompt!r:>15} -> {out.text!r:<12} same as the oracle: {out.text == want}")
    """),
    md("""
    Same answers. The engine changed *how* the work was scheduled, not what the model
    computes. (Notebook 01 checks this down to the logits.)

    ## 3. What happened inside

    `llm.traces` holds one record per step. In the timeline below each lane is a request
    and each box a step it ran in. **Orange boxes are prefill**: prompt tokens go through
    the model (the number is how many). **Blue boxes are decode**: one new token. Look for
    steps where both kinds share one batch, and for requests that wait for a free row
    (`max_num_seqs=4`) and join the moment another finishes: that is **continuous batching**.
    """),
    code("viz.draw_timeline(llm.traces)"),
    code("""
    for trace in llm.traces[:4]:
        print(viz.describe_step(trace))
    print(llm.stats())
    """),
    md("""
    Each request's keys and values live in fixed-size **blocks** of the KV cache (here 4
    tokens each). The bars count the blocks each running request holds: they grow by one
    block every 4 tokens and disappear when the request finishes, so memory follows the
    work instead of being reserved up front.
    """),
    code("viz.draw_kv_occupancy(llm.traces)"),
    md("""
    ## 4. Pause the engine mid-flight

    `generate` runs to the end; `add_request` and `step` let you stop anywhere. Queue two
    prompts that start with the same sentence and look after three steps.
    """),
    code("""
    shared = "the red cat sat on the mat. "
    for text in [shared + "the dog", shared + "a cat"]:
        llm.add_request(text, fleetlab.SamplingParams(max_tokens=6))
    for _ in range(3):
        finished, trace = llm.step(trace=True)
        print(viz.describe_step(trace))
    """),
    md("""
    The **block pool**: one square per block of the cache, coloured by the request holding
    it. The two requests' prompts share their first 29 tokens, so the second one found the
    first one's full blocks already computed and *reused* them (**prefix caching**): those
    blocks are hatched and marked `x2`. Grey dotted squares are free, but still remember
    the tokens of a finished request, in case a later prompt starts the same way; their
    number is their turn to be recycled.
    """),
    code("""
    tables = llm.block_tables()
    viz.draw_block_pool(llm.pool, tables, ncols=16)
    """),
    md("""
    The **InputBatch** is the engine's persistent table of running requests, one row each.
    Its rows survive from step to step; only what changed is updated.
    """),
    code("""
    viz.draw_batch(llm.runner.batch.snapshot())
    """),
    code("""
    while llm.has_unfinished_requests():
        for out in llm.step():
            print(f"req {out.request_id} finished: {out.text!r} ({out.finish_reason})")
    print(f"prefix cache hit rate: {llm.stats()['prefix_cache_hit_rate']:.0%}")
    """),
    md("""
    ## Try next

    - **01_attention_patching**: how `LLM` took over the model's attention without editing its code.
    - **02_paged_kv_cache**: blocks, block tables, prefix sharing and eviction, with sliders.
    - **03_input_batch_reorder**: why and how the batch puts decode rows first.
    - **04_decode_loop**: the scheduler step by step, with preemption and a play button.
    - **05_performance**: continuous batching against static batches, measured.

    Or change the engine above: `max_num_seqs=1` (one request at a time: watch the timeline
    stretch), `block_size=16`, or `max_num_batched_tokens=8` (long prompts get split over
    several steps: *chunked prefill*).
    """),
]

# --------------------------------------------------------------------------- 01
PATCHING = [
    md("""
    # 01 · Attention patching

    **You will learn** how fleetlab runs a model library's *own* model on its paged
    attention without editing the model's code:

    - what `fleetlab.patch_model` changes in a PaddleFormers model, and which layer gets which id;
    - why attention needs a *forward context*, and what it holds;
    - how to prove the patch changes nothing: logits against the unpatched model (the oracle);
    - the Fleet/Megatron-style variant: swapping each layer's `core_attention`, and the
      1-based `layer_number` trap.

    We use tiny *random* models here (built in milliseconds): parity does not need a trained
    model, only the same weights on both sides.
    """),
    setup("""

    from fleetlab.patching.parity import paged_greedy, reference_greedy"""),
    md("""
    ## 1. A PaddleFormers model, before

    A tiny `LlamaForCausalLM`. PaddleFormers picks each layer's attention function by name
    (`config._attn_implementation`), and each attention module knows its 0-based `layer_idx`.
    """),
    code("""
    model = fleetlab.models.tiny("llama", seed=0)
    print(type(model).__name__, "| attention:", model.config._attn_implementation)
    for name, layer in model.named_sublayers():
        if name.endswith("self_attn"):
            print(f"  {name:<24} layer_idx={layer.layer_idx}")
    """),
    md("""
    First the oracle: greedy decoding with the model's own full forward pass, recomputing
    the whole sequence for every new token. Three prompts of random token ids.
    """),
    code("""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (5, 11, 8)]
    ref_tokens, ref_logits = reference_greedy(model, prompts, max_new_tokens=8)
    print("oracle tokens:", ref_tokens)
    """),
    md("""
    ## 2. Patch it

    `patch_model` registers fleetlab's attention function with PaddleFormers, points the
    model at it, turns the library's own KV cache off (fleetlab owns the cache), and tags
    every attention module with its layer id and backend. It returns a **handle**; the
    handle's `layer_ids` says which module writes which layer of the paged cache.
    """),
    code("""
    handle = fleetlab.patch_model(model)
    print(handle)
    print("attention:", model.config._attn_implementation, "| library cache:", model.config.use_cache)
    print(viz.format_patch_table(handle))
    """),
    code("viz.draw_layer_map(handle)"),
    md("""
    The model's signature has no room for a block table, so patched attention reads the
    step's metadata and the cache from a **forward context** that the engine opens around
    each forward pass. Without one, it refuses to guess:
    """),
    code("""
    try:
        model(input_ids=paddle.to_tensor([prompts[0]]))
    except RuntimeError as err:
        print("RuntimeError:", str(err)[:160], "...")
    """),
    md("""
    What the context holds for one step that prefills our three prompts together, packed
    into one sequence of 24 tokens: each token's position *within its own request*, where
    its K/V go (`slot_mapping`), and where each request's tokens start (`cu_seqlens_q`).
    """),
    code("""
    md = fleetlab.AttentionMetadata.build(
        query_lens=[5, 11, 8], num_computed_tokens=[0, 0, 0],
        block_tables=[[0, 1, -1], [2, 3, 4], [5, 6, -1]], block_size=4)
    print("positions   ", md.positions.numpy())
    print("slot_mapping", md.slot_mapping.numpy())
    print("cu_seqlens_q", md.cu_seqlens_q_host)
    """),
    md("""
    ## 3. Parity: oracle against paged

    `paged_greedy` decodes the same prompts through the patched model: one packed prefill
    step, then one packed decode step per token, on a fresh paged cache whose block ids are
    shuffled (so a layout bug cannot hide behind contiguous blocks). Every logit should sit
    on the diagonal, and the worst difference per step should be float rounding (~1e-6).
    """),
    code("""
    paged_tokens, paged_logits = paged_greedy(handle, prompts, max_new_tokens=8, block_size=4)
    print(viz.greedy_table(ref_tokens, paged_tokens))
    viz.draw_logits_parity(ref_logits, paged_logits)
    """),
    md("`unpatch()` puts everything back; the model is exactly what it was."),
    code("""
    handle.unpatch()
    print("attention:", model.config._attn_implementation)
    again, _ = reference_greedy(model, prompts, max_new_tokens=8)
    print("same oracle tokens after unpatch:", again == ref_tokens)
    """),
    md("""
    ## 4. Fleet/Megatron-style models: module surgery

    Megatron-style models (and PaddleFleet) have no attention registry. Instead each decoder
    layer's attention holds a `core_attention` sub-layer that receives already-rotated q/k/v
    and only does softmax attention. That is the seam: replace that one sub-layer and
    everything else (projections, RoPE, norms, MLP) stays the model's own code.
    """),
    code("""
    fleet = fleetlab.models.tiny("fleet", seed=0)
    print(fleet.decoder.layers[0])
    print("layer_number of each layer:", [layer.layer_number for layer in fleet.decoder.layers])
    """),
    md("""
    Note `layer_number`: Megatron and Fleet count layers **from 1**. A paged cache is
    indexed **from 0**. Using `layer_number` directly as the cache index (as a production
    engine's first version did) shifts every layer by one and sends the last layer past the
    end. fleetlab uses `layer_number - 1` and checks the ids are exactly `0..L-1`.
    """),
    code("""
    fleet_ref_tokens, fleet_ref_logits = reference_greedy(fleet, prompts, max_new_tokens=8)
    fleet_handle = fleetlab.patch_model(fleet)
    print(fleet.decoder.layers[0].self_attention)
    print(viz.format_patch_table(fleet_handle))
    """),
    code("viz.draw_layer_map(fleet_handle)"),
    code("""
    from fleetlab.patching.fleet import check_layer_ids

    one_based = {name: layer_id + 1 for name, layer_id in fleet_handle.layer_ids.items()}
    try:
        check_layer_ids(one_based)
    except ValueError as err:
        print("ValueError:", err)
    """),
    code("""
    fleet_tokens, fleet_logits = paged_greedy(fleet_handle, prompts, max_new_tokens=8)
    print(viz.greedy_table(fleet_ref_tokens, fleet_tokens))
    fleet_handle.unpatch()
    viz.draw_logits_parity(fleet_ref_logits, fleet_logits)
    """),
    md("""
    ## Try next

    - Patch another family: `fleetlab.models.tiny("gemma3")` or `"gpt_oss"` mix sliding-window
      and full layers (see `handle.sliding_windows`); GPT-OSS adds attention sinks.
    - Re-run `paged_greedy` with `block_size=1` or `16`: the paged layout changes completely,
      the logits must not.
    - Next notebook: **02_paged_kv_cache**, where those block tables come from.
    """),
]

# --------------------------------------------------------------------------- 02
PAGED = [
    md("""
    # 02 · The paged KV cache

    **You will learn** how an engine stores keys and values for many requests of unknown
    length without reserving memory for the longest one:

    - blocks, block tables, and the slot where each token's K/V live;
    - prefix sharing: two requests holding the same blocks, counted by reference;
    - free-but-cached blocks and eviction in least-recently-used order;
    - how much memory paging wastes compared with padding, with sliders to explore it.
    """),
    setup("""

    from matplotlib.figure import Figure"""),
    md("""
    ## 1. Blocks, block tables, slots

    The cache is cut into blocks of `block_size` token slots. A request owns a list of block
    ids, its **block table**; the blocks need not be contiguous. Token `p` of the request
    lives in slot `block_table[p // block_size] * block_size + p % block_size`.
    """),
    code("""
    block_size = 4
    block_table = np.array([5, 2, 9])
    positions = np.arange(10)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    print("positions:", positions)
    print("slots:    ", slots)
    viz.draw_block_tables({"a": block_table.tolist()}, {"a": 10}, block_size)
    """),
    md("""
    The shaded part of each cell is how full the block is. Only a request's *last* block can
    be partly empty: that is all the memory paging wastes.

    ## 2. Sharing a prefix

    A `BlockPool` hands out block ids and counts their owners. A request's life:
    `lookup` (which of my prompt's full blocks are already cached?), `touch` (take a
    reference on those), `allocate` the rest, and once the model has written a block full,
    `cache_blocks` so later requests can find it. Request **a** starts with a 10-token
    "system prompt":
    """),
    code("""
    pool = fleetlab.BlockPool(num_blocks=16, block_size=4)
    system = list(range(100, 110))  # 10 tokens that every request starts with

    a = system + [1, 2, 3]
    a_blocks = pool.lookup(a)  # nothing cached yet
    a_blocks += pool.allocate(-(-len(a) // 4) - len(a_blocks))
    # ... the model runs and writes a's K/V; its 3 full blocks can now be shared:
    pool.cache_blocks(a, a_blocks, num_cached_blocks=0, num_full_blocks=len(a) // 4)
    print("a holds blocks", a_blocks)
    """),
    md("""
    Request **b** has the same system prompt. Blocks are matched by a key that chains the
    block's tokens with *all the tokens before it* (attention looks back, so the same tokens
    after a different prefix have different K/V). b's first two blocks match; the third
    holds `108, 109` followed by other tokens, so it does not.
    """),
    code("""
    b = system + [7, 8, 9, 9, 9]
    hits = pool.lookup(b)
    pool.touch(hits)
    b_blocks = hits + pool.allocate(-(-len(b) // 4) - len(hits))
    print("b reuses", hits, "and holds", b_blocks)
    print(pool.stats())
    viz.draw_block_pool(pool, {"a": a_blocks, "b": b_blocks})
    """),
    md("""
    ## 3. Freeing, reviving, evicting

    When a request finishes its blocks go back to the free queue, but a full block **keeps
    its cached content** until the pool needs it for something else. The queue is in
    least-recently-freed order (the number in a grey block is its place: 0 is reused first),
    and a request's blocks are freed tail first, so the head of a prefix, the part most
    likely to be shared, survives longest.
    """),
    code("""
    pool.free(a_blocks)
    pool.free(b_blocks)
    viz.draw_block_pool(pool, title="a and b finished: free, but still cached")
    """),
    code("""
    c = system + [4, 4]
    hits = pool.lookup(c)
    pool.touch(hits)  # revives them: out of the free queue, reference count 1
    c_blocks = hits + pool.allocate(-(-len(c) // 4) - len(hits))
    print("c found", hits, "still cached after a and b left")
    big = pool.allocate(pool.num_free_blocks)  # someone needs every free block
    print(pool.stats())
    viz.draw_block_pool(pool, {"c": c_blocks, "big": big}, title="a big request takes every free block: cached ones are evicted")
    """),
    md("""
    ## 4. Memory: paging against padding

    Without paging, an engine either pads every request of a batch to the longest one or
    reserves `max_model_len` slots per request up front. Paging rounds each request up to
    a whole block and no more. For three requests of 23, 41 and 7 tokens:
    """),
    code("viz.draw_memory_waste([23, 41, 7], block_size=16, max_model_len=128)"),
    md("""
    A slot is not small. It holds one token's K and V in every layer: for the tiny model of
    notebook 00 (4 layers, 2 KV heads of 32 dims, float32) that is 2 KiB per token; for a
    7B-class model in bfloat16 (32 layers, 8 KV heads of 128 dims) it is 128 KiB.
    """),
    code("""
    for name, (layers, kv_heads, head_dim, dtype) in {
            "tiny Llama": (4, 2, 32, "float32"), "7B-class": (32, 8, 128, "bfloat16")}.items():
        per_token = fleetlab.PagedKVCache.bytes_per_block(layers, kv_heads, head_dim, 1, dtype)
        print(f"{name:>10}: {per_token / 1024:.0f} KiB per token")
    """),
    md("""
    ## 5. Explore

    Move the sliders: block size and three prompt lengths. The pool has room for 192 token
    slots whatever the block size. Small blocks waste almost nothing but mean longer block
    tables (more ids to store and look up); large blocks waste more in each request's last
    block. Real engines settle around 16.
    """),
    code("""
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
    """),
    md("""
    ## Try next

    - Set `block_size` to 1 and to 32 above: which layout wins, and by how much?
    - In section 2, make `system` 12 tokens long instead of 10: how many blocks do **a** and
      **b** share now, and why?
    - Next notebook: **03_input_batch_reorder**, the table of running requests.
    """),
]

# --------------------------------------------------------------------------- 03
REORDER = [
    md("""
    # 03 · The InputBatch and decode-first reordering

    **You will learn** how an engine keeps the state of its running requests between
    steps, and why it rearranges that state every step:

    - the InputBatch: one row per request, every per-request buffer declared once;
    - holes left by finished requests, and `condense()`;
    - the decode-first reorder: a two-pointer scan that swaps rows, stepped with a slider;
    - the alternative that moves no row at all: a gather index map.

    **Why reorder?** Attention kernels for decode (one query token per request, reading a
    long cache) and for prefill (many query tokens) are different. With all decode rows
    first, a backend can run its decode kernel on tokens `[0, num_decode_tokens)` and its
    prefill kernel on the rest, with no per-row branching.
    """),
    setup(),
    md("""
    ## 1. A batch with decodes, prefills and a hole

    Ten requests: most are decoding (their prompt is in the cache; they run 1 token), three
    are prefilling (they run their whole prompt). Then request **c** finishes and leaves a
    hole.
    """),
    code("""
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
    viz.draw_batch(batch.snapshot())
    """),
    md("""
    Every per-request buffer above (token ids, block table, sampling settings...) is
    declared once in a field registry. Moving a row moves *every* registered field, so no
    buffer can be forgotten: in a production engine, buffers missing from a hand-written
    swap list were a real source of bugs.

    ## 2. Condense, then reorder, one move at a time

    `reorder_frames` runs exactly what the engine runs each step: `condense()` (live rows
    slide up into the holes, keeping their order), then the two-pointer scan: a left pointer
    finds the next prefill row in the decode region, a right pointer the last decode row in
    the prefill region, and they swap. Press play, or drag the slider. Rows that just moved
    are outlined in red; the dashed line separates decodes from prefills.
    """),
    code("""
    frames = viz.reorder_frames(make_batch())
    for i, frame in enumerate(frames):
        print(i, frame.label)
    viz.player(lambda i: viz.draw_reorder_frame(frames, i), len(frames), description="frame", interval_ms=1200)
    """),
    md("""
    The whole move at once: an arrow for each request that changed rows.
    """),
    code("viz.draw_reorder(frames[1].records, frames[-1].records, num_decodes=frames[-1].num_decodes)"),
    md("""
    The scan makes the fewest moves (each misplaced row moves once), but it is **not
    stable**: look at the order inside each group (`j` jumped ahead of `d`). A stable
    partition keeps the order but moves more rows (twice as many below). Both are correct,
    because the engine never trusts row order to mean anything: results go back to requests
    by id (`by_request`), or through the permutation (`unpermute`).
    """),
    code("""
    from fleetlab.engine.input_batch import unpermute
    from fleetlab.lessons.reorder import stable_reorder

    for stable in (False, True):
        b = make_batch()
        b.condense()
        before = b.req_ids
        perm, num_decodes = stable_reorder(b) if stable else b.reorder_split_prefill_and_decode()
        moved = int((perm != np.arange(len(perm))).sum())
        print(f"stable={stable!s:<5} rows {b.req_ids}  {moved} rows moved  "
              f"unpermute gives back {list(unpermute(b.req_ids, perm)) == before}")
    print("tokens run per request:", b.by_request(b.np("num_scheduled_tokens")))
    """),
    md("""
    ## 3. The alternative: move nothing, gather through an index map

    A newer design leaves every row where it is (holes included) and builds, each step, an
    index map: step slot `k` reads batch row `order[k]`, decodes first. The step gathers
    the few fields it needs through that map; the persistent buffers never move.
    """),
    code("""
    from fleetlab.lessons.reorder import decode_first_order

    batch = make_batch()
    order, num_decodes = decode_first_order(batch)
    print("order:", order.tolist(), "| decodes:", num_decodes)
    print("gathered block tables (first 3 columns):")
    print(batch.np("block_table")[order][:, :3])
    viz.draw_gather_map(batch.snapshot(), order, num_decodes)
    """),
    md("""
    Which is faster depends on how many fields the step reads against how many the batch
    carries; `python -m fleetlab bench reorder` measures both.

    ## 4. In the engine

    With `reorder=True`, every `LLM` step records the row order before and after the
    reorder. A tiny random model is enough to watch it:
    """),
    code("""
    llm = fleetlab.LLM(fleetlab.models.tiny("fleet", seed=0), block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=4, reorder=True, record_traces=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (3, 12, 5, 9, 4, 7)]
    llm.generate(prompt_token_ids=prompts, sampling_params=fleetlab.SamplingParams(max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    for trace in llm.traces:
        if trace.order_before != trace.order_after:
            print(viz.describe_step(trace))
    """),
    md("""
    Notice step 0: request 2's prompt got only the last token of the step's budget, a
    prefill chunk of **1** token, and the reorder counted it as a decode. That is on
    purpose: the reorder serves the attention kernels, and to a kernel a row with one query
    token *is* a decode, whatever the request's history.
    """),
    md("""
    ## Try next

    - In `make_batch`, make every request a decode: how many swaps now?
    - Use `decode_threshold=4` in `reorder_frames`: rows running up to 4 tokens (say,
      speculative decoding) count as decodes.
    - Next notebook: **04_decode_loop**, the scheduler that fills these rows.
    """),
]

# --------------------------------------------------------------------------- 04
DECODE_LOOP = [
    md("""
    # 04 · The decode loop: continuous batching step by step

    **You will learn** what the scheduler decides every step, and watch it happen:

    - requests arriving while others run, and joining as soon as there is room;
    - a token budget shared by prefills and decodes, and long prompts split across steps
      (**chunked prefill**);
    - what happens when the KV cache runs out: **preemption** and recomputation;
    - a play button that replays the run step by step.
    """),
    setup(),
    md("""
    ## 1. A deliberately small engine

    The trained tiny model, but a cache of only 14 blocks of 4 tokens (56 token slots), a
    budget of 16 tokens per step and at most 4 running requests. `ignore_eos=True` makes
    every request run its full `max_tokens`, so the run is long enough to watch.
    """),
    code("""
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
        \"\"\"Add each request at its arrival step and run until all are done.\"\"\"
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
    """),
    md("""
    ## 2. The whole run

    Top: who ran in each step (orange prefill, with its token count; blue decode; a red `x`
    where a request was preempted; `|` where it finished). Middle: KV blocks held per
    request against the pool's 14. Bottom: tokens per step against the budget of 16.

    Things to find: the long prompt of request 6 split over steps (chunked prefill); steps
    that mix prefill and decode; the cache filling up until the scheduler preempts the
    newest request, which later comes back and recomputes its prompt *and* the tokens it
    had already generated.
    """),
    code("viz.draw_timeline(traces)"),
    code("viz.draw_kv_occupancy(traces)"),
    code("viz.draw_step_tokens(traces, budget=engine_config['max_num_batched_tokens'])"),
    code("""
    for trace in traces[:10]:
        print(viz.describe_step(trace))
    """),
    md("""
    ## 3. Replay it

    Press play (or drag the slider) to see the run build up one step at a time; the title
    describes the current step: its rows in batch order (`d` decode, `p` prefill, then the
    tokens run), any reorder, preemptions and finishes.
    """),
    code("""
    viz.player(lambda i: viz.draw_engine_step(traces, traces[i].step, budget=engine_config["max_num_batched_tokens"]),
               len(traces), interval_ms=700)
    """),
    md("""
    ## 4. Preemption costs time, never correctness

    A preempted request loses its blocks and is recomputed later. Its answer must be the
    one it would have got with plenty of memory. Run the same arrivals on a roomy engine
    (the same patched model, 10x the blocks) and compare. (With `ignore_eos=True` the model
    keeps writing past its answer, so each text starts with the answer, e.g. `'19'` for
    `12+7=`, and trails off into noise: what matters here is that both runs agree.)
    """),
    code("""
    roomy = fleetlab.LLM(llm.handle, tokenizer, **{**engine_config, "num_blocks": 140})
    roomy_outputs = serve(roomy, arrivals)
    for tight, free in zip(outputs, roomy_outputs):
        print(f"req {tight.request_id}: preempted {tight.metrics['num_preemptions']}x  "
              f"{tight.text!r:<16} same as roomy: {tight.text == free.text}")
    print("steps: tight", len(traces), "| roomy", len(roomy.traces), "| roomy preemptions:",
          roomy.stats()["num_preemptions"])
    """),
    md("""
    ## Try next

    - `scheduling_policy="spf"` (shortest prompt first) or `"priority"`: who waits now?
    - `enable_chunked_prefill=False`: a prompt must fit the step's budget whole
      (then `max_num_batched_tokens` must be at least `max_model_len`).
    - `num_blocks=20`: fewer preemptions, fewer steps? (Below 14 the longest request would
      not fit even alone, and `add_request` refuses it.)
    - Next notebook: **05_performance**, what continuous batching buys.
    """),
]

# --------------------------------------------------------------------------- 05
PERFORMANCE = [
    md("""
    # 05 · Performance

    **You will learn** how to read fleetlab's benchmark results, and what continuous
    batching buys over static batches, measured on this machine:

    - the stored benchmark results (`benchmarks/results/*.json`), if someone has run them;
    - a live comparison on the tiny model: static batches against continuous batching;
    - where one engine step spends its time.

    Numbers on a shared CPU are noisy: read the *shape* of the comparison, not the digits.
    """),
    setup("""

    import time
    from pathlib import Path

    from IPython.display import display"""),
    md("""
    ## 1. Stored results

    `python -m fleetlab bench` (or `make bench`) measures the engine and writes JSON into
    `benchmarks/results/`: `bench.json` for the engine on this kind of machine, and other
    files for kernel benchmarks run elsewhere (a GPU, for instance). What each panel shows:

    - **throughput**: output tokens per second of fleetlab's `LLM` against PaddleFormers'
      own `generate` in static batches, on the same mixed workload and the same model;
    - **KV slots holding a token**: how much of the reserved KV memory actually holds
      tokens when it is paged, padded to the longest request, or reserved for the maximum
      length (notebook 02 in numbers);
    - **prefix cache**: a workload whose prompts share a long prefix, with caching off and on;
    - **ms per engine step**: where a step's time goes, at a small and a large batch;
    - **KV read bandwidth** (kernel files): how close decode attention comes to the
      device's memory bandwidth as the context grows.

    If there are no results, the cell says so and section 2 measures something small here.
    """),
    code("""
    candidates = [Path("../benchmarks/results"), Path("benchmarks/results")]
    results_dir = next((p for p in candidates if p.is_dir()), candidates[0])
    results = viz.load_results(results_dir)
    if not results:
        print(f"No benchmark results in {results_dir} yet: run `python -m fleetlab bench` "
              "to create them. Section 2 measures a small live comparison instead.")
    for name, data in results.items():
        if not isinstance(data, dict):
            continue
        machine = data.get("machine") or data.get("environment") or {}
        print(f"{name}.json:", {k: machine[k] for k in ("processor", "device", "cpu_count") if k in machine})
        for figure in (viz.draw_bench_summary(data), viz.draw_decode_bandwidth(data)):
            if figure is not None:
                display(figure)
    """),
    md("""
    ## 2. Static batches against continuous batching

    Sixteen additions on the trained tiny model, with output lengths between 4 and 40
    tokens (`ignore_eos=True` makes each request run exactly its `max_tokens`). Both runs
    use the same patched model, the same engine and the same 4 rows; only the admission
    differs:

    - **static**: hand the engine 4 requests, wait until *all* of them finish, then the next 4.
      A batch is as slow as its longest request, and rows sit idle meanwhile;
    - **continuous**: hand it all 16; a new request takes a row the step after one frees.
    """),
    code("""
    model, tokenizer = fleetlab.models.load_tiny()
    handle = fleetlab.patch_model(model)
    rng = np.random.default_rng(0)
    prompts = [f"{a}+{b}=" for a, b in rng.integers(10, 100, size=(16, 2))]
    params = [fleetlab.SamplingParams(max_tokens=int(n), ignore_eos=True) for n in rng.integers(4, 41, size=16)]
    engine_config = dict(block_size=8, max_num_batched_tokens=256, max_num_seqs=4)

    def run_static(batch_size=4):
        llm = fleetlab.LLM(handle, tokenizer, **engine_config)
        start, outputs = time.perf_counter(), []
        for i in range(0, len(prompts), batch_size):
            outputs += llm.generate(prompts[i:i + batch_size], params[i:i + batch_size], use_tqdm=False)
        end = time.perf_counter()
        return viz.run_record("static batches of 4", outputs, start, end, llm.stats()["num_steps"]), llm

    def run_continuous():
        llm = fleetlab.LLM(handle, tokenizer, record_traces=True, **engine_config)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        end = time.perf_counter()
        return viz.run_record("continuous batching", outputs, start, end, llm.stats()["num_steps"]), llm

    run_continuous()  # warm-up: the first steps pay one-off costs
    static, static_llm = run_static()
    continuous, continuous_llm = run_continuous()
    for run in (static, continuous):
        print(f"{run.name:<20} {run.wall_s:5.2f} s  {run.tokens_per_s:6.0f} tokens/s  {run.num_steps} steps  "
              f"mean time to finish {run.mean_latency_s:.2f} s")
    viz.draw_run_comparison([static, continuous])
    """),
    md("""
    Both runs compute exactly the same tokens, but continuous batching needs about a third
    fewer **steps**: no row sits idle behind its batch's longest request. Whether that shows
    in seconds depends on the hardware. On a GPU a step of 4 rows costs about as much as a
    step of 1 (the weights are read once either way), so time follows the step count. On
    this CPU, with a 1M-parameter model, a step's cost grows with the rows in it, so the gap
    in seconds is usually smaller than the gap in steps, and wobbles from run to run. The
    step count is the part of the result that carries over to real hardware.

    ## 3. Where a step's time goes

    Each trace records the time spent in scheduling, updating the InputBatch, building the
    attention metadata, the model's forward pass, sampling and the scheduler's update.
    """),
    code("viz.draw_step_timings(continuous_llm.traces)"),
    code("""
    totals = {part: sum(t.timings.get(part, 0.0) for t in continuous_llm.traces) for part in viz.TIMING_PARTS}
    whole = sum(totals.values())
    for part, seconds in totals.items():
        print(f"{part:>12}: {1e3 * seconds:7.1f} ms  ({seconds / whole:.0%})")
    handle.unpatch()
    """),
    md("""
    On a model this small the engine's own bookkeeping is a visible share of each step; on
    a real model the forward pass dominates and batching more tokens per step is what pays.

    ## 4. Inside the GPU decode kernel

    On a GPU, fleetlab's `backend="triton"` runs three Triton kernels over the same paged
    cache this notebook's CPU backend uses: `store_kv` writes each token's K/V to its slot,
    `_decode_kernel` handles the decode rows, `_prefill_kernel` the prefill chunks (that is
    why this backend asks for decode-first rows). Triton is not installed on a CPU machine,
    so here we only *read* the decode kernel; it was tested and timed on an NVIDIA H200 (on
    torch tensors), and its numbers are the `h200_triton` panel in section 1.

    One program handles one (row, KV head, split of the context). Read it with three ideas:

    1. **GQA for free**: the query heads that share a KV head are loaded together as a
       `[GROUP, head_dim]` tile, so each K/V tile is read from memory once for all of them;
    2. **paging inside the loop**: `_kv_tile_offsets` turns logical positions into cache
       addresses through the block table — no gather into a contiguous copy first, which is
       why paging costs almost nothing (3x faster than gather-then-SDPA on the H200);
    3. **online softmax and split-K**: a running max `m`, a running sum `l` and an
       accumulator `acc` let the program stream over the context once; when a batch is too
       small to fill the GPU, the context is split over several programs whose partial
       results `_decode_reduce_kernel` merges by their log-sum-exp (flash-decoding).
    """),
    code("""
    from fleetlab.attention.source import kernel_source

    print(kernel_source("_kv_tile_offsets"))
    print()
    print(kernel_source("_decode_kernel"))
    """),
    md("""
    ## Try next

    - `max_num_seqs=8` for both runs, or output lengths all equal: when does static
      batching catch up?
    - Run `python -m fleetlab bench` (or `make bench`) and re-run section 1.
    - Read `_prefill_kernel` the same way: where does the causal mask come in?
    - Back to **00_tour** with what you know now.
    """),
]

# --------------------------------------------------------------------------- 06
PROTOTYPING = [
    md("""
    # 06 · Prototyping: your own attention backend and scheduling policy

    **You will learn** how to try an idea on the engine without touching its code:

    1. write an attention backend in a cell (decodes and prefills on two code paths, the
       decode path recording how spread out each layer's attention is), register it, and
       check its tokens against the reference backend;
    2. compare two scheduling policies on the same workload: a timeline of each run and the
       latency percentiles users feel, time to first token (TTFT) and time per output
       token (TPOT);
    3. write a scheduling policy of your own in a few lines, register it, and run it.
    """),
    setup("""
    import collections

    from matplotlib.figure import Figure

    from fleetlab.attention.backend import AttentionBackend
    from fleetlab.attention.reference import paged_attention
    from fleetlab.engine.metrics import latency_stats, latency_table
    from fleetlab.engine.policies import SchedulingPolicy, register_policy
    """),
    md("""
    ## 1. A model and a workload

    The trained tiny model, and requests that arrive over the first steps: a mix of long
    sentences and short sums. `serve` adds each request at its arrival step and notes that
    step (the latency figures in section 3 count from it). `ignore_eos=True` makes every
    request run its full `max_tokens`, so every run does the same amount of work.
    """),
    code("""
    model, tokenizer = fleetlab.models.load_tiny()

    # step -> requests arriving then: (prompt, max_tokens[, request id])
    arrivals = {
        0: [("the dog ran to the big red house and sat down.", 8), ("the red cat sat on the mat and ate.", 8),
            ("12+7=", 6)],
        1: [("3+4=", 6), ("6*7=", 6), ("45+38=", 6)],
        3: [("count 1 2 3", 8), ("a cat and a dog sat in the sun by the red house.", 6), ("9-4=", 6)],
        5: [("23+19=", 6), ("8*8=", 6)],
    }
    engine_config = dict(block_size=4, num_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                         record_traces=True)

    def serve(llm, arrivals):
        \"\"\"Add each request at its arrival step, run until all are done.
        Returns (outputs in arrival order, {request id: arrival step}).\"\"\"
        outputs, arrival_steps, step = {}, {}, 0
        while llm.has_unfinished_requests() or step <= max(arrivals):
            for prompt, max_tokens, *request_id in arrivals.get(step, []):
                params = fleetlab.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                rid = llm.add_request(prompt, params, request_id=request_id[0] if request_id else None)
                arrival_steps[rid] = step
            for out in llm.step():
                outputs[out.request_id] = out
            step += 1
        return [outputs[rid] for rid in arrival_steps], arrival_steps
    """),
    md("""
    ## 2. An attention backend in a cell

    A backend subclasses `AttentionBackend` and implements `attend(query, key_cache,
    value_cache, metadata, scale=...)`: `query` is the step's packed queries `[T, heads,
    head_dim]`, the caches are one layer's `[num_blocks, block_size, kv_heads, head_dim]`,
    already holding this step's keys and values (the base class's `forward` wrote them).
    Class attributes tell the engine what the backend needs:

    - `requires_reorder = True`: the engine puts decode rows first, so rows
      `[0, metadata.num_decodes)` are decodes (one query token each) and their queries are
      the first `num_decodes` tokens. That is what makes a two-path backend easy.
    - `supports_sliding_window = False`, `supports_sinks = False`: our decode path ignores
      both, so we say so; patching a model that needs them then fails with a clear error
      instead of computing something wrong.

    **Decodes** take our own path, a dozen lines: gather each row's keys and values through
    its block table, softmax, weighted sum, and on the way the **entropy** of each head's
    attention, divided by its maximum `log(context length)` (1 = spread evenly over the
    whole context, 0 = all on one key), averaged per layer. **Prefills** go to the
    reference kernel `paged_attention` with a metadata of just the prefill rows. The plan
    (slots to gather, masks, that metadata) depends only on the step, so the first layer
    of a step builds it and the others reuse it.
    """),
    code("""
    class SplitBackend(AttentionBackend):
        \"\"\"Decodes on our own path (recording attention entropy), prefills on the reference kernel.\"\"\"

        name = "split"
        requires_reorder = True          # decode rows first
        supports_sliding_window = False  # our decode path ignores windows and sinks
        supports_sinks = False

        def __init__(self):
            super().__init__()
            self.entropy = collections.defaultdict(list)  # layer id -> mean normalized entropy, per step
            self._plan = (None,)

        def forward(self, layer_id, *args, **kwargs):
            self.layer_id = layer_id  # attend() is not told its layer; remember it here
            return super().forward(layer_id, *args, **kwargs)

        def attend(self, query, key_cache, value_cache, metadata, *, scale, sliding_window=None, sinks=None):
            if self._plan[0] is not metadata:  # first layer of a new step
                self._plan = (metadata, *self.plan(metadata))
            _, nd, slots, visible, prefill_metadata = self._plan
            outs = []
            if nd:
                outs.append(self.decode(query[:nd], key_cache, value_cache, slots, visible, scale))
            if prefill_metadata is not None:
                outs.append(paged_attention(query[nd:], key_cache, value_cache, prefill_metadata, scale=scale))
            return paddle.concat(outs) if len(outs) == 2 else outs[0]

        @staticmethod
        def plan(md):
            \"\"\"Decode rows' cache slots [nd, L] and visible keys [nd, 1, L]; the prefill rows' metadata.\"\"\"
            nd, q_lens, seq_lens = md.num_decodes, md.query_lens_host, md.seq_lens_kv_host
            tables = md.block_tables.numpy()  # host copy, once per step
            pos = np.arange(int(seq_lens[:nd].max(initial=1)))
            slots = tables[:nd, pos // md.block_size] * md.block_size + pos % md.block_size
            visible = pos[None, :] < seq_lens[:nd, None]
            prefill = None
            if nd < md.num_reqs:
                prefill = fleetlab.AttentionMetadata.build(q_lens[nd:], seq_lens[nd:] - q_lens[nd:], tables[nd:],
                                                           md.block_size)
            return nd, paddle.to_tensor(np.where(visible, slots, 0)), paddle.to_tensor(visible[:, None]), prefill

        def decode(self, q, key_cache, value_cache, slots, visible, scale):
            \"\"\"One query per row: q [B, H, D] -> [B, H, D].\"\"\"
            B, H, D = q.shape
            kv_heads = key_cache.shape[2]

            def gather(cache):  # [B, H, L, D]; each KV head serves H / kv_heads query heads
                rows = paddle.gather(cache.reshape([-1, kv_heads, D]), slots.flatten())
                return rows.reshape([B, -1, kv_heads, D]).transpose([0, 2, 1, 3]).repeat_interleave(H // kv_heads, 1)

            k, v = gather(key_cache), gather(value_cache)
            scores = paddle.matmul(q.unsqueeze(2) * scale, k, transpose_y=True).squeeze(2)  # [B, H, L]
            probs = paddle.nn.functional.softmax(paddle.where(visible, scores, paddle.full_like(scores, -1e30)), -1)
            entropy = -(probs * paddle.log(probs + 1e-30)).sum(-1)  # [B, H] nats
            context = visible.astype("float32").sum(-1).clip(min=2)  # [B, 1]
            self.entropy[self.layer_id].append(float((entropy / paddle.log(context)).mean()))
            return paddle.matmul(probs.unsqueeze(2), v).squeeze(2)


    fleetlab.register_attention_backend("split", SplitBackend)
    """),
    md("""
    ## 3. Check it against the reference backend

    Serve the same workload twice, once per backend, and compare the greedy tokens. The
    budget of 16 tokens per step makes many steps carry decodes *and* prefill chunks, so
    both paths run in the same step (counted below from the traces).
    """),
    code("""
    runs = {}
    for backend in ["reference", "split"]:
        llm = fleetlab.LLM(model, tokenizer, backend=backend, **engine_config)
        outputs, _ = serve(llm, arrivals)
        runs[backend] = (llm, outputs)
        llm.handle.unpatch()  # the next backend patches the model afresh

    reference_tokens = [o.token_ids for o in runs["reference"][1]]
    split_tokens = [o.token_ids for o in runs["split"][1]]
    print(viz.greedy_table(reference_tokens, split_tokens, decode=tokenizer.decode))
    print("same tokens as the reference:", split_tokens == reference_tokens)
    split_llm = runs["split"][0]
    both = sum(t.num_decodes > 0 and t.num_decodes < len(t.rows) for t in split_llm.traces)
    print(f"steps that ran both paths: {both} of {len(split_llm.traces)}")
    """),
    md("""
    Same tokens: the decode path is right (for these prompts; a parity test in `tests/` is
    the next step before trusting it further). Now what it recorded: each layer's attention
    entropy over the decode steps.
    """),
    code("""
    for layer_id, values in sorted(split_llm.handle.backend.entropy.items()):
        print(f"layer {layer_id}: mean normalized entropy {np.mean(values):.2f} over {len(values)} decode steps")
    """),
    md("""
    A value near 1 means the heads spread their attention almost evenly over the context; a
    lower one, that they pick out a few keys (in a trained model, often the `<bos>` token
    or the digits being added). Which layers spread, which ones pick? That is the kind of
    question a recording backend answers in a few lines.

    ## 4. Two scheduling policies on the same workload

    `fcfs` admits waiting requests in arrival order; `spf` (shortest prompt first) admits
    the shortest waiting prompt. Both run the same requests to the same tokens; what changes
    is who waits. `latency_stats` measures, for each request:

    - **TTFT**, time to first token: from its arrival to its first output token;
    - **TPOT**, time per output token: `(finish - first token) / (tokens - 1)`.

    Each in two clocks. **Steps** come from the traces: they do not depend on how busy the
    CPU is, so they show exactly what the policy changed. **Milliseconds** come from
    `time.perf_counter` (in `RequestOutput.metrics`): what a user feels, but noisy on a
    shared machine, and a step that batches a long prefill takes longer than a decode-only
    one. The table gives p50 / p90 / p99 over the 11 requests.
    """),
    code("""
    handle = fleetlab.patch_model(model)  # one patched model for every run below
    policy_runs, stats = {}, {}
    for policy in ["fcfs", "spf"]:
        llm = fleetlab.LLM(handle, tokenizer, scheduling_policy=policy, **engine_config)
        outputs, arrival_steps = serve(llm, arrivals)
        policy_runs[policy] = llm
        prompt_lens = {o.request_id: len(o.prompt_token_ids) for o in outputs}  # the same in both runs
        stats[policy] = latency_stats(outputs, llm.traces, arrival_steps)
        print(f"{policy}: {len(llm.traces)} steps, {llm.stats()['num_preemptions']} preemptions")
    print(latency_table(stats))
    """),
    md("""
    The two timelines, one above the other (a red `x` is a preemption: the cache holds 16
    blocks of 4 tokens, not enough for two long sentences at once). Under `fcfs` request 0's
    long prompt fills most of the cache; request 1, next in line, does not fit beside it,
    and `fcfs` lets nobody pass it, so the short sums queue behind both: **head-of-line
    blocking**. Under `spf` the short sums go first and the long sentences wait.
    """),
    code("""
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (policy, llm) in zip(axes, policy_runs.items()):
        viz.draw_timeline(llm.traces, ax=ax, title=f"scheduling_policy={policy!r}")
    axes[0].set_xlim(-0.6, max(llm.traces[-1].step for llm in policy_runs.values()) + 0.6)  # the longer run
    fig
    """),
    md("""
    Who gained and who paid, request by request:
    """),
    code("""
    print("req  prompt tokens  TTFT steps: fcfs -> spf")
    for fcfs, spf in zip(stats["fcfs"].requests, stats["spf"].requests):
        print(f"{fcfs.request_id:>3}  {prompt_lens[fcfs.request_id]:>13}  {fcfs.ttft_steps:>17} -> {spf.ttft_steps}")
    """),
    code("viz.draw_latency(stats)"),
    md("""
    Reading the bars: `spf` cuts the median TTFT (most requests are short and no longer
    wait behind long prompts), but the long sentences (requests 0 and 7 above) wait longer
    than under `fcfs`: a policy moves latency between requests. With 11 requests, p99 is
    essentially the slowest one. TPOT in steps is 1.0 for a request that decoded in every
    step after its first token; above 1 it lost steps, here to preemption (its tokens had to
    be recomputed). In milliseconds TPOT also reflects what shared the steps: a decode that
    rides along with a big prefill chunk waits for it.

    ## 5. A policy of your own

    A policy has two methods: `admission_key(request, step)` (the waiting request with the
    smallest key is admitted next) and `pick_victim(running)` (who is preempted when the
    cache is full; the default takes the newest). Here is **round robin by user**: with
    request ids `"user/n"`, every user's first request goes before anyone's second, so one
    user sending a burst cannot make everyone else wait behind it.
    """),
    code("""
    class RoundRobinByUser(SchedulingPolicy):
        \"\"\"Users take turns: everyone's 1st request, then everyone's 2nd, ... (request ids "user/n").\"\"\"

        name = "round-robin"

        def __init__(self):
            self.turn = {}                        # request id -> its rank among its user's requests
            self.seen = collections.Counter()     # user -> requests seen so far

        def admission_key(self, request, step):
            if request.request_id not in self.turn:
                user = request.request_id.split("/")[0]
                self.turn[request.request_id] = self.seen[user]
                self.seen[user] += 1
            return (self.turn[request.request_id], request.arrival_order)


    register_policy("round-robin", RoundRobinByUser)  # now scheduling_policy="round-robin" works
    """),
    md("""
    A user called `bulk` sends six sums at step 0; `alice` and `bob` send one each a step
    later. Two requests run at a time.
    """),
    code("""
    user_arrivals = {0: [(f"{10 + i}+{20 + i}=", 8, f"bulk/{i}") for i in range(6)],
                     1: [("3+4=", 8, "alice/0")], 2: [("6*7=", 8, "bob/0")]}
    user_config = {**engine_config, "num_blocks": 32, "max_num_seqs": 2}
    for policy in ["fcfs", "round-robin"]:
        llm = fleetlab.LLM(handle, tokenizer, scheduling_policy=policy, **user_config)
        outputs, arrival_steps = serve(llm, user_arrivals)
        by_request = {r.request_id: r.ttft_steps for r in latency_stats(outputs, llm.traces, arrival_steps).requests}
        print(f"{policy:>11}: TTFT in steps", by_request)
    handle.unpatch()
    """),
    md("""
    Under `fcfs` Alice and Bob wait for the whole burst; under `round-robin` they are
    admitted as soon as a row frees up, and `bulk` pays for it: its later requests start
    about 8 steps later.

    ## Try next

    - Set `reorder_threshold = 4` on `SplitBackend` so short chunks count as decodes too, and
      extend its decode path to a few queries per row (each sees keys up to its own position);
      check the tokens again.
    - Record something else per layer: the share of attention on the `<bos>` token, or the
      distance to the most attended key.
    - Write "longest waiting first" with `step - request.enqueue_step`, or give
      `RoundRobinByUser` a `pick_victim` that preempts the user with the most running requests.
    - `scheduling_policy="priority"` with `llm.add_request(..., priority=...)`: who gets the
      low TTFT now?
    """),
]

NOTEBOOKS = {
    "00_tour": TOUR,
    "01_attention_patching": PATCHING,
    "02_paged_kv_cache": PAGED,
    "03_input_batch_reorder": REORDER,
    "04_decode_loop": DECODE_LOOP,
    "05_performance": PERFORMANCE,
    "06_prototyping": PROTOTYPING,
}


def build(name: str, cells) -> nbformat.NotebookNode:
    """A stripped notebook with deterministic cell ids."""
    nb = new_notebook(cells=cells)
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    return nb


def main(argv: list[str]) -> int:
    NOTEBOOK_DIR.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        if argv and not any(name.startswith(prefix) for prefix in argv):
            continue
        path = NOTEBOOK_DIR / f"{name}.ipynb"
        nbformat.write(build(name, cells), path)
        print(f"wrote {path.relative_to(NOTEBOOK_DIR.parent)} ({len(cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
