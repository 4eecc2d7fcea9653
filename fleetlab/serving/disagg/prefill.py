"""The prefill rank's loop of disaggregated serving: between two steps, poll the decode rank for
its new handshakes and add their requests (one token deep) to the running ones, so several
handshakes' prompts share a step; their K/V goes out from inside the steps, layer by layer
(:meth:`~fleetlab.kv_transfer.paddle_distributed.PaddleDistributedConnector.save_kv_layer`)."""

from __future__ import annotations

import logging
import time

from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.kv_transfer.paddle_distributed import STOP

logger = logging.getLogger(__name__)


def serve(llm, *, delay_s: float = 0.0) -> None:
    """The prefill rank's loop: poll (waiting, when nothing runs here), add what came, run one step,
    until told to stop. ``delay_s``: wait that long before adding a handshake's requests (a slow
    peer, for demonstrations)."""
    conn = llm.kv_connector
    while True:
        kind, payload = conn.poll(waiting=not llm.has_unfinished_requests())
        if kind == STOP:
            conn.answer_stop(llm.pool.num_free_blocks, llm.pool.num_blocks)
            return
        if payload and payload[0]:
            time.sleep(delay_s)
            add_requests(llm, payload)
        if llm.has_unfinished_requests():
            llm.step()


def add_requests(llm, payload: list[int]) -> None:
    """The requests of one answer to a poll (see the wire format in
    :mod:`fleetlab.kv_transfer.paddle_distributed`), each to run its prompt and send its K/V."""
    conn, sp, pos = llm.kv_connector, SamplingParams(max_tokens=1, ignore_eos=True), 1
    for _ in range(payload[0]):
        index, num_tokens, start, count, num_blocks = payload[pos:pos + 5]
        tokens = payload[pos + 5:pos + 5 + num_tokens]
        blocks = payload[pos + 5 + num_tokens:pos + 5 + num_tokens + num_blocks]
        pos += 5 + num_tokens + num_blocks
        rid = f"pd{index}"
        try:
            llm.add_request(prompt_token_ids=tokens, sampling_params=sp, request_id=rid)
        except ValueError as exc:
            logger.warning("prefill side: refusing request %d: %s", index, exc)
            conn.refuse(index)
            continue
        conn.expect(rid, index, start, count, blocks)
