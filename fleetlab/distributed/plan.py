"""Which attention heads and MLP columns each tensor-parallel rank holds (Megatron's split).

With ``N`` ranks, rank ``r`` holds

- query heads ``[r * H / N, (r + 1) * H / N)`` -- ``N`` must divide ``H``;
- the KV heads those query heads read: ``K / N`` of them when ``N`` divides ``K``, or, when
  ranks outnumber KV heads (``N`` a multiple of ``K``), the one KV head its query group
  uses -- replicated on ``N / K`` ranks;
- MLP columns ``[r * F / N, (r + 1) * F / N)`` of the gate and of the up projection, and the
  same rows of the down projection -- ``N`` must divide ``F``.

Column-parallel layers (QKV, gate/up) need no communication: each rank computes its own
heads and columns. Row-parallel layers (attention output, MLP down) each produce a partial
sum over the rank's heads or columns; one all-reduce per row-parallel layer adds them up,
two per decoder layer. This module is pure arithmetic: no Paddle, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RankShard:
    """What rank ``rank`` of ``tp_size`` holds.

    q_heads, kv_heads: global head ids on this rank, in order.
    mlp_columns: ``(start, stop)`` of the intermediate (``F``) columns on this rank.
    head_dim: size of one head.
    """

    rank: int
    tp_size: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    mlp_columns: tuple[int, int]
    head_dim: int

    @property
    def num_heads(self) -> int:
        """Query heads on this rank (``H / N``)."""
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank -- what its paged KV cache holds."""
        return len(self.kv_heads)

    @property
    def intermediate_size(self) -> int:
        """MLP columns on this rank (``F / N``)."""
        return self.mlp_columns[1] - self.mlp_columns[0]

    def q_columns(self) -> list[int]:
        """Columns of a ``[hidden, H * head_dim]`` query projection on this rank."""
        return _head_columns(self.q_heads, self.head_dim)

    def kv_columns(self) -> list[int]:
        """Columns of a ``[hidden, K * head_dim]`` key (or value) projection on this rank."""
        return _head_columns(self.kv_heads, self.head_dim)


@dataclass(slots=True, frozen=True)
class ShardPlan:
    """The split of one model over ``tp_size`` ranks; ``ranks[r]`` is rank ``r``'s share.

    kv_replicas: how many ranks hold each KV head (1 unless ranks outnumber KV heads).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tp_size: int
    ranks: tuple[RankShard, ...]

    @property
    def kv_replicas(self) -> int:
        return max(1, self.tp_size // self.num_kv_heads)

    def table(self) -> list[dict]:
        """One row per rank: heads, KV heads and MLP columns (for printing or a DataFrame)."""
        return [{"rank": s.rank, "q_heads": list(s.q_heads), "kv_heads": list(s.kv_heads),
                 "mlp_columns": f"{s.mlp_columns[0]}:{s.mlp_columns[1]}"} for s in self.ranks]


def plan_shards(num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                tp_size: int) -> ShardPlan:
    """Split ``num_heads`` query heads, ``num_kv_heads`` KV heads and ``intermediate_size``
    MLP columns over ``tp_size`` ranks.

    Raises ``ValueError`` naming ``tensor_parallel_size`` and what to choose instead when
    the heads or columns do not split evenly.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size!r} must be an int >= 1")
    divisors = [n for n in range(1, num_heads + 1) if _splits(num_heads, num_kv_heads, intermediate_size, n)]
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide num_attention_heads={num_heads}: "
                         f"each rank must hold whole query heads; choose one of {divisors}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} and num_key_value_heads={num_kv_heads}: one must "
                         f"divide the other (split the KV heads, or replicate each on tp/kv ranks); "
                         f"choose one of {divisors}")
    if intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the MLP intermediate size "
                         f"{intermediate_size}; choose one of {divisors}")
    q_per, f_per = num_heads // tp_size, intermediate_size // tp_size
    group = num_heads // num_kv_heads  # query heads per KV head
    ranks = []
    for r in range(tp_size):
        q = tuple(range(r * q_per, (r + 1) * q_per))
        kv = tuple(sorted({h // group for h in q}))  # the KV heads these query heads read
        ranks.append(RankShard(r, tp_size, q, kv, (r * f_per, (r + 1) * f_per), head_dim))
    return ShardPlan(num_heads, num_kv_heads, head_dim, intermediate_size, tp_size, tuple(ranks))


def _splits(num_heads: int, num_kv_heads: int, intermediate_size: int, n: int) -> bool:
    return (num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
            and intermediate_size % n == 0)


def _head_columns(heads, head_dim: int) -> list[int]:
    return [h * head_dim + d for h in heads for d in range(head_dim)]
