"""The prefill rank's loop of disaggregated serving: take each handshake of the decode rank, run its
requests one token deep, and send their K/V from inside the steps
(:meth:`~fleetlab.kv_transfer.paddle_distributed.PaddleDistributedConnector.save_kv_layer`)."""

from __future__ import annotations

import logging
import time

from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.kv_transfer.paddle_distributed import PING, STOP

logger = logging.getLogger(__name__)


def serve(llm, *, max_handshakes: int | None = None, delay_s: float = 0.0) -> None:
    """The prefill rank's loop: take each handshake, run its requests, send their K/V (from
    inside the steps: :meth:`PaddleDistributedConnector.save_kv_layer`), until told to stop.
    ``delay_s``: wait that long before each handshake's work (a slow peer, for demonstrations)."""
    conn = llm.kv_connector
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    seq = 0
    while max_handshakes is None or seq < max_handshakes:
        kind, payload = conn.recv_handshake()
        if kind == STOP:
            conn.answer_stop(llm.pool.num_free_blocks, llm.pool.num_blocks)
            return
        if kind == PING:
            continue
        time.sleep(delay_s)
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
