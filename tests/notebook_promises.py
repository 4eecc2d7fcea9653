"""What each notebook's prose promises about its figures, checked on the objects it drew.

``PROMISES[stem]`` is Python run in the notebook's own kernel right after its last cell
(by ``tests/test_notebooks.py``), so it sees the notebook's variables. Each check quotes the
sentence it holds the notebook to. A notebook without an entry is only run.
"""

PROMISES: dict[str, str] = {}

PROMISES["00_why_a_kv_cache"] = '''
# Section 1: the loop "stops when the model writes its end-of-text token"
assert no_cache_ids[-1] == tokenizer.eos_token_id and len(prompt) == 9
# Section 2: "every position they share gets the same logits, to float rounding"
assert prefix_diff < 1e-4, prefix_diff
# Section 3: "the prefill runs the 9 prompt tokens in one pass; every later step, a decode, runs one"; the same
# tokens as the loop without a cache; the timed runs agree
assert cached_tokens == [9] + [1] * 99
assert cached_ids[:len(no_cache_ids)] == no_cache_ids and all(r[0] == cached_ids for r in runs)
# "without the cache the model runs 5,850 tokens to write 100, with it 108"
assert sum(no_cache_work) == 5850 and sum(cached_tokens) == 108 and len(cached_ids) == 100
drawn = {ln.get_gid(): ln for ax in cache_figure.axes for ln in ax.lines if ln.get_gid()}
assert list(drawn["work:no-cache"].get_ydata()) == no_cache_work
assert list(drawn["work:cached"].get_ydata()) == cached_tokens
# "a decode step stays nearly flat as the sequence grows ... a pass over the whole sequence grows with its length:
# by 128 tokens it costs more than a decode step" (medians over stretches: a burst of load on a shared machine
# can slow a few stretches in every run, and the claim is about growth, not about a burst)
assert np.median(decode_ms[-3:]) < 1.5 * np.median(decode_ms[:3]), decode_ms
assert pass_ms[128] > 1.5 * pass_ms[8] and pass_ms[128] > np.median(decode_ms), (pass_ms, decode_ms)
# Section 4: "A pass of 64 tokens costs a few times a pass of one token, not 64 times: per token, prefill is more
# than ten times cheaper"; "a pass of 8 tokens ... costs less than two passes of 1"; "half an operation per byte"
assert pass_ms[64] < 8 * pass_ms[1] and per_token[1] / per_token[64] > 10, pass_ms
assert pass_ms[8] < 2 * pass_ms[1], pass_ms
# Section 3, the timing by measurement (the two timed in alternating rounds): "The engine's own work ... is the
# small part of its step; the forward is most of it, and that forward costs about what a bare pass over a short
# sequence costs (within a factor of two)"; "the lines cross"
assert sum(host_ms.values()) < 0.5 * engine_forward_ms and 0.5 < engine_forward_ms / bare_ms < 2, (
    engine_forward_ms, bare_ms, host_ms)
assert len(early) >= 10 and set(host_ms) == {"schedule", "batch_update", "metadata", "sample", "update"}
assert crossing is not None and crossing > 8
bars = {p.get_gid(): p.get_width() for p in split.axes[0].patches}
assert abs(bars["split:forward"] - engine_forward_ms) < 1e-9 and abs(bars["split:bare"] - bare_ms) < 1e-9
# KV bytes per token: "2 x layers x kv_heads x head_dim x bytes per number", the engine's own cache agreeing
with fleetlab.LLM(model, tokenizer, block_size=4, num_blocks=4) as _small:
    _k = _small.kv_cache.key_cache(0)
    _per_token = 2 * cfg.num_hidden_layers * _k.shape[2] * _k.shape[3] * _k.element_size()
assert kv_bytes_per_token == _per_token == 2048
# "64 requests of 4,096 tokens hold 32 GiB of cache next to 16 GB of weights"
assert weights == 16e9
assert llama8b_kv == 128 * 2**10 and 4096 * llama8b_kv == 2**29 and 64 * 4096 * llama8b_kv == 32 * 2**30
# the roofline: the H200's stored bandwidth; "from 32 requests of 4,096 tokens on, the step reads more KV than
# weights"; "(512) keeps climbing, to about half the ridge at 256 requests; at 4,096 and 32,768 it flattens far
# below it"; tokens/s "capped by the bandwidth divided by the KV bytes each token's attention reads"
assert bandwidth == h200["ceilings"]["read_sum_tbps"] * 1e12 and ridge == peak_flops / bandwidth
assert 16 * 4096 * llama8b_kv < weights < 32 * 4096 * llama8b_kv
def _intensity(b, c):
    bytes_read, flops, _ = decode_step(b, c)
    return flops / bytes_read
assert 0.4 * ridge < _intensity(256, 512) < 0.6 * ridge and _intensity(256, 512) > 1.4 * _intensity(128, 512)
for _c in (4096, 32768):
    assert _intensity(256, _c) < ridge / 5 and _intensity(256, _c) < 1.15 * _intensity(128, _c)
assert all(b / decode_step(b, c)[2] <= bandwidth / (c * llama8b_kv) for b in batches for c in contexts)
drawn = {ln.get_gid() for ln in roofline.axes[1].lines if ln.get_gid()}
assert drawn == {f"intensity:{c}" for c in contexts}
# Section 4's axes: linear tokens, per-token ticks in plain numbers
assert all(ax.get_xscale() == "linear" for ax in pass_figure.axes)
from matplotlib.backends.backend_agg import FigureCanvasAgg as _Canvas
_Canvas(pass_figure).draw()
_labels = [t.get_text() for t in pass_figure.axes[1].get_yticklabels(which="both") if t.get_text()]
assert _labels and not any("10^" in t or "times" in t for t in _labels), _labels

'''

PROMISES["01_tour"] = '''
steps = {t.step: t for t in llm.traces}
first_step = {}
for t in llm.traces:
    for r in t.rows:
        first_step.setdefault(r.request_id, t.step)
finish_step = {rid: t.step for t in llm.traces for rid in t.finished}
# "In step 0 the four rows are taken, so requests 4 and 5 wait."
assert len(steps[0].rows) == 4 and first_step["4"] > 0 and first_step["5"] > 0
# "Request 4 joins in step 2, right after request 2 finishes, and request 5 in step 3"
assert first_step["4"] == 2 == finish_step["2"] + 1 and first_step["5"] == 3
# "so requests 4 and 5 wait: the thin grey bars ... (here: every row was taken)"
waited = {w.request_id: w for w in waits if w.reasons}
assert set(waited) == {"4", "5"} and {r for w in waited.values() for r in w.reasons.values()} == {"rows"}
bars = {p.get_gid() for p in timeline.axes[0].patches if (p.get_gid() or "").startswith("wait:")}
assert bars == {"wait:4:0:rows", "wait:4:1:rows", "wait:5:0:rows", "wait:5:1:rows", "wait:5:2:rows"}
# "steps 2 and 3 run prefill and decode side by side"
assert all({r.phase for r in steps[s].rows} == {"prefill", "decode"} for s in (2, 3))
# "The pool has 48 blocks; this small workload never needs more than a dozen."
assert max(t.num_blocks - t.num_free_blocks for t in llm.traces[:15]) <= 12
# Section 4: "Request 6 ... runs its prompt in two chunks, 24 tokens then the last 8 after
# the 4 it found cached"; "Request 7 ... runs only its last 6 tokens" after 28 cached.
paused = [t for t in llm.traces if t.step in (first_step["6"], first_step["6"] + 1)]
six = [r for t in paused for r in t.rows if r.request_id == "6"]
seven = [r for t in paused for r in t.rows if r.request_id == "7"]
assert [r.num_scheduled_tokens for r in six] == [24, 8] and six[0].num_computed_tokens == 4
assert [r.num_scheduled_tokens for r in seven] == [6] and seven[0].num_computed_tokens == 28
# "Request 6 (36 tokens: <bos> and 35 characters)"; request 7's "first 29 tokens are the same as request 6's"
six_ids, seven_ids = (tokenizer.encode(shared + tail) for tail in ("the dog", "a cat"))
assert len(six_ids) == 36 == six[0].num_prompt_tokens and sum(r.num_scheduled_tokens for r in six) + 4 == 36
assert next(i for i, (x, y) in enumerate(zip(six_ids, seven_ids)) if x != y) == 29
# grey blocks: "their number is the order in which the pool would overwrite them (1 first ...)"
cached_free = [i for i in frame.blocks if i.ref_count == 0 and i.is_cached]
numbers = sorted(int(t.get_text()) for t in pool_figure.axes[0].texts
                 if t.get_bbox_patch() is not None and t.get_text().isdigit())
assert numbers == list(range(1, len(cached_free) + 1))
# "The 7 blocks both requests hold are hatched and marked x2"
assert set(frame.block_tables) == {"6", "7"}
shared_blocks = [i.block_id for i in frame.blocks if i.ref_count == 2]
assert len(shared_blocks) == 7 and set(shared_blocks) <= set(frame.block_tables["7"])
pool_texts = [t.get_text() for t in pool_figure.axes[0].texts]
assert pool_texts.count("x2") == 7
# "requests 6 and 7 each ran a prefill chunk (8 and 6 tokens) on top of the 28 tokens ..."
rows = [(r.req_id, r.phase, r.num_scheduled_tokens, r.num_computed_tokens) for r in batch_rows]
assert rows == [("6", "prefill", 8, 28), ("7", "prefill", 6, 28)]
# "the scheduler plans (schedule()), the model runner executes the plan (_execute ...), the scheduler commits (update)"
step_text = chr(10).join(step_source.lines)
assert step_text.index("self.scheduler.schedule()") < step_text.index("self._execute(sched)") < step_text.index(
    "self.scheduler.update(sched, result)") < step_text.index("observer.on_step")
# "the black line is what is still held after each step: it drops below the bars exactly in the steps where a
# request finished"
_ax = occupancy.axes[0]
_line = next(ln for ln in _ax.lines if ln.get_gid() == "kv:in-use")
_bars = {}
for _p in _ax.patches:
    if (_p.get_gid() or "").startswith("kv:"):
        _bars[int(_p.get_gid().split(":")[2])] = _bars.get(int(_p.get_gid().split(":")[2]), 0) + _p.get_height()
_after = dict(zip(_line.get_xdata(), _line.get_ydata()))
_finished_steps = sorted(t.step for t in llm.traces if t.finished and t.step in _bars)
assert sorted(s for s in _bars if _after[s] < _bars[s]) == _finished_steps, (_bars, _after)
# "0:p7: request 0 runs a 7-token prefill; 1:d1: request 1 decodes one token"
assert viz.describe_step(llm.traces[0]).startswith("step 0: rows [0:p7, 1:p7") and "1:d1" in viz.describe_step(
    llm.traces[1])
# "white blocks are not always taken first: here some of them wait behind cached ones"
_free = [i for i in frame.blocks if i.ref_count == 0]
_white = [i.lru_position for i in _free if not i.is_cached]
_grey = [i.lru_position for i in _free if i.is_cached]
assert _white and _grey and max(_white) > min(_grey)
# "(computed/total in KV cache)"
assert all(r.num_computed_tokens <= r.num_tokens for r in batch_rows if r.phase != "empty")

'''

PROMISES["02_paged_kv_cache"] = '''
# "logical block j ... lives in physical block block_table[j]"; the shuffled pool hands out
# scattered ids, and "the slots ... jump wherever the table jumps"
assert any(b - a != 1 for a, b in zip(a_blocks, a_blocks[1:]))
assert [int(s) for s in slots] == [a_blocks[p // 4] * 4 + p % 4 for p in range(len(a))]
# "b's first two blocks match; the third ... does not"
assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] not in a_blocks
# "Two arrows end in each of the two shared blocks (hatched)"
physical = {p.get_gid(): p for p in shared_mapping.axes[0].patches if (p.get_gid() or "").startswith("physical:")}
hatched = {int(g.split(":")[1]) for g, p in physical.items() if p.get_hatch()}
assert hatched == set(a_blocks[:2])
arrows = [p for p in shared_mapping.axes[0].patches if (p.get_gid() or "").startswith("map:")]
assert len(arrows) == len(a_blocks) + len(b_blocks)
# Section 3: c "still finds the two cached blocks and revives them"
assert c_blocks[:2] == a_blocks[:2]
# the box: "b would share all 10 system-prompt tokens, not the 8 of two full blocks"
assert len(system) == 10 and b[:10] == a[:10] and b[10] != a[10] and b_blocks[:2] == a_blocks[:2]
# the pool's code beside the pictures: allocate_slots touches the hits before it allocates, then registers; free walks
# the table backwards; allocate pops the least recently freed block and evicts it only then
slots_text = str(allocate_slots_source)
assert slots_text.index("self.pool.touch([*hits, *pinned])") < \
    slots_text.index("self.pool.allocate(num_new_blocks)") < \
    slots_text.index("self._cache_known_blocks(") and "return None" in slots_text
assert "for block_id in reversed(ids):" in str(free_source)
_alloc = str(allocate_source)
_forget = 'cache_call(self.prefix_cache, "forget", block_id)'
assert _alloc.index("self._free.popitem(last=False)") < _alloc.index(_forget)
# Section 5: q's insert splits p's edge after 4 blocks, r's after 2; the hash chain holds the same tree, a node a block;
# "Both found the same blocks"; r "shares 9 tokens with p", q 17
assert [len(trees["radix", rid]) for rid in "pqr"] == [1, 3, 5]
assert [n.block_ids for n in trees["radix", "q"]][0] == (0, 1, 2, 3)
assert [n.block_ids for n in trees["radix", "r"]][0] == (0, 1)
# "The radix tree holds two blocks more: the tail pages of p and q ... (p's edge ends in one of 3 tokens, q's in
# one of 2)"
assert len(trees["hash", "r"]) == sum(len(n.block_ids) for n in trees["radix", "r"]) - 2
assert sorted(len(n.token_ids) % 4 for n in trees["radix", "r"] if len(n.token_ids) % 4) == [2, 3]
assert all(n.held for n in trees["radix", "r"] if n.block_ids[0] in (0, 12))
# "the radix tree hit 2 tokens more above, one for q and one for r"
assert design_hits["radix"] == design_hits["hash"] + 2 and design_hits["hash"] > 0
# the chat: "turn 1 wrote the K/V of its 29 prompt tokens and 11 of its 12 answer tokens ... 40 tokens"; "The hash
# chain gave turn 2 the 32 tokens of the 2 full blocks; the radix tree 40"; "The answers are the same tokens"
assert len(tokenizer.encode("the old man sat by the road.")) == 29
assert chat["hash"][0] == 32 and chat["radix"][0] == 40 and chat["hash"][2] == chat["radix"][2]
assert chat["hash"][1] - chat["radix"][1] == 8
_ids = {rid: tokenizer.encode(text) for rid, text in tree_prompts.items()}
_common = lambda x, y: next(i for i, (s, t) in enumerate(zip(x, y)) if s != t)  # noqa: E731
assert _common(_ids["p"], _ids["r"]) == 9 and _common(_ids["p"], _ids["q"]) == 17
# Section 6: "the rest to blocks of bytes_per_block"
assert sizing.num_blocks == left // sizing.bytes_per_block == sized_stats["num_blocks"]
# Section 4, n = 3: "a red cat is 10 tokens: 2 full blocks of 4, and 2 more in a third, partial block"; "the first
# child computed all 10 prompt tokens, the other two only the last 2"; blocks 0 and 1 held by all three, a third block
# each of its own; "10 prompt tokens instead of 14"; copy-on-write's fork: all three point at the same three blocks
first_child, *others = list(at_prompt)
assert len(tokenizer.encode(prompt)) == 10 and computed == {first_child: 10, **{c: 2 for c in others}}
assert len({tuple(t[:2]) for t in at_prompt.values()}) == 1 and len({t[2] for t in at_prompt.values()}) == 3
assert at_prompt[first_child][:2] == [0, 1] and at_prompt[first_child][2] == 2 and sum(computed.values()) == 14
assert all(t == at_prompt[first_child] for t in viz.fork_tables(at_prompt, 10, 4).values())
assert all(now[c][:3] == at_prompt[c] and len(now[c]) == 4 for c in now) and set(kv_tokens.values()) == {15}
marks = {p.get_gid() for ax in fork_figure.axes for p in ax.patches if (p.get_gid() or "").startswith("mark:")}
assert marks == {f"mark:{panel}:{c}:2" for panel in ("prefix-prompt", "prefix-now", "cow-now") for c in others}
cow_labels = [t.get_text() for t in fork_figure.axes[1].texts]
assert cow_labels.count("2 x3") == 3 and cow_labels.count("0 x3") == 3
assert len(set(answers.values())) == 3
# Section 6: "ceil(192 / block_size) blocks: 192 token slots when the block size divides 192, a few more otherwise"
# and "block size 25 with three 64-token prompts ... need 9 blocks (225 slots) and the pool has 8 (200); the
# picture says so". The sliders never leave a stale or broken picture.
sliders = explore.controls
for name in ("prompt_a", "prompt_b", "prompt_c"):
    sliders[name].value = 64
for size in (1, 5, 7, 16, 25, 32):
    sliders["block_size"].value = size
    assert explore.error is None, (size, explore.error)
    title = explore.figure.axes[0].get_title()
    slots = int(title.split("= ")[1].split()[0])
    assert 192 <= slots < 192 + size and (slots == 192) == (192 % size == 0), title
    texts = " ".join(t.get_text() for t in explore.figure.axes[0].texts)
    assert ("does not fit" in texts) == (3 * -(-64 // size) > -(-192 // size)), (size, texts)
sliders["block_size"].value = 25
assert "need 9 blocks of 25" in explore.figure.axes[0].texts[-1].get_text()
assert "8 blocks x 25 = 200 token slots" in explore.figure.axes[0].get_title()
# "large blocks waste more in each request's last block (the hatched part of its last square)"
sliders["prompt_a"].value, sliders["prompt_b"].value, sliders["prompt_c"].value = 23, 41, 7
for size, empty in ((8, 3), (1, 0), (32, 3)):
    sliders["block_size"].value = size
    hatched = [p for p in explore.figure.axes[0].patches if (p.get_gid() or "").startswith("empty:")]
    assert len(hatched) == empty, (size, len(hatched))
# section 2: "its 3 full blocks become shareable" (printed, not a bare value)
assert newly_cached == 3 == len(a) // 4
# section 6's static figures: "block size 25 with three 64-token prompts: they need 9 blocks (225 slots) and the pool
# has 8 (200)"; the starting point fits
_tight = " ".join(t.get_text() for t in paging_tight.axes[0].texts)
assert "does not fit" in _tight and "9 blocks of 25" in _tight and "(225 slots), the pool has 8" in _tight
assert "does not fit" not in " ".join(t.get_text() for t in paging_start.axes[0].texts)

'''

PROMISES["03_attention_patching"] = '''
# "Request 0's first four tokens land in block 7 (slots 28-31) and its fifth in block 2 (slot 8)"
assert md.slot_mapping.numpy()[:5].tolist() == [28, 29, 30, 31, 8]
# "request i's tokens are [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of the packed sequence"
assert list(md.cu_seqlens_q_host) == [0, 5, 16, 24]
# Parity: "sits a few times above the dashed line, one float32 rounding step at the size of these logits ... and under
# ten such steps everywhere"; "A layout bug would show as a difference of the logits' own size, about a million
# times higher"
report = viz.logits_parity(ref_logits, paged_logits)
largest = float(abs(np.concatenate([a.ravel() for a in ref_logits])).max())
step = np.finfo(np.float32).eps * max(largest, 1e-30)
worst = [float(max(d)) for d in report.per_step]
assert all(1 < w / step < 10 for w in worst) and report.max_abs_diff < 10 * step and paged_tokens == ref_tokens
assert 3e5 < largest / report.max_abs_diff < 3e6, largest / report.max_abs_diff
legend = [t.get_text() for t in parity_figure.axes[1].get_legend().get_texts()]
assert legend[1:] == ["request 0", "request 1", "request 2"]
# The packed mask of step 2: "requests 0 and 1 decode while request 2's 14-token prompt runs its second chunk";
# "Block-diagonal"; a decode row "sees its whole context"; "The chunk's 6 queries all see the 6 positions cached by
# step 1 ... a lower triangle"; "Of the 8 x 24 pairs only 7 + 5 + 57 = 69 are visible"
assert [(r.request_id, r.phase, r.num_scheduled_tokens, r.num_computed_tokens) for r in mixed.rows] == [
    ("0", "decode", 1, 6), ("1", "decode", 1, 4), ("2", "prefill", 6, 6)] and len(mask_prompts[2]) == 14
assert len(step_masks) == len(mask_llm.traces) == 3 and mixed.step == 2
assert not mixed_mask.visible[mixed_mask.query_row[:, None] != mixed_mask.key_row[None, :]].any()
assert mixed_mask.block(0).all() and mixed_mask.block(1).all()
chunk = mixed_mask.block(2)
assert chunk[:, :6].all() and (chunk[:, 6:] == np.tri(6, dtype=bool)).all()
assert mixed_mask.visible.shape == (8, 24) and mixed_mask.visible.sum() == 7 + 5 + 57 == 69
# the keys this step writes sit in the slots of the trace's block tables (the mask reads the step's own metadata)
written = [row.block_ids[p // 4] * 4 + p % 4 for row in mixed.rows
           for p in range(row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens)]
assert [int(x) for x in mixed_mask.key_slot[~mixed_mask.key_cached]] == written
'''

PROMISES["04_input_batch_reorder"] = '''
from fleetlab.lab.lessons.row_moves import unpermute as _unpermute  # noqa: F401  (the notebook's import)

split_before, split_after = viz.token_split(rows_before), viz.token_split(rows_after)
# "here T = 37 tokens"; "Before, only row a is in the decode kernel's range: the five other decodes
# (d, f, g, h, j) sit ... inside the prefill kernel's range (hatched)"
assert split_before.num_tokens == split_after.num_tokens == 37
assert split_before.num_decode_tokens == 1 and sorted(split_before.stranded) == list("dfghj")
hatched = {p.get_gid().split(":")[2] for p in token_axis.axes[0].patches
           if (p.get_gid() or "").startswith("token:before:") and p.get_hatch()}
assert hatched == set("dfghj")
# "After the reorder the six decodes come first (tokens 0-5) and the prefill kernel takes tokens 6-36."
assert split_after.num_decodes == 6 and split_after.num_decode_tokens == 6 and not split_after.stranded
# "That cut is what the step's AttentionMetadata computes"
for rows, split in ((rows_before, split_before), (rows_after, split_after)):
    md = fleetlab.AttentionMetadata.build([r.num_scheduled_tokens for r in rows], [r.num_computed_tokens for r in rows],
                                          [r.block_table + [-1] * (8 - len(r.block_table)) for r in rows], 4)
    assert (md.num_decodes, md.num_decode_tokens) == (split.num_decodes, split.num_decode_tokens)
# Section 3: "not stable ... (j jumped ahead of d)"; "A stable partition ... moves more rows (twice as many)"
order = [r.req_id for r in frames[-1].records]
assert order.index("j") < order.index("d")
# "every frame side by side: the rows each frame moved are outlined in red"
assert [ax.get_title().split(":")[0] for ax in reorder_strip.axes] == [str(i) for i in range(len(frames))]
for i, frame in enumerate(frames):
    red = {int(p.get_gid().split(":")[2]) for p in reorder_strip.axes[i].patches
           if (p.get_gid() or "").startswith("strip:") and p.get_linewidth() > 2}
    assert red == set(frame.moved), (i, red, frame.moved)
# the code beside the strip: condense moves the live rows with one move_rows, which copies every registered field;
# two_pointer_swaps pairs lefts with reversed rights: "frames 2 and 3 above"
assert "self.move_rows(np.arange(n), live)" in str(condense_source)
assert "for buf in self._np.values():" in str(move_source) and "buf[dst] = buf[src]" in str(move_source)
assert "two_pointer_swaps(mask)" in str(reorder_source) and "self.move_rows(dst, src)" in str(reorder_source)
_b = make_batch()
_b.condense()
_lefts, _rights = two_pointer_swaps(_b.is_decode())
assert [set(f.moved) for f in frames[2:]] == [{int(lo), int(hi)} for lo, hi in zip(_lefts, _rights)]
# "the cell after it times them on this machine against the play interval"
assert len(frame_s) == len(frames) and np.median(frame_s) < reorder_player.play.interval / 1000, frame_s
moved = {}
for stable in (False, True):
    b = make_batch()
    b.condense()
    perm, _ = stable_reorder(b) if stable else b.reorder_split_prefill_and_decode()
    moved[stable] = int((perm != np.arange(len(perm))).sum())
assert moved[True] == 2 * moved[False], moved
# Section 5: "request 2's prompt got only the last token of the step's budget, a prefill chunk of 1 token,
# and the reorder counted it as a decode"
assert rows_by_id["2"].num_scheduled_tokens == 1 and rows_by_id["2"].phase == "prefill"
assert step0.order_after[0] == "2" and step0.num_decodes == 1 and step0.num_batched_tokens == 16
'''

PROMISES["05_decode_loop"] = '''
# "the long prompt of request 1 split over steps 0-2 (chunked prefill)"
assert [t.step for t in traces for r in t.rows if r.request_id == "1" and r.phase == "prefill"] == [0, 1, 2]
# "preempts the newest running request (request 2 in step 7, request 5 in step 16, request 6 in steps 18 and 21)"
assert [(r, t.step) for t in traces for r in t.preempted] == [("2", 7), ("5", 16), ("6", 18), ("6", 21)]
# Section 3: "Request 2 ... had generated 5 tokens when it was preempted in step 7. It comes back in step 10,
# finds its first block (4 tokens) cached and recomputes the other 6 of its 10 tokens. Request 6 ... comes
# back with 8, then 20 of its tokens cached, and runs 20 + 16 + 11 = 47."
back = [a for a in viz.admissions(traces, block_size=4) if a.resumed]
two = next(a for a in back if a.request_id == "2")
assert (two.step, two.num_cached_tokens, len(two.cached_block_ids), two.chunks) == (10, 4, 1, [6])
assert sum(r.request_id == "2" and r.phase == "decode" for t in traces if t.step < 7 for r in t.rows) == 4
six = [a for a in back if a.request_id == "6"]
assert [a.num_cached_tokens for a in six] == [8, 20] and six[-1].chunks == [16, 11] and six[-1].rebuilt
assert len(outputs[6].prompt_token_ids) == 47
# Section 4: "the blocks a returning request takes back from the cache outlined in green (steps 10, 17, 20, 23)"
assert sorted({a.step for a in viz.admissions(traces, block_size=4) if a.cached_block_ids}) == [10, 17, 20, 23]
replay.slider.value = [t.step for t in traces].index(10)
assert replay.error is None
outlined = {p.get_gid() for ax in replay.figure.axes for p in ax.patches if (p.get_gid() or "").startswith("revived:")}
assert outlined == {f"revived:{b}" for b in two.cached_block_ids}
# "empty on a preemption (the freed blocks turn grey, still cached)": after step 7 request 2 holds nothing
frame7 = next(f for f in pool_frames if f.step == 7)
assert "2" not in frame7.block_tables and any(i.is_cached and i.ref_count == 0 for i in frame7.blocks)
# Section 2: the queue drawn is the engine's own, before every step
assert all(len(viz.queue_before(waits, s)) == n for s, n in waiting_before.items())
why = {(w.request_id, w.after_preemption): w for w in waits}
def _steps(rid, reason):
    return sorted(s for s, r in why[rid, False].reasons.items() if r == reason)
# "request 2 waits two steps for tokens"; "Requests 3 and 4 arrive in step 3 and wait seven steps: ... the pool
# (it stays full through step 9, and in step 7 the scheduler even preempts request 2"
assert why["2", False].reasons == {0: "budget", 1: "budget"}
for rid in ("3", "4"):
    assert why[rid, False].start == 3 and why[rid, False].end == 10 and len(why[rid, False].reasons) == 7
    assert _steps(rid, "pool") == [3, 4, 5, 6, 8, 9] and _steps(rid, "preemption") == [7]
full = [t for t in traces if t.step in (3, 4, 5, 6, 8) and not t.finished]
assert full and all(t.num_free_blocks < 2 for t in full)  # the smallest waiting prompt (7 tokens) needs 2 blocks
assert ("2", 7) in [(r, t.step) for t in traces for r in t.preempted]
# "Requests 5 and 6 arrive in step 6 ...; request 5 waits one more step for the budget, and request 6 ... finds every
# row taken (steps 11-15)"
assert why["5", False].start == why["6", False].start == 6
assert _steps("5", "budget") == [10] and why["5", False].end == 11
assert _steps("6", "rows") == [11, 12, 13, 14, 15]
drawn = {p.get_gid() for p in timeline.axes[0].patches if (p.get_gid() or "").startswith("wait:")}
assert drawn == {f"wait:{w.request_id}:{s}:{r}" for w in waits for s, r in w.reasons.items()}
# the code beside the picture: "admits nobody after a preemption (if not out.preempted_req_ids)"; the while line
# holds "budget > 0" and "len(self.running) < self.max_num_seqs"; "n = min(remaining, budget)"; allocate_slots ... break
assert "if not out.preempted_req_ids:" in str(schedule_source)
admission_text = chr(10).join(admission_source.lines)
while_line = admission_source.lines[0]
assert while_line.strip().startswith("while") and "budget > 0" in while_line
assert "len(self.running) < self.max_num_seqs" in while_line and "n = min(remaining, budget)" in admission_text
assert admission_text.index("self.kv.allocate_slots(") < admission_text.index("break", admission_text.index(
    "self.kv.allocate_slots(")) < admission_text.index("self.running.append(req)")
# Section 4: the strip's key steps, with what the prefix cache gave back outlined
strip_steps = [ax.get_gid() for ax in pool_strip.axes if ax.get_visible()]
assert strip_steps == [f"pool-step:{s}" for s in (6, 7, 10, 16, 17, 23)]
outlined_at = {ax.get_gid(): {p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("revived:")}
               for ax in pool_strip.axes if ax.get_visible()}
assert outlined_at["pool-step:10"] == {f"revived:{b}" for b in two.cached_block_ids}
assert len(outlined_at["pool-step:23"]) == 5 and not outlined_at["pool-step:7"]
# the player's frames, timed on this machine, fit its play interval
assert len(frame_s) == len(traces) and np.median(frame_s) < replay.play.interval / 1000, frame_s
# Section 5: every text the same as the roomy run's, which never preempts
assert all(t.token_ids == f.token_ids for t, f in zip(outputs, roomy_outputs))
assert roomy.stats()["num_preemptions"] == 0 and len(roomy.traces) < len(traces)
# Section 2, the preemption half: the code shown holds what the prose says it does
running_text = str(running_source)
assert "self.policy.pick_victim(self.running)" in running_text and "self._preempt(victim, out)" in running_text
assert "budget += out.num_scheduled_tokens.pop(victim.request_id, 0)" in running_text
assert "if victim is req:" in running_text and "self.kv.allocate_slots(" in running_text
assert "min(n, budget" in str(new_tokens_source) and "num_computed_tokens" in str(new_tokens_source)
assert "return running[-1]" in str(victim_source)
assert "req.num_computed_tokens = 0" in str(preempt_source) and "self.waiting.append(req)" in str(preempt_source)
assert "self.kv.free(req)" in str(preempt_source)
# "After step 6 the pool has no free block. In step 7 request 0 comes first: its next token starts a fourth block
# ... pick_victim returns request 2 ... frees its three blocks. Request 0 then takes one of them (block 13),
# request 1 another (block 10), and nobody is admitted: two rows run."
assert all(i.ref_count > 0 for i in frame6.blocks)
zero = next(r for r in traces[7].rows if r.request_id == "0")
assert len(frame6.block_tables["0"]) == 3 and zero.num_computed_tokens == 3 * 4
assert traces[7].preempted == ["2"] and len(frame6.block_tables["2"]) == 3 and len(traces[7].rows) == 2
assert set(frame7.block_tables["0"]) - set(frame6.block_tables["0"]) == {13}
assert set(frame7.block_tables["1"]) - set(frame6.block_tables["1"]) == {10}
assert {13, 10} < set(frame6.block_tables["2"])
# Section 4: "of its three blocks only block 9 stays grey (free, still cached): blocks 10 and 13 go straight to
# requests 1 and 0"; "in step 17 it comes back, takes its block 7 from the cache (outlined) and finishes in the
# same step, so the panel draws its blocks free again"
info7 = {i.block_id: i for i in frame7.blocks}
assert set(frame6.block_tables["2"]) == {9, 10, 13} and info7[9].ref_count == 0 and info7[9].is_cached
assert outlined_at["pool-step:17"] == {"revived:7"} and "5" in traces[17].finished
frame17 = next(f for f in pool_frames if f.step == 17)
assert "5" not in frame17.block_tables and {i.block_id: i for i in frame17.blocks}[7].ref_count == 0
# the occupancy figure: "the black line is what is still held after the step. The line drops below the bars exactly
# in the steps where a request finished ... step 9, where requests 0 and 1 finish"
ax = occupancy.axes[0]
line = next(ln for ln in ax.lines if ln.get_gid() == "kv:in-use")
bars = {}
for patch in ax.patches:
    if (patch.get_gid() or "").startswith("kv:"):
        _, _rid, _step = patch.get_gid().split(":")
        bars[int(_step)] = bars.get(int(_step), 0) + patch.get_height()
held_after = dict(zip(line.get_xdata(), line.get_ydata()))
below = sorted(s for s in bars if held_after[s] < bars[s])
assert below == sorted(t.step for t in traces if t.finished), (below, bars, held_after)
assert all(held_after[s] <= bars[s] for s in bars) and traces[9].finished == ["0", "1"]
# Section 6: the reference answer agrees with the engine at every step; "about 45 lines"; preempting the oldest
# "agrees with the engine until the first step that preempts, and the check stops there"
import inspect as _inspect
assert mismatch is None and 40 <= len(_inspect.getsource(toy_schedule).splitlines()) <= 50
assert not exercise_llm.config.enable_prefix_caching and any(t.preempted for t in exercise_llm.traces)
first_preemption = next(t for t in exercise_llm.traces if t.preempted)
assert wrong.step == first_preemption.step and wrong.engine.preempted == first_preemption.preempted
assert wrong.toy.preempted != first_preemption.preempted
'''

PROMISES["06_performance"] = '''
from pathlib import Path as _Path

# "viz.results_dir() finds that folder from the installed package, wherever the notebook runs"
assert _Path(viz.results_dir()).resolve() == (_Path(fleetlab.__file__).resolve().parents[1] / "benchmarks" / "results")
assert "bench" in results and ("bench", "summary") in result_figures
# "for the two model sizes README lists (Llama 1.0M and 3.4M parameters)"
labels = [t.get_text() for t in result_figures["bench", "summary"].axes[0].get_xticklabels()]
assert labels == ["Llama 1.0M params", "Llama 3.4M params"], labels
readme = (_Path(fleetlab.__file__).resolve().parents[1] / "README.md").read_text()
assert all(label.replace(" params", "").replace("Llama ", "Llama ") in readme for label in labels)
# Bandwidth: "reads a little faster than the dashed line" at long contexts, batch >= 64; nothing crosses 4.8
if "h200_triton" in results:
    h200 = results["h200_triton"]
    ceiling = h200["ceilings"]["read_sum_tbps"]
    big = [r["triton_tbps"] for r in h200["decode_bandwidth"] if r["batch"] >= 64 and r["context"] >= 8192]
    assert big and all(v > ceiling for v in big)
    assert max(v for r in h200["decode_bandwidth"] for k, v in r.items() if k.endswith("_tbps")) < 4.8
    # "as fast as SDPA ... from batch 16 up, far faster at batch 1 (3.35 TB/s at 32k against SDPA's 0.35), and at least
    # 2.6 times as fast as gathering"; "an older copy of the same kernel ... lies on the red one"
    _bw = h200["decode_bandwidth"]
    assert all(abs(r["triton_tbps"] / r["sdpa_tbps"] - 1) < 0.1 for r in _bw if r["batch"] >= 16)
    _one = next(r for r in _bw if (r["batch"], r["context"]) == (1, 32768))
    assert (round(_one["triton_tbps"], 2), round(_one["sdpa_tbps"], 2)) == (3.35, 0.35)
    assert min(r["triton_tbps"] / r["gather_sdpa_tbps"] for r in _bw) >= 2.6
    assert all(abs(r["before_tbps"] / r["triton_tbps"] - 1) < 0.03 for r in _bw)
# Launch costs: "One attention call costs the host 10-22 µs and a whole layer's call 32-49 µs, against 71-146 µs for
# the older kernels ..., and 30-53 µs for one call of torch's SDPA"; "at 4 × 4k ... 1.45 ms ... 0.91 ms (1.6x); the
# larger batches are within 5% of their graph, and a single row at 32k context within 14%"
if "h200_triton" in results:
    _span = {k: (min(v), max(v)) for k, v in host.items()}
    assert 10 <= _span["triton_host_us"][0] and _span["triton_host_us"][1] < 22.5
    assert 31.5 <= _span["layer_host_us"][0] and _span["layer_host_us"][1] < 49.5
    assert 71 <= _span["before_host_us"][0] and _span["before_host_us"][1] < 146.5
    assert 29.5 <= _span["sdpa_host_us"][0] and _span["sdpa_host_us"][1] < 53.5
    _steps = {(r["batch"], r["context"], r["prefill_chunk"]): r for r in h200["decode_step"]}
    _small = _steps[4, 4096, 0]
    assert (round(_small["eager_step_ms"], 2), round(_small["graph_step_ms"], 2)) == (1.45, 0.91)
    assert round(_small["graph_speedup"], 1) == 1.6 and _steps[1, 32768, 0]["graph_speedup"] < 1.14
    assert all(r["graph_speedup"] < 1.05 for r in h200["decode_step"] if r["batch"] >= 32)
    assert {p.get_gid() for ax in launch_figure.axes for p in ax.patches if (p.get_gid() or "").startswith("step:")}
# the bandwidth panels draw the graph clock only, each line named in words
_bandwidth = result_figures.get(("h200_triton", "bandwidth"))
if _bandwidth is not None:
    from fleetlab.lab.viz.results import IMPLEMENTATION_NAMES as _NAMES
    _labels = {t.get_text() for t in _bandwidth.legends[0].get_texts()}
    assert {_NAMES[i] for i in ("triton", "sdpa", "gather_sdpa", "before")} <= _labels
    assert not any("eager" in _label for _label in _labels)
# Rows: "the rows of the short ones go idle"; continuous rows "stay busy until the queue runs dry at the end"
static_idle = viz.idle_row_steps(static_llm.traces, 4)
continuous_idle = viz.idle_row_steps(continuous_llm.traces, 4)
assert static_idle > 2 * continuous_idle
last_admission = max(a.step for a in viz.admissions(continuous_llm.traces))
assert all(len(t.rows) == 4 for t in continuous_llm.traces if t.step <= last_admission)
# "continuous batching needs about a third fewer steps"; "in exactly the same steps every run"
assert 0.25 <= 1 - continuous.num_steps / static.num_steps <= 0.4, (static.num_steps, continuous.num_steps)
assert {r.num_steps for r in runs if r.name == static.name} == {static.num_steps}
assert {r.num_steps for r in runs if r.name == continuous.name} == {continuous.num_steps}
assert sum(r.name == static.name for r in runs) == sum(r.name == continuous.name for r in runs) == 3
# "In CPU time, continuous batching's best run needs less than static batching's best"
cpu = {name: [r.cpu_s for r in runs if r.name == name] for name in (static.name, continuous.name)}
assert min(cpu[continuous.name]) < min(cpu[static.name]), cpu
# Section 2: "The model's forward pass takes most of the steps' time"
assert shares["forward"] > 0.5, shares
# Section 4: "the twenty lines below, and the fold they call, read from the kernel file as it is now"
assert 15 <= len(loop.lines) <= 25 and "_online_softmax(" in loop.lines[-1] and "for n0 in range" in str(loop)
assert "_kv_tile_offsets(" in str(loop) and fold.name == "_online_softmax" and len(fold.lines) <= 10
assert (_Path(fleetlab.__file__).resolve().parents[1] / loop.path).is_file()
# Section 4, Hopper prefill: "0.92x" on 1 x 8k, "1.5x" after 8k cached, "0.70-0.71x" on 8 x 2k and 32 x 512, other
# layouts "0.84-0.92x at head dim 64 and 128, 0.74x at head dim 256", before "0.58-0.61x"; the loop read from the file
assert "warpgroup_mma(q_smem" in str(viz.source_excerpt("_attend", "fleetlab.attention.gluon_ws_prefill"))
if prefill_rows:
    _pf = {(r["rows"], r["chunk"], r["context"], r["num_heads"], r["head_dim"]): r for r in prefill_rows}
    assert {r["config"]["kernel"] for r in prefill_rows} == {"gluon_ws"}
    assert round(_pf[1, 8192, 0, 32, 128]["ratio_vs_sdpa_best"], 2) == 0.92
    assert round(_pf[1, 512, 8192, 32, 128]["ratio_vs_sdpa_best"], 1) == 1.5
    assert all(0.695 <= _pf[k]["ratio_vs_sdpa_best"] < 0.715 for k in ((8, 2048, 0, 32, 128), (32, 512, 0, 32, 128)))
    _other = [r["ratio_vs_sdpa_best"] for r in prefill_rows if r["chunk"] in (6144, 3072, 700, 4096)]
    assert 0.835 <= min(_other) and max(_other) < 0.925, _other
    assert round(_pf[4, 2048, 0, 16, 256]["ratio_vs_sdpa_best"], 2) == 0.74
    _causal = [r for r in prefill_rows if r["context"] == 0 and r["chunk"] in (8192, 2048, 512)
               and r["num_heads"] == 32]
    _before = [r["sdpa_best_ms"] / r["before_ms"] for r in _causal]
    assert 0.575 <= min(_before) and max(_before) < 0.615, _before
# Section 5: "One read per step ... and between five and ten uploads"; a plain decode step uploads five
assert counts and all(reads == 1 for reads, _ in counts) and all(5 <= u <= 10 for _, u in counts), counts
assert (1, 5) in counts, counts
# "The stored run (22.7 ms a step at batch 4) has its own workload (64-128-token prompts, 48 tokens out,
# 16-token blocks)": live milliseconds are not compared with it (they move with the machine's load)
_bench = results["bench"]
_b4 = next(r for r in _bench["step_breakdown"] if r["batch_size"] == 4)
assert round(_b4["ms_per_step"]["total"], 1) == 22.7 and _bench["config"]["breakdown_prompt_len"] == [64, 128]
assert _bench["config"]["breakdown_output_len"] == 48 and _bench["config"]["block_size"] == 16

'''

PROMISES["07_prototyping"] = '''
# "Same tokens"; "both paths run in the same step"
assert split_tokens == reference_tokens and both > 0
fcfs_traces = policy_runs["fcfs"].traces
first = {}
for t in fcfs_traces:
    for r in t.rows:
        first.setdefault(r.request_id, t.step)
zero_done = next(t.step for t in fcfs_traces if "0" in t.finished)
# "Request 1 ... starts beside it in step 2 ... in step 4 the scheduler preempts request 1, the newest"
assert first["1"] == 2 and ("1", 4) in [(r, t.step) for t in fcfs_traces for r in t.preempted]
# "the short sums queue behind both until request 0 finishes"
assert all(first[r] > zero_done for r in ("2", "3", "4"))
# "request 1 (36 tokens) comes back in step 10 with 12 of them cached and runs chunks of 16 and 8"
back = next(a for a in viz.admissions(fcfs_traces, block_size=4) if a.resumed and a.request_id == "1")
assert (back.step, back.num_cached_tokens, back.chunks) == (10, 12, [16, 8]) and prompt_lens["1"] == 36
# "a request preempted while decoding may find all but its newest token cached and decode at once"
assert any(a.resumed and a.rebuilt and not a.chunks for a in viz.admissions(fcfs_traces, block_size=4))
# "the long sentences (requests 0 and 7 above) wait longer than under fcfs"; "The step panels have no whiskers:
# steps are the same in every run"
ttft = {p: {r.request_id: r.ttft_steps for r in runs[0].requests} for p, runs in stats.items()}
assert all(ttft["spf"][r] > ttft["fcfs"][r] for r in ("0", "7"))
assert ttft["spf"]["2"] < ttft["fcfs"]["2"]
for runs in stats.values():
    assert len(runs) == 3 and all([r.ttft_steps for r in s.requests] == [r.ttft_steps for r in runs[0].requests]
                                  and [r.tpot_steps for r in s.requests] == [r.tpot_steps for r in runs[0].requests]
                                  for s in runs)
# "In milliseconds TTFT follows the steps: the middle of the three spf runs' medians is below the middle of the fcfs
# runs'"; "TPOT's median is 1.0 step under both policies"
assert np.median([s.ttft_s.p50 for s in stats["spf"]]) < np.median([s.ttft_s.p50 for s in stats["fcfs"]])
assert all(s.tpot_steps.p50 == 1.0 for runs in stats.values() for s in runs)
# the timelines' waits: fcfs "request 1 ... waits two steps for tokens"; "preempts request 1 ... the pool stays full
# (steps 5-9)"; "the short sums that arrived in steps 0 and 1 queue behind both until request 0 finishes"
fw = {(w.request_id, w.after_preemption): w for w in waits["fcfs"]}
assert fw["1", False].reasons == {0: "budget", 1: "budget"} and fw["1", False].end == 2
assert set(fw["1", True].reasons) == {5, 6, 7, 8, 9} and set(fw["1", True].reasons.values()) == {"pool"}
assert all(fw[r, False].end > zero_done for r in ("2", "3", "4", "5"))
# spf: "the sum 12+7= (request 2) goes first in step 0, and request 1, at 36 tokens shorter than request 0's 47, takes
# the rest of the budget. Request 0 waits: for the budget, then for room in the pool, then for a row ...; it starts in
# step 16. Request 7, the longest sentence (49 tokens), waits longer still."
sw = {(w.request_id, w.after_preemption): w for w in waits["spf"]}
spf_step0 = policy_runs["spf"].traces[0]
assert [r.request_id for r in spf_step0.rows] == ["2", "1"] and spf_step0.num_batched_tokens == 16
assert (prompt_lens["0"], prompt_lens["1"], prompt_lens["7"]) == (47, 36, 49)
reasons0 = [sw["0", False].reasons[s] for s in sw["0", False].steps]
assert reasons0[:3] == ["budget"] * 3 and "pool" in reasons0 and "rows" in reasons0 and sw["0", False].end == 16
assert sw["7", False].end > sw["0", False].end
# "Both timelines list the requests in the same order (by id, top down)": the same lane is the same request
def _lanes(ax):
    return {p.get_gid().split(":")[1]: p.get_y() for p in ax.patches
            if (p.get_gid() or "").startswith(("prefill:", "decode:"))}
_l0, _l1 = (_lanes(ax) for ax in policy_figure.axes[:2])
assert _l0 and {r: round(y) for r, y in _l0.items()} == {r: round(y) for r, y in _l1.items()}

'''

PROMISES["08_speculative_decoding"] = '''
# Section 1: "Same texts, in 5 steps instead of 19"; "proposed 48 tokens and the target accepted 44 of them
# (0.92)"; "4.67 tokens on average"; by position "1.0, 0.92, 0.92, 0.83"
assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
assert plain.stats()["num_steps"] == 19 and stats["num_steps"] == 5
assert (stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (48, 44)
assert round(stats["spec_mean_acceptance_length"], 2) == 4.67
assert [round(a, 2) for a in stats["spec_acceptance_by_position"]] == [1.0, 0.92, 0.92, 0.83]
# Section 2, draft: request 0 "gets its 13 tokens in 4 target forwards: the prefill, then two steps in which the
# target accepts all four drafts and adds a bonus token ..., then a step that ends at the EOS; the two drafts after
# the EOS are cut"
costs = viz.request_forwards(llm.traces)
assert (costs["0"].num_tokens, costs["0"].num_forwards) == (13, 4)
zero = [r for r in viz.verify_rows(llm.traces) if r.request_id == "0"]
kinds = [[k for _, k in r.cells] for r in zero]
assert kinds[0] == ["sampled"] and kinds[1] == kinds[2] == ["accepted"] * 4 + ["bonus"]
assert kinds[3] == ["accepted", "accepted", "dropped", "dropped"] and zero[3].kept[-1] == tokenizer.eos_token_id
drawn = {p.get_gid() for ax in steps_draft.axes for p in ax.patches if (p.get_gid() or "").startswith("cell:0:")}
assert sum(g.endswith(":bonus") for g in drawn) == 2 and sum(g.endswith(":dropped") for g in drawn) == 2
# request 1, step 3: "guessed ' bed' ...; the target kept the space, rejected bed, and wrote its own r"
one = next(r for r in viz.verify_rows(llm.traces) if r.request_id == "1" and r.step == 3)
assert [(viz.token_label(t, tokenizer), k) for t, k in one.cells] == [
    ("␣", "accepted"), ("b", "rejected"), ("e", "rejected"), ("d", "rejected"), ("r", "recovered")]
# "'45+38=' needs only 2 forwards for its 3 tokens"
assert (costs["2"].num_tokens, costs["2"].num_forwards) == (3, 2)
# ngram: "Same texts again, but 16 steps instead of the 18 that plain decoding of these two prompts takes: only 11%
# of the drafts are accepted"; "13 tokens in 9
# forwards"; "18 tokens in 16 forwards"
assert [o.text for o in ngram_outputs] == [o.text for o in plain_outputs[:2]]
assert ngram_stats["num_steps"] == 16 and round(ngram_stats["spec_acceptance_rate"], 2) == 0.11
assert plain_two.stats()["num_steps"] == 18
ngram_costs = viz.request_forwards(ngram_llm.traces)
assert (ngram_costs["0"].num_tokens, ngram_costs["0"].num_forwards) == (13, 9)
assert (ngram_costs["1"].num_tokens, ngram_costs["1"].num_forwards) == (18, 16)
# looping model: "Every draft is accepted (1.00) and the model needs 14 forwards for 32 tokens"; "in steps 7 and 8
# ... all four drafts plus a bonus"; "Step 8's bonus token is 62, new to the text: ... step 9 has nothing to copy"
assert round(loop_stats["spec_acceptance_rate"], 2) == 1.0 and loop_stats["num_steps"] == 14
assert len(loop_output.token_ids) == 32
loop_rows = {r.step: r for r in viz.verify_rows(loop_llm.traces)}
loop_drafts = {s: r.num_drafts for s, r in loop_rows.items()}
assert max(loop_drafts[s] for s in range(7)) <= 2 and loop_drafts[7] == loop_drafts[8] == 4 and loop_drafts[9] == 0
assert loop_rows[8].cells[-1] == (62, "bonus") and loop_rows[9].cells == [(62, "sampled")]
assert 62 not in looping_prompt + [t for s in range(8) for t, _ in loop_rows[s].cells]
# Section 3, by hand: "condense() slides d, e and f up into c's hole; the decode-first scan then swaps b ... with f";
# "the three verify rows lead, and the decode kernel gets tokens 0-11"; "the same four moves"
assert [r.req_id for r in lockstep_before] == ["a", "b", None, "d", "e", "f"]
assert [r.req_id for r in lockstep_after] == ["a", "f", "d", "e", "b"] and num_decodes == 3
assert sum(r.num_scheduled_tokens for r in lockstep_after[:num_decodes]) == 12
assert all(r.in_step for r in lockstep_before + lockstep_after)
arrows = {a.get_gid() for a in lockstep_figure.artists}
assert arrows == {f"move:{w}:{r}" for w in ("main", "proposer") for r in "fdeb"}
# "request a: 14 against 11, k = 3 ahead"
a_row = lockstep_after[0]
assert (a_row.draft_num_computed_tokens, a_row.num_computed_tokens) == (14, 11) and K == 3
# live frames: "Both halves of a row show the same moment, the step's start": a verify row's drafts are the ones the
# step verified, and "Each verify row's draft model is k = 3 tokens ahead of the target"
for t, rows in zip(live_traces, live_frames):
    verified = {r.request_id: r.draft_token_ids for r in t.rows}
    for row in rows:
        if row.phase != "empty" and row.num_spec_tokens:
            assert row.draft_token_ids == verified[row.req_id], (t.step, row)
            assert row.draft_num_computed_tokens == row.num_computed_tokens + row.num_spec_tokens, (t.step, row)
assert [ax.get_title().startswith(("main", "Proposer")) for ax in live_strip.axes] == [True] * 4
assert len(frame_s) == len(live_frames) and np.median(frame_s) < live_player.play.interval / 1000, frame_s
# live: lockstep after every step (the cell checks it); "step 7: requests 2 and 3 each verify three drafts (4 tokens)
# and request 4 runs an 8-token chunk ...; the reorder swapped rows 1 and 2"; "In step 5 a 4-token chunk of a prompt
# counts as a decode"
assert 7 in moves and live_traces[7].step == 7 and live_player.slider.value == 7 and live_player.error is None
seven = live_traces[7]
assert seven.order_before == ["2", "4", "3"] and seven.order_after == ["2", "3", "4"]
assert [(r.req_id, r.phase, r.num_scheduled_tokens, r.num_spec_tokens) for r in live_frames[7]] == [
    ("2", "decode", 4, 3), ("3", "decode", 4, 3), ("4", "prefill", 8, 0)]
five = {r.request_id: r for r in live_traces[5].rows}
assert five["3"].num_scheduled_tokens == 4 and five["3"].num_computed_tokens == 0
assert live_frames[5][0].req_id == "3" and live_frames[5][0].phase == "decode"
# Section 4: "from 0.95 at k = 1 to 0.64 at k = 8, though not at every step: k = 5 (0.80) sits above k = 4 (0.78)
# (at k = 4 ... 0.97, 0.76, 0.71, 0.68)"; forwards per token
# "0.56 at k = 1, 0.33 at k = 4 ..., 0.26 at k = 8"; same tokens throughout
acc = {r["k"]: round(r["acceptance_rate"], 2) for r in sweep}
fpt = {r["k"]: round(r["forwards_per_token"], 2) for r in sweep}
assert (acc[4], acc[5]) == (0.78, 0.80)
assert (acc[1], acc[8]) == (0.95, 0.64) and [round(x, 2) for x in sweep[3]["acceptance_by_position"]] == [
    0.97, 0.76, 0.71, 0.68]
assert (fpt[1], fpt[4], fpt[8]) == (0.56, 0.33, 0.26) and all(r["token_ids"] == sweep_off["token_ids"] for r in sweep)
assert sweep_off["forwards_per_token"] == 1.0
for k in range(1, 9):
    explore.controls["k"].value = k
    assert explore.error is None, (k, explore.error)
    sizes = {ln.get_gid(): ln.get_markersize() for ln in explore.figure.axes[2].lines if ln.get_gid()}
    assert sizes[f"forwards:{k}"] > sizes[f"forwards:{1 + k % 8}"]
# the static figure beside the slider is the slider's k = 4 picture
assert len(sweep_figure.axes) == len(explore.figure.axes)
static_sizes = {ln.get_gid(): ln.get_markersize() for ln in sweep_figure.axes[2].lines if ln.get_gid()}
assert static_sizes["forwards:4"] > static_sizes["forwards:1"]
# Section 2: "a recovered token ... in place of the first draft it rejected, drawn in that draft's slot, under it"
slots = {p.get_gid(): p for ax in steps_draft.axes for p in ax.patches if (p.get_gid() or "").startswith("cell:1:3:")}
recovered = next(p for g, p in slots.items() if g.endswith(":recovered"))
first_rejected = min((p for g, p in slots.items() if g.endswith(":rejected")), key=lambda p: p.get_x())
assert recovered.get_x() == first_rejected.get_x() and recovered.get_y() < first_rejected.get_y()
# timing: "drafting alone costs about as much as the target's forward or more"
ms = sweep[3]["ms_per_step"]
assert ms["propose"] >= 0.7 * ms["forward"], ms
# Section 5: "proposed o in 1,998 of the 2,000 samples, and the target accepted it in 28% of them, as often as its own
# p('o') = 0.28 says"; "both chi-square statistics are far below the 0.1% critical value"
p_o = float(probs[tokenizer.encode("o", add_bos=False)[0]] / probs.sum())
assert drafted["o"] == 1998 and round(p_o, 2) == 0.28 and abs(sampled_acceptance - p_o) < 0.03
assert all(stat < crit / 2 for stat, _, crit in hist.chi_square.values()), hist.chi_square
# the code beside the histogram: "u[:, 0] to draw a token, u[:, 1] to accept"; accept is "u < p(draft)"; residual is
# "p with the draft's entry zeroed"
draw_text = str(rejection_sources["draw"])
assert "self.accept(p_draft, u[:, 1])" in draw_text and "self.residual(probs, is_draft), u[:, 0]" in draw_text
assert "return u < p_draft" in str(rejection_sources["accept"])
assert "paddle.where(is_draft, paddle.zeros_like(probs), probs)" in str(rejection_sources["residual"])
'''

PROMISES["09_tensor_parallel"] = '''
# "KV head 0 is replicated on ranks 0 and 1, KV head 1 on ranks 2 and 3 (... one band per rank holding it, each
# labelled). The MLP boxes name the columns each rank holds."
two, four = shard_figure.axes[:2]
labels = {t.get_gid(): t.get_text() for t in four.texts if t.get_gid()}
assert [labels[f"label:KV heads (cached):0:{r}"] for r in (0, 1)] == ["0", "0"]
assert [labels[f"label:KV heads (cached):1:{r}"] for r in (2, 3)] == ["1", "1"]
assert not any(k.startswith("label:KV heads (cached):0:") and k[-1] in "23" for k in labels)
mlp = [t.get_text() for ax in (two, four) for t in ax.texts if (t.get_gid() or "").startswith("label:MLP")]
assert mlp[:4] == ["0-31", "32-63", "64-95", "96-127"] and mlp[4:] == [f"{16 * b}-{16 * b + 15}" for b in range(8)]
# "Every rank must produce exactly these tokens" (the cell's last family, llama, still in `alone`)
assert family == "llama" and all(r["families"]["llama"]["tokens"] == alone["tokens"] for r in ranks)
# Section 1: "0-63 on rank 0 and 64-127 on rank 1"; the lower panel: "8 query heads over the same 2 KV heads, on 4
# ranks ... Each rank takes two query heads ... KV head 0 is replicated on ranks 0 and 1, KV head 1 on ranks 2 and 3
# ... the MLP's columns go to the ranks in quarters"
assert [r.mlp_columns for r in plan2.ranks] == [(0, 64), (64, 128)] and cfg.num_attention_heads == 4
assert (plan4.num_heads, plan4.num_kv_heads, plan4.tp_size) == (8, 2, 4)
assert all(len(r.q_heads) == 2 for r in plan4.ranks) and [r.kv_heads for r in plan4.ranks] == [(0,), (0,), (1,), (1,)]
assert [r.mlp_columns for r in plan4.ranks] == [(0, 32), (32, 64), (64, 96), (96, 128)]
# Section 5: "the printed shares, between a fifth and four fifths on each rank"
assert all(0.2 < x < 0.8 for x in share), share
# the run's temporary folder names this notebook
assert work.name.startswith("fleetlab-09-")

'''

PROMISES["10_serving"] = '''
# Streaming: "a chunk may carry several tokens; the text is the same either way. The EOS token is not text: the chunk
# it ends carries only the finish_reason"
assert 1 < len(chunk_texts) <= usage.completion_tokens and chunk_texts[-1] == "" and finish == "stop"
assert "".join(chunk_texts).startswith("4 5 6 7 ")
# "the stored full run (64 requests per rate ...), where they stand out": throughput and TTFT grow with the rate;
# TPOT and ITL "from the lowest rate to the highest"
assert stored is not None and stored["workload"]["num_prompts"] == 64
for key in ("request_throughput", "ttft_ms", "tpot_ms", "itl_ms"):
    values = [run[key] if key == "request_throughput" else run[key]["median"] for run in stored["runs"]]
    if key in ("request_throughput", "ttft_ms"):
        assert all(b >= a for a, b in zip(values, values[1:])), (key, values)
    else:
        assert values[-1] > values[0], (key, values)
# "in the stored run, 2 and 8 requests per second offered, about as many finished. From 32 on it falls well short of
# the offered load"; "The bars still never stop growing (in the stored run...)"
served = {run["rate"]: run["request_throughput"] for run in stored["runs"]}
assert served[2.0] > 0.85 * 2 and served[8.0] > 0.75 * 8 and served[32.0] < 0.5 * 32
tok_s = [run["output_throughput"] for run in stored["runs"]]
assert all(b > a for a, b in zip(tok_s, tok_s[1:])), tok_s
# Section 4: "HTTP 400 ... naming the field"; "A model the server does not serve is a 404 ... (the second request)"
assert [code for code, _ in refusals] == [400, 404, 400] and refusals[0][1] == "temperature"
assert refusals[1][1] == "model" and refusals[2][1] == "max_tokens"
'''

PROMISES["11_structured_outputs"] = r'''
# Section 1: "refuses the request at once, naming what is missing"
assert "cannot be spelled by the model's vocabulary: it has no '{', '}'" in refusal
# Section 2: each step's chosen token is one its mask allows, drawn on the figure
counts = masks.sum(axis=1)
assert all(masks[s, t] for s, t in enumerate(chosen)) and len(chosen) == len(masks)
drawn = {p.get_gid() for p in mask_figure.axes[0].patches}
assert {f"chosen:{s}" for s in range(len(chosen))} <= drawn
text = [labels[t] for t in chosen]
# '{"name":"' forced character by character (steps 0-8)
assert (counts[:9] == 1).all() and "".join(text[:9]) == '{"name":"'
# "the mask opens to 83 tokens, every character but the newline"; "picks Z eight times";
# "after the eighth, maxLength leaves only the closing quote"
newline = tokenizer.encode("\n", add_bos=False)[0]
assert (counts[9:17] == 83).all() and not masks[9:17, newline].any() and counts[9] == vocab_size - 4 - 1
assert "".join(text[9:17]) == "Z" * 8 and counts[17] == 1 and text[17] == '"'
# "The age allows digits, then after 44 only }"; "the mask allows EOS alone"
age = "".join(text).index("age") + 5
assert "".join(text[age:age + 2]) == "44" and counts[age + 2] == 1 and text[age + 2] == "}"
assert counts[-1] == 1 and chosen[-1] == tokenizer.eos_token_id and out.finish_reason == "stop"
# Section 3: "d takes its row 0 with a prefill ... the constrained c moves from row 2 to row 0", the same object
assert (row_before, row_after) == (2, 0) and same_object
assert trace.order_before[0] == "d" and phases["d"] == "prefill" and phases["c"] == "decode"
assert {ln.get_gid() for ln in rows_figure.axes[0].lines} == {"move:c", "move:b", "move:d"}
# preemption: resent with the same object, its matcher holding exactly the committed tokens
assert num_preemptions > 0 and resends.seen
assert all(committed == held and same for _, _, committed, held, same in resends.seen)
for o in preempted:
    jsonschema.validate(json.loads(o.text), SCHEMAS["person"])
# Section 4: the same text as without speculation; "Most steps keep one token: the unconstrained drafts ...
# are refused by the grammar at once"; a step allowing three of four drafts, one allowing the first and
# refusing the second
assert spec_out.text == out.text
assert sum(len(v["kept"]) == 1 and v["refused"] == [1] for v in watch.rows) > len(watch.rows) / 2
assert any(v["accepted"] == 3 and v["refused"] == [4] for v in watch.rows)
assert any(v["accepted"] == 1 and v["refused"] == [2] for v in watch.rows)
# the drawn step: "the name already had five Zs, so three more drafts fit"; "the target writes the quote there";
# the last row never used; after the step the matcher holds only the tokens committed before it
assert verify is next(v for v in watch.rows if v["accepted"] == 3 and v["refused"] == [4])
before = tokenizer.decode(spec_out.token_ids[: verify["committed_before"]])
assert before == '{"name":"ZZZZZ' and "".join(labels[t] for t in verify["kept"]) == 'ZZZ"'
marks = {ln.get_gid() for ln in verify_figure.axes[0].lines}
assert marks == {"draft:0:allowed", "draft:1:allowed", "draft:2:allowed", "draft:3:refused"}
assert "unused:4" in {p.get_gid() for p in verify_figure.axes[0].patches}
assert verify["in_matcher"] == verify["committed_before"] == 14
# the code is shown from the package with its file and line numbers (viz.show_source), as every notebook does;
# "Unconstrained steps pay one comparison over the rows' structured_output field"; the drafts are "rolled back"
assert mask_source.path.endswith(".py") and mask_source.first_line > 1 and "structured_output" in str(mask_source)
assert drafts_source.path.endswith(".py") and "rollback" in str(drafts_source)
'''

PROMISES["12_read_the_engine"] = '''
from pathlib import Path as _Path

_eos = tokenizer.eos_token_id
# Section 1: refused "with a ValueError naming the request and the field, before anything is queued"
assert len(refusals) == 2 and all(r.startswith("request 'bad':") for r in refusals)
assert "prompt_token_ids" in refusals[0] and "KV blocks" in refusals[1] and "bad" not in llm.scheduler.requests
# "b: 12+7=, 6 tokens with <bos>"
assert b.prompt_token_ids == tokenizer.encode("12+7=") and len(b.prompt_token_ids) == 6
# Section 2: "a runs 1 token (a decode), and b its whole 6-token prompt: 7 tokens of the 16"; "b starts from 0"
assert plan.num_scheduled_tokens == {"a": 1, "b": 6} and plan.total_num_scheduled_tokens == 7
assert llm.scheduler.max_num_batched_tokens == 16 and new.num_computed_tokens == 0 and new.req_id == "b"
# Section 3: "b's 6 tokens need 2 blocks (its second one 2/4 full)"; "not in id order"; "2 evictions"; one white block
assert len(tables["b"]) == 2 and tokens_after["b"] == 6 and tables["b"] != sorted(tables["b"])
assert tables["a"] != sorted(tables["a"]) and pool_stats.evictions == 2
assert sum(1 for i in pool_now if i.ref_count == 0 and not i.is_cached) == 1
# Section 4: a's diff carries its sampled token 8 and no new block
cached = plan.scheduled_cached_reqs
assert cached.req_ids == ["a"] and tokenizer.decode(cached.new_token_ids[0]) == "8" and cached.new_block_ids == [[]]
# Section 5: "a in row 0, b in row 1", no reorder
assert order_before == order_after == ["a", "b"] and [r.req_id for r in rows] == ["a", "b"]
# Section 6: "a's one decode token at position 7 and b's prompt at positions 0-5, each with its slot"; two scored
assert md.positions.numpy().tolist() == [7, 0, 1, 2, 3, 4, 5]
for pos, slot, row in zip(md.positions.numpy(), md.slot_mapping.numpy(), row_of_token):
    _blocks = tables[rows[row].req_id]
    assert slot == _blocks[pos // 4] * 4 + pos % 4
assert inputs.logits_indices.tolist() == [0, 6]
# Section 7: "[2, 55]"; "sure of 3 after 45+38=8 and of 1 after 12+7="; every slot written
assert list(logits.shape) == [2, tokenizer.vocab_size]
assert [tokenizer.decode([int(t)]) for t in top[:, 0]] == ["3", "1"] and written.all()
# Section 8: greedy: the sampled tokens are the argmax
assert result.sampled_token_ids == {"a": [int(top[0, 0])], "b": [int(top[1, 0])]}
# Section 9: "b has computed its 6 prompt tokens and holds its first output token, 1; a has its third"
assert b_now["num_computed_tokens"] == 6 and tokenizer.decode(b_now["output_token_ids"]) == "1"
assert {o.request_id: len(o.token_ids) for o in outputs} == {"a": 2, "b": 1}
# "Both answers are right ... stop at the end-of-text token: a in the first step of the loop, b in the second"
assert {rid: (o.text, o.finish_reason, o.token_ids[-1]) for rid, (o, _) in finished.items()} == {
    "a": ("83", "stop", _eos), "b": ("19", "stop", _eos)} and _eos == 2
assert {rid: s for rid, (_, s) in finished.items()} == {"a": 1, "b": 2}
# Section 10: the table has every part, and its fleetlab column names a file of the package
_root = _Path(fleetlab.__file__).resolve().parents[1]
assert len(table) == len(PARTS) + 2 and all(row.count(" | ") == 3 for row in table)
for _part, _obj, _vllm, _fd in PARTS:
    _src = viz.show_source(_obj)
    assert (_root / _src.path).is_file() and _src.path.startswith("fleetlab/")
    assert _vllm and _fd and "fleetlab" not in _vllm + _fd
# the naive excerpt starts where the cache becomes one row per slot, which makes the gather read a slot's key
assert naive_excerpt.lines[0].strip().startswith("keys = key_cache.reshape") and "paddle.gather(keys, slots)" in str(
    naive_excerpt)
# the sampler's names the prose explains: raw, taken, lp, blocks, _read (and lp is fleetlab.engine.logprobs)
sample_text = str(sample_excerpt)
assert all(name in sample_text for name in ("raw", "self.taken(", "lp.gather(", "blocks", "self._read("))
import fleetlab.engine.sampler as _sampler_module
assert _sampler_module.lp.__name__ == "fleetlab.engine.logprobs"

'''

PROMISES["13_kv_beyond_one_engine"] = '''
_L = model.config.num_layers
# Section 3: "A saved 15 files: 3 layers for each of the prompt's 4 full blocks, and for the fifth block";
# "B loaded the prompt's 16 and computed only the last 2 prompt tokens"; "The tokens equal the full forward's"
assert _L == 3 and len(files) == 15 and len(prompt) == 18
assert b.kv_connector.stats.loaded_tokens == 16 and prompt_computed == {"A: empty directory": 18,
                                                                         "B: restarted, loads": 2}
assert tokens_a == tokens_b == want[0] and b.kv_connector.stats.saved_blocks == 0
_bars = sorted((p.get_gid(), p.get_width()) for p in fig_restart.axes[0].patches)
assert _bars == [("computed", 2), ("computed", 18), ("loaded", 16)], _bars
# Section 4: A's step saves blocks 0-3 in every layer, layer 0 first, after build_connector_meta; B's step loads
# them layer by layer in wait_for_layer_load and saves nothing
for _rec, _moving in ((steps["A (producer), step 0"], "save_kv_layer"), (steps["B (consumer), step 0"],
                                                                        "wait_for_layer_load")):
    _moved = [(layer, blocks) for call, layer, blocks in _rec if call == _moving]
    assert [layer for layer, _ in _moved] == list(range(_L)) and all(len(bl) == 4 for _, bl in _moved)
    _other = "wait_for_layer_load" if _moving == "save_kv_layer" else "save_kv_layer"
    assert all(not blocks for call, _, blocks in _rec if call == _other)
    _calls = [call for call, _, _ in _rec]
    assert _calls.index("build_connector_meta") < _calls.index("start_load_kv") < _calls.index(_moving)
    assert _calls.index("update_state_after_alloc") < _calls.index("build_connector_meta")
    # "just before the layer attends": load of layer i, then the save (write) of layer i, then layer i+1
    _per_layer = [(call, layer) for call, layer, _ in _rec if layer is not None]
    assert _per_layer == [(c_, i) for i in range(_L) for c_ in ("wait_for_layer_load", "save_kv_layer")]
_squares = [ln.get_gid() for ax in fig_calls.axes for ln in ax.lines if ln.get_marker() == "s"]
assert _squares == [f"call:save_kv_layer:{i}" for i in range(_L)] + [f"call:wait_for_layer_load:{i}" for i in range(_L)]
# Section 5: "its first step ran the last 2 prompt tokens ... (one preemption), and the next step runs all 18";
# "the same tokens"; "never offered the store again" (one failed load only)
assert c_steps[:2] == [2, 18] and failed == (1, 1) and tokens_c == want[0] and "disk on fire" in log.getvalue()
# Section 6: "A and B lie on top of each other"; "5 blocks ..., a sixth in step 3"; "C holds none after its first
# step ... then the same curve one step later"; every pool ends free
assert pool_used["A"] == pool_used["B"] == [5, 5, 5, 6, 0] and pool_used["C"] == [0] + pool_used["A"]
assert all(free == total == 16 for free, total in pool_end.values())
# "it returns False too": the last line of the excerpt shown
_pd_src = show_source(PaddleDistributedConnector.request_finished)
assert _pd_src.lines[-1].strip() == "return False" and "return True" not in str(_pd_src)
_drawn = {ln.get_gid(): list(ln.get_ydata()) for ln in fig_pools.axes[0].lines}
assert _drawn == {f"pool:{k}": v for k, v in zip(["A (saves)", "B (loads)", "C (load fails)"], pool_used.values())}
# Section 7: "each request holds 6 blocks ... the four make 24, twice the pool"; "The pool alone hits nothing";
# "16 of each repeat's 20 ... a hit rate of 0.4"; "Both runs write the full forward's tokens"
assert all(len(p_) == 20 for p_ in prompts) and 4 * (20 + 4) // BS == 2 * 12
assert hit_rates["pool alone"] == {"pool": 0.0, "host tier": 0.0}
assert hit_rates["pool + offload"]["pool"] == 0.0 and abs(hit_rates["pool + offload"]["host tier"] - 0.4) < 1e-9
assert all(t == [offload_want[i] for i in order] for t in offload_tokens.values())
# stored figures as printed: the tier's repeats faster than the pool's; the restarted engine's load faster
_runs = kv_results["offload"]["runs"]
assert _runs["pool + offload"]["repeat_ttft_median_ms"] < _runs["pool alone"]["repeat_ttft_median_ms"]
assert restart["new engine, loading"] < restart["new engine, computing"]
# Section 9: "Bytes moved per token match 2 x layers x kv_heads x head_dim x dtype bytes exactly";
# "the wire adds a small header"; "the pair's inter-token latency is lower ..., at the median and at p99";
# "The long prompts' time to first token is worse on the pair"
assert pd["bytes_per_token"] == pd["expected_bytes_per_token"] == formula == 768
assert pd["bytes_loaded"] < pd["wire_bytes"] < 1.1 * pd["bytes_loaded"]
# "ran three times ...; the bars are the medians of the three runs and the lines their spread"; "lower than one
# engine's, at the median and at p99"; "The long prompts' time to first token is lower on the pair too";
# "one step of up to 512 tokens, where one engine runs it in four chunks of 60"
assert len(pd["mixed_runs"]) == 3 and all(r_["identical_tokens"] for r_ in pd["mixed_runs"])
for _f in ("itl_p50_ms", "itl_p99_ms", "long_ttft_median_ms"):
    assert spread["pair"][_f][0] < spread["one engine"][_f][0], (_f, spread)
    for _n in ("pair", "one engine"):
        _bar = [b_ for b_ in fig_bench.axes[1 if _f.startswith("itl") else 2].patches
                if abs(b_.get_height() - spread[_n][_f][0]) < 1e-9]
        assert _bar, (_f, _n)
assert kv_results["config"] is not None and max(s_[2] for s_ in mixed["timeline"]["prefill rank"]["timeline"]) <= 512
assert pd["equal_forward"] and pd["equal_single"] and pd["failed_loads"] == 0
# The timelines: "up to 60 prompt tokens beside the four decode rows"; "longer than a decode-only step";
# "the decode rank only ever runs decode rows"; "hatched steps ran while some request ... waited there"; the
# prefill rank runs the prompt steps; every lane drawn from its data
_tl = mixed["timeline"]
assert max(s_[2] for s_ in _tl["one engine"]["timeline"]) == 60 and {s_[3] for s_ in _tl["one engine"]["timeline"]
                                                                    if s_[2] == 60} == {4}
assert step_ms["one engine"]["prompt"] > 1.2 * step_ms["one engine"]["decode"], step_ms
assert all(s_[2] == 0 for s_ in _tl["pair"]["timeline"]) and any(s_[4] > 0 for s_ in _tl["pair"]["timeline"])
assert _tl["prefill rank"]["timeline"] and all(s_[2] > 0 and s_[3] == 0 for s_ in _tl["prefill rank"]["timeline"])
_ax = fig_timelines.axes[0]
_drawn = {c.get_gid(): len(c.get_paths()) for c in _ax.collections if c.get_gid()}
for _lane, _run in _tl.items():
    _n_prompt = sum(s_[2] > 0 for s_ in _run["timeline"])
    assert _drawn[f"steps:{_lane}:prompt"] == _n_prompt
    assert _drawn[f"steps:{_lane}:decode"] == len(_run["timeline"]) - _n_prompt
assert _drawn["held:pair"] == sum(s_[4] > 0 for s_ in _tl["pair"]["timeline"]) and "held:one engine" not in _drawn
_stars = {ln.get_gid(): list(ln.get_xdata()) for ln in _ax.lines}
assert len(_stars["arrive:one engine"]) == len(_stars["first:pair"]) == 4
# Section 10 (a live run: only what holds on any run): the same tokens; each long prompt waits, runs "in one step"
# on the prefill rank (its 119 prompt tokens but the last), then the decode rank's step takes it in and samples its
# first token; "the decode rank's steps never carry a prompt"; the figure draws every part of every long prompt
assert live_run.returncode == 0 and live["identical_tokens"] and len(live["long_requests"]) == 4
_pre = {round(s_[0], 6): s_ for s_ in live["timeline"]["prefill rank"]["timeline"]}
for _rid, _p in live["long_requests"].items():
    assert _p["arrive"] <= _p["prefill"][0] < _p["join"][0] < _p["join"][1] <= _p["first_token"], (_rid, _p)
    assert _p["prefill"][0] < _p["prefill"][1] and _pre[round(_p["prefill"][0], 6)][2] >= 119, (_rid, _p)
assert all(s_[2] == 0 for s_ in live["timeline"]["pair"]["timeline"])
_gids = {c.get_gid() for c in fig_paths.axes[0].collections} | {ln.get_gid() for ln in fig_paths.axes[0].lines}
_parts = ("wait", "prefill", "transfer", "join")
assert _gids == {f"path:{part}:{r_}" for part in _parts for r_ in live["long_requests"]} | {
    f"first:{r_}" for r_ in live["long_requests"]}
assert set(parts) == {"wait", "prefill", "transfer", "join"} and all(v >= 0 for v in parts.values())
'''

PROMISES["14_overlap_scheduling"] = '''
# "the Triton backend's per-step plan ... was 81% hidden" on the H200
assert round(probe["plan_hidden"], 2) == 0.81 and step["overlapped"] < step["inline"]
# Section 2: "same tokens in both loops"; the forward on the host in one, on the model thread in the other
assert tokens["synchronous"] == tokens["overlapped"]
assert threads == {"synchronous": ["MainThread"], "overlapped": ["fleetlab-model_0"]}
# "None of the synchronous host work runs under a forward; most of the overlapped loop's does"
assert shares["synchronous"] == 0 and shares["overlapped"] > 0.5, shares
_labels = [t.get_text() for t in timeline_figure.axes[0].get_yticklabels()]
assert _labels == ["synchronous: model", "synchronous: host", "overlapped: model", "overlapped: host"]
_names = [t.get_text() for t in timeline_figure.axes[0].texts]
assert _names == ["N", "N+1", "N+2"] * 2, _names
# Section 3: "The first call plans the prompts (no placeholder)"; then each placeholder holds the token the
# previous step sampled, right after the known tokens; "In the last call both placeholders hold <eos>"
assert fills[0] == [] and all(len(f) == 2 for f in fills[1:])
assert all(tok == was for f in fills for _, _, tok, was in f)
assert [show(tok) for _, _, tok, _ in fills[-1]] == ["<eos>", "<eos>"] and [o.text for o in two] == ["19", "83"]
assert [pos for _, pos, _, _ in fills[1]] == [len(tokenizer.encode("12+7=")), len(tokenizer.encode("45+38="))]
# Section 4: "Three tokens ... planned into 4 steps"; three tokens and one finished, nothing after
assert planned_in == 4 and len(streamed) == 3 and [f for _, f in streamed] == [False, False, True]
# Section 2: "five times each in turns"; the step times printed are each loop's runs
assert all(len(v) == RUNS == 5 for v in step_ms.values())
# Section 5: "Round by round, overlapping every step served fewer tokens a second than the synchronous loop";
# "The gate found in-line steps faster at most of its probes"; "the loop as built kept the synchronous loop's pace"
assert summary["paired_always_tok_s_ratio"] < 1
assert 2 * sum(p_["overlap"] for p_ in probes) < len(probes) and probes
assert summary["paired_tok_s_ratio"] >= 0.98, summary["paired_tok_s_ratio"]
# the bars are the medians, the lines the rounds' range
_bars = fig_speed.axes[0].patches
assert [round(b_.get_height(), 6) for b_ in _bars] == [round(med[k_]["tok_s"], 6) for k_ in LOOPS]
assert all(spread[k_]["tok_s"][0] <= med[k_]["tok_s"] <= spread[k_]["tok_s"][1] for k_ in LOOPS)
'''
