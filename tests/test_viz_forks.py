"""Parallel sampling's block tables drawn two ways (fleetlab.lab.viz.forks), on tables of the
shape the engine produces: three children of a 10-token prompt in blocks of 4."""

import pytest

from fleetlab.lab import viz

AT_PROMPT = {"0_r": [0, 1, 2], "1_r": [0, 1, 3], "2_r": [0, 1, 4]}
NOW = {"0_r": [0, 1, 2, 5], "1_r": [0, 1, 3, 6], "2_r": [0, 1, 4, 7]}
COMPUTED = {"0_r": 10, "1_r": 2, "2_r": 2}


def _patches(fig, prefix):
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def test_fork_tables_give_every_child_the_first_childs_prompt_blocks():
    assert viz.fork_tables(AT_PROMPT, 10, 4) == {c: [0, 1, 2] for c in AT_PROMPT}
    assert viz.fork_tables(AT_PROMPT, 8, 4) == {c: [0, 1] for c in AT_PROMPT}  # no partial block to share


def test_parallel_sampling_marks_computed_tails_and_copies_and_counts_owners():
    fig = viz.draw_parallel_sampling(AT_PROMPT, NOW, 10, {c: 15 for c in NOW}, 4, COMPUTED)
    marks = _patches(fig, "mark:")
    assert set(marks) == {f"mark:{panel}:{c}:2" for panel in ("prefix-prompt", "prefix-now", "cow-now")
                          for c in ("1_r", "2_r")}
    assert all(marks[f"mark:cow-now:{c}:2"].get_linestyle() == "--" for c in ("1_r", "2_r"))
    cells = _patches(fig, "cell:")
    assert len([g for g in cells if g.startswith("cell:cow-prompt:")]) == 9
    assert len([g for g in cells if g.startswith("cell:prefix-now:")]) == 12
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}
    fork = texts["fork + copy-on-write (the paged-attention paper): after the prompt's step"]
    assert fork.count("2 x3") == 3 and "computed 0 (forked)" in fork
    prefix = texts["prefix cache (fleetlab, vLLM v1): after the prompt's step"]
    assert prefix.count("0 x3") == 3 and prefix.count("2") == 1 and "computed 2 prompt tokens" in prefix
    assert texts["copy-on-write: 5 tokens later"].count("copied block 2") == 2


@pytest.mark.parametrize("num_prompt_tokens", [8, 12])
def test_a_prompt_of_whole_blocks_has_no_tail_to_mark(num_prompt_tokens):
    tables = {c: t[: num_prompt_tokens // 4] for c, t in NOW.items()}
    fig = viz.draw_parallel_sampling(tables, tables, num_prompt_tokens, dict.fromkeys(tables, num_prompt_tokens), 4,
                                     dict.fromkeys(tables, 4))
    assert _patches(fig, "mark:") == {}
