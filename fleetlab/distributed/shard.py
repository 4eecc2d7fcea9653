"""Shard a model in place for one tensor-parallel rank (Megatron's split, per family).

:func:`shard_model` replaces each decoder layer's projections with this rank's slices
(:mod:`fleetlab.distributed.layers`) and sets the layer's head counts to this rank's, so
the model's own forward code runs unchanged on fewer heads and MLP columns:

=====================  =========================  ===================================
family                 column-parallel (no comm)  row-parallel (+ one all-reduce each)
=====================  =========================  ===================================
Fleet-style            ``linear_qkv``, ``linear_fc1``  ``linear_proj``, ``linear_fc2``
PaddleFormers Llama    ``q/k/v_proj``, ``gate/up_proj``  ``o_proj``, ``down_proj``
=====================  =========================  ===================================

Embeddings, norms and the LM head stay whole on every rank (replicated): each rank ends a
step with the same hidden states and the same logits. The sharding cannot be undone:
load the model again for a single-process run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import paddle

from fleetlab.distributed.layers import column_parallel, row_parallel
from fleetlab.distributed.plan import RankShard, ShardPlan, plan_shards
from fleetlab.patching.families import family_of
from fleetlab.patching.handle import has_core_attention

logger = logging.getLogger(__name__)

SHARDED_ATTR = "_fleetlab_tensor_parallel"
SUPPORTED_PADDLEFORMERS = ("llama",)


@dataclass(slots=True)
class ShardedModel:
    """What :func:`shard_model` did to a model, for the engine, notebooks and tests.

    family: ``"fleet"`` or a PaddleFormers family name. plan: the whole split; shard: this
    rank's share. layers: ``"manual"`` or ``"paddle"`` (see ``fleetlab.distributed.layers``).
    row_parallel: names of the row-parallel layers, in forward order (one all-reduce each).
    weight_shapes: ``{projection name: (full shape, this rank's shape)}`` of layer 0.
    """

    family: str
    plan: ShardPlan
    shard: RankShard
    layers: str
    row_parallel: list[str] = field(default_factory=list)
    weight_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank: what its paged KV cache holds."""
        return self.shard.num_kv_heads


def model_dims(model) -> tuple[str, int, int, int, int]:
    """``(family, num_heads, num_kv_heads, head_dim, intermediate_size)`` of a full model."""
    config = model.config
    if has_core_attention(model):
        return ("fleet", config.num_attention_heads, config.num_kv_heads, config.head_dim,
                config.ffn_hidden_size)
    spec = family_of(model)
    if spec.name not in SUPPORTED_PADDLEFORMERS:
        raise NotImplementedError(
            f"tensor parallelism: family {spec.name!r} has no sharding plan yet (supported: fleet, "
            f"{', '.join(SUPPORTED_PADDLEFORMERS)}); add one in fleetlab/distributed/shard.py and a 2-process "
            "parity test")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (spec.name, int(config.num_attention_heads), int(config.num_key_value_heads), int(head_dim),
            int(config.intermediate_size))


def plan_for(model, tensor_parallel_size: int) -> ShardPlan:
    """The :class:`ShardPlan` of ``model`` over ``tensor_parallel_size`` ranks (no sharding done).

    Raises ``ValueError`` when the heads or MLP columns do not split evenly.
    """
    existing = getattr(model, SHARDED_ATTR, None)
    if existing is not None:
        return existing.plan
    _, heads, kv_heads, head_dim, ffn = model_dims(model)
    return plan_shards(heads, kv_heads, head_dim, ffn, tensor_parallel_size)


def weight_table(model, tensor_parallel_size: int) -> list[dict]:
    """Each projection of one decoder layer: its full weight shape, one rank's shape, how it
    is split (``"column"``: no communication; ``"row"``: an all-reduce follows), and what the
    slice holds. Pure arithmetic on the config -- nothing is sharded."""
    family, heads, kv, d, ffn = model_dims(model)
    plan = plan_shards(heads, kv, d, ffn, tensor_parallel_size)
    s = plan.ranks[0]
    hidden = int(model.config.hidden_size)
    qh, kvh, f = s.num_heads, s.num_kv_heads, s.intermediate_size
    if family == "fleet":
        rows = [("linear_qkv", [hidden, (heads + 2 * kv) * d], [hidden, (qh + 2 * kvh) * d], "column",
                 "this rank's q heads, then its k and v heads"),
                ("linear_proj", [heads * d, hidden], [qh * d, hidden], "row", "rows of this rank's q heads"),
                ("linear_fc1", [hidden, 2 * ffn], [hidden, 2 * f], "column", "this rank's gate and up columns"),
                ("linear_fc2", [ffn, hidden], [f, hidden], "row", "rows of this rank's MLP columns")]
    else:
        rows = [("q_proj", [hidden, heads * d], [hidden, qh * d], "column", "this rank's q heads"),
                ("k_proj", [hidden, kv * d], [hidden, kvh * d], "column", "the k heads its q heads read"),
                ("v_proj", [hidden, kv * d], [hidden, kvh * d], "column", "the v heads its q heads read"),
                ("o_proj", [heads * d, hidden], [qh * d, hidden], "row", "rows of this rank's q heads"),
                ("gate_proj", [hidden, ffn], [hidden, f], "column", "this rank's MLP columns"),
                ("up_proj", [hidden, ffn], [hidden, f], "column", "this rank's MLP columns"),
                ("down_proj", [ffn, hidden], [f, hidden], "row", "rows of this rank's MLP columns")]
    return [{"projection": n, "full": full, "per_rank": local, "split": split,
             "after": "all-reduce" if split == "row" else "-", "holds": what}
            for n, full, local, split, what in rows]


def shard_model(model, tp, layers: str = "manual") -> ShardedModel:
    """Shard ``model`` in place for rank ``tp.rank`` of ``tp.size`` and return what was done.

    ``tp``: a :class:`~fleetlab.distributed.group.TensorParallelGroup`. ``layers``:
    ``"manual"`` or ``"paddle"``. A model already sharded for this group size is returned
    as it is; one sharded for another size raises ``ValueError``.
    """
    existing = getattr(model, SHARDED_ATTR, None)
    if existing is not None:
        if existing.plan.tp_size != tp.size or existing.shard.rank != tp.rank:
            raise ValueError(f"model is already sharded for rank {existing.shard.rank} of "
                             f"{existing.plan.tp_size}; load it again to shard it for rank {tp.rank} of {tp.size}")
        return existing
    if layers not in ("manual", "paddle"):
        raise ValueError(f"tensor parallel layers={layers!r} must be 'manual' or 'paddle'")
    family, heads, kv_heads, head_dim, ffn = model_dims(model)
    plan = plan_shards(heads, kv_heads, head_dim, ffn, tp.size)
    info = ShardedModel(family, plan, plan.ranks[tp.rank], layers)
    if family == "fleet":
        _shard_fleet(model, info, tp)
    else:
        _shard_llama(model, info, tp)
    object.__setattr__(model, SHARDED_ATTR, info)  # plain attribute: not a sub-layer or parameter
    logger.info("sharded %s for rank %d/%d: %d query heads, %d KV heads, MLP columns %s (%s layers)",
                family, tp.rank, tp.size, info.shard.num_heads, info.num_kv_heads, info.shard.mlp_columns, layers)
    return info


def sharded_info(model) -> ShardedModel | None:
    """The :class:`ShardedModel` record of a sharded model, else ``None``."""
    return getattr(model, SHARDED_ATTR, None)


def _cols(w: paddle.Tensor, index: list[int]) -> paddle.Tensor:
    return paddle.index_select(w, paddle.to_tensor(index, dtype="int64", place=w.place), axis=1)


def _rows(w: paddle.Tensor, index: list[int]) -> paddle.Tensor:
    return paddle.index_select(w, paddle.to_tensor(index, dtype="int64", place=w.place), axis=0)


def _bias_cols(linear, index):
    b = getattr(linear, "bias", None)
    return None if b is None else paddle.index_select(b, paddle.to_tensor(index, dtype="int64", place=b.place))


def _record(info: ShardedModel, name: str, full, local) -> None:
    if name not in info.weight_shapes:
        info.weight_shapes[name] = (tuple(full.weight.shape), tuple(local.weight.shape))


def _split_columns(info: ShardedModel, module, name: str, index: list[int], tp) -> None:
    """Replace ``module.<name>`` by its column-parallel shard: output columns ``index``."""
    old = getattr(module, name)
    setattr(module, name, column_parallel(_cols(old.weight, index), _bias_cols(old, index), tp, info.layers))
    _record(info, name, old, getattr(module, name))


def _split_rows(info: ShardedModel, module, name: str, index: list[int], tp, label: str) -> None:
    """Replace ``module.<name>`` by its row-parallel shard (input rows ``index``, then an
    all-reduce named ``label``)."""
    old = getattr(module, name)
    setattr(module, name, row_parallel(_rows(old.weight, index), getattr(old, "bias", None), tp, info.layers, label))
    _record(info, name, old, getattr(module, name))
    info.row_parallel.append(label)


@paddle.no_grad()
def _shard_fleet(model, info: ShardedModel, tp) -> None:
    """Fleet-style layers: ``linear_qkv [hidden, (H + 2K) D]`` packed ``[q | k | v]``,
    ``linear_proj [H D, hidden]``, ``linear_fc1 [hidden, 2F]`` packed ``[gate | up]``,
    ``linear_fc2 [F, hidden]``."""
    s, p = info.shard, info.plan
    q, kv = s.q_columns(), s.kv_columns()
    qkv_index = q + [p.num_heads * p.head_dim + c for c in kv] + [(p.num_heads + p.num_kv_heads) * p.head_dim + c
                                                                   for c in kv]
    f0, f1 = s.mlp_columns
    fc1_index = list(range(f0, f1)) + [p.intermediate_size + c for c in range(f0, f1)]
    for i, layer in enumerate(model.decoder.layers):
        att, mlp = layer.self_attention, layer.mlp
        _split_columns(info, att, "linear_qkv", qkv_index, tp)
        _split_rows(info, att, "linear_proj", q, tp, f"layer {i} attention linear_proj")
        att.num_heads, att.num_kv_heads = s.num_heads, s.num_kv_heads
        _split_columns(info, mlp, "linear_fc1", fc1_index, tp)
        _split_rows(info, mlp, "linear_fc2", list(range(f0, f1)), tp, f"layer {i} mlp linear_fc2")


@paddle.no_grad()
def _shard_llama(model, info: ShardedModel, tp) -> None:
    """PaddleFormers Llama: ``q_proj [hidden, H D]``, ``k_proj``/``v_proj [hidden, K D]``,
    ``o_proj [H D, hidden]``; MLP ``gate_proj``/``up_proj [hidden, F]``, ``down_proj [F, hidden]``."""
    s = info.shard
    q, kv = s.q_columns(), s.kv_columns()
    f = list(range(*s.mlp_columns))
    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        if getattr(mlp, "fuse_up_gate", False) or not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj")):
            raise NotImplementedError("tensor parallelism: fused QKV or gate/up projections are not supported; "
                                      "build the model with separate q/k/v and gate/up projections")
        for name, index in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            _split_columns(info, att, name, index, tp)
        _split_rows(info, att, "o_proj", q, tp, f"layer {i} attention o_proj")
        att.num_heads, att.num_key_value_heads = s.num_heads, s.num_kv_heads
        for name in ("gate_proj", "up_proj"):
            _split_columns(info, mlp, name, f, tp)
        _split_rows(info, mlp, "down_proj", f, tp, f"layer {i} mlp down_proj")
        mlp.intermediate_size = s.intermediate_size
