"""One rank of disaggregated serving (``serve --kv-role prefill|decode|by-rank``): the
``kv_transfer_config`` of its role, and the prefill rank's program. The decode rank is the
ordinary OpenAI server with that config (:mod:`fleetlab.serving.cli`); the launcher that starts
both ranks behind the proxy is :mod:`fleetlab.serving.disagg.cli`."""

from __future__ import annotations

import os
import sys

KV_ROLES = ("prefill", "decode", "by-rank")


def kv_role_config(role: str) -> dict:
    """Join the two-rank job (once) and return the ``kv_transfer_config`` of this rank's role."""
    import paddle.distributed as dist

    if not dist.is_initialized():
        if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) != 2:
            raise ValueError(f"--kv-role {role}: start both roles with `python -m fleetlab disagg ...` "
                             "(or under `python -m paddle.distributed.launch --nproc_per_node 2`)")
        dist.init_parallel_env()
    role = resolve_role(role)
    from fleetlab.serving.disagg.proxy import write_pid

    write_pid(role)  # the proxy watches this process
    return {"connector": "paddle_distributed", "role": "producer" if role == "prefill" else "consumer",
            "peer_rank": 1 - dist.get_rank()}


def resolve_role(role: str) -> str:
    """``by-rank``: rank 0 decodes (and serves HTTP), rank 1 prefills."""
    if role != "by-rank":
        return role
    return "decode" if int(os.environ.get("PADDLE_TRAINER_ID", "0")) == 0 else "prefill"


def run_prefill(args, engine_config) -> int:
    """The prefill rank: an engine with the producer connector (``engine_config(args)``: its
    ``LLM`` keywords), serving handshakes until told to stop."""
    from fleetlab.llm import LLM
    from fleetlab.serving.disagg.prefill import serve
    from fleetlab.serving.loader import load_model

    try:
        config = engine_config(args)
        model, tokenizer = load_model(args.model, args.model_impl)
        llm = LLM(model, tokenizer, **config)
    except (ValueError, TypeError, OSError) as e:
        print(f"fleetlab serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    with llm:
        print(f"fleetlab serve: prefill engine for {args.model!r} waiting for the decode rank", flush=True)
        serve(llm)
    return 0
