"""``KVConnector``: the seam through which a request's KV cache leaves or enters an engine.

The engine calls a connector at a few named points of a step, and nowhere else:

=============================  ===========================================  ==========================================
fleetlab (called by)           vLLM v1 ``KVConnectorBase_V1``               FastDeploy (splitwise)
=============================  ===========================================  ==========================================
**scheduler side**
``get_num_new_matched_tokens`` ``get_num_new_matched_tokens``: tokens       decode side asks for the prefill's cache
(admission)                    loadable from outside, counted as computed   (``splitwise_connector.py``)
``update_state_after_alloc``   ``update_state_after_alloc``: the blocks     ``send_cache_info_to_prefill``: the decode
(after allocation)             the loaded tokens will land in               side's block ids go to the prefill side
``load_kv_async`` + the        ``get_num_new_matched_tokens``' second       the decode side waits for the cache
returned future                value; ``WAITING_FOR_REMOTE_KVS`` until      outside its running batch
(a request held out of the     ``get_finished`` names it in
batch until its K/V arrive)    ``finished_recving``
``build_connector_meta``       ``build_connector_meta``: this step's loads  the cache messager's per-step task list
(end of ``schedule``)          and saves, sent to the worker side           (``cache_messager.py``)
``request_finished``           ``request_finished``: True keeps the blocks  the prefill side keeps a request's blocks
(a request retires)            until ``get_finished`` says its save is done until its cache is sent
**worker side**
``start_load_kv``              ``start_load_kv`` (before the forward)       ``CacheMessager`` starting a transfer
``wait_for_layer_load``        ``wait_for_layer_load`` (each attention      layer-wise receive
(attention, before the write)  layer, before it reads the cache)
``save_kv_layer``              ``save_kv_layer`` (each layer, after its     ``prefill_layerwise_send_cache_thread``:
(attention, after the write)   K/V is written)                              each layer sent once computed
``wait_for_save``              ``wait_for_save`` (after the forward)
``get_finished``               ``get_finished`` + ``get_block_ids_with_     transfer status; a failed one is
                               load_errors`` (failed loads are recomputed)  recomputed
=============================  ===========================================  ==========================================

If a step fails anywhere (the connector itself, the runner, another extension), the engine rolls
the whole step back and calls :meth:`KVConnector.rollback` with its plan: a connector forgets
what it recorded while planning it. Whatever a scheduler-side call returns is checked where the
scheduler receives it (``checked_*`` below); an exception it raises comes out as
:class:`~fleetlab.errors.ExtensionError` naming the connector and the method.

This base class is itself the *null connector*: every call does nothing, so an engine with no
``kv_transfer_config`` runs exactly as before, through the same calls (no ``if`` anywhere in
the core). vLLM builds two instances, one per side (role SCHEDULER / WORKER); fleetlab's
scheduler and runner live in one process, so one object serves both, and its worker side
tells its scheduler side about failed loads directly, and about a finished receive through
the future :meth:`KVConnector.update_state_after_alloc` returned (vLLM's ``get_finished``
reports ``finished_recving`` through the runner's output; a future also lets
``LLM.wait_until_runnable`` sleep until one is done when no other request can run).

A connector is built by :func:`make_kv_connector` from a checked
:class:`~fleetlab.kv_transfer.config.KVTransferConfig` and the cache's :class:`KVCacheSpec`.
"""

from __future__ import annotations

import operator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar

from fleetlab.errors import bad_return, call_extension, int_in
from fleetlab.registry import Registry


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The geometry of the engine's paged KV cache (what a connector stores per block)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_cache) -> KVCacheSpec:
        return cls(kv_cache.num_layers, kv_cache.block_size, kv_cache.num_kv_heads, kv_cache.head_dim,
                   kv_cache.dtype)

    @property
    def bytes_per_block(self) -> int:
        """All layers, K and V."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(slots=True)
class KVConnectorStats:
    """What a connector moved: blocks and bytes loaded / saved, admissions that loaded, failures."""

    lookups: int = 0
    hit_lookups: int = 0
    loaded_tokens: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    failed_loads: int = 0
    query_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Tokens loaded from outside over tokens asked for at admission."""
        return self.loaded_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "extra"}
        return {**d, "hit_rate": self.hit_rate, **self.extra}


class KVConnector:
    """Base class of KV connectors, and the null connector (every call a no-op).

    Args:
      config: a checked :class:`~fleetlab.kv_transfer.config.KVTransferConfig` (None: the null one).
      spec: the geometry of the engine's cache.

    Class attributes a connector sets: ``name`` (its registry name) and ``options``
    (``{option: default}``, the extra keys its ``kv_transfer_config`` may carry; a key not
    listed is refused at the edge, naming it). Override :meth:`check_options` to check values.
    """

    name: ClassVar[str] = "null"
    options: ClassVar[dict] = {}
    #: True: what :meth:`get_num_new_matched_tokens` offers arrives *between* steps. The scheduler
    #: then admits the request ``WAITING_FOR_REMOTE_KVS`` (blocks allocated, none in the prefix
    #: cache yet), skips it each step while the others run, and lets it join once the future
    #: :meth:`update_state_after_alloc` returned is done (a dry pool may preempt it meanwhile:
    #: the connector reads ``preempted_req_ids`` and discards what still arrives).
    load_kv_async: ClassVar[bool] = False

    def __init__(self, config=None, spec: KVCacheSpec | None = None):
        self.config = config
        self.spec = spec
        self.role = config.role if config is not None else "both"
        self.stats = KVConnectorStats()

    @classmethod
    def check_options(cls, options: dict) -> dict:
        """The connector's options with defaults filled in; raise ValueError/TypeError naming a bad one."""
        return {**cls.options, **options}

    @property
    def loads(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def saves(self) -> bool:
        return self.role in ("producer", "both")

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens of a waiting ``request`` past its ``num_computed_tokens`` local prefix-cache hits
        that this connector can load (they are allocated and counted as computed). Never all of
        them: at least one token runs through the model."""
        return 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int):
        """The request was admitted: its external tokens land in ``block_ids`` at positions
        ``[num_computed_tokens, num_computed_tokens + num_external_tokens)``. A connector that
        ``load_kv_async`` returns a ``concurrent.futures.Future``, done when they are in hand
        (result True: the request joins the batch and they are written before its first step's
        layers attend) or failed (False: the request is recomputed); others return None."""

    def build_connector_meta(self, scheduler_output, scheduler):
        """This step's loads and saves, for the worker side (``scheduler``: read its ``requests``
        and ``kv``; change nothing). Goes out as ``scheduler_output.kv_connector_metadata``."""
        return None

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """The request retired. True: keep its blocks until :meth:`get_finished` names it.

        Called before the step that retires it commits: if the step is then rolled back, the
        request runs on and retires again later (this is called again)."""
        return False

    def rollback(self, scheduler_output) -> None:
        """The step ``scheduler_output`` planned never happened (something in it failed): forget
        what planning it recorded (loads queued by its admissions, saves it planned), so that
        planning the step again starts from where it started. ``kv_connector_metadata`` is what
        :meth:`build_connector_meta` returned (None if planning failed before it)."""

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, metadata, kv_cache) -> None:
        """Before the forward: take this step's metadata; a connector may start loading here."""

    def wait_for_layer_load(self, layer_id: int) -> None:
        """Before layer ``layer_id`` reads the cache: its loaded K/V must be in place."""

    def save_kv_layer(self, layer_id: int, kv_cache, attn_metadata) -> None:
        """After layer ``layer_id`` wrote this step's K/V into ``kv_cache``."""

    def wait_for_save(self) -> None:
        """After the forward: every save of the step is done (or handed to a sender)."""

    def get_finished(self, finished_req_ids) -> tuple[set[str], set[int]]:
        """``(requests whose saves are done, block ids whose load failed)`` since the last call.
        The scheduler frees the first; it recomputes every request holding one of the second."""
        return set(), set()

    def close(self) -> None:
        """Let go of files, peers, threads."""


KV_CONNECTORS = Registry("KV connector", KVConnector, {
    "null": "fleetlab.kv_transfer.base:KVConnector",
    "shared_storage": "fleetlab.kv_transfer.shared_storage:SharedStorageConnector",
    "offload": "fleetlab.kv_transfer.offload:OffloadConnector",
    "paddle_distributed": "fleetlab.kv_transfer.paddle_distributed:PaddleDistributedConnector",
})
register_kv_connector = KV_CONNECTORS.register
NULL_CONNECTOR = KVConnector()


KIND = "KV connector"


def connector_call(connector, method: str, *args):
    """``connector.method(*args)``, an exception it raises named (:class:`~fleetlab.errors.ExtensionError`)."""
    return call_extension(KIND, connector, method, *args)


def checked_num_matched(connector, value, request, num_computed_tokens: int) -> int:
    """What ``get_num_new_matched_tokens`` returned: an int in ``[0, tokens left - 1]`` (one token
    always runs through the model), else ExtensionError naming the connector and the request."""
    most = request.num_tokens - num_computed_tokens - 1
    if (n := int_in(value, 0, most)) is not None:
        return n
    raise bad_return(KIND, connector, "get_num_new_matched_tokens", value,
                     f"request {request.request_id!r} has {request.num_tokens} tokens, {num_computed_tokens} of "
                     f"them computed: it must return an int in [0, {most}] (one token always runs)")


def checked_arrival(connector, value, waits: bool):
    """What ``update_state_after_alloc`` returned: a ``Future`` for a connector that
    ``load_kv_async`` (for a request that loads), None otherwise."""
    if waits and not isinstance(value, Future):
        raise bad_return(KIND, connector, "update_state_after_alloc", value,
                         "with load_kv_async it must return a concurrent.futures.Future (done when the K/V arrived)")
    if not waits and value is not None:
        raise bad_return(KIND, connector, "update_state_after_alloc", value,
                         "it must return None unless the connector load_kv_async and the request loads tokens")
    return value


def checked_holds(connector, value) -> bool:
    """What ``request_finished`` returned: True (keep the blocks) or False."""
    if not isinstance(value, bool):
        raise bad_return(KIND, connector, "request_finished", value,
                         "it must return True (keep the blocks until get_finished names the request) or False")
    return value


def checked_finished(connector, value, num_blocks: int) -> tuple[set, set]:
    """What ``get_finished`` returned: ``(request ids whose saves are done, block ids whose load
    failed)``, the block ids in ``[0, num_blocks)``."""
    if isinstance(value, tuple) and len(value) == 2:
        try:
            sending, failed = set(value[0]), {operator.index(b) for b in value[1]}
            if all(isinstance(r, str) for r in sending) and all(0 <= b < num_blocks for b in failed):
                return sending, failed
        except TypeError:
            pass
    raise bad_return(KIND, connector, "get_finished", value, "it must return (set of request ids whose saves are "
                     f"done, set of block ids in [0, {num_blocks}) whose load failed)")


def requests_to_recompute(kv, scheduled_req_ids, failed_block_ids: set[int]) -> list[str]:
    """Scheduled requests holding a block whose load failed (a request admitted in the same step
    may share it): their K/V there is garbage, so they are recomputed."""
    if not failed_block_ids:
        return []
    return [rid for rid in scheduled_req_ids if failed_block_ids.intersection(kv.get_block_ids(rid))]
