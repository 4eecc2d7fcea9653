"""The extension points a prototyper imports (issue 23): one registry's rules, backends and
policies as name, class or instance, ``attend`` told its layer, errors that name the backend,
custom batch fields that reach the engine and move with their row, and the InputBatch bugs."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import random_prompts

import fleetlab
from fleetlab import (
    LLM,
    AttentionBackend,
    AttentionMetadata,
    Field,
    InputBatch,
    SamplingParams,
    SchedulingPolicy,
    register_attention_backend,
    register_policy,
)
from fleetlab.attention.naive import naive_paged_attention
from fleetlab.attention.tiled import TiledBackend
from fleetlab.engine.logits_processor import LogitsProcessor
from fleetlab.inspect.batch import check_batch
from fleetlab.patching.parity import reference_greedy

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(fleet_model):
    prompts = random_prompts([3, 14, 6, 21, 9], seed=21)
    want, _ = reference_greedy(fleet_model, prompts, 5)
    return prompts, want


def tokens(llm, prompts, sp=GREEDY):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]


# ----------------------------------------------------------------------------- one registry
class Shadow(TiledBackend):
    name = "tiled"


def test_one_registry_one_set_of_rules():
    with pytest.raises(ValueError, match="built in.*replace=True"):
        register_attention_backend("tiled", Shadow)  # replacing a built-in must be explicit
    with pytest.raises(TypeError, match="subclass of .*SchedulingPolicy"):
        register_policy("x", int)  # refused at once, not at the first step
    with pytest.raises(ValueError, match="says name='tiled'"):
        register_attention_backend("mine", TiledBackend)  # a class carries the name it is known by
    with pytest.raises(ValueError, match="module:Class"):
        fleetlab.spec_decode.proposer.register_proposer("p", "fleetlab.spec_decode.ngram")

    class Again(TiledBackend):
        name = "again"

    register_attention_backend("again", Again)
    register_attention_backend("again", Again)  # a re-run notebook cell registers its class again
    assert fleetlab.get_attention_backend("again") is Again


# ----------------------------------------------------------------------------- name, class or instance
class LayerRecorder(AttentionBackend):
    """The naive attention, recording which layers each step asked for."""

    name = "layer-recorder"

    def __init__(self):
        super().__init__()
        self.layers = []

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None, sinks=None):
        self.layers.append(layer_id)
        return naive_paged_attention(query, key_cache, value_cache, metadata, scale=scale,
                                     sliding_window=sliding_window, sinks=sinks)


class LongestFirst(SchedulingPolicy):
    name = "longest-first"

    def admission_key(self, request, step):
        return (-request.num_prompt_tokens, request.arrival_order)


@pytest.mark.parametrize("backend", [LayerRecorder, LayerRecorder(), "layer-recorder"], ids=["cls", "obj", "name"])
@pytest.mark.parametrize("policy", [LongestFirst, LongestFirst(), "longest-first"], ids=["cls", "obj", "name"])
def test_backend_and_policy_as_name_class_or_instance(fleet_model, workload, backend, policy):
    register_attention_backend("layer-recorder", LayerRecorder)
    register_policy("longest-first", LongestFirst)
    prompts, want = workload
    with LLM(fleet_model, backend=backend, scheduling_policy=policy, block_size=4) as llm:
        assert tokens(llm, prompts) == want
        assert isinstance(llm.handle.backend, LayerRecorder) and isinstance(llm.scheduler.policy, LongestFirst)
        layers = llm.handle.backend.layers
        num_layers = llm.handle.num_layers
        assert layers[:num_layers] == list(range(num_layers)) and len(layers) % num_layers == 0


class NoAttend(AttentionBackend):
    name = "no-attend"


class WrongShape(AttentionBackend):
    name = "wrong-shape"

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None, sinks=None):
        return query[:, :1]


@pytest.mark.parametrize("cls,error,words", [(NoAttend, NotImplementedError, ["'no-attend'", "attend("]),
                                             (WrongShape, ValueError, ["'wrong-shape'", "shape"])])
def test_backend_errors_name_the_backend(fleet_model, cls, error, words):
    with LLM(fleet_model, backend=cls, block_size=4) as llm, pytest.raises(error) as err:
        tokens(llm, [[5, 6, 7]])
    assert all(w in str(err.value) for w in words)


# ----------------------------------------------------------------------------- custom batch fields
class LoraSeer(TiledBackend):
    """Records, every step, each row's request id beside its ``lora_id`` as attention sees them."""

    name = "lora-seer"

    def __init__(self):
        super().__init__()
        self.seen = []

    def build_metadata(self, common):
        batch = common.batch
        self.seen.append(list(zip(batch.req_ids, batch.np("lora_id").tolist())))
        return super().build_metadata(common)


@pytest.mark.parametrize("engine", [dict(reorder=True, max_num_batched_tokens=10),
                                    dict(num_blocks=12, max_num_batched_tokens=16)], ids=["reorder", "preempting"])
def test_a_custom_batch_field_reaches_the_backend_and_moves_with_its_row(fleet_model, workload, engine):
    prompts, want = workload
    lora = Field("lora_id", (), "int32", "host", -1, "which adapter a request uses")
    with LLM(fleet_model, backend=LoraSeer, block_size=4, batch_fields=[lora], **engine) as llm:
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=GREEDY, extra={"lora_id": 10 + i})
               for i, p in enumerate(prompts)]
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        assert [done[i] for i in ids] == want
        seen = llm.handle.backend.seen
        if "num_blocks" in engine:
            assert llm.stats()["num_preemptions"] > 0
        else:
            assert any(rows != sorted(rows, key=lambda r: int(r[0])) for rows in seen)  # rows really moved
    assert all(lid == 10 + ids.index(rid) for rows in seen for rid, lid in rows)


def test_an_extra_value_is_checked_before_it_is_queued(fleet_model):
    lora = Field("lora_id", (), "int32", "host", -1)
    with LLM(fleet_model, block_size=4, batch_fields=[lora]) as llm:
        for extra, words in (({"lora_id": "adapter-A"}, ["'bad'", "lora_id"]), ({"nope": 1}, ["'bad'", "nope"])):
            with pytest.raises(ValueError) as err:
                llm.add_request(prompt_token_ids=[5, 6], request_id="bad", extra=extra)
            assert all(w in str(err.value) for w in words)
        assert not llm.has_unfinished_requests()


def test_fields_of_a_live_batch_are_fixed():
    batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="fields=") as err:
        batch.fields.register(Field("lora_id", (), "int32"))
    assert "lora_id" in str(err.value)
    batch.add_request("a", [1, 2])  # still works
    check_batch(batch)


def test_a_rejected_extra_value_leaves_no_ghost_row():
    fields = fleetlab.DEFAULT_FIELDS.copy()
    fields.register(Field("lora_id", (), "int32", "host", -1))
    batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=4, fields=fields)
    batch.add_request("a", [1, 2], extra={"lora_id": 1})
    with pytest.raises(ValueError, match="'b'.*lora_id"):
        batch.add_request("b", [3], extra={"lora_id": "adapter-A"})
    check_batch(batch)
    assert batch.req_ids == ["a"] and batch.num_reqs == 1


# ----------------------------------------------------------------------------- the manual loop
def test_metadata_from_ragged_block_tables_and_from_a_batch():
    md = AttentionMetadata.build([3, 1], [0, 5], [[7], [2, 4]], block_size=4)
    assert md.block_tables.numpy().tolist() == [[7, -1], [2, 4]]
    assert md.slot_mapping.numpy().tolist() == [28, 29, 30, 17]  # 4 * 7 + 0..2; 4 * block 4 + 5 % 4
    batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=4)
    batch.add_request("a", [1, 2, 3], block_ids=[7])
    batch.add_request("b", [1, 2, 3, 4, 5, 6], num_computed_tokens=5, block_ids=[2, 4])
    batch.set_num_scheduled({"a": 3, "b": 1})
    batch.sync_to_device()
    from_batch = AttentionMetadata.from_batch(batch, block_size=4)
    assert from_batch.slot_mapping.numpy().tolist() == md.slot_mapping.numpy().tolist()
    assert from_batch.batch is batch and from_batch.num_decodes == 0


def test_the_documented_manual_loop_matches_the_model(fleet_model, workload):
    from fleetlab.patching.parity import paged_greedy

    prompts, want = workload
    handle = fleetlab.patch_model(fleet_model)
    try:
        got, _ = paged_greedy(handle, prompts, 5)
    finally:
        handle.unpatch()
    assert got == want


def test_everything_a_prototyper_extends_is_exported():
    for name in ("AttentionBackend", "AttentionMetadata", "SchedulingPolicy", "register_policy", "Field",
                 "FieldRegistry", "DEFAULT_FIELDS", "unpermute", "Registry", "Proposer", "register_proposer",
                 "StepRecorder", "register_attention_backend"):
        assert getattr(fleetlab, name) is not None, name
    assert paddle is not None and np is not None


class BanOne(LogitsProcessor):
    """Each request may name one token it never gets (its own ``ban_token`` field)."""

    fields = (Field("ban_token", (), "int64", "host", -1, "a token this request never gets"),)

    def __call__(self, logits, st):
        ban = st.batch.np("ban_token")[st.pos_row]
        rows = np.flatnonzero(ban >= 0)
        if len(rows) == 0:
            return logits
        mask = np.zeros(logits.shape, dtype=bool)
        mask[rows, ban[rows]] = True
        return paddle.where(paddle.to_tensor(mask), paddle.full_like(logits, float("-inf")), logits)


def test_a_logits_processor_reads_its_own_field_per_row(fleet_model, workload):
    prompts, want = workload
    with LLM(fleet_model, block_size=4, logits_processors=[BanOne()], reorder=True) as llm:
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=GREEDY,
                               extra={"ban_token": want[i][0]} if i % 2 else None) for i, p in enumerate(prompts)]
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    for i, rid in enumerate(ids):
        if i % 2:
            assert want[i][0] not in done[rid]
        else:
            assert done[rid] == want[i]
