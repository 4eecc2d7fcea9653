"""``paddle_distributed``: prefill on one rank, decode on another, K/V sent layer by layer.

Two engines, one per rank of a ``paddle.distributed.launch`` job (gloo on CPU; NCCL on GPUs,
written, unrun here: no Paddle GPU build on this machine). The *decode* engine (role
``consumer``) is where requests arrive. Admitting one, it counts every token but the last as
loadable from the peer, allocates their blocks, and at the start of its step sends the
*handshake*: each request's token ids and the decode side's block ids (FastDeploy's
``send_cache_info_to_prefill``). The *prefill* engine (role ``producer``, in :func:`serve`)
runs those tokens (chunked, prefix-cached, as any request; ``max_tokens=1``), and in the step
of a request's last chunk, as each layer writes its K/V, sends that layer's K/V of the asked-for
positions, with the decode slots they go to, computed from the decode side's block ids. The
decode step receives a layer right before that layer attends (``wait_for_layer_load``), so
its layer ``i`` computes while layer ``i + 1`` is on the wire; then it computes the last
prompt token and samples the first output token itself.

Wire format (int64 unless said): handshake ``[kind, n]`` then ``n`` ints (``kind`` 1: requests,
each ``[num_tokens, start, count, num_blocks, tokens..., block_ids...]``; 0: stop, answered
with the prefill pool's ``[num_free_blocks, num_blocks]``; 2: a keep-alive, at least every
``KEEPALIVE_S`` seconds: gloo gives up a receive after 30 s and closes the pair); data ``[req_index, layer, count,
status]``, then (status 0) the slots ``[count]`` and ``[2, count, kv_heads, head_dim]`` K/V in
the cache dtype. A request the prefill side refuses (status 1), or a peer that fails mid-way,
makes the decode side recompute: nothing it did not receive is served.

In vLLM: ``NixlConnector`` (``nixl_connector.py``; the decode side pulls with RDMA reads) and
the ``P2pNcclConnector``; FastDeploy: ``splitwise_connector.py`` + ``cache_messager.py``
(``prefill_layerwise_send_cache_thread``); SGLang: ``disaggregation/`` (a bootstrap server,
``KVPoll`` states).

Options: ``peer_rank`` (the other side's rank; default: the other of two ranks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import paddle

from fleetlab.kv.paged_cache import gather_rows
from fleetlab.kv_transfer.base import KVConnector
from fleetlab.validation import int_field

logger = logging.getLogger(__name__)

REQUESTS, STOP, PING = 1, 0, 2
OK, REFUSED = 0, 1
# Gloo closes a pair whose receive waits 30 s (measured, Paddle 3.3.1: the pair is unusable after),
# so an idle decode side pings the prefill side, which waits in a receive, well within that.
KEEPALIVE_S = 10.0


@dataclass(slots=True)
class RemoteLoad:
    """One decode-side request's tokens ``[start, start + count)`` coming into ``block_ids``."""

    req_id: str
    token_ids: list[int]
    start: int
    count: int
    block_ids: list[int]


@dataclass(slots=True)
class RemoteSend:
    """One prefill-side request's K/V to send: its source slots and the decode side's slots."""

    index: int
    src_slots: np.ndarray
    dst_slots: np.ndarray


@dataclass(slots=True)
class PDMeta:
    loads: list[RemoteLoad] = field(default_factory=list)
    sends: list[RemoteSend] = field(default_factory=list)


def slots_of(block_ids, start: int, count: int, block_size: int) -> np.ndarray:
    """Cache slots of positions ``[start, start + count)`` of a request with these blocks."""
    pos = np.arange(start, start + count)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


class PaddleDistributedConnector(KVConnector):
    """Both sides of the transfer (``role`` picks which this engine plays)."""

    name = "paddle_distributed"
    options = {"peer_rank": None}

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
        self._pending: list[RemoteLoad] = []
        self._failed_reqs: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._meta = PDMeta()
        self._kv_cache = None
        self._outgoing: dict[str, tuple] = {}  # producer: request id -> (index, start, count, decode block ids)
        self._sent: set[str] = set()
        self._last_send = time.monotonic()
        self._inbox: dict[tuple[int, int], tuple] = {}
        self._done: set[int] = set()  # load indices failed or refused this step
        self.stats.extra.update(recv_seconds=0.0, wire_bytes=0)

    # ------------------------------------------------------------------ transport
    def _send(self, array: np.ndarray) -> None:
        self.dist.send(paddle.to_tensor(array), dst=self.peer)
        self._last_send = time.monotonic()
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

    def recv_handshake(self) -> tuple[int, list[int]]:
        kind, n = self._recv([2], "int64").numpy().tolist()
        return kind, (self._recv([n], "int64").numpy().tolist() if n else [])

    # ------------------------------------------------------------------ decode side: scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if (not self.loads or not self.peer_alive or request.request_id in self._failed_reqs
                or request.skip_reading_prefix_cache):  # it wants prompt logprobs: every position runs here
            return 0
        # The last token runs here; so do tokens past side data (the prefill side gets token ids only).
        return max(0, min(request.num_tokens - 1, request.num_cacheable_tokens) - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        if not self.loads:
            return
        self.stats.lookups += 1
        self.stats.query_tokens += request.num_tokens
        if num_external_tokens:
            self.stats.hit_lookups += 1
            self._pending.append(RemoteLoad(request.request_id, request.all_token_ids[:num_computed_tokens +
                                            num_external_tokens], num_computed_tokens, num_external_tokens,
                                            list(block_ids)))

    def build_connector_meta(self, scheduler_output, scheduler) -> PDMeta:
        meta = PDMeta(loads=self._pending)
        self._pending = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            if rid in self._outgoing:  # producer: a request whose last chunk runs this step
                req = scheduler.requests[rid]
                if req.num_computed_tokens + n >= req.num_tokens:
                    index, start, count, dst_blocks = self._outgoing[rid]
                    blocks, bs = scheduler.kv.get_block_ids(rid), self.spec.block_size
                    meta.sends.append(RemoteSend(index, slots_of(blocks, start, count, bs),
                                                 slots_of(dst_blocks, start, count, bs)))
                    self._sent.add(rid)
        return meta

    def request_finished(self, request, block_ids) -> bool:
        outgoing = self._outgoing.pop(request.request_id, None)  # its sends ran in its last step's forward
        if outgoing is not None and request.request_id not in self._sent:  # aborted, or failed early
            self.refuse(outgoing[0])
        self._sent.discard(request.request_id)
        self._failed_reqs.discard(request.request_id)
        return False

    # ------------------------------------------------------------------ decode side: worker
    def start_load_kv(self, metadata, kv_cache) -> None:
        self._meta = metadata if metadata is not None else PDMeta()
        self._kv_cache, self._inbox, self._done = kv_cache, {}, set()
        if not self._meta.loads:
            self.keepalive()
            return
        payload = [len(self._meta.loads)]
        for load in self._meta.loads:
            payload += [len(load.token_ids), load.start, load.count, len(load.block_ids), *load.token_ids,
                        *load.block_ids]
        try:
            self.send_handshake(REQUESTS, payload)
        except RuntimeError as exc:
            self._fail_all(f"handshake failed: {exc}")

    def wait_for_layer_load(self, layer_id: int) -> None:
        t0 = time.perf_counter()
        loads = self._meta.loads
        for index, load in enumerate(loads):
            while index not in self._done and (index, layer_id) not in self._inbox:
                if not self._receive_one():
                    break
            if (index, layer_id) in self._inbox:
                slots, kv = self._inbox.pop((index, layer_id))
                self._kv_cache.write(layer_id, kv[0], kv[1], slots)
                self.stats.bytes_loaded += kv.numel().item() * kv.element_size()
                if layer_id == self.spec.num_layers - 1:
                    self.stats.loaded_tokens += load.count
        self.stats.extra["recv_seconds"] += time.perf_counter() - t0

    def _receive_one(self) -> bool:
        """Take the next data message into the inbox; False once the peer is gone."""
        try:
            index, layer, count, status = self._recv([4], "int64").numpy().tolist()
            if status != OK:
                self._fail(index, "the prefill side refused it")
                return True
            slots = self._recv([count], "int64")
            kv = self._recv([2, count, self.spec.num_kv_heads, self.spec.head_dim], self.spec.dtype)
        except RuntimeError as exc:
            self._fail_all(f"the prefill rank stopped answering: {str(exc).strip()[:120]}")
            return False
        self._inbox[index, layer] = (slots, kv)
        return True

    def _fail(self, index: int, why: str) -> None:
        load = self._meta.loads[index]
        logger.warning("paddle_distributed: request %s: KV transfer failed (%s); recomputing it here",
                       load.req_id, why)
        self._done.add(index)
        self._failed_reqs.add(load.req_id)
        self._failed_blocks.update(load.block_ids)
        self.stats.failed_loads += 1

    def _fail_all(self, why: str) -> None:
        self.peer_alive = False
        for index in range(len(self._meta.loads)):
            if index not in self._done:
                self._fail(index, why)

    def get_finished(self, finished_req_ids):
        failed, self._failed_blocks = self._failed_blocks, set()
        return set(), failed

    def keepalive(self) -> None:
        """Decode side: ping the prefill side if nothing went to it for ``KEEPALIVE_S`` seconds
        (call it from the thread that runs the steps: the transport is not thread-safe)."""
        if self.role == "consumer" and self.peer_alive and time.monotonic() - self._last_send > KEEPALIVE_S:
            try:
                self.send_handshake(PING, [])
            except RuntimeError as exc:
                self.peer_alive = False
                logger.warning("paddle_distributed: the prefill rank is gone (%s); computing locally", exc)

    # ------------------------------------------------------------------ prefill side: worker
    def save_kv_layer(self, layer_id: int, kv_cache, attn_metadata) -> None:
        for send in self._meta.sends:
            index = paddle.to_tensor(send.src_slots)
            flat = [-1, self.spec.num_kv_heads, self.spec.head_dim]
            k = gather_rows(kv_cache.key_cache(layer_id).reshape(flat), index)
            v = gather_rows(kv_cache.value_cache(layer_id).reshape(flat), index)
            self._send(np.asarray([send.index, layer_id, len(send.src_slots), OK], dtype=np.int64))
            self._send(send.dst_slots)
            kv = paddle.stack([k, v])
            self.dist.send(kv, dst=self.peer)
            self.stats.bytes_saved += kv.numel().item() * kv.element_size()
            self.stats.extra["wire_bytes"] += kv.numel().item() * kv.element_size()

    def wait_for_save(self) -> None:
        self._meta = PDMeta()

    def refuse(self, index: int) -> None:
        self._send(np.asarray([index, -1, 0, REFUSED], dtype=np.int64))

    def expect(self, req_id: str, index: int, start: int, count: int, dst_blocks: list[int]) -> None:
        self._outgoing[req_id] = (index, start, count, dst_blocks)

    def close(self) -> None:
        if self.loads and self.peer_alive and self.role == "consumer":
            self.peer_alive = False
            try:
                self.send_handshake(STOP, [])
                self.peer_pool = self._recv([2], "int64").numpy().tolist()
            except RuntimeError:
                logger.warning("paddle_distributed: the prefill rank was gone at close")


def serve(llm, *, max_handshakes: int | None = None) -> None:
    """The prefill rank's loop: take each handshake, run its requests, send their K/V (from
    inside the steps: :meth:`PaddleDistributedConnector.save_kv_layer`), until told to stop."""
    from fleetlab.engine.sampling_params import SamplingParams

    conn = llm.kv_connector
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    seq = 0
    while max_handshakes is None or seq < max_handshakes:
        kind, payload = conn.recv_handshake()
        if kind == STOP:
            conn._send(np.asarray([llm.pool.num_free_blocks, llm.pool.num_blocks], dtype=np.int64))
            return
        if kind == PING:
            continue
        pos = 1
        for index in range(payload[0]):
            num_tokens, start, count, num_blocks = payload[pos:pos + 4]
            tokens = payload[pos + 4:pos + 4 + num_tokens]
            blocks = payload[pos + 4 + num_tokens:pos + 4 + num_tokens + num_blocks]
            pos += 4 + num_tokens + num_blocks
            rid = f"pd{seq}-{index}"
            try:
                llm.add_request(prompt_token_ids=tokens, sampling_params=sp, request_id=rid)
            except ValueError as exc:
                logger.warning("prefill side: refusing request %d of handshake %d: %s", index, seq, exc)
                conn.refuse(index)
                continue
            conn.expect(rid, index, start, count, blocks)
        while llm.has_unfinished_requests():
            llm.step()
        seq += 1
