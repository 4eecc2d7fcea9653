"""Benchmark: overlap scheduling (``LLM(async_scheduling=True)``) against the synchronous loop.

Three engines serve the same decode-heavy workload on the shipped tiny model (``--batch``
requests at once, all prefilled in the first step, then decoding together): the synchronous
loop, the overlapped one as ``LLM(async_scheduling=True)`` builds it (its gate,
:mod:`fleetlab.overlap.gate`, probes both ways and keeps the faster; its probes are stored), and
the overlapped one made to overlap every step. They take turns (A B C C B A ...) so all meet the
same moments of a shared machine. From the engine's own phase
timestamps (:class:`fleetlab.overlap.Timeline`) each round gives, over its steady decode steps:

- ``step_ms``: the median wall time between two steps' returns (the loop's cadence);
- ``model_ms``: the median of the step's ``forward`` + ``sample`` (the model's own time; on the
  model thread when overlapped, where it competes with the host for the GIL);
- ``host_ms``: the host's own phases per step (schedule, batch update, metadata, update, and
  overlapped also freeze and fill);
- ``tok_s`` (output tokens over the round's wall time) and ``ttft_ms`` (median arrival to
  first token).

Summary: each mode's ``step / model``, the overlapped step against the synchronous model time
(the issue's target: at most 1.03x), the share of the synchronous host work the overlap hid,
and each round's pair compared (overlapped over synchronous, step time and tok/s: the median
of the pairs), which a machine whose load swings between rounds disturbs least.

Run: ``python -m fleetlab bench overlap [--batch 64] [--rounds 6] [--out DIR] [-q]``;
writes ``<out>/overlap.json``. ``--switch-interval`` (default 0.0002 s) is the interpreter's
thread switch interval while it runs (``sys.setswitchinterval``: how long a thread that wants
the GIL waits for the one holding it); 0 keeps Python's default (0.005 s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.overlap import Timeline

DEFAULT_OUT = Path("benchmarks/results")
HOST_PHASES = ("schedule", "batch_update", "metadata", "freeze", "fill", "update")
# The synchronous loop; the overlapped one as LLM(async_scheduling=True) builds it (its gate probes both ways and
# keeps the faster); the overlapped one made to overlap every step (gate.always).
MODES = ("sync", "overlap", "overlap_always")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fleetlab bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 32), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, default=48, help="tokens each request generates")
    p.add_argument("--rounds", type=int, default=6, help="rounds per mode, alternated")
    p.add_argument("--switch-interval", type=float, default=0.0002, help="seconds; 0: Python's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_quiet(p)
    return p


def one_round(llm, timeline: Timeline, prompts, sp) -> dict:
    """Serve ``prompts`` to completion; the round's figures over its steady decode steps."""
    timeline.clear()
    returns, outs = [], []
    start = time.perf_counter()
    for p in prompts:
        llm.add_request(prompt_token_ids=p, sampling_params=sp)
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
        returns.append(time.perf_counter())
    wall = time.perf_counter() - start
    steady = slice(4, len(returns) - 4)  # past the prefill and the pipeline's start, before the finish
    model = _per_step(timeline, ("forward", "sample"))[steady]
    host = _per_step(timeline, HOST_PHASES)[steady]
    return {"step_ms": 1e3 * statistics.median(np.diff(returns)[steady]),
            "model_ms": 1e3 * statistics.median(model), "host_ms": 1e3 * statistics.median(host),
            "tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "ttft_ms": 1e3 * statistics.median(o.metrics["first_token_time"] - o.metrics["arrival_time"]
                                               for o in outs),
            "steps": len(returns)}


def _per_step(timeline: Timeline, names) -> list[float]:
    """Seconds per step spent in ``names`` (each step opens with its ``schedule`` or ``forward``)."""
    first = "forward" if "forward" in names else "schedule"
    totals: list[float] = []
    for span in timeline.spans:
        if span.name == first:
            totals.append(0.0)
        if span.name in names and totals:
            totals[-1] += span.end - span.start
    return totals


def summarize(rounds: dict[str, list[dict]]) -> dict:
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rounds.items()}
    sync, over = med["sync"], med["overlap"]
    host_sync = sync["step_ms"] - sync["model_ms"]
    return {"median": med,
            "sync_step_over_model": sync["step_ms"] / sync["model_ms"],
            "overlap_step_over_model": over["step_ms"] / over["model_ms"],
            "overlap_step_over_sync_model": over["step_ms"] / sync["model_ms"],
            "host_work_hidden": 1 - (over["step_ms"] - sync["model_ms"]) / host_sync if host_sync > 0 else None,
            "tok_s_ratio": over["tok_s"] / sync["tok_s"], "ttft_ratio": over["ttft_ms"] / sync["ttft_ms"],
            # Each round's pair (taken one right after the other) compared, then the median: on a machine whose
            # load swings between rounds, the pairs compare better than medians taken over all rounds.
            "paired_step_ratio": statistics.median(o["step_ms"] / s["step_ms"]
                                                   for o, s in zip(rounds["overlap"], rounds["sync"])),
            "paired_tok_s_ratio": statistics.median(o["tok_s"] / s["tok_s"]
                                                    for o, s in zip(rounds["overlap"], rounds["sync"])),
            "paired_always_tok_s_ratio": statistics.median(o["tok_s"] / s["tok_s"] for o, s in
                                                           zip(rounds["overlap_always"], rounds["sync"])),
            "spread": {mode: {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in ("step_ms", "tok_s")}
                       for mode, rs in rounds.items()}}


@contextlib.contextmanager
def switch_interval(seconds: float):
    """Python's thread switch interval set to ``seconds`` for the block (how soon a thread that
    wants the GIL gets it from the one holding it: when the host and the model thread hand
    over), then restored, also on an error; 0 keeps the default."""
    before = sys.getswitchinterval()
    if seconds > 0:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from fleetlab import LLM, SamplingParams
    from fleetlab.models import load_tiny

    with switch_interval(args.switch_interval):
        model, _ = load_tiny()
        sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        config = dict(block_size=16, max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len[1],
                      num_blocks=args.batch * (-(-(args.prompt_len[1] + args.output_len) // 16) + 1))
        engines = {mode: LLM(model, async_scheduling=mode != "sync", **config) for mode in MODES}
        engines["overlap_always"].core.gate.always = True  # every step overlapped: what the gate weighs
        rng, vocab = np.random.default_rng(args.seed), engines["sync"].handle.vocab_size
        prompts = [rng.integers(3, vocab, size=int(rng.integers(*args.prompt_len))).tolist() for _ in range(args.batch)]
        timelines = {mode: Timeline() for mode in engines}
        for mode, llm in engines.items():
            llm.hooks.attach(timelines[mode])
            one_round(llm, timelines[mode], prompts[: max(8, args.batch // 4)], sp)  # warm-up
        rounds: dict[str, list[dict]] = {mode: [] for mode in engines}
        started = time.perf_counter()
        with MachineRecord() as machine, section("overlap", len(MODES) * args.rounds, quiet=args.quiet) as bar:
            for i in range(args.rounds):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    bar.set_postfix_str(mode)
                    rounds[mode].append(one_round(engines[mode], timelines[mode], prompts, sp))
                    bar.update()
        gate = engines["overlap"].core.gate
        probes = [{"step": p.step, "overlapped": p.overlapped, "in_line": p.in_line, "overlap": p.overlap}
                  for p in gate.history]
        for llm in engines.values():
            llm.close()
    result = {"schema_version": 1, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "python -m fleetlab bench overlap " + " ".join(argv or sys.argv[2:]),
              "elapsed_s": time.perf_counter() - started, "machine": machine.info,
              "config": {**{k: v for k, v in vars(args).items() if k not in ("out", "quiet")}, "engine": config,
                         "model": "load_tiny()"},
              "rounds": rounds, "summary": summarize(rounds), "gate_probes": probes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(result, indent=1, default=list) + "\n")
    print(report(result))
    print(describe(result["machine"]))
    return 0


def report(result: dict) -> str:
    """The side-by-side table of ``overlap.json``."""
    s, med = result["summary"], result["summary"]["median"]
    lines = ["| loop | step ms | forward+sample ms | host ms | step / model | tok/s | TTFT ms |",
             "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        m = med[mode]
        lines.append(f"| {mode} | {m['step_ms']:.2f} | {m['model_ms']:.2f} | {m['host_ms']:.2f} | "
                     f"{m['step_ms'] / m['model_ms']:.3f}x | {m['tok_s']:.0f} | {m['ttft_ms']:.1f} |")
    hidden = s["host_work_hidden"]
    lines.append(f"\noverlapped step / synchronous forward+sample: {s['overlap_step_over_sync_model']:.3f}x; "
                 f"host work hidden: {hidden:.0%}; tok/s {s['tok_s_ratio']:.2f}x; TTFT {s['ttft_ratio']:.2f}x"
                 if hidden is not None else "")
    lines.append(f"round by round (median of the pairs): step {s['paired_step_ratio']:.3f}x, "
                 f"tok/s {s['paired_tok_s_ratio']:.2f}x "
                 f"(overlapping every step: {s['paired_always_tok_s_ratio']:.2f}x)")
    probes = result.get("gate_probes", [])
    if probes:
        lines.append(f"the gate probed {len(probes)} times and overlapped after {sum(p['overlap'] for p in probes)}")
    return "\n".join(lines)
