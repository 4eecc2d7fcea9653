"""fleetlab.lab.viz.mask: the packed step's mask, read from real AttentionMetadata, is block-diagonal
over rows, causal within a row, sees each row's cached prefix, and names the slots the step writes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fleetlab
from fleetlab.lab import viz

ROWS = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=5)  # (query_len, computed)


def metadata(rows, block_size=4, seed=0):
    widths = [-(-(q + c) // block_size) for q, c in rows]
    blocks = np.random.default_rng(seed).permutation(sum(widths) + 3)
    tables, start = np.full((len(rows), max(widths)), -1), 0
    for r, w in enumerate(widths):
        tables[r, :w] = blocks[start:start + w]
        start += w
    return fleetlab.AttentionMetadata.build(query_lens=[q for q, _ in rows], num_computed_tokens=[c for _, c in rows],
                                            block_tables=tables.tolist(), block_size=block_size)


@settings(max_examples=60, deadline=None)
@given(ROWS)
def test_the_mask_is_block_diagonal_causal_and_sees_the_cached_prefix(rows):
    md = metadata(rows)
    mask = viz.packed_mask(md)
    assert mask.visible.shape == (md.num_tokens, int(md.seq_lens_kv_host.sum()))
    assert (mask.query_pos == md.positions.numpy()).all()  # the packed queries' positions, as the step has them
    written = ~mask.key_cached  # the keys this step writes sit in the slots its slot_mapping names, in order
    assert (mask.key_slot[written] == md.slot_mapping.numpy()).all()
    for r, (q, c) in enumerate(rows):
        block = mask.block(r)
        assert block.shape == (q, c + q)
        assert block[:, :c].all()  # the cached prefix: every query of the row sees it whole
        assert (block[:, c:] == np.tri(q, dtype=bool)).all()  # this step's keys: causal
    rows_of = mask.query_row[:, None] != mask.key_row[None, :]
    assert not mask.visible[rows_of].any()  # nothing across rows
    assert mask.visible.sum() == sum(q * c + q * (q + 1) // 2 for q, c in rows)


def test_a_sliding_window_hides_what_is_further_back():
    md = metadata([(1, 9), (6, 4)])
    mask = viz.packed_mask(md, sliding_window=3)
    assert (mask.visible.sum(axis=1) <= 3).all() and mask.block(0).sum() == 3


def test_the_drawing_colours_visible_keys_and_leaves_hidden_ones_white():
    md = metadata([(1, 7), (1, 3), (5, 4)])
    mask = viz.packed_mask(md, row_labels=["0", "1", "2"])
    fig = viz.draw_packed_mask(mask)
    image = next(im for im in fig.axes[0].images if im.get_gid() == "mask").get_array()
    white = (np.asarray(image) == 1).all(axis=-1)
    assert (white == ~mask.visible).all()
    assert {ln.get_gid() for ln in fig.axes[0].lines if ln.get_gid()} == {"row-edge:0", "row-edge:1", "row-edge:2"}
