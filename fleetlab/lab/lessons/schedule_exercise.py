"""Write the scheduler yourself: a toy ``schedule()`` checked against the engine's own steps.

The learner's function sees one step's state as plain data (:class:`ToyState`) and returns
its plan (:class:`ToyPlan`): how many tokens each request runs and whom it preempts.
:func:`check_schedule` replays an engine run recorded with ``record_traces=True``: before
each step it rebuilds the state the engine's scheduler saw, asks the toy for its plan,
compares the plan with what the engine did, and then advances the state by what the
engine did. The first step where the two differ is returned as a :class:`Mismatch`.

A learner's slip is returned too, as a :class:`Slip` naming it, never as a crash inside the
checker: a ``schedule()`` that returns None (a forgotten ``return``) or something other than a
``ToyPlan`` (a dict), a plan whose fields are not a dict of int and a list of ids, one that
raises (its exception and the lines of the learner's code it came through), or one that takes
longer than ``time_limit`` seconds (an endless loop: it is stopped, the notebook goes on).

The toy world is the engine's with the prefix cache off (a waiting request starts from
zero computed tokens), first-come-first-served (admit the oldest waiting request, preempt
the newest running one), no speculative decoding (:func:`check_schedule` refuses an engine
configured otherwise), and no request long enough to reach the model's length.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

TIME_LIMIT_S = 10.0  # per step: a toy's step runs in microseconds; one that does not return is a bug


@dataclass
class ToyRequest:
    """One request as a scheduler sees it. ``num_tokens``: prompt plus tokens generated so
    far; ``num_computed_tokens``: those with K/V in the cache; ``num_blocks``: blocks held."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    num_blocks: int = 0


@dataclass
class ToyState:
    """What the scheduler knows before a step. ``running`` in admission order (oldest
    first); ``waiting`` in the order to admit (the oldest arrival first, a preempted request
    included: it keeps its place)."""

    step: int
    running: list[ToyRequest]
    waiting: list[ToyRequest]
    num_free_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass
class ToyPlan:
    """A step's plan: tokens per scheduled request, and the requests preempted, in order."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


@dataclass
class Mismatch:
    """Where the toy first differs from the engine: the step, the request, and both plans."""

    step: int
    request_id: str | None
    engine: ToyPlan
    toy: ToyPlan
    state: ToyState

    def describe(self) -> str:
        rid = self.request_id

        def what(plan: ToyPlan) -> str:
            if rid in plan.preempted:
                return "preempted it"
            if rid in plan.num_scheduled_tokens:
                return f"ran {plan.num_scheduled_tokens[rid]} of its tokens"
            return "left it out"

        if rid is None:  # same requests and tokens, preempted in another order
            return f"step {self.step}: engine preempted {self.engine.preempted}, yours {self.toy.preempted}"
        return f"step {self.step}, request {rid}: the engine {what(self.engine)}, yours {what(self.toy)}"


@dataclass
class Slip:
    """The toy's step could not be compared: ``problem`` says why, in the learner's terms."""

    step: int
    problem: str
    state: ToyState
    request_id: str | None = None  # never one: a slip is the whole step's

    def describe(self) -> str:
        return f"step {self.step}: your schedule() {self.problem}"


class _TimeUp(BaseException):  # not an Exception: a learner's ``except Exception`` does not swallow it
    pass


def ask(schedule, state: ToyState, time_limit: float = TIME_LIMIT_S) -> ToyPlan | str:
    """``schedule(state)`` if it returns a well-formed ``ToyPlan`` within ``time_limit`` seconds;
    else what went wrong, as a sentence (see :class:`Slip`).

    It runs on a thread of its own, traced so that a Python loop past the limit is stopped where
    it stands; one blocked in C (``time.sleep``) is left behind on its daemon thread."""
    box: dict = {}
    deadline = time.monotonic() + time_limit

    def tracer(frame, event, arg):  # every line the learner's code runs checks the clock
        if time.monotonic() > deadline:
            raise _TimeUp
        return tracer

    def run():
        sys.settrace(tracer)
        try:
            box["plan"] = schedule(state)
        except _TimeUp:
            box["late"] = True
        except Exception as exc:  # the learner's: reported, never raised out of the checker
            box["error"] = exc
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=run, name="schedule-exercise", daemon=True)
    worker.start()
    worker.join(time_limit + 1.0)
    if worker.is_alive() or box.get("late"):
        return (f"did not return within {time_limit:g} s (an endless loop? a `while` whose condition never "
                "changes?); it was stopped")
    if "error" in box:
        return _raised(box["error"])
    return _plan_problem(box["plan"])


def _raised(exc: Exception) -> str:
    """The learner's exception and the lines of their code it passed through (not the checker's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    where = "".join(f"\n    {f.filename}, line {f.lineno}, in {f.name}: {f.line}" for f in frames[-3:])
    return f"raised {type(exc).__name__}: {exc}{where}"


def _plan_problem(plan) -> ToyPlan | str:
    """``plan`` if it is a well-formed ToyPlan, else what is wrong with it."""
    if plan is None:
        return "returned None: did it forget `return plan`?"
    if not isinstance(plan, ToyPlan):
        hint = " (wrap it: ToyPlan(num_scheduled_tokens=...))" if isinstance(plan, dict) else ""
        return f"returned a {type(plan).__name__}, not a ToyPlan{hint}"
    tokens, preempted = plan.num_scheduled_tokens, plan.preempted
    if not isinstance(tokens, dict):
        return f"returned ToyPlan(num_scheduled_tokens={tokens!r:.60}): it must be a dict, request id -> tokens"
    bad = {rid: n for rid, n in tokens.items() if not isinstance(rid, str) or isinstance(n, bool)
           or not isinstance(n, int) or n < 1}
    if bad:
        return (f"returned num_scheduled_tokens with {bad!r:.80}: each entry must be a request id (str) -> a "
                "number of tokens (int >= 1)")
    if not isinstance(preempted, (list, tuple)) or not all(isinstance(rid, str) for rid in preempted):
        return f"returned ToyPlan(preempted={preempted!r:.60}): it must be a list of request ids (str)"
    return plan


def first_difference(engine: ToyPlan, toy: ToyPlan) -> tuple[bool, str | None]:
    """``(differs, request_id)``: the first request (engine order, then the toy's) the plans treat differently."""
    rids = list(dict.fromkeys([*engine.num_scheduled_tokens, *engine.preempted,
                               *toy.num_scheduled_tokens, *toy.preempted]))
    for rid in rids:
        if (engine.num_scheduled_tokens.get(rid), rid in engine.preempted) != \
                (toy.num_scheduled_tokens.get(rid), rid in toy.preempted):
            return True, rid
    return engine.preempted != toy.preempted, None


def check_schedule(schedule, llm, arrival_steps: dict[str, int], *,
                   time_limit: float = TIME_LIMIT_S) -> Mismatch | Slip | None:
    """Replay ``llm.traces`` against ``schedule(state) -> ToyPlan``; None when every step agrees.

    ``arrival_steps``: request id -> the step before which the request was added (in the
    order they were added). The engine must have run with ``record_traces=True``, the
    prefix cache off and the ``"fcfs"`` policy, without speculative decoding.
    Returns the first :class:`Mismatch`, or the first :class:`Slip` (``schedule`` returned no
    well-formed ``ToyPlan``, raised, or ran past ``time_limit`` seconds in one step); both
    have ``describe()``.
    """
    _check_engine(llm)
    cfg, traces = llm.config, llm.traces
    prompts = {r.request_id: r.num_prompt_tokens for t in traces for r in t.rows}
    missing = sorted(set(arrival_steps) - set(prompts))
    if missing:
        raise ValueError(f"check_schedule: requests {missing} never ran in the recorded traces")
    requests = {rid: ToyRequest(rid, prompts[rid]) for rid in arrival_steps}
    order = {rid: i for i, rid in enumerate(arrival_steps)}
    running: list[ToyRequest] = []
    waiting: list[ToyRequest] = []
    for trace in traces:
        waiting += [requests[rid] for rid, s in arrival_steps.items() if s == trace.step]
        waiting.sort(key=lambda r: order[r.request_id])
        used = sum(r.num_blocks for r in running)
        state = ToyState(trace.step, [_copy(r) for r in running], [_copy(r) for r in waiting],
                         trace.num_blocks - used, cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        engine = ToyPlan({r.request_id: r.num_scheduled_tokens for r in trace.rows}, list(trace.preempted))
        toy = ask(schedule, state, time_limit)
        if isinstance(toy, str):
            return Slip(trace.step, toy, state)
        differs, rid = first_difference(engine, toy)
        if differs:
            return Mismatch(trace.step, rid, engine, toy, state)
        _advance(trace, running, waiting, requests, cfg.block_size)
    return None


def _check_engine(llm) -> None:
    cfg = llm.config
    if not getattr(llm, "traces", None):
        raise ValueError("check_schedule: the engine recorded no traces (create it with record_traces=True)")
    refused = {"enable_prefix_caching": cfg.enable_prefix_caching, "speculative decoding": llm.proposer is not None,
               "a policy other than fcfs": getattr(llm.scheduler.policy, "name", None) != "fcfs"}
    on = [name for name, value in refused.items() if value]
    if on:
        raise ValueError(f"check_schedule: the toy scheduler models none of {on}; run the engine without them")


def _copy(r: ToyRequest) -> ToyRequest:
    return ToyRequest(r.request_id, r.num_tokens, r.num_computed_tokens, r.num_blocks)


def _advance(trace, running: list[ToyRequest], waiting: list[ToyRequest], requests: dict[str, ToyRequest],
             block_size: int) -> None:
    """Move the state on by what the engine did in ``trace`` (preempt, admit, compute, sample, finish)."""
    for rid in trace.preempted:
        req = requests[rid]
        running.remove(req)
        req.num_computed_tokens = req.num_blocks = 0
        waiting.append(req)
    ran = {row.request_id for row in trace.rows}
    for req in [r for r in waiting if r.request_id in ran]:  # admitted: to the back of running, in order
        waiting.remove(req)
        running.append(req)
    for row in trace.rows:
        req = requests[row.request_id]
        req.num_computed_tokens += row.num_scheduled_tokens
        req.num_blocks = max(req.num_blocks, -(-req.num_computed_tokens // block_size))
        req.num_tokens += len(trace.tokens.get(row.request_id, ()))
    for rid in trace.finished:
        running.remove(requests[rid])
    held = sum(r.num_blocks for r in running)
    if trace.num_blocks - held != trace.num_free_blocks:  # the replay lost track of the pool: say so, never guess
        raise RuntimeError(f"check_schedule: after step {trace.step} the replay counts {trace.num_blocks - held} "
                           f"free blocks, the engine {trace.num_free_blocks}")
