"""Prefill on one rank, decode on the other: a two-rank run checked against one engine.

    python -m paddle.distributed.launch --nproc_per_node 2 python -m fleetlab.kv_transfer.disagg

Rank 0 is the decode engine (requests arrive there; it prints the result), rank 1 the
prefill engine (:func:`~fleetlab.kv_transfer.paddle_distributed.serve`). Rank 0 then runs
the same prompts on one engine alone and through the model's full forward, and prints one
``DISAGG_RESULT {json}`` line: whether the tokens agree, bytes moved per token against
``2 x layers x kv_heads x head_dim x dtype bytes``, transfer seconds, failures, and both
pools' free blocks at the end. ``--prefill-max-model-len`` makes the prefill side refuse
longer prompts, which the decode side then recomputes (the fault path).
"""

from __future__ import annotations

import argparse
import json
import time

import fleetlab  # noqa: F401  (first: keeps Paddle's import-time notices out)


def _model(name: str):
    from fleetlab import models

    return models.load_tiny()[0] if name == "tiny" else models.tiny(name, seed=0)


def _prompts(n: int, seed: int, length: int) -> list[list[int]]:
    """``n`` prompts sharing their first quarter (prefix hits on both sides), ``length`` tokens at most."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, 40, size=max(1, length // 4))]
    lengths = rng.integers(length // 8 + 1, length - len(shared), size=n)
    return [shared + [int(t) for t in rng.integers(3, 40, size=int(k))] for k in lengths]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fleet")
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
    args = ap.parse_args(argv)

    import paddle.distributed as dist

    from fleetlab import LLM, SamplingParams
    from fleetlab.kv_transfer.paddle_distributed import serve

    dist.init_parallel_env()
    rank = dist.get_rank()
    model = _model(args.model)
    common = dict(block_size=args.block_size, max_num_batched_tokens=args.budget, max_num_seqs=4)
    if rank == 1:
        llm = LLM(model, **common, max_model_len=args.prefill_max_model_len,
                  kv_transfer_config={"connector": "paddle_distributed", "role": "producer", "peer_rank": 0})
        serve(llm)
        return
    prompts = _prompts(args.prompts, args.seed, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature, seed=args.seed)
    decode = LLM(model, **common, num_blocks=args.decode_num_blocks,
                 kv_transfer_config={"connector": "paddle_distributed", "role": "consumer", "peer_rank": 1})
    t0 = time.perf_counter()
    got = [o.token_ids for o in decode.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    seconds = time.perf_counter() - t0
    conn = decode.kv_connector
    decode_free = (decode.pool.num_free_blocks, decode.pool.num_blocks)
    preemptions = decode.stats()["num_preemptions"]
    decode.close()  # tells the prefill rank to stop; it answers with its pool's free blocks
    single = LLM(model, **common)
    want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    single.close()
    from fleetlab.patching.parity import reference_greedy

    forward = reference_greedy(model, prompts, args.max_tokens)[0] if args.temperature == 0 else None
    s, spec = conn.stats, conn.spec
    print("DISAGG_RESULT " + json.dumps({
        "equal_single": got == want, "equal_forward": None if forward is None else got == forward,
        "num_prompts": len(prompts),
        "loaded_tokens": s.loaded_tokens, "bytes_loaded": s.bytes_loaded,
        "bytes_per_token": s.bytes_loaded / max(1, s.loaded_tokens),
        "expected_bytes_per_token": spec.bytes_per_block // spec.block_size,
        "wire_bytes": s.extra["wire_bytes"], "recv_seconds": s.extra["recv_seconds"],
        "generate_seconds": seconds, "failed_loads": s.failed_loads,
        "decode_pool": decode_free, "prefill_pool": getattr(conn, "peer_pool", None),
        "decode_preemptions": preemptions}), flush=True)


if __name__ == "__main__":
    main()
