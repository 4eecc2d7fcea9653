"""What the overlapped loop does not do, refused at the edge with the option named.

Each of these needs step N's result before step N+1 can be planned or prepared, so it cannot
run one step ahead without more machinery than this loop has:

- ``speculative_config``: step N+1's drafts are proposed from step N's accepted tokens, and
  how many step N accepts decides step N+1's positions;
- ``tensor_parallel_size > 1``: every rank checks the schedule against the last sampled
  tokens (``fleetlab.distributed``), which are one step late here;
- ``kv_transfer_config``: a connector's loads and saves are planned with the step they serve
  and its failed loads make the scheduler recompute a request in the same commit;
- ``record_traces``: a trace reads the batch as the step left it, and here the host has
  already changed it for the next step;
- a request's ``structured_outputs``: step N+1's grammar mask needs the token step N samples
  (a production engine fills the mask on the device after sampling; this loop does not).
"""

from __future__ import annotations

import dataclasses

_WHY = {
    "speculative_config": "step N+1's drafts and positions depend on how many drafts step N accepts",
    "tensor_parallel_size": "every rank checks the schedule against the last sampled tokens, one step late here",
    "kv_transfer_config": "a connector's loads and saves are planned and failed loads recomputed within one step",
    "record_traces": "a trace reads the batch as its step left it, and the host has already changed it",
}


def check_async_scheduling(cfg) -> None:
    """ValueError naming the first option of ``cfg`` (an ``EngineConfig``) that cannot go with
    ``async_scheduling=True``."""
    clashes = {"speculative_config": cfg.speculative_config is not None,
               "tensor_parallel_size": cfg.tensor_parallel_size > 1,
               "kv_transfer_config": cfg.kv_transfer_config is not None,
               "record_traces": cfg.record_traces}
    for name, clash in clashes.items():
        if clash:
            value = readable(getattr(cfg, name))
            raise ValueError(f"engine config: async_scheduling=True cannot go with {name}={value}: {_WHY[name]}")


def readable(value, limit: int = 80) -> str:
    """A config value for a message: a dict (or a dataclass, as its non-default fields) shown
    item by item, whole items only, ``...`` for those past ``limit`` characters; else its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                 if f.repr and getattr(value, f.name) != _default(f)}
        return f"{type(value).__name__}({_items(items, limit, '=', str)})"
    if isinstance(value, dict):
        return "{" + _items(value, limit, ": ", repr) + "}"
    return repr(value)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _items(items: dict, limit: int, sep: str, key) -> str:
    shown = []
    for k, v in items.items():
        item = f"{key(k)}{sep}{v!r}"
        if shown and sum(len(x) + 2 for x in shown) + len(item) > limit:
            return ", ".join(shown) + ", ..."
        shown.append(item)
    return ", ".join(shown)


class RefusedStructuredOutputs:
    """What the overlapped engine's input checks hold instead of the grammar compiler: a request
    with ``structured_outputs`` is refused, naming the request and the field."""

    def start(self, request_id: str, constraint):
        raise ValueError(f"request {request_id!r}: sampling field structured_outputs cannot go with the engine's "
                         "async_scheduling=True: the grammar mask of step N+1 needs the token step N samples")
