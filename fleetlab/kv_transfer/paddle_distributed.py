"""``paddle_distributed``: prefill on one rank, decode on another, K/V sent layer by layer.

Two engines, one per rank of a ``paddle.distributed.launch`` job (gloo on CPU; NCCL on GPUs,
written, unrun here: no Paddle GPU build on this machine). The *decode* engine (role
``consumer``) is where requests arrive. Admitting one, it counts every token but the last as
loadable from the peer and allocates their blocks; the request then *waits for remote KV*
(``WAITING_FOR_REMOTE_KVS``: held out of the running batch while the other requests keep
decoding). Its *handshake*, each request's token ids and the decode side's block ids
(FastDeploy's ``send_cache_info_to_prefill``), goes out on the decode side's link thread, the
only thread that touches the transport there. The *prefill* engine (role ``producer``, in
:func:`serve`) runs those tokens (chunked, prefix-cached, as any request; ``max_tokens=1``)
and in the step of a request's last chunk, as each layer writes its K/V, sends that layer's
K/V of the asked-for positions with the decode slots they go to. The link thread collects the
layers; once all are in hand it completes the request's future and the scheduler lets the
request join the batch. In that step each layer's K/V is written into its blocks right before
the layer attends (``wait_for_layer_load``); then the decode side computes the last prompt
token and **samples the first output token itself** (the prefill side's one sampled token is
dropped: seeded sampling then draws from the same generator one engine would).

A request preempted while its K/V arrives (a dry pool: it holds blocks and computes nothing)
has its blocks freed at once; what still arrives for it is discarded (the connector reads
``preempted_req_ids``), and it asks the prefill side again when re-admitted.

The prefill side drives the wire: between two of its steps it *polls* the decode side, which
answers with every handshake queued since (so the prefill engine takes several at once: their
prompts' chunks share its steps, each request's K/V still goes out layer by layer in the step of
its last chunk). An idle prefill side polls *waiting*: the answer comes with the next handshake,
or empty after ``KEEPALIVE_S`` seconds (gloo gives up a receive after 30 s and closes the pair).
Wire format (int64 unless said): prefill to decode, a header ``[kind, a, b, c, d]``: a poll
``[POLL, waiting, 0, 0, 0]``, or a layer of a request ``[DATA, req_index, layer, count, status]``
then (status 0) the slots ``[count]`` and ``[2, count, kv_heads, head_dim]`` K/V in the cache
dtype. Decode to prefill, the answer to a poll: ``[kind, n]`` then ``n`` ints (``kind`` 1:
requests, each ``[req_index, num_tokens, start, count, num_blocks, tokens..., block_ids...]``,
``req_index`` counted across handshakes; 0: stop, answered with the prefill pool's
``[num_free_blocks, num_blocks]``). A request the prefill side refuses (status 1), or a peer
that fails mid-way, makes the decode side recompute it: nothing it did not receive is served.

In vLLM: ``NixlConnector`` (``nixl_connector.py``; the decode side pulls with RDMA reads) and
the ``P2pNcclConnector``; FastDeploy: ``splitwise_connector.py`` + ``cache_messager.py``
(``prefill_layerwise_send_cache_thread``); SGLang: ``disaggregation/`` (a bootstrap server,
``KVPoll`` states).

Options: ``peer_rank`` (the other side's rank; default: the other of two ranks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import paddle

from fleetlab.fields import int_field
from fleetlab.kv.paged_cache import gather_rows
from fleetlab.kv_transfer.base import KVConnector

logger = logging.getLogger(__name__)

REQUESTS, STOP = 1, 0  # the decode side's answers to a poll
POLL, DATA = 0, 1  # the prefill side's headers
OK, REFUSED = 0, 1
# Gloo closes a pair whose receive waits 30 s (measured, Paddle 3.3.1: the pair is unusable after),
# so the decode side answers a waiting poll within this, even with nothing to send.
KEEPALIVE_S = 10.0


@dataclass(slots=True, eq=False)
class RemoteLoad:
    """One decode-side request's tokens ``[start, start + count)`` coming into ``block_ids``.

    ``layers``: layer -> ``(slots [count], kv [2, count, kv_heads, head_dim])``, filled by the
    link thread; ``future``: done once every layer is in hand (True) or the transfer failed (False).
    """

    req_id: str
    token_ids: list[int]
    start: int
    count: int
    block_ids: list[int]
    future: Future = field(default_factory=Future)
    layers: dict = field(default_factory=dict)


@dataclass(slots=True)
class RemoteSend:
    """One prefill-side request's K/V to send: its source slots and the decode side's slots."""

    index: int
    src_slots: np.ndarray
    dst_slots: np.ndarray


@dataclass(slots=True)
class PDMeta:
    """A step's plan: loads whose K/V is written into the cache (decode), K/V to send (prefill)."""

    writes: list[RemoteLoad] = field(default_factory=list)
    sends: list[RemoteSend] = field(default_factory=list)


def slots_of(block_ids, start: int, count: int, block_size: int) -> np.ndarray:
    """Cache slots of positions ``[start, start + count)`` of a request with these blocks."""
    pos = np.arange(start, start + count)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


class PaddleDistributedConnector(KVConnector):
    """Both sides of the transfer (``role`` picks which this engine plays)."""

    name = "paddle_distributed"
    options = {"peer_rank": None}
    load_kv_async = True  # the decode side: a request waits for its K/V outside the batch

    @classmethod
    def check_options(cls, options: dict) -> dict:
        peer = options.get("peer_rank")
        return {"peer_rank": None if peer is None else int_field("field", "peer_rank", peer, 0, 2**31 - 1)}

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        import paddle.distributed as dist

        self.dist = dist
        peer = config.options["peer_rank"]
        self.peer = (1 - dist.get_rank()) if peer is None else peer
        self.peer_alive = True
        self.peer_pool = None  # the prefill pool's (free, total) blocks, told at close
        self._pending: list[RemoteLoad] = []  # decode: admitted, handshake not yet handed to the link
        self._loads: dict[str, RemoteLoad] = {}  # decode: request id -> its load, until its first step ran
        self._failed_reqs: set[str] = set()
        self._meta = PDMeta()
        self._kv_cache = None
        self._outgoing: dict[str, tuple] = {}  # prefill: request id -> (index, start, count, decode block ids)
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._link = None
        self.stats.extra.update(recv_seconds=0.0, wire_bytes=0, discarded_loads=0)
        if self.loads:
            self._link = threading.Thread(target=self._run_link, name="fleetlab-kv-link", daemon=True)
            self._link.start()

    # ------------------------------------------------------------------ transport
    def _send(self, array: np.ndarray) -> None:
        self.dist.send(paddle.to_tensor(array), dst=self.peer)
        self.stats.extra["wire_bytes"] += array.nbytes

    def _recv(self, shape, dtype) -> paddle.Tensor:
        t = paddle.empty(shape, dtype=dtype)
        self.dist.recv(t, src=self.peer)
        self.stats.extra["wire_bytes"] += t.numel().item() * t.element_size()
        return t

    def send_handshake(self, kind: int, payload: list[int]) -> None:
        self._send(np.asarray([kind, len(payload)], dtype=np.int64))
        if payload:
            self._send(np.asarray(payload, dtype=np.int64))

    def poll(self, waiting: bool) -> tuple[int, list[int]]:
        """Prefill side: ask the decode side for its new requests; ``waiting`` (nothing runs
        here): the answer may wait for one (at most ``KEEPALIVE_S``). Returns ``(kind, payload)``."""
        self._send(np.asarray([POLL, int(waiting), 0, 0, 0], dtype=np.int64))
        kind, n = self._recv([2], "int64").numpy().tolist()
        return kind, (self._recv([n], "int64").numpy().tolist() if n else [])

    def answer_stop(self, num_free_blocks: int, num_blocks: int) -> None:
        """Prefill side: answer the decode side's stop with this pool's ``[num_free_blocks, num_blocks]``."""
        self._send(np.asarray([num_free_blocks, num_blocks], dtype=np.int64))

    # ------------------------------------------------------------------ decode side: the link thread
    def _run_link(self) -> None:
        """Answer the prefill side's polls with the queued handshakes, take in the K/V it sends,
        send the stop at close: the decode side's one thread on the transport (gloo's is not
        thread-safe; the steps never wait on it)."""
        open_loads: dict[int, RemoteLoad] = {}  # req_index -> its load, until every layer is in
        next_index, t0 = 0, {}
        while True:
            try:
                kind, index, layer, count, status = self._recv([5], "int64").numpy().tolist()
                if kind == DATA:
                    self._take_layer(open_loads, t0, index, layer, count, status)
                    continue
                loads, stop = self._queued(wait=KEEPALIVE_S if index else 0.0)
                if stop:
                    self.send_handshake(STOP, [])
                    self.peer_pool = self._recv([2], "int64").numpy().tolist()
                    for load in open_loads.values():
                        self._fail(load, "the engine closed before it arrived")
                    return
                payload = [len(loads)]
                for load in loads:
                    open_loads[next_index], t0[next_index] = load, time.perf_counter()
                    payload += [next_index, len(load.token_ids), load.start, load.count, len(load.block_ids),
                                *load.token_ids, *load.block_ids]
                    next_index += 1
                self.send_handshake(REQUESTS, payload if loads else [])
            except RuntimeError as exc:
                self._peer_lost(f"the prefill rank stopped answering: {str(exc).strip()[:120]}",
                                list(open_loads.values()))
                return

    def _queued(self, wait: float) -> tuple[list[RemoteLoad], bool]:
        """Every load queued so far (waiting up to ``wait`` seconds for the first), and whether
        the engine closes (the stop is queued)."""
        loads = []
        try:
            job = self._jobs.get(timeout=wait) if wait else self._jobs.get_nowait()
        except queue.Empty:
            return loads, False
        while True:
            if job is None:
                return loads, True
            loads += job
            if self._jobs.empty():
                return loads, False
            job = self._jobs.get()

    def _take_layer(self, open_loads: dict, t0: dict, index: int, layer: int, count: int, status: int) -> None:
        """One layer of request ``index`` (or its refusal) off the wire."""
        load = open_loads[index]
        if status != OK:
            del open_loads[index]
            t0.pop(index)
            self._fail(load, "the prefill side refused it")
            return
        load.layers[layer] = (self._recv([count], "int64"),
                              self._recv([2, count, self.spec.num_kv_heads, self.spec.head_dim], self.spec.dtype))
        if len(load.layers) == self.spec.num_layers:
            del open_loads[index]
            self.stats.extra["recv_seconds"] += time.perf_counter() - t0.pop(index)
            load.future.set_result(True)

    def _fail(self, load: RemoteLoad, why: str) -> None:
        if load.future.done():
            return
        logger.warning("paddle_distributed: request %s: KV transfer failed (%s); recomputing it here",
                       load.req_id, why)
        self._failed_reqs.add(load.req_id)
        self.stats.failed_loads += 1
        load.future.set_result(False)

    def _post(self, loads: list[RemoteLoad]) -> None:
        with self._lock:
            if self.peer_alive:
                self._jobs.put(loads)
                return
        for load in loads:
            self._fail(load, "the prefill rank is gone")

    def _peer_lost(self, why: str, loads: list[RemoteLoad]) -> None:
        with self._lock:
            self.peer_alive = False
            while not self._jobs.empty():
                loads = loads + (self._jobs.get() or [])
        for load in loads:
            self._fail(load, why)

    # ------------------------------------------------------------------ decode side: scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if (not self.loads or not self.peer_alive or request.request_id in self._failed_reqs
                or request.skip_reading_prefix_cache):  # it wants prompt logprobs: every position runs here
            return 0
        # The last token runs here; so do tokens past side data (the prefill side gets token ids only).
        return max(0, min(request.num_tokens - 1, request.num_cacheable_tokens) - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        if not self.loads:
            return None
        self.stats.lookups += 1
        self.stats.query_tokens += request.num_tokens
        if not num_external_tokens:
            return None
        self.stats.hit_lookups += 1
        load = RemoteLoad(request.request_id, request.all_token_ids[:num_computed_tokens + num_external_tokens],
                          num_computed_tokens, num_external_tokens, list(block_ids))
        self._loads[request.request_id] = load
        self._pending.append(load)
        return load.future

    def build_connector_meta(self, scheduler_output, scheduler) -> PDMeta:
        return self._plan_loads(scheduler_output, scheduler) if self.loads else self._plan_sends(scheduler_output,
                                                                                                  scheduler)

    def _plan_loads(self, out, scheduler) -> PDMeta:
        """Discard what a preempted request still receives, hand this step's handshakes to the
        link, and write the arrived K/V of the requests joining the batch this step."""
        for rid in out.preempted_req_ids:
            load = self._loads.pop(rid, None)
            self.stats.extra["discarded_loads"] += load is not None and not load.future.done()
        if self._pending:
            self._post(self._pending)
            self._pending = []
        meta = PDMeta()
        for rid in out.num_scheduled_tokens:
            load = self._loads.get(rid)
            if load is None:
                continue
            if scheduler.requests[rid].num_computed_tokens > load.start + load.count:  # its first step ran
                del self._loads[rid]
            elif load.future.done() and load.future.result():  # (written again if that step is rolled back)
                meta.writes.append(load)
        return meta

    def request_finished(self, request, block_ids) -> bool:
        self._loads.pop(request.request_id, None)  # decode: aborted (or done) while or after receiving
        outgoing = self._outgoing.pop(request.request_id, None)  # its sends ran in its last step's forward
        if outgoing is not None and request.request_id not in self._sent:  # aborted, or failed early
            self.refuse(outgoing[0])
        self._sent.discard(request.request_id)
        self._failed_reqs.discard(request.request_id)
        return False

    # ------------------------------------------------------------------ decode side: worker
    def start_load_kv(self, metadata, kv_cache) -> None:
        self._meta = metadata if metadata is not None else PDMeta()
        self._kv_cache = kv_cache

    def wait_for_layer_load(self, layer_id: int) -> None:
        for load in self._meta.writes:
            slots, kv = load.layers[layer_id]
            self._kv_cache.write(layer_id, kv[0], kv[1], slots)
            self.stats.bytes_loaded += kv.numel().item() * kv.element_size()
            if layer_id == self.spec.num_layers - 1:
                self.stats.loaded_tokens += load.count

    # ------------------------------------------------------------------ prefill side
    def _plan_sends(self, out, scheduler) -> PDMeta:
        """The requests whose last chunk runs this step: their K/V goes out layer by layer."""
        meta = PDMeta()
        for rid, n in out.num_scheduled_tokens.items():
            if rid in self._outgoing:
                req = scheduler.requests[rid]
                if req.num_computed_tokens + n >= req.num_tokens:
                    index, start, count, dst_blocks = self._outgoing[rid]
                    blocks, bs = scheduler.kv.get_block_ids(rid), self.spec.block_size
                    meta.sends.append(RemoteSend(index, slots_of(blocks, start, count, bs),
                                                 slots_of(dst_blocks, start, count, bs)))
                    self._sent.add(rid)
        return meta

    def save_kv_layer(self, layer_id: int, kv_cache, attn_metadata) -> None:
        for send in self._meta.sends:
            index = paddle.to_tensor(send.src_slots)
            flat = [-1, self.spec.num_kv_heads, self.spec.head_dim]
            k = gather_rows(kv_cache.key_cache(layer_id).reshape(flat), index)
            v = gather_rows(kv_cache.value_cache(layer_id).reshape(flat), index)
            self._send(np.asarray([DATA, send.index, layer_id, len(send.src_slots), OK], dtype=np.int64))
            self._send(send.dst_slots)
            kv = paddle.stack([k, v])
            self.dist.send(kv, dst=self.peer)
            self.stats.bytes_saved += kv.numel().item() * kv.element_size()
            self.stats.extra["wire_bytes"] += kv.numel().item() * kv.element_size()

    def wait_for_save(self) -> None:
        self._meta = PDMeta()

    def refuse(self, index: int) -> None:
        self._send(np.asarray([DATA, index, -1, 0, REFUSED], dtype=np.int64))

    def expect(self, req_id: str, index: int, start: int, count: int, dst_blocks: list[int]) -> None:
        self._outgoing[req_id] = (index, start, count, dst_blocks)

    def close(self) -> None:
        """Decode side: tell the prefill rank to stop (it answers with its pool) and end the link."""
        if self._link is not None and self._link.is_alive():
            self._jobs.put(None)
            self._link.join(timeout=30)
            if self._link.is_alive():
                logger.warning("paddle_distributed: the prefill rank did not answer the stop")
        self.peer_alive = False
