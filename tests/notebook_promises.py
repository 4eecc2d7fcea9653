"""What each notebook's prose promises about its figures, checked on the objects it drew.

``PROMISES[stem]`` is Python run in the notebook's own kernel right after its last cell
(by ``tests/test_notebooks.py``), so it sees the notebook's variables. Each check quotes the
sentence it holds the notebook to. A notebook without an entry is only run.
"""

PROMISES: dict[str, str] = {}

PROMISES["00_tour"] = '''
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
# "The 7 blocks both requests hold are hatched and marked x2"
assert set(frame.block_tables) == {"6", "7"}
shared_blocks = [i.block_id for i in frame.blocks if i.ref_count == 2]
assert len(shared_blocks) == 7 and set(shared_blocks) <= set(frame.block_tables["7"])
pool_texts = [t.get_text() for t in pool_figure.axes[0].texts]
assert pool_texts.count("x2") == 7
# "here requests 6 and 7 ... each ran a prefill chunk (8 and 6 tokens) ... (36 of 37)"
assert [(r.req_id, r.phase, r.num_scheduled_tokens) for r in batch_rows] == [("6", "prefill", 8), ("7", "prefill", 6)]
assert (batch_rows[0].num_computed_tokens, batch_rows[0].num_tokens) == (36, 37)
'''
