"""The two kinds of tensor-parallel linear layer, built from a slice of a full layer's weight.

- **Column-parallel** (QKV, MLP gate/up): rank ``r`` keeps columns of ``W [in, out]``; its
  output is its own heads or MLP columns, ``[..., out_r]``. No communication.
- **Row-parallel** (attention output, MLP down): rank ``r`` keeps the matching rows of
  ``W [in, out]``; its output ``[..., out]`` is a partial sum, completed by one all-reduce.
  A bias is added once, after the all-reduce.

Two implementations:

- ``"manual"`` (the default on CPU, and verified there): :class:`ShardedLinear` and
  :class:`RowParallelAllReduce`, plain matmuls plus ``paddle.distributed.all_reduce``
  through :class:`~fleetlab.distributed.group.TensorParallelGroup` (counted and timed).
- ``"paddle"`` (the default on GPUs, **written but not run here**): Paddle's own
  ``paddle.distributed.fleet.meta_parallel.ColumnParallelLinear`` /
  ``RowParallelLinear`` with their weights set to the same slices. Measured on CPU with
  Paddle 3.3.1 and gloo: ``ColumnParallelLinear`` runs when ``mp_skip_c_identity`` is on
  (without it ``c_identity`` has no CPU kernel), ``RowParallelLinear`` does not
  (``ProcessGroupGLOO does not support all_reduce with sync_op and use_calc_stream``).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear


class ShardedLinear(nn.Layer):
    """``x @ weight (+ bias)`` with a given ``weight [in, out]``: a column-parallel shard.

    ``weight``/``bias`` are copied into new parameters of the same dtype and device.
    """

    def __init__(self, weight: paddle.Tensor, bias: paddle.Tensor | None = None):
        super().__init__()
        self.weight = _parameter(self, weight)
        self.bias = _parameter(self, bias) if bias is not None else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[0]}, out={self.weight.shape[1]} (this rank's columns)"


class RowParallelAllReduce(nn.Layer):
    """Row-parallel linear: ``all_reduce(x_r @ weight_r) + bias``.

    x: ``[..., in_r]`` (this rank's heads or MLP columns); weight: ``[in_r, out]``;
    bias: ``[out]`` (the full bias, added once after the sum) or ``None``; returns
    ``[..., out]``, identical on every rank. ``name`` labels the all-reduce in the
    group's records.
    """

    def __init__(self, weight: paddle.Tensor, bias: paddle.Tensor | None, tp, name: str):
        super().__init__()
        self.weight = _parameter(self, weight)
        self.bias = _parameter(self, bias) if bias is not None else None
        self.tp = tp
        self.name_ = name

    def forward(self, x):
        out = self.tp.all_reduce(F.linear(x, self.weight), self.name_)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[0]} (this rank's rows), out={self.weight.shape[1]}, then all-reduce"


def column_parallel(weight: paddle.Tensor, bias, tp, layers: str) -> nn.Layer:
    """A column-parallel layer holding ``weight [in, out_r]`` (this rank's columns)."""
    if layers == "manual":
        return ShardedLinear(weight, bias)
    with _default_dtype(weight.dtype):
        layer = ColumnParallelLinear(weight.shape[0], weight.shape[1] * tp.size, has_bias=bias is not None,
                                     gather_output=False, mp_group=tp.group)
    layer.weight.set_value(weight)
    if bias is not None:
        layer.bias.set_value(bias)
    return layer


def row_parallel(weight: paddle.Tensor, bias, tp, layers: str, name: str) -> nn.Layer:
    """A row-parallel layer holding ``weight [in_r, out]`` (this rank's rows) and its all-reduce."""
    if layers == "manual":
        return RowParallelAllReduce(weight, bias, tp, name)
    with _default_dtype(weight.dtype):
        layer = RowParallelLinear(weight.shape[0] * tp.size, weight.shape[1], has_bias=bias is not None,
                                  input_is_parallel=True, mp_group=tp.group)
    layer.weight.set_value(weight)
    if bias is not None:
        layer.bias.set_value(bias)
    return layer


def _parameter(layer: nn.Layer, value: paddle.Tensor):
    p = layer.create_parameter(list(value.shape), dtype=value.dtype,
                               default_initializer=nn.initializer.Constant(0.0))
    p.set_value(value)
    p.stop_gradient = True
    return p


class _default_dtype:
    """Context: Paddle's default dtype set to ``dtype`` (the fleet layers create in it)."""

    def __init__(self, dtype):
        self.dtype = str(dtype).removeprefix("paddle.")

    def __enter__(self):
        self.previous = paddle.get_default_dtype()
        paddle.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        paddle.set_default_dtype(self.previous)
