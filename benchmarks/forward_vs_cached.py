"""fleetlab's paged forward of a decode step against PaddleFormers' own cached decode step, side by side.

    python benchmarks/forward_vs_cached.py [--batch 64] [--context 64] [--rounds 15]

Both sides run the shipped tiny model (two copies: fleetlab patches its own), ``--batch`` rows
that each hold ``--context`` tokens and add one:

- fleetlab: ``LLM`` prefills the rows, then one decode step's prepared inputs are run again and
  again through ``ModelRunner.forward`` (the same slots rewritten with the same values); also
  timed apart, the host's preparation of that step (``ModelRunner.prepare``'s metadata: the
  attention metadata and the tiled backend's plan, which PaddleFormers' forward does inside);
- PaddleFormers: ``model(input_ids [B, 1], past_key_values=DynamicCache, use_cache=True)``,
  its cache cropped back to ``--context`` after each call (outside the timing).

The sides take turns (A B A B ...), ``--steps`` calls each per round; per round the median call,
then the median and the spread (min-max) of the rounds, and the median of the per-round ratios.
Writes ``--out`` (default ``benchmarks/results/forward_vs_cached.json``) with the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time


def fleetlab_side(batch: int, context: int):
    """A callable running one decode step's forward again, and one building that step's metadata."""
    import numpy as np

    from fleetlab import LLM, SamplingParams
    from fleetlab.models import load_tiny

    model, _ = load_tiny()
    llm = LLM(model, block_size=16, max_num_seqs=batch, max_num_batched_tokens=batch * context,
              num_blocks=batch * (context // 16 + 2))
    rng = np.random.default_rng(0)
    runner, captured = llm.runner, {}
    real = runner.forward

    def capture(inputs):
        captured["inputs"] = inputs
        return real(inputs)

    runner.forward = capture
    for _ in range(batch):
        llm.add_request(prompt_token_ids=rng.integers(3, llm.handle.vocab_size, context).tolist(),
                        sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # every prompt in one step
    llm.step()  # the first decode step: contexts of context + 1
    runner.forward = real
    inputs = captured["inputs"]
    assert inputs.metadata.num_decodes == batch, "the captured step is not an all-decode step"
    return (lambda: real(inputs) if llm else None), (lambda: runner.prepare_inputs())  # llm: kept alive (patched)


def paddleformers_side(batch: int, context: int):
    """A callable running PaddleFormers' cached decode step at ``context`` past tokens."""
    import numpy as np
    import paddle

    from fleetlab.models import load_tiny

    model, _ = load_tiny()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(3, model.config.vocab_size, (batch, context)))
    with paddle.no_grad():
        cache = model(input_ids=ids, use_cache=True, return_dict=True).past_key_values
    step = paddle.to_tensor(rng.integers(3, model.config.vocab_size, (batch, 1)))

    def run():
        with paddle.no_grad():
            logits = model(input_ids=step, past_key_values=cache, use_cache=True, return_dict=True).logits
        cache.crop(context)
        return logits

    return run


def timed(fn, steps: int) -> float:
    """Median seconds of ``steps`` calls."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/forward_vs_cached.json")
    args = parser.parse_args()
    from fleetlab.lab.bench.machine import MachineRecord

    forward, prepare = fleetlab_side(args.batch, args.context)
    cached = paddleformers_side(args.batch, args.context)
    sides = {"fleetlab_forward": forward, "fleetlab_prepare": prepare, "paddleformers_cached_step": cached}
    for fn in sides.values():  # warm up
        timed(fn, 3)
    rounds = {name: [] for name in sides}
    with MachineRecord() as machine:
        for k in range(args.rounds):
            for name in (list(sides) if k % 2 == 0 else list(sides)[::-1]):
                rounds[name].append(1e3 * timed(sides[name], args.steps))
    summary = {name: {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3),
                      "max_ms": round(max(v), 3)} for name, v in rounds.items()}
    pairs = list(zip(rounds["fleetlab_forward"], rounds["fleetlab_prepare"], rounds["paddleformers_cached_step"]))
    summary["forward_over_cached"] = round(statistics.median(f / c for f, _, c in pairs), 3)
    summary["forward_and_prepare_over_cached"] = round(statistics.median((f + p) / c for f, p, c in pairs), 3)
    result = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": f"python benchmarks/forward_vs_cached.py --batch {args.batch} --context {args.context} "
                         f"--rounds {args.rounds} --steps {args.steps}",
              "machine": machine.info, "rounds_ms": rounds, "summary": summary}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
