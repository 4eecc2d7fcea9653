"""A mixed workload on a prefill rank + a decode rank, against one engine with chunked prefill.

    python -m paddle.distributed.launch --nproc_per_node 2 python -m fleetlab.serving.disagg.mixed

Short requests decode while long prompts arrive, one every ``--every`` steps. Rank 0 serves it
twice: as the decode engine of the pair (each long prompt's K/V computed by rank 1), then as
one engine alone (chunked prefill, the same token budget, ``--budget``: a long prompt's chunks
share steps with the decodes, so a bigger budget would stretch their inter-token latency). The
prefill rank decodes nothing, so it takes whole prompts, several handshakes' at once
(``--prefill-budget`` tokens a step): prefill is compute-bound and runs best in big steps,
decode is memory-bound and wants small, steady ones; the pair gives each its own. It prints one ``MIXED_RESULT
{json}`` line: the short requests' inter-token latency p50 / p99 and the long prompts' TTFT
in both setups, whether the tokens agree, and each engine's step timeline (``timeline``: per
step ``[start_ms, end_ms, prompt tokens (rows of more than one), decode rows (of one), requests
held waiting for K/V]``, from ``time.perf_counter``, one clock for both ranks on one machine;
the prefill rank's from its log). On the pair a long prompt waits for its K/V outside the decode rank's running batch
(``WAITING_FOR_REMOTE_KVS``) while the short requests keep decoding; what that buys on a given
machine is what the figures say there.
"""

from __future__ import annotations

import argparse
import json
import time


def requests(seed: int, num_short: int, short_len: int, num_long: int, long_len: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    draw = lambda n: [int(t) for t in rng.integers(3, 120, n)]  # noqa: E731
    return [draw(short_len) for _ in range(num_short)], [draw(long_len) for _ in range(num_long)]


class StepClock:
    """An observer: each step's start and end (``perf_counter`` seconds) and what it ran."""

    def __init__(self, llm):
        self.llm, self.start, self.steps = llm, 0.0, []
        self.first: dict[str, list[float]] = {}  # request id -> [start, end] of the first step that ran it
        self.last: dict[str, list[float]] = {}  # ... and of the last
        llm.hooks.attach(self)

    def on_phase(self, name, seconds):
        if name == "schedule":
            self.start = time.perf_counter() - seconds

    def on_step(self, so, result, outputs):
        from fleetlab.engine.request import RequestStatus

        n = so.num_scheduled_tokens.values()
        held = sum(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.llm.scheduler.running)
        if n:
            end = time.perf_counter()
            self.steps.append([self.start, end, sum(k for k in n if k > 1), sum(k == 1 for k in n), held])
            for rid in so.num_scheduled_tokens:
                self.first.setdefault(rid, [self.start, end])
                self.last[rid] = [self.start, end]

    def relative(self, t0: float) -> list:
        return [[1e3 * (a - t0), 1e3 * (b - t0), *rest] for a, b, *rest in self.steps]


def drive(llm, shorts, longs, *, every: int, short_tokens: int) -> dict:
    """Run the workload; returns each request's token times and tokens (``s<i>`` short, ``l<i>`` long)."""
    from fleetlab import SamplingParams

    clock = StepClock(llm)
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
    return {"arrive": arrive, "times": times, "tokens": tokens, "t0": t0, "timeline": clock.relative(t0),
            "arrive_ms": {rid: 1e3 * (t - t0) for rid, t in arrive.items()},
            "first_step_ms": {rid: [1e3 * (a - t0), 1e3 * (b - t0)] for rid, (a, b) in clock.first.items()},
            "first_token_ms": {rid: 1e3 * (ts[0] - t0) for rid, ts in times.items()}}


def summarize(run: dict) -> dict:
    import numpy as np

    itl = [b - a for rid, ts in run["times"].items() if rid.startswith("s") for a, b in zip(ts, ts[1:])]
    ttft = [run["times"][rid][0] - t for rid, t in run["arrive"].items() if rid.startswith("l")]
    return {"itl_p50_ms": 1e3 * float(np.percentile(itl, 50)), "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            "long_ttft_median_ms": 1e3 * float(np.median(ttft)), "num_itl": len(itl)}


def collect(output: str, prefill_log: str) -> dict:
    """The ``MIXED_RESULT`` of a run (rank 0's ``output``), with the prefill rank's steps from its
    log on the same clock, and each long prompt's path through the pair: ``long_requests[rid]`` =
    ``{"arrive", "prefill": [start, end] of the prefill rank's step that ran its last chunk (its K/V
    sent layer by layer inside it), "join": [start, end] of the decode rank's step that took it in
    (its last prompt token run there, its first token sampled), "first_token"}`` in ms. Requests
    reach the prefill rank in the order they were admitted here (one link thread posts them), so
    its ``pd<k>`` are matched to this rank's requests in order of arrival."""
    lines = [line for line in output.splitlines() if line.startswith("MIXED_RESULT ")]
    if not lines:
        raise RuntimeError(f"the mixed workload printed no result:\n{output[-3000:]}")
    mixed = json.loads(lines[-1].removeprefix("MIXED_RESULT "))
    t0 = mixed.pop("pair_t0")
    logged = {key: json.loads(line.removeprefix(key + " ")) for line in prefill_log.splitlines()
              for key in ("PREFILL_STEPS", "PREFILL_LAST_STEP") if line.startswith(key + " ")}
    ms = lambda a, b: [1e3 * (a - t0), 1e3 * (b - t0)]  # noqa: E731
    mixed["timeline"]["prefill rank"] = {"timeline": [[*ms(a, b), *rest] for a, b, *rest in
                                                      logged.get("PREFILL_STEPS", [])]}
    pair = mixed["timeline"]["pair"]
    remote = sorted(logged.get("PREFILL_LAST_STEP", {}).items(), key=lambda kv: int(kv[0].removeprefix("pd")))
    local = sorted(pair["arrive_ms"], key=lambda rid: (pair["arrive_ms"][rid], rid))
    last = dict(zip(local, (ms(*span) for _, span in remote))) if len(remote) == len(local) else {}
    mixed["long_requests"] = {rid: {"arrive": pair["arrive_ms"][rid], "prefill": last.get(rid),
                                    "join": pair["first_step_ms"][rid], "first_token": pair["first_token_ms"][rid]}
                              for rid in local if rid.startswith("l")}
    return mixed


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
    ap.add_argument("--budget", type=int, default=64, help="tokens a step: the decode rank and the one engine")
    ap.add_argument("--prefill-budget", type=int, default=512, help="tokens a step: the prefill rank")
    args = ap.parse_args(argv)

    import paddle.distributed as dist

    from fleetlab import LLM
    from fleetlab.models import tiny
    from fleetlab.serving.disagg.prefill import serve

    dist.init_parallel_env()
    model = tiny("llama", seed=0, **args.model_overrides)
    common = dict(block_size=16, max_num_batched_tokens=args.budget, max_num_seqs=args.short + args.long)
    if dist.get_rank() == 1:
        with LLM(model, **{**common, "max_num_batched_tokens": args.prefill_budget},
                 kv_transfer_config={"connector": "paddle_distributed", "role": "producer"}) as llm:
            clock = StepClock(llm)
            serve(llm)
        print("PREFILL_STEPS " + json.dumps(clock.steps), flush=True)  # to its log; rank 0 sets the origin
        print("PREFILL_LAST_STEP " + json.dumps(clock.last), flush=True)  # each request's last chunk: its K/V sent
        return
    shorts, longs = requests(0, args.short, 8, args.long, args.long_len)
    kw = dict(every=args.every, short_tokens=args.short_tokens)
    with LLM(model, **common, kv_transfer_config={"connector": "paddle_distributed", "role": "consumer"}) as llm:
        pair = drive(llm, shorts, longs, **kw)
    with LLM(model, **common) as llm:
        one = drive(llm, shorts, longs, **kw)
    timeline = {name: {k: run[k] for k in ("timeline", "arrive_ms", "first_token_ms", "first_step_ms")}
                for name, run in (("pair", pair), ("one engine", one))}
    print("MIXED_RESULT " + json.dumps({"pair": summarize(pair), "one engine": summarize(one),
                                        "identical_tokens": pair["tokens"] == one["tokens"], "config": vars(args),
                                        "pair_t0": pair["t0"], "timeline": timeline}), flush=True)


if __name__ == "__main__":
    main()
