"""What ``LLM(..., tensor_parallel_size=N)`` does on each rank.

**Where the scheduler runs: on every rank, deterministically.** Every rank of a
tensor-parallel fleetlab program runs the whole engine -- scheduler, block pool, InputBatch,
sampler -- on identical inputs, and only the model forward is split. That works because

- the program is SPMD: every rank adds the same requests in the same order (the same
  request ids, arrival order and seeds, drawn from ``EngineConfig.seed``);
- the scheduler's decisions depend only on those requests, the pool and the sampled
  tokens, never on wall time;
- after each row-parallel all-reduce every rank holds the same hidden states (the
  embeddings, norms and LM head are replicated), so every rank computes the same logits;
  greedy picks the same argmax, and seeded sampling draws the same token, because each
  request's random numbers come from its own seed and token index on the host.

So block ids and block tables come out identical on every rank with no message at all:
a step costs the model's ``2 * num_layers`` all-reduces and nothing else. The alternative
-- the scheduler on rank 0 and its step message broadcast, as vLLM's engine core does for
its workers -- is what a server needs, where requests reach one process; fleetlab's
``serve``/``AsyncLLM`` do not run tensor-parallel. The bet is checked cheaply:
:class:`AgreementCheckedRunner` all-reduces a fingerprint of the step's schedule (request
ids, token counts, block ids) and of the previous step's sampled tokens, on the first step
and every ``FLEETLAB_TP_CHECK_EVERY`` steps after (default 16; 1 checks every step, 0 never),
and stops every rank with a :class:`TensorParallelError` if they differ.
"""

from __future__ import annotations

import logging
import os
import zlib

from fleetlab.distributed.group import TensorParallelGroup, init_tensor_parallel
from fleetlab.distributed.shard import ShardedModel, plan_for, shard_model

logger = logging.getLogger(__name__)

CHECK_EVERY_ENV = "FLEETLAB_TP_CHECK_EVERY"


class TensorParallelState:
    """The tensor-parallel side of one ``LLM``: the group, this rank's shard, the check.

    tp: this rank's :class:`TensorParallelGroup`; sharded: the :class:`ShardedModel` record;
    check_every: agreement check period in steps (0: off).
    """

    def __init__(self, tp: TensorParallelGroup, sharded: ShardedModel, check_every: int):
        self.tp = tp
        self.sharded = sharded
        self.check_every = check_every

    @classmethod
    def prepare(cls, model, tensor_parallel_size: int) -> TensorParallelState:
        """Join the group and shard ``model`` (a model or a ``PatchHandle``) for this rank.

        Raises ``ValueError`` when the program was not launched with ``tensor_parallel_size``
        processes, or when the model's heads or MLP columns do not split that many ways. The
        layers (manual, or Paddle's fleet layers) are the group's: see ``init_tensor_parallel``.
        """
        target = getattr(model, "model", model) if hasattr(model, "compute_logits") else model
        plan_for(target, tensor_parallel_size)  # an uneven split raises before any process group work
        tp = init_tensor_parallel(tensor_parallel_size)  # an earlier call may have chosen its layers
        sharded = shard_model(target, tp, layers=tp.layers)
        every = int(os.environ.get(CHECK_EVERY_ENV, "16"))
        if every < 0:
            raise ValueError(f"{CHECK_EVERY_ENV}={every} must be >= 0")
        return cls(tp, sharded, every)

    def adapt_handle(self, handle) -> None:
        """Give the patch handle this rank's head counts: the paged KV cache is sized by them."""
        handle.num_kv_heads = self.sharded.num_kv_heads
        handle.tp_rank, handle.tp_size = self.tp.rank, self.tp.size

    def wrap_runner(self, runner):
        """The runner, wrapped so that ranks check they agree (see the module docstring)."""
        return AgreementCheckedRunner(runner, self.tp, self.check_every)


class AgreementCheckedRunner:
    """A model runner that, every ``every`` steps (and on the first), checks before the
    forward that all ranks plan the same step after sampling the same tokens.

    Everything else is the wrapped runner's (attribute access passes through).
    """

    def __init__(self, runner, tp: TensorParallelGroup, every: int):
        self.runner = runner
        self.tp = tp
        self.every = every
        self.num_checks = 0
        self._last_sampled: dict[str, int] = {}
        self._num_steps = 0

    def execute(self, sched):
        if self.every and (self._num_steps == 0 or self._num_steps % self.every == 0):
            self.tp.check_agree(step_fingerprint(sched, self._last_sampled),
                                f"engine step {self._num_steps}: the schedule and the last sampled tokens")
            self.num_checks += 1
        self._num_steps += 1
        out = self.runner.execute(sched)
        self._last_sampled = {rid: tuple(tokens) for rid, tokens in out.sampled_token_ids.items()}
        return out

    def __getattr__(self, name):
        return getattr(self.runner, name)


def step_fingerprint(sched, last_sampled: dict[str, tuple[int, ...]]) -> int:
    """A 64-bit fingerprint of a step's message (who runs how many tokens, which drafts, the
    block ids it hands out, the blocks it copies) and of the tokens sampled just before it.

    Deterministic across processes (CRC32s, not Python's salted ``hash``).
    """
    blocks = {n.req_id: tuple(n.block_ids) for n in sched.scheduled_new_reqs}
    cached = sched.scheduled_cached_reqs
    blocks.update({rid: (cached.num_blocks[i], *cached.new_block_ids[i]) for i, rid in enumerate(cached.req_ids)})
    rows = sorted((rid, n, blocks.get(rid, ()), tuple(sched.scheduled_spec_decode_tokens.get(rid, ())))
                  for rid, n in sched.num_scheduled_tokens.items())
    a = zlib.crc32(repr((rows, [tuple(c) for c in sched.kv_copies])).encode())
    b = zlib.crc32(repr(sorted(last_sampled.items())).encode())
    return (a << 32) | b
