"""The scheduler on its own: hand-built runner outputs, no model.

Each test plays the runner: it reads the ``SchedulerOutput`` and answers with a
``ModelRunnerOutput``, then checks budgets, chunking, preemption, prefix reuse and the
speculative-token accounting the scheduler commits.
"""

from __future__ import annotations

import pytest

from fleetlab.engine.messages import ModelRunnerOutput
from fleetlab.engine.request import Request, RequestStatus
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.engine.scheduler import Scheduler
from fleetlab.inspect.pool import check_kv_manager, pool_stats
from fleetlab.inspect.spec_stats import SpecDecodingStats
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.prefix_cache.hash_chain import HashChainCache

BS = 4


def make_scheduler(num_blocks=32, budget=16, max_num_seqs=8, max_model_len=64, lookahead=0, caching=True,
                   chunked=True):
    kv = KVCacheManager(BlockPool(num_blocks, BS, HashChainCache(BS) if caching else None))
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     enable_chunked_prefill=chunked, num_lookahead_tokens=lookahead)


def request(rid, prompt, max_tokens=8, order=0, eos=None, **sp):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp), seed=0, arrival_order=order,
                   eos_token_id=eos)


def answer(so, tokens=None, drafts=None):
    """A runner's reply: each row that reached its last known token gets ``tokens[rid]``
    (default: one token, 7) and the drafts ``drafts[rid]``."""
    tokens, drafts = tokens or {}, drafts or {}
    out = ModelRunnerOutput()
    sched = so_requests(so)
    for rid, n in so.num_scheduled_tokens.items():
        num_computed, num_tokens = sched[rid]
        if num_computed + n >= num_tokens:
            out.sampled_token_ids[rid] = tokens.get(rid, [7])
            if rid in drafts:
                out.spec_token_ids[rid] = drafts[rid]
    return out


_STATE: dict = {}


def so_requests(so):
    return _STATE[id(so)]


def schedule(s):
    so = s.schedule()
    _STATE[id(so)] = {rid: (s.requests[rid].num_computed_tokens, s.requests[rid].num_tokens)
                      for rid in so.num_scheduled_tokens}
    return so


def step(s, tokens=None, drafts=None):
    so = schedule(s)
    outputs = s.update(so, answer(so, tokens, drafts), now=0.0)
    return so, [o for o in outputs if o.finished]


def test_budget_running_first_and_chunked_prefill():
    s = make_scheduler(budget=10)
    s.add_request(request("a", range(3, 9)))  # 6 tokens
    s.add_request(request("b", range(30, 44), order=1))  # 14 tokens: chunked
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 6, "b": 4} and so.total_num_scheduled_tokens == 10
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"] and so.scheduled_cached_reqs.req_ids == []
    so, _ = step(s)
    # a decodes first (running, in admission order), b continues its prompt within the budget
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert so.scheduled_new_reqs == [] and so.scheduled_cached_reqs.req_ids == ["a", "b"]
    cached = so.scheduled_cached_reqs
    assert cached.new_token_ids == [[7], []] and cached.num_computed_tokens == [6, 4]
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert s.requests["b"].num_computed_tokens == 14 and s.requests["b"].output_token_ids == [7]


def test_no_chunking_admits_only_whole_prompts():
    s = make_scheduler(budget=10, chunked=False)
    s.add_request(request("a", range(3, 9)))
    s.add_request(request("b", range(30, 36), order=1))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 6}


def test_preemption_frees_the_victim_and_resends_it_in_full():
    # Each request alone fits the pool (8 + 20 tokens = 7 blocks of 8); together they do not.
    s = make_scheduler(num_blocks=8, budget=32)
    s.add_request(request("old", range(3, 11), max_tokens=20, ignore_eos=True))  # 8 tokens: 2 blocks
    s.add_request(request("new", range(20, 28), order=1, max_tokens=20, ignore_eos=True))
    step(s)
    assert s.kv.pool.num_free_blocks == 4
    for _ in range(12):  # both grow until the pool runs dry
        so, _ = step(s)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == ["new"] and "new" not in so.num_scheduled_tokens
    new = s.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.kv.get_block_ids("new") == [] and len(s.kv.get_block_ids("old")) >= 3
    for _ in range(30):  # old finishes, new comes back
        so = schedule(s)
        if "new" in so.num_scheduled_tokens:
            break
        s.update(so, answer(so), now=0.0)
    data = {n.req_id: n for n in so.scheduled_new_reqs}["new"]
    assert data.output_token_ids == new.output_token_ids and data.block_ids == s.kv.get_block_ids("new")
    check_kv_manager(s.kv, s.requests)


def test_prefix_reuse_across_steps_and_within_one_step():
    s = make_scheduler(budget=64)
    prefix = list(range(3, 15))  # 3 full blocks
    s.add_request(request("a", prefix + [40, 41]))
    s.add_request(request("b", prefix + [50]))  # admitted in the same step: shares a's blocks
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 14, "b": 1}  # b computes only its own token
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 12 and new["b"].block_ids[:3] == new["a"].block_ids[:3]
    s.add_request(request("c", prefix + [60, 61]))
    so, _ = step(s)
    assert so.num_scheduled_tokens["c"] == 2 and pool_stats(s.kv.pool).hit_rate > 0
    check_kv_manager(s.kv, s.requests)


def test_a_preempted_request_takes_back_its_same_step_prefix_registrations():
    s = make_scheduler(num_blocks=6, budget=64)
    s.add_request(request("a", range(3, 11), max_tokens=30, ignore_eos=True))
    step(s)
    s.add_request(request("b", range(40, 52), order=1, max_tokens=30, ignore_eos=True))  # 3 blocks, registered
    so = schedule(s)
    assert "b" in so.num_scheduled_tokens and pool_stats(s.kv.pool).num_cached_blocks >= 4
    s.rollback(so)  # the runner failed: b goes back to waiting, its unwritten blocks leave the cache
    assert s.requests["b"].status is RequestStatus.WAITING and s.kv.get_block_ids("b") == []
    assert pool_stats(s.kv.pool).num_cached_blocks == 2  # a's prompt only
    so, _ = step(s)  # the retried step resends everything in full
    assert {n.req_id for n in so.scheduled_new_reqs} == {"a", "b"}
    check_kv_manager(s.kv, s.requests)


def test_spec_tokens_are_scheduled_verified_and_rolled_back():
    s = make_scheduler(budget=32, lookahead=3)
    s.add_request(request("r", range(3, 9), max_tokens=30, ignore_eos=True))  # 6 prompt tokens
    so, _ = step(s, tokens={"r": [10]}, drafts={"r": [11, 12, 13]})
    r = s.requests["r"]
    assert r.spec_token_ids == [11, 12, 13] and r.num_computed_tokens == 6
    assert len(s.kv.get_block_ids("r")) == 3  # 6 + 1 + 3 lookahead slots -> 10 tokens -> 3 blocks
    so = schedule(s)
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_spec_decode_tokens == {"r": [11, 12, 13]}
    # the target accepts 11, rejects 12 and samples 20 instead: 2 tokens gained
    result = answer(so, tokens={"r": [11, 20]}, drafts={"r": [21, 22, 23]})
    s.update(so, result, now=0.0)
    spec_stats = SpecDecodingStats()  # what the engine's observer counts from the step's messages
    spec_stats.on_step(so, result, [])
    assert r.output_token_ids == [10, 11, 20]
    assert r.num_computed_tokens == 6 + 1 + 1  # the last token and the accepted draft; 12 and 13 rolled back
    assert spec_stats.num_draft_tokens == 3 and spec_stats.num_accepted_tokens == 1
    assert spec_stats.accepted_per_position == [1] and spec_stats.drafted_per_position == [1, 1, 1]
    so = schedule(s)
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_cached_reqs.new_token_ids == [[11, 20]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]


def test_rejected_drafts_free_the_blocks_past_the_new_end():
    s = make_scheduler(budget=32, lookahead=8)
    s.add_request(request("r", range(3, 7), max_tokens=30, ignore_eos=True))
    step(s, tokens={"r": [10]}, drafts={"r": list(range(11, 19))})
    so = schedule(s)
    held = len(s.kv.get_block_ids("r"))  # 4 + 1 + 8 drafts + 8 lookahead -> 21 tokens -> 6 blocks
    s.update(so, answer(so, tokens={"r": [30]}), now=0.0)  # every draft rejected
    r = s.requests["r"]
    assert r.num_computed_tokens == 5 and held == 6
    assert len(s.kv.get_block_ids("r")) == 4  # 6 tokens + 8 lookahead -> 14 -> 4 blocks
    so = schedule(s)
    assert so.scheduled_cached_reqs.num_blocks == [len(s.kv.get_block_ids("r"))]  # the runner cuts its table
    check_kv_manager(s.kv, s.requests)


@pytest.mark.parametrize("stop", ["eos", "stop_id", "max_tokens", "min_tokens"])
def test_a_stop_inside_an_accepted_run_cuts_it_exactly(stop):
    kw = dict(max_tokens=30, eos=99)
    if stop == "stop_id":
        kw["stop_token_ids"] = (12,)
    if stop == "max_tokens":
        kw["max_tokens"] = 3
    if stop == "min_tokens":
        kw["min_tokens"] = 5
    s = make_scheduler(budget=32, lookahead=4)
    s.add_request(request("r", range(3, 7), **kw))
    step(s, tokens={"r": [10]}, drafts={"r": [11, 12, 99, 13]})
    so = schedule(s)
    accepted = [11, 12, 99, 13, 14] if stop != "min_tokens" else [11, 12, 99, 13, 99]
    finished = [o for o in s.update(so, answer(so, tokens={"r": accepted}), now=0.0) if o.finished]
    want = {"eos": [10, 11, 12, 99], "stop_id": [10, 11, 12], "max_tokens": [10, 11, 12],
            "min_tokens": [10, 11, 12, 99, 13, 99]}[stop]
    (req,) = finished
    assert req.token_ids == want
    assert req.finish_reason == ("length" if stop == "max_tokens" else "stop")
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_abort_frees_and_reports_finished_ids_to_the_runner():
    s = make_scheduler()
    s.add_request(request("a", range(3, 9)))
    s.add_request(request("b", range(3, 9), order=1))
    step(s)
    assert [r.request_id for r in s.abort(["b", "zzz"])] == ["b"]
    so = schedule(s)
    assert so.finished_req_ids == {"b"} and list(so.num_scheduled_tokens) == ["a"]
    assert s.kv.get_block_ids("b") == [] and "b" not in s.requests
