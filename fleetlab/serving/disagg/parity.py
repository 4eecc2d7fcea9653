"""Prefill on one rank, decode on the other: a two-rank run checked against one engine.

    python -m paddle.distributed.launch --nproc_per_node 2 python -m fleetlab.serving.disagg.parity

Rank 0 is the decode engine (requests arrive there; it prints the result), rank 1 the
prefill engine (:func:`~fleetlab.serving.disagg.prefill.serve`). Rank 0 then runs
the same prompts on one engine alone and through the model's full forward, and prints one
``DISAGG_RESULT {json}`` line: whether the tokens agree, bytes moved per token against
``2 x layers x kv_heads x head_dim x dtype bytes``, transfer seconds, failures, the decode
steps that ran while a request waited for its K/V, and both pools' free blocks at the end.

``--prefill-max-model-len`` makes the prefill side refuse longer prompts, which the decode
side then recomputes (the fault path); ``--stagger K`` holds half the prompts back until the
decode side has run ``K`` steps (their K/V arrives while the first half decodes);
``--prefill-delay S`` makes the prefill side wait ``S`` seconds before each handshake's work
(a slow peer: transfers are surely in flight); ``--structured`` gives every other request a
JSON schema or a regex (a tiny model over the JSON character vocabulary); ``--ngram K``
speculates ``K`` prompt-lookup drafts on the decode side (and on the single engine);
``--sequences N`` samples ``n = N`` sequences per prompt and ``--logprobs K`` compares each sampled
token's logprob with one engine's; ``--model a,b,...`` runs a pair of engines per model in one job.
"""

from __future__ import annotations

import argparse
import json
import time


def _model(name: str, structured: bool):
    from fleetlab import models

    if structured:
        from fleetlab.models.json_tiny import json_tokenizer

        tok = json_tokenizer()
        return models.tiny("fleet", seed=0, vocab_size=tok.vocab_size, num_layers=2), tok
    return (models.load_tiny()[0] if name == "tiny" else models.tiny(name, seed=0)), None


def _prompts(n: int, seed: int, length: int, vocab: int = 40) -> list[list[int]]:
    """``n`` prompts sharing their first quarter (prefix hits on both sides), ``length`` tokens at most."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, vocab, size=max(1, length // 4))]
    lengths = rng.integers(length // 8 + 1, length - len(shared), size=n)
    return [shared + [int(t) for t in rng.integers(3, vocab, size=int(k))] for k in lengths]


def _params(args, n: int) -> list:
    """Each request's sampling: greedy or seeded; with ``--structured`` every other one constrained."""
    from fleetlab import SamplingParams
    from fleetlab.structured_output.examples import MAX_JSON_CHARS, SCHEMAS

    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature, seed=args.seed,
                           n=args.sequences, logprobs=args.logprobs)
    if not args.structured:
        return [plain] * n
    kinds = [{"json": SCHEMAS["person"], "disable_any_whitespace": True}, {"regex": r"[0-9]{2,3}-[a-z]{2}"}]
    return [SamplingParams(max_tokens=MAX_JSON_CHARS, structured_outputs=kinds[i // 2 % 2]) if i % 2 == 0 else plain
            for i in range(n)]


class HeldSteps:
    """An observer: steps that ran tokens while some request waited for its K/V outside the batch."""

    def __init__(self, llm):
        self.llm, self.count = llm, 0

    def on_step(self, so, result, outputs):
        from fleetlab.engine.request import RequestStatus

        held = [r for r in self.llm.scheduler.running if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS]
        self.count += bool(held and so.num_scheduled_tokens)


def drive(llm, prompts, sps, stagger: int) -> tuple[list[list[int]], list[list[float]]]:
    """Serve ``prompts``, the second half added after ``stagger`` steps (0: all at once); the
    tokens of each of their ``n`` sequences, in order, and each sampled token's logprob (with
    ``--logprobs``)."""
    half = len(prompts) // 2 if stagger else len(prompts)
    for i in range(half):
        llm.add_request(prompt_token_ids=prompts[i], sampling_params=sps[i], request_id=str(i))
    done, step = {}, 0
    while llm.has_unfinished_requests() or half < len(prompts):
        if step == stagger and half < len(prompts):
            for i in range(half, len(prompts)):
                llm.add_request(prompt_token_ids=prompts[i], sampling_params=sps[i], request_id=str(i))
            half = len(prompts)
        llm.wait_until_runnable()
        done.update({(o.request_id, o.index): o for o in llm.step() if o.finished})
        step += 1
    outs = [done[key] for key in sorted(done, key=lambda k: (int(k[0]), k[1]))]
    return [list(o.token_ids) for o in outs], [[lp.logprob for lp in o.logprobs or []] for o in outs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fleet", help="a family, \"tiny\", or several, comma-separated (one "
                    "DISAGG_RESULT line each)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16, help="max_num_batched_tokens of both engines")
    ap.add_argument("--prefill-max-model-len", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=24, help="longest prompt")
    ap.add_argument("--decode-num-blocks", type=int, default=None, help="a small decode pool preempts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (checked against one "
                    "engine; the full forward is greedy)")
    ap.add_argument("--stagger", type=int, default=0, help="the second half of the prompts after this many steps")
    ap.add_argument("--prefill-delay", type=float, default=0.0, help="seconds the prefill side waits per handshake")
    ap.add_argument("--structured", action="store_true", help="every other request a JSON schema or a regex")
    ap.add_argument("--ngram", type=int, default=0, help="ngram drafts per step on the decode side")
    ap.add_argument("--sequences", type=int, default=1, help="n, sequences per prompt (parallel sampling on the "
                    "decode side)")
    ap.add_argument("--logprobs", type=int, default=None, help="top logprobs per sampled token, compared too")
    args = ap.parse_args(argv)

    import paddle.distributed as dist

    dist.init_parallel_env()
    for name in args.model.split(","):  # one pair of engines per model, in one job
        _run_pair(name, args, dist.get_rank())


def _run_pair(name: str, args, rank: int) -> None:
    """Rank 1 serves prefills until the decode side stops it; rank 0 drives the prompts and prints."""
    from fleetlab import LLM
    from fleetlab.serving.disagg.prefill import serve

    model, tok = _model(name, args.structured)
    common = dict(block_size=args.block_size, max_num_batched_tokens=args.budget, max_num_seqs=4)
    if rank == 1:
        llm = LLM(model, tok, **common, max_model_len=args.prefill_max_model_len,
                  kv_transfer_config={"connector": "paddle_distributed", "role": "producer", "peer_rank": 0})
        serve(llm, delay_s=args.prefill_delay)
        llm.close()
        return
    prompts = _prompts(args.prompts, args.seed, args.prompt_len, tok.vocab_size if tok else 40)
    sps = _params(args, len(prompts))
    decode_only = dict(speculative_config={"method": "ngram", "num_speculative_tokens": args.ngram}
                       if args.ngram else None)
    decode = LLM(model, tok, **common, **decode_only, num_blocks=args.decode_num_blocks,
                 kv_transfer_config={"connector": "paddle_distributed", "role": "consumer", "peer_rank": 1})
    held = HeldSteps(decode)
    decode.observers.append(held)
    t0 = time.perf_counter()
    got, got_lp = drive(decode, prompts, sps, args.stagger)
    seconds = time.perf_counter() - t0
    conn = decode.kv_connector
    decode_free = (decode.pool.num_free_blocks, decode.pool.num_blocks)
    preemptions = decode.stats()["num_preemptions"]
    decode.close()  # tells the prefill rank to stop; it answers with its pool's free blocks
    single = LLM(model, tok, **common, **decode_only)
    want, want_lp = drive(single, prompts, sps, args.stagger)
    single.close()
    from fleetlab.patching.parity import reference_greedy

    greedy = args.temperature == 0 and not args.structured
    forward = [ids for ids in reference_greedy(model, prompts, args.max_tokens)[0] for _ in range(args.sequences)] \
        if greedy else None
    lp_diff = max((abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)), default=0.0)
    s, spec = conn.stats, conn.spec
    print("DISAGG_RESULT " + json.dumps({
        "equal_single": got == want, "equal_forward": None if forward is None else got == forward,
        "model": name, "num_prompts": len(prompts), "tokens": got,
        "num_logprobs": sum(map(len, got_lp)), "logprob_max_diff": lp_diff,
        "loaded_tokens": s.loaded_tokens, "bytes_loaded": s.bytes_loaded,
        "bytes_per_token": s.bytes_loaded / max(1, s.loaded_tokens),
        "expected_bytes_per_token": spec.bytes_per_block // spec.block_size,
        "wire_bytes": s.extra["wire_bytes"], "recv_seconds": s.extra["recv_seconds"],
        "generate_seconds": seconds, "failed_loads": s.failed_loads, "held_steps": held.count,
        "discarded_loads": s.extra["discarded_loads"],
        "decode_pool": decode_free, "prefill_pool": conn.peer_pool,
        "decode_preemptions": preemptions}), flush=True)


if __name__ == "__main__":
    main()
