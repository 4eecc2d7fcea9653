"""``python -m fleetlab demo``: serve a batch of prompts on the shipped tiny model.

It prints each answer (arithmetic is checked), a timeline of which request ran a
prefill chunk (P) or a decode (D) in each step, and the engine's figures: throughput,
KV-cache utilization, prefix-cache hit rate and preemptions.
"""

from __future__ import annotations

import argparse
import random
import time

PROMPT_KINDS = ("add", "times", "count", "add", "text")


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """A mix of prompts the tiny model was trained on; ``n`` of them, deterministic."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = PROMPT_KINDS[i % len(PROMPT_KINDS)]
        if kind == "add":
            prompts.append(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=")
        elif kind == "times":
            prompts.append(f"{rng.randint(2, 9)}*{rng.randint(2, 9)}=")
        elif kind == "count":
            prompts.append(f"count {rng.randint(1, 80)} ")
        else:
            prompts.append(rng.choice(["the red cat ", "a small dog ", "the old man "]))
    return prompts


def check(prompt: str, answer: str) -> str:
    """A tick or a cross for arithmetic prompts, blank for the rest."""
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for op, fn in ops.items():
        if prompt.endswith("=") and op in prompt:
            a, b = prompt[:-1].split(op)
            want = fn(int(a), int(b))
            return "ok" if answer.strip() == str(want) else f"want {want}"
    return ""


def timeline(traces, request_ids, width: int = 60) -> list[str]:
    """One text line per request: P prefill chunk, D decode, x preempted, . waiting."""
    lines = []
    for rid in request_ids:
        cells, finished = [], False
        for t in traces[:width]:
            row = next((r for r in t.rows if r.request_id == rid), None)
            if rid in t.preempted:
                cells.append("x")
            elif row is not None:
                cells.append("D" if row.phase == "decode" else "P")
            else:
                cells.append(" " if finished else ".")
            finished = finished or rid in t.finished
        lines.append("".join(cells))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetlab demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from fleetlab import LLM, SamplingParams
    from fleetlab.models import load_tiny

    model, tok = load_tiny()
    llm = LLM(model, tok, block_size=args.block_size, num_blocks=args.num_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              record_traces=True)
    prompts = make_prompts(args.num_prompts, args.seed)
    print(f"fleetlab demo: {len(prompts)} prompts, tiny trained Llama "
          f"({sum(int(w.numel()) for w in model.parameters()) / 1e6:.2f}M parameters), "
          f"KV pool of {args.num_blocks} blocks x {args.block_size} tokens, "
          f"{args.max_num_seqs} rows, budget {args.max_num_batched_tokens} tokens/step\n")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=False)
    elapsed = time.perf_counter() - t0

    width = max(len(pr) for pr in prompts)
    for pr, out in zip(prompts, outs):
        print(f"  {pr:<{width}} -> {out.text!r:<32} {check(pr, out.text):>8}  [{out.finish_reason}]")
    print("\nWho ran in each step (P prefill chunk, D decode, x preempted, . waiting):")
    ids = [o.request_id for o in outs]
    for rid, line in zip(ids, timeline(llm.traces, ids)):
        print(f"  req {rid:>3} |{line}|")

    s = llm.stats()
    n_tokens = sum(len(o.token_ids) for o in outs)
    peak = max(1 - t.num_free_blocks / t.num_blocks for t in llm.traces)
    print(f"\n  {n_tokens} tokens in {elapsed:.2f} s over {s['num_steps']} steps: "
          f"{n_tokens / elapsed:.0f} output tokens/s on {_device()}")
    print(f"  KV cache: peak {peak:.0%} of blocks in use; prefix-cache hit rate "
          f"{s['prefix_cache_hit_rate']:.0%}; preemptions {s['num_preemptions']}")
    right = sum(check(p_, o.text) == "ok" for p_, o in zip(prompts, outs))
    total = sum(check(p_, o.text) != "" for p_, o in zip(prompts, outs))
    print(f"  arithmetic right: {right}/{total}")
    return 0


def _device() -> str:
    import paddle

    return paddle.device.get_device()
