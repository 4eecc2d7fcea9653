"""``python -m fleetlab serve``: an OpenAI-compatible server on one model.

    python -m fleetlab serve --model tiny --port 8000
    python -m fleetlab serve --model tiny --model-impl fleet --max-num-seqs 32 --max-queue-len 64
    python -m fleetlab serve --model tiny --prefix-cache radix --scheduling-policy lpm
    python -m fleetlab serve --model /path/to/checkpoint --backend triton --api-key KEY
    python -m fleetlab -v serve --model tiny --shutdown-timeout 30
    python -m fleetlab serve --model tiny --allowed-origins '["http://localhost:3000"]'

The engine options are ``LLM``'s (``fleetlab.EngineConfig``); ``--speculative-config JSON`` is
handed to ``LLM(speculative_config=...)``, its ``"model"`` (a draft) loaded by name. ``--port 0``
takes any free port; the line printed at start names the address. ``-v`` shows uvicorn's and
fleetlab's INFO lines (access lines included); warnings always show.

Ctrl-C (SIGINT) or SIGTERM stops the server (:mod:`fleetlab.serving.shutdown`): requests still
running may finish for ``--shutdown-timeout`` seconds, then each one left ends with an error
(a stream: an error event and ``data: [DONE]``); the exit status is 0. A second Ctrl-C ends
them at once.

``--allowed-origins`` (vLLM's flag, a JSON list; with ``--allowed-methods``,
``--allowed-headers``, ``--allow-credentials``) lets web pages from those origins call the
server (CORS). Unlike vLLM, which allows every origin by default, fleetlab allows none unless
told: a page on any site could otherwise drive a server on ``localhost``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from fleetlab.serving.listen import bind, uvicorn_server
from fleetlab.serving.loader import MODEL_IMPLS

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fleetlab serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (the shipped tiny Llama), 'code' (the shipped code model), "
                   "'tiny-json' (a tiny random model that can spell JSON, for structured outputs), a checkpoint "
                   "directory or a PaddleFormers model id (downloaded by from_pretrained)")
    p.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS,
                   help="auto/paddleformers: the PaddleFormers model; fleet (or paddlefleet, the production "
                        "Paddle engine's spelling): the weights in the Fleet-style model")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    e = p.add_argument_group("engine (fleetlab.EngineConfig)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: max-num-seqs full sequences)")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--backend", default="tiled", help="attention backend name (e.g. tiled, naive, triton)")
    e.add_argument("--scheduling-policy", default="fcfs",
                   help="fcfs, spf (shortest prompt first), priority, lpm (longest cached prefix first), or a "
                        "registered name")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--prefix-cache", choices=("hash", "radix", "none"), default="hash",
                   help="the prefix-cache design: hash (vLLM's hash chain, whole blocks), radix (SGLang's radix "
                        "tree, token by token) or none")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="passed to LLM(speculative_config=...), e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or "
                        "'{\"method\": \"draft\", \"num_speculative_tokens\": 4, \"model\": \"tiny\"}' "
                        "(\"tiny\": the shipped draft; else a checkpoint directory)")
    e.add_argument("--async-scheduling", action="store_true",
                   help="overlap scheduling: the host plans step N+1 while step N's forward runs (fleetlab.overlap)")
    p.add_argument("--kv-role", choices=("prefill", "decode", "by-rank"), default=None,
                   help="disaggregated serving (fleetlab.serving.disagg.rank; `python -m fleetlab disagg` starts "
                        "both): decode serves HTTP and pulls each prompt's K/V from the prefill rank")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs; one more is answered 503 at once")
    p.add_argument("--api-key", default=None,
                   help="answer /v1 requests only with the header 'Authorization: Bearer KEY' (else 401)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on Ctrl-C / SIGTERM, let running requests finish for this long before ending them")
    c = p.add_argument_group("CORS (cross-origin requests from web pages; vLLM's flags)")
    c.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                   help='origins allowed, e.g. \'["http://localhost:3000"]\' or \'["*"]\' (default: none)')
    c.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON")
    c.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON")
    c.add_argument("--allow-credentials", action="store_true", help="allow cookies and auth headers cross-origin")
    return p


def _json_list(text: str) -> list[str]:
    """A JSON list of strings (argparse reports the ValueError as a bad option value)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings, e.g. '[\"http://localhost:3000\"]'")
    return value


def cors_options(args) -> dict | None:
    """``build_app(cors=...)`` from the CORS flags (None without ``--allowed-origins``)."""
    if args.allowed_origins is None:
        return None
    return {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}


def engine_config(args) -> dict:
    """``LLM`` keywords from parsed arguments."""
    cfg = {"block_size": args.block_size, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
           "backend": args.backend, "scheduling_policy": args.scheduling_policy,
           "enable_prefix_caching": args.enable_prefix_caching and args.prefix_cache != "none",
           "prefix_cache": None if args.prefix_cache == "none" else args.prefix_cache, "seed": args.seed,
           "async_scheduling": args.async_scheduling}
    if args.speculative_config is not None:
        cfg["speculative_config"] = resolve_draft(args.speculative_config)
    if args.kv_role is not None:
        from fleetlab.serving.disagg.rank import kv_role_config

        cfg["kv_transfer_config"] = kv_role_config(args.kv_role)
    return cfg


def resolve_draft(spec: dict) -> dict:
    """A JSON speculative config with its ``"model"`` name loaded (``loader.load_draft``)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
        return spec
    from fleetlab.serving.loader import load_draft

    return {**spec, "model": load_draft(spec["model"])}


def make_engine(args):
    """``(AsyncLLM, served model name)`` for parsed ``serve`` arguments."""
    from fleetlab.llm import LLM
    from fleetlab.serving.async_llm import AsyncLLM
    from fleetlab.serving.loader import load_model

    model, tokenizer = load_model(args.model, args.model_impl)
    llm = LLM(model, tokenizer, **engine_config(args))
    return AsyncLLM(llm, max_queue_len=args.max_queue_len), args.served_model_name or args.model


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.shutdown_timeout < 0:
        print(f"fleetlab serve: --shutdown-timeout {args.shutdown_timeout} must be >= 0", file=sys.stderr)
        return 2
    verbose = logging.getLogger("fleetlab").isEnabledFor(logging.INFO)  # `python -m fleetlab -v`
    if args.kv_role is not None:
        from fleetlab.serving.disagg.rank import resolve_role, run_prefill

        if resolve_role(args.kv_role) == "prefill":
            return run_prefill(args, engine_config)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"fleetlab serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        engine, name = make_engine(args)
    except Exception as e:  # a bad option or model: say what, not a traceback (-v logs it)
        sock.close()
        logger.info("serve: the engine could not be built", exc_info=True)
        print(f"fleetlab serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from fleetlab.serving.app import build_app

    host, port = sock.getsockname()[:2]
    app = build_app(engine, name, api_key=args.api_key, cors=cors_options(args))
    server = uvicorn_server(app, verbose, args.shutdown_timeout)
    print(f"fleetlab serve: {name!r} ({args.model_impl}, {args.backend} attention) on http://{host}:{port}/v1 "
          f"-- Ctrl-C stops", flush=True)
    # uvicorn takes SIGINT / SIGTERM while it runs; once stopped it raises the signal again, for the
    # default action (KeyboardInterrupt, or death by SIGTERM: exit 143). It has stopped cleanly by
    # then, so the handlers it restores and calls do nothing, and the exit status is 0.
    previous = {sig: signal.signal(sig, _stopped_already) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
        sock.close()
    return 0


def _stopped_already(signum, frame) -> None:
    """The handler uvicorn calls again after a graceful stop (see ``main``)."""
