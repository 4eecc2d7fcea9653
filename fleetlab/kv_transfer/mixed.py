"""A mixed workload on a prefill rank + a decode rank, against one engine with chunked prefill.

    python -m paddle.distributed.launch --nproc_per_node 2 python -m fleetlab.kv_transfer.mixed

Short requests decode while long prompts arrive, one every ``--every`` steps. Rank 0 serves it
twice: as the decode engine of the pair (each long prompt's K/V computed by rank 1), then as
one engine alone (chunked prefill, the same token budget). It prints one ``MIXED_RESULT
{json}`` line: the short requests' inter-token latency p50 / p99 and the long prompts' TTFT
in both setups, and whether the tokens agree. On the pair a long prompt waits for its K/V
outside the decode rank's running batch (``WAITING_FOR_REMOTE_KVS``) while the short
requests keep decoding; what that buys on a given machine is what the figures say there.
"""

from __future__ import annotations

import argparse
import json
import time

import fleetlab  # noqa: F401  (first: keeps Paddle's import-time notices out)


def requests(seed: int, num_short: int, short_len: int, num_long: int, long_len: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    draw = lambda n: [int(t) for t in rng.integers(3, 120, n)]  # noqa: E731
    return [draw(short_len) for _ in range(num_short)], [draw(long_len) for _ in range(num_long)]


def drive(llm, shorts, longs, *, every: int, short_tokens: int) -> dict:
    """Run the workload; returns each request's token times and tokens (``s<i>`` short, ``l<i>`` long)."""
    from fleetlab import SamplingParams

    t0 = time.perf_counter()
    arrive, times, tokens = {}, {}, {}
    for i, p in enumerate(shorts):
        llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=short_tokens, ignore_eos=True),
                        request_id=f"s{i}")
        arrive[f"s{i}"] = t0
    step, pending = 0, list(enumerate(longs))
    while llm.has_unfinished_requests() or pending:
        if pending and step >= every and step % every == 0:
            i, p = pending.pop(0)
            llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                            request_id=f"l{i}")
            arrive[f"l{i}"] = time.perf_counter()
        llm.wait_until_runnable()
        outs = llm.step()
        now = time.perf_counter()
        for out in outs:
            times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        step += 1
    return {"arrive": arrive, "times": times, "tokens": tokens}


def summarize(run: dict) -> dict:
    import numpy as np

    itl = [b - a for rid, ts in run["times"].items() if rid.startswith("s") for a, b in zip(ts, ts[1:])]
    ttft = [run["times"][rid][0] - t for rid, t in run["arrive"].items() if rid.startswith("l")]
    return {"itl_p50_ms": 1e3 * float(np.percentile(itl, 50)), "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            "long_ttft_median_ms": 1e3 * float(np.median(ttft)), "num_itl": len(itl)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-overrides", type=json.loads, default={"hidden_size": 256, "intermediate_size": 704,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                    "vocab_size": 128})
    ap.add_argument("--short", type=int, default=4, help="short requests decoding")
    ap.add_argument("--short-tokens", type=int, default=40)
    ap.add_argument("--long", type=int, default=4, help="long prompts arriving")
    ap.add_argument("--long-len", type=int, default=200)
    ap.add_argument("--every", type=int, default=8, help="a long prompt arrives every this many steps")
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args(argv)

    import paddle.distributed as dist

    from fleetlab import LLM
    from fleetlab.kv_transfer.paddle_distributed import serve
    from fleetlab.models import tiny

    dist.init_parallel_env()
    model = tiny("llama", seed=0, **args.model_overrides)
    common = dict(block_size=16, max_num_batched_tokens=args.budget, max_num_seqs=args.short + args.long)
    if dist.get_rank() == 1:
        with LLM(model, **common, kv_transfer_config={"connector": "paddle_distributed", "role": "producer"}) as llm:
            serve(llm)
        return
    shorts, longs = requests(0, args.short, 8, args.long, args.long_len)
    kw = dict(every=args.every, short_tokens=args.short_tokens)
    with LLM(model, **common, kv_transfer_config={"connector": "paddle_distributed", "role": "consumer"}) as llm:
        pair = drive(llm, shorts, longs, **kw)
    with LLM(model, **common) as llm:
        one = drive(llm, shorts, longs, **kw)
    print("MIXED_RESULT " + json.dumps({"pair": summarize(pair), "one engine": summarize(one),
                                        "identical_tokens": pair["tokens"] == one["tokens"], "config": vars(args)}),
          flush=True)


if __name__ == "__main__":
    main()
