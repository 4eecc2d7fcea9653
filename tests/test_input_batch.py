"""Tests of the InputBatch: the field registry, row moves, decode-first reorder, device sync."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fleetlab.engine.batch_fields import DEFAULT_FIELDS, Field, FieldRegistry
from fleetlab.engine.input_batch import InputBatch, two_pointer_swaps
from fleetlab.inspect.batch import batch_snapshot, check_batch
from fleetlab.lab.lessons.reorder import decode_first_order, stable_partition, stable_reorder
from fleetlab.lab.lessons.row_moves import (
    append_block_ids,
    append_tokens,
    by_request,
    invert_permutation,
    swap_rows,
    unpermute,
)


def reorder(batch, threshold=1, stable=False):
    """The runtime's two-pointer reorder, or the lessons module's stable one."""
    if stable:
        return stable_reorder(batch, threshold)
    return batch.reorder_split_prefill_and_decode(threshold)

SIZES = {"max_num_seqs": 6, "max_model_len": 8, "max_blocks_per_seq": 3, "max_stop_ids": 2}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Sampling:
    temperature: float = 0.7
    top_k: int = 5
    top_p: float = 0.9
    seed: int | None = 11
    max_tokens: int = 4
    min_tokens: int = 1
    ignore_eos: bool = True
    stop_token_ids: tuple = (2,)


def extended_registry() -> FieldRegistry:
    """DEFAULT_FIELDS plus two fields the batch code has never heard of."""
    reg = DEFAULT_FIELDS.copy()
    reg.register(Field("lora_scale", ("max_blocks_per_seq", 2), "float32", "device", -1.0, "test field"))
    reg.register(Field("note", (), "object", "host", None, "test field"))
    return reg


# ---------------------------------------------------------------- fingerprints
def stamp(batch: InputBatch, row: int, tag: int) -> None:
    """Write ``tag`` into every element of every field of ``row`` (bool fields: its parity)."""
    for field in batch.fields:
        if field.name != "req_id":
            batch.buffer(field.name)[row] = bool(tag % 2) if field.dtype == "bool" else tag


def check_fingerprints(batch: InputBatch, tags: dict) -> None:
    """Every live row carries exactly one request's tag in every field."""
    check_batch(batch)
    assert set(batch.req_id_to_row) == set(tags)
    for req_id, row in batch.req_id_to_row.items():
        assert batch.buffer("req_id")[row] == req_id
        tag = tags[req_id]
        for field in batch.fields:
            if field.name == "req_id":
                continue
            expected = bool(tag % 2) if field.dtype == "bool" else tag
            assert np.all(batch.buffer(field.name)[row] == expected), (field.name, req_id, row)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add")),
        st.tuples(st.just("remove"), st.integers(0, 10)),
        st.tuples(st.just("condense")),
        st.tuples(st.just("swap"), st.integers(0, 10), st.integers(0, 10)),
        st.tuples(st.just("reorder"), st.integers(0, 12), st.booleans()),
    ),
    max_size=40,
)


def run_fingerprint_ops(batch: InputBatch, ops) -> None:
    """Apply ``ops``; tags double as ``num_scheduled_tokens``, so a reorder's split depends on them."""
    tags, next_tag = {}, 1
    for op in ops:
        if op[0] == "add" and batch.num_reqs < batch.max_num_seqs:
            req_id = f"q{next_tag}"
            row = batch.add_request(req_id, [1, 2])
            stamp(batch, row, next_tag)
            tags[req_id], next_tag = next_tag, next_tag + 1
        elif op[0] == "remove" and tags:
            req_id = sorted(tags)[op[1] % len(tags)]
            del tags[req_id]
            batch.remove_request(req_id)
        elif op[0] == "condense":
            live_before = [r for r in batch.req_ids if r is not None]
            batch.condense()
            assert batch.req_ids == live_before  # stable compaction, no holes left
        elif op[0] == "swap" and batch.num_rows:
            swap_rows(batch, op[1] % batch.num_rows, op[2] % batch.num_rows)
        elif op[0] == "reorder":
            check_reorder(batch, tags, threshold=op[1], stable=op[2])
        check_fingerprints(batch, tags)


def check_reorder(batch: InputBatch, tags: dict, threshold: int, stable: bool) -> None:
    if batch.has_holes:
        with pytest.raises(RuntimeError, match="condense"):  # a check, not an assert: python -O keeps it
            batch.reorder_split_prefill_and_decode(threshold)
        return
    before = batch.req_ids
    perm, num_decodes = reorder(batch, threshold, stable)
    after = batch.req_ids
    decodes = {r for r in before if tags[r] <= threshold}
    assert set(after[:num_decodes]) == decodes and num_decodes == len(decodes)
    assert after == [before[old] for old in perm]  # perm[new_row] = old_row
    assert list(unpermute(after, perm)) == before
    if stable:
        assert after == [r for r in before if r in decodes] + [r for r in before if r not in decodes]


@FAST
@given(OPS)
def test_fingerprints_survive_random_ops(ops):
    run_fingerprint_ops(InputBatch(**SIZES), ops)


@FAST
@given(OPS)
def test_extra_registered_field_is_carried_without_code_changes(ops):
    batch = InputBatch(**SIZES, fields=extended_registry())
    assert "lora_scale" in batch.fields and batch.buffer("lora_scale").shape == (6, 3, 2)
    run_fingerprint_ops(batch, ops)


def test_registry_copy_is_independent():
    reg = extended_registry()
    assert "lora_scale" in reg and "lora_scale" not in DEFAULT_FIELDS
    assert reg.names()[: len(DEFAULT_FIELDS)] == DEFAULT_FIELDS.names()
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Field("note", (), "object"))
    with pytest.raises(ValueError, match="lacks fields"):
        InputBatch(**SIZES, fields=FieldRegistry([Field("req_id", (), "object", fill=None)]))
    with pytest.raises(ValueError, match="clashes"):
        bad = DEFAULT_FIELDS.copy()
        bad.register(Field("condense"))
        InputBatch(**SIZES, fields=bad)
    with pytest.raises(ValueError, match="object"):
        Field("x", (), "object", "device")
    with pytest.raises(ValueError, match="unknown size parameter"):
        InputBatch(**SIZES, fields=_with(Field("y", ("max_heads",))))


def _with(field: Field) -> FieldRegistry:
    reg = DEFAULT_FIELDS.copy()
    reg.register(field)
    return reg


# ---------------------------------------------------------------- reorder algorithms
def two_pointer_loop(is_decode) -> list[tuple[int, int]]:
    """The textbook scan, as the reference for the vectorized ``two_pointer_swaps``."""
    is_decode, swaps = list(is_decode), []
    left, right = 0, len(is_decode) - 1
    while True:
        while left < len(is_decode) and is_decode[left]:
            left += 1
        while right >= 0 and not is_decode[right]:
            right -= 1
        if left >= right:
            return swaps
        swaps.append((left, right))
        is_decode[left], is_decode[right] = is_decode[right], is_decode[left]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=30))
def test_two_pointer_matches_scan_with_fewest_swaps(mask):
    mask = np.array(mask, dtype=bool)
    lefts, rights = two_pointer_swaps(mask)
    assert list(zip(lefts.tolist(), rights.tolist())) == two_pointer_loop(mask)
    num_decodes = int(mask.sum())
    assert len(lefts) == int((~mask[:num_decodes]).sum())  # lower bound: each misplaced prefill moves
    perm = stable_partition(mask)
    assert mask[perm][:num_decodes].all() and not mask[perm][num_decodes:].any()
    assert sorted(perm.tolist()) == list(range(len(mask)))
    assert (perm[invert_permutation(perm)] == np.arange(len(mask))).all()


def test_reorder_by_scheduled_tokens_and_results_by_request():
    batch = InputBatch(**SIZES)
    for i, prompt_len in enumerate([3, 1, 4, 1, 5]):
        batch.add_request(f"r{i}", [9] * prompt_len)
    batch.set_num_scheduled({"r0": 3, "r1": 1, "r2": 4, "r3": 1, "r4": 2})
    perm, num_decodes = batch.reorder_split_prefill_and_decode(decode_threshold=1)
    assert num_decodes == 2 and set(batch.req_ids[:2]) == {"r1", "r3"}
    assert (perm != np.arange(5)).sum() == 2  # one swap: r0 <-> r3
    sampled = np.array([100 + int(r[1:]) for r in batch.req_ids])  # "results" in row order
    assert by_request(batch, sampled) == {f"r{i}": 100 + i for i in range(5)}
    _, num_decodes2 = batch.reorder_split_prefill_and_decode(decode_threshold=2)
    assert num_decodes2 == 3 and set(batch.req_ids[:3]) == {"r1", "r3", "r4"}
    order, nd = decode_first_order(batch, decode_threshold=2)
    assert nd == 3 and (order == np.arange(5)).all()  # already decode-first: the map is the identity


def test_unscheduled_rows_are_classed_by_prompt_progress():
    batch = InputBatch(**SIZES)
    batch.add_request("fresh", [1, 2, 3])
    batch.add_request("running", [1, 2], output_token_ids=[5], num_computed_tokens=2)
    assert batch.is_decode().tolist() == [False, True]
    assert [r.phase for r in batch_snapshot(batch)] == ["prefill", "decode"]


def test_gather_map_skips_holes_and_agrees_with_reorder():
    batch = InputBatch(**SIZES)
    for i in range(6):
        batch.add_request(f"r{i}", [1] * 4, num_computed_tokens=i % 2 * 3)
    batch.remove_request("r2")
    batch.set_num_scheduled({f"r{i}": (1 if i % 2 else 4) for i in range(6) if i != 2})
    order, nd = decode_first_order(batch)
    ids = batch.req_ids
    assert [ids[r] for r in order] == ["r1", "r3", "r5", "r0", "r4"] and nd == 3
    batch.condense()
    _, num_decodes = batch.reorder_split_prefill_and_decode()
    assert set(batch.req_ids[:num_decodes]) == {"r1", "r3", "r5"}


# ---------------------------------------------------------------- requests and errors
def test_add_request_fills_every_field():
    batch = InputBatch(**SIZES)
    row = batch.add_request("a", [4, 5, 6], output_token_ids=[7], num_computed_tokens=3,
                            block_ids=[8, 9], sampling=Sampling(), eos_token_id=1)
    assert row == 0 and batch.req_ids == ["a"] and batch.num_reqs == 1
    assert batch.token_ids[0, :4].tolist() == [4, 5, 6, 7] and batch.num_tokens[0] == 4
    assert batch.num_prompt_tokens[0] == 3 and batch.num_tokens[0] - batch.num_prompt_tokens[0] == 1  # outputs
    assert batch.block_table[0].tolist() == [8, 9, -1] and batch.num_blocks[0] == 2
    assert batch.np("temperature")[0] == np.float32(0.7) and batch.top_k[0] == 5
    assert batch.seed[0] == 11 and batch.max_tokens[0] == 4 and batch.min_tokens[0] == 1
    assert batch.ignore_eos[0] and batch.stop_token_ids[0].tolist() == [2, -1] and batch.eos_token_id[0] == 1
    append_tokens(batch, 0, [3])
    append_block_ids(batch, 0, [10])
    assert batch.token_ids[0, :5].tolist() == [4, 5, 6, 7, 3] and batch.num_tokens[0] - batch.num_prompt_tokens[0] == 2
    assert batch.block_table[0].tolist() == [8, 9, 10] and batch.num_blocks[0] == 3
    # A setting left None keeps the field's fill (the edge resolves seeds and max_tokens; a direct
    # call passes what it wants), and an explicit seed wins over the sampling object's.
    unseeded = batch.add_request("b", [1], sampling=Sampling(seed=None, max_tokens=None))
    assert batch.max_tokens[unseeded] == 0 and batch.seed[unseeded] == 0
    seeded = batch.add_request("c", [1], sampling=Sampling(seed=None), seed=5)
    assert batch.seed[seeded] == 5 and batch.max_tokens[seeded] == 4


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: b.add_request("r0", [1]), "'r0'.*already"),
        (lambda b: b.add_request("long", [1] * 9), "'long'.*token_ids"),
        (lambda b: b.add_request("long", [1] * 6, output_token_ids=[2] * 3), "'long'.*token_ids"),
        (lambda b: b.add_request("e", []), "'e'.*empty prompt"),
        (lambda b: b.add_request("blk", [1], block_ids=[1, 2, 3, 4]), "'blk'.*block_table"),
        (lambda b: b.add_request("st", [1], sampling=Sampling(stop_token_ids=(1, 2, 3))), "'st'.*stop_"),
        (lambda b: b.add_request("x", [1], extra={"nope": 1}), "'x'.*nope"),
        (lambda b: b.remove_request("ghost"), "'ghost'.*req_id"),
        (lambda b: append_tokens(b, 5, [1]), "row 5"),
        (lambda b: append_block_ids(b, 0, [1, 2, 3]), "'r0'.*block_table"),
        (lambda b: b.set_num_scheduled({"r0": 3}), "'r0'.*num_scheduled_tokens"),
        (lambda b: b.set_num_scheduled({"ghost": 1}), "'ghost'"),
        (lambda b: swap_rows(b, 0, 4), "row 4"),
    ],
)
def test_clear_errors(call, match):
    batch = InputBatch(**SIZES)
    batch.add_request("r0", [1, 2], block_ids=[0])
    batch.add_request("r1", [1])
    with pytest.raises(ValueError, match=match):
        call(batch)
    check_batch(batch)  # a rejected call leaves the batch as it was
    assert batch.req_ids == ["r0", "r1"]


def remove_if_present(batch, req_id):
    """``remove_request`` that returns None for a request the batch does not hold (was its
    ``missing_ok=True``; the engine never needed it)."""
    return batch.remove_request(req_id) if req_id in batch.req_id_to_row else None


def test_full_batch_and_missing_ok():
    batch = InputBatch(**SIZES)
    for i in range(SIZES["max_num_seqs"]):
        batch.add_request(i, [1])
    with pytest.raises(ValueError, match="'late'.*max_num_seqs=6"):
        batch.add_request("late", [1])
    assert remove_if_present(batch, "ghost") is None
    assert batch.remove_request(2) == 2 and batch.add_request("late", [1]) == 2  # lowest hole first
    with pytest.raises(ValueError, match="full"):
        full = InputBatch(**SIZES)
        full.add_request("f", [1] * 8)
        append_tokens(full, 0, [1])


def test_remove_trims_trailing_holes_and_condense_reports_moves():
    batch = InputBatch(**SIZES)
    for i in range(5):
        batch.add_request(f"r{i}", [1])
    batch.remove_request("r4")
    assert batch.num_rows == 4 and not batch.has_holes
    batch.remove_request("r1")
    assert batch.num_rows == 4 and batch.has_holes and batch.req_ids == ["r0", None, "r2", "r3"]
    assert batch.condense().tolist() == [0, 2, 3]
    assert batch.req_ids == ["r0", "r2", "r3"] and dict(batch.req_id_to_row) == {"r0": 0, "r2": 1, "r3": 2}
    check_batch(batch)


# ---------------------------------------------------------------- device mirror and snapshot
def test_sync_to_device_mirrors_live_rows():
    batch = InputBatch(**SIZES, fields=extended_registry())
    for i in range(4):
        batch.add_request(f"r{i}", [1, 2], block_ids=[i], sampling=Sampling(seed=i, temperature=i / 4))
    with pytest.raises(RuntimeError, match="sync_to_device"):
        batch.dev("seed")
    with pytest.raises(ValueError, match="host"):
        batch.dev("token_ids")
    batch.remove_request("r1")
    with pytest.raises(RuntimeError, match="rows \\[1\\] are holes.*condense"):
        batch.sync_to_device()
    batch.condense()
    batch.buffer("lora_scale")[:3] = 0.5
    batch.sync_to_device()
    device_fields = [f.name for f in batch.fields if f.home == "device"]
    assert "lora_scale" in device_fields and "block_table" in device_fields
    for name in device_fields:
        mirror = batch.dev(name)
        assert mirror.shape[0] == 3
        np.testing.assert_array_equal(mirror.numpy(), batch.np(name))
    swap_rows(batch, 0, 2)
    with pytest.raises(RuntimeError, match="stale"):
        batch.dev("block_table")
    batch.sync_to_device()
    assert batch.dev("seed").numpy().tolist() == [3, 2, 0]


def test_sync_copies_only_the_device_fields_that_changed_however_they_were_written():
    """A field whose buffer equals its mirror is not copied again; a write through any view
    (the public ``np`` / ``buffer`` ones included) is seen by the next sync."""
    from fleetlab.syncs import count_syncs

    batch = InputBatch(**SIZES)
    for i in range(3):
        batch.add_request(f"r{i}", [1, 2], block_ids=[i], sampling=Sampling(seed=i, temperature=0.5))
    batch.sync_to_device()
    with count_syncs() as log:
        batch.sync_to_device()
    assert log.num_uploads == 0
    batch.np("temperature")[1] = 0.0
    batch.buffer("block_table")[2, 1] = 7
    with count_syncs() as log:
        batch.sync_to_device()
    assert log.num_uploads == 2
    assert batch.dev("temperature").numpy().tolist() == [0.5, 0.0, 0.5]
    assert batch.dev("block_table").numpy()[2, :2].tolist() == [2, 7]


def test_upload_packed_gives_each_array_its_own_dtype_and_shape():
    import paddle

    from fleetlab.device import upload_packed
    from fleetlab.syncs import count_syncs

    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    with count_syncs() as log:
        t_table, t_empty, t_ids = upload_packed(table, np.zeros(0, np.int64), np.array([7, -1]))
    assert log.num_uploads == 2  # one copy per dtype
    assert t_table.dtype == paddle.int32 and t_table.shape == [2, 3] and t_table.numpy().tolist() == table.tolist()
    assert t_empty.shape == [0] and t_ids.dtype == paddle.int64 and t_ids.numpy().tolist() == [7, -1]


def test_snapshot_describes_rows():
    batch = InputBatch(**SIZES)
    batch.add_request("p", [1, 2, 3], block_ids=[4])
    batch.add_request("gone", [1])
    batch.add_request("d", [1, 2], output_token_ids=[3], num_computed_tokens=2, block_ids=[5, 6])
    batch.remove_request("gone")
    batch.set_num_scheduled({"p": 3, "d": 1})
    snap = batch_snapshot(batch)
    phases = [(r.row, r.req_id, r.phase) for r in snap]
    assert phases == [(0, "p", "prefill"), (1, None, "empty"), (2, "d", "decode")]
    assert snap[2].block_table == [5, 6] and snap[2].num_tokens == 3 and snap[2].num_computed_tokens == 2
    assert snap[0].num_prompt_tokens == 3 and snap[0].num_scheduled_tokens == 3 and snap[1].block_table == []
    assert len(batch_snapshot(batch, include_free=True)) == SIZES["max_num_seqs"]
    batch.condense()
    batch.reorder_split_prefill_and_decode()
    assert [r.req_id for r in batch_snapshot(batch)] == ["d", "p"]


# ---------------------------------------------------------------- stateful: batch vs a plain model
@dataclass
class Shadow:
    """What the batch should hold for one request, kept with plain Python lists."""

    tokens: list
    num_prompt: int
    computed: int
    blocks: list
    seed: int
    scheduled: int = 0


class BatchMachine(RuleBasedStateMachine):
    """Drives the batch through realistic ops and compares each request with its shadow."""

    def __init__(self):
        super().__init__()
        self.batch = InputBatch(**SIZES)
        self.model: dict[str, Shadow] = {}
        self.next_id = 0

    @precondition(lambda self: len(self.model) < SIZES["max_num_seqs"])
    @rule(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=5), n_out=st.integers(0, 2),
          n_blocks=st.integers(0, 2), data=st.data())
    def add(self, prompt, n_out, n_blocks, data):
        req_id, self.next_id = f"s{self.next_id}", self.next_id + 1
        output = [60 + i for i in range(n_out)]
        computed = data.draw(st.integers(0, len(prompt) + n_out))
        blocks = [self.next_id * 10 + i for i in range(n_blocks)]
        self.batch.add_request(req_id, prompt, output, computed, blocks, Sampling(seed=self.next_id))
        self.model[req_id] = Shadow(prompt + output, len(prompt), computed, blocks, self.next_id)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.model)))
        row = self.batch.req_id_to_row[req_id]
        assert self.batch.remove_request(req_id) == row
        del self.model[req_id]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), token=st.integers(0, 99))
    def append_token(self, data, token):
        req_id = data.draw(st.sampled_from(sorted(self.model)))
        if len(self.model[req_id].tokens) < SIZES["max_model_len"]:
            append_tokens(self.batch, self.batch.req_id_to_row[req_id], [token])
            self.model[req_id].tokens.append(token)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def schedule(self, data):
        plan = {}
        for req_id, s in self.model.items():
            n = data.draw(st.integers(0, len(s.tokens) - s.computed))
            if n:
                plan[req_id] = n
        self.batch.set_num_scheduled(plan)
        for req_id, s in self.model.items():
            s.scheduled = plan.get(req_id, 0)

    @rule()
    def condense(self):
        live = [r for r in self.batch.req_ids if r is not None]
        self.batch.condense()
        assert self.batch.req_ids == live and not self.batch.has_holes

    @precondition(lambda self: self.batch.num_rows)
    @rule(data=st.data())
    def swap(self, data):
        i = data.draw(st.integers(0, self.batch.num_rows - 1))
        j = data.draw(st.integers(0, self.batch.num_rows - 1))
        swap_rows(self.batch, i, j)

    @precondition(lambda self: not self.batch.has_holes)
    @rule(threshold=st.integers(1, 3), stable=st.booleans())
    def reorder(self, threshold, stable):
        before = self.batch.req_ids
        perm, num_decodes = reorder(self.batch, threshold, stable)
        after = self.batch.req_ids

        def is_decode(s):
            return s.scheduled <= threshold if s.scheduled else s.computed >= s.num_prompt

        assert {r for r in after[:num_decodes]} == {r for r, s in self.model.items() if is_decode(s)}
        assert list(unpermute(after, perm)) == before

    @precondition(lambda self: not self.batch.has_holes)
    @rule()
    def sync(self):
        self.batch.sync_to_device()
        np.testing.assert_array_equal(self.batch.dev("block_table").numpy(), self.batch.block_table)
        for name in (f.name for f in self.batch.fields if f.home == "device"):  # every mirror, not only the table
            np.testing.assert_array_equal(self.batch.dev(name).numpy(), self.batch.np(name))

    @invariant()
    def rows_match_model(self):
        b = self.batch
        check_batch(b)
        assert set(b.req_id_to_row) == set(self.model) and b.num_reqs == len(self.model)
        for req_id, s in self.model.items():
            row = b.req_id_to_row[req_id]
            n = len(s.tokens)
            assert b.token_ids[row, :n].tolist() == s.tokens and b.num_tokens[row] == n
            assert b.num_prompt_tokens[row] == s.num_prompt
            assert b.num_tokens[row] - b.num_prompt_tokens[row] == n - s.num_prompt  # the outputs
            assert b.num_computed_tokens[row] == s.computed and b.num_scheduled_tokens[row] == s.scheduled
            assert b.block_table[row, : len(s.blocks)].tolist() == s.blocks
            assert b.num_blocks[row] == len(s.blocks)
            assert b.seed[row] == s.seed


TestBatchMachine = BatchMachine.TestCase
TestBatchMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- benchmark (correctness only, not timed)
def test_reorder_benchmark_runs_and_both_strategies_agree(capsys, tmp_path):
    from fleetlab.lab.bench import reorder

    assert reorder.main(["--rows", "8", "16", "--steps", "4", "--warmup", "2", "--max-model-len", "64",
                         "--chunk", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line[:5].strip().isdigit()]
    assert rows == ["8", "16"] and "moves/gather" in out


def test_stable_reorder_permutation_direction():
    batch = InputBatch(**SIZES)
    for req_id, computed in [("p0", 0), ("p1", 0), ("d", 2)]:
        batch.add_request(req_id, [1, 2], output_token_ids=[3], num_computed_tokens=computed)
    batch.set_num_scheduled({"p0": 3, "p1": 3, "d": 1})
    perm, num_decodes = stable_reorder(batch)
    assert perm.tolist() == [2, 0, 1] and num_decodes == 1  # perm[new_row] = old_row: a 3-cycle
    assert batch.req_ids == ["d", "p0", "p1"]
    assert unpermute(batch.req_ids, perm).tolist() == ["p0", "p1", "d"]


def test_every_default_field_has_a_typed_accessor_declared_on_the_class():
    """``batch.<field>`` is defined in InputBatch's own body (a reader and an IDE find it), one per default field,
    and reads what ``batch.np(field)`` reads."""
    from fleetlab.engine.batch_fields import DEFAULT_FIELDS, FieldView

    declared = [name for name, value in vars(InputBatch).items() if isinstance(value, FieldView)]
    assert declared == DEFAULT_FIELDS.names()
    batch = InputBatch(max_num_seqs=2, max_model_len=8, max_blocks_per_seq=2)
    batch.add_request("a", [5, 6, 7], block_ids=[0])
    assert batch.token_ids is not None and np.shares_memory(batch.token_ids, batch.np("token_ids"))
    assert batch.num_tokens.tolist() == batch.np("num_tokens").tolist() == [3]
    assert InputBatch.num_tokens.__doc__ == DEFAULT_FIELDS["num_tokens"].doc
