"""Disaggregated serving: ``python -m fleetlab disagg`` and ``serve --kv-role prefill|decode``.

    python -m fleetlab disagg --model tiny --port 8000

starts a two-rank ``paddle.distributed.launch`` job: rank 0 runs ``serve --kv-role decode``,
the OpenAI-compatible server on ``--port`` (the client's one address: it plays the proxy,
since requests go to the decode side, which pulls their prompts' K/V from the prefill side),
and rank 1 ``serve --kv-role prefill``, the prefill engine's loop
(:func:`~fleetlab.kv_transfer.paddle_distributed.serve`). Every other option is ``serve``'s
and goes to both engines. Ctrl-C / SIGTERM stops the job (both ranks).

vLLM's toy proxy sends each request to the prefill instance with ``max_tokens=1`` and then to the
decode instance with the prefill's ``kv_transfer_params``; FastDeploy's router picks a pair and
sends to both. Here the decode side's own handshake does that routing.
"""

from __future__ import annotations

import os
import signal
import subprocess
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
    from fleetlab.kv_transfer.paddle_distributed import serve
    from fleetlab.llm import LLM
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


def main(argv=None) -> int:
    """``python -m fleetlab disagg [serve options]``: both roles in one ``paddle.distributed.launch`` job."""
    from fleetlab.distributed.launch import CCACHE_WARNING, QUIET_ENV, NoticeFilter, _Reader, launch_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    log_dir = os.environ.get("FLEETLAB_DISAGG_LOG_DIR", f"/tmp/fleetlab-disagg-{os.getpid()}")
    cmd = launch_command(["fleetlab", "serve", "--kv-role", "by-rank", *argv], 2, log_dir)
    env = {**QUIET_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1"}
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), CCACHE_WARNING) if w)
    for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        env.pop(key, None)
    # Its own session, so the launcher and both ranks stop as one; rank 0's output passes through
    # less the notices the ranks print at start (fleetlab.distributed.launch's filter).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _Reader(proc.stdout, NoticeFilter(sys.stdout))

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
