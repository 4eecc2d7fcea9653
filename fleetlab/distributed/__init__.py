"""Tensor parallelism on Paddle's own distributed runtime (``paddle.distributed``).

``LLM(model, tensor_parallel_size=N)`` inside a program started with
``python -m paddle.distributed.launch --nproc_per_node N prog.py`` splits the model over the
``N`` ranks the Megatron way -- query/KV heads and MLP columns -- with one all-reduce after
each attention output projection and one after each MLP down projection. Each rank's paged
KV cache holds only its KV heads; every rank runs the same scheduler on the same inputs, so
block ids and tables are identical everywhere (see :mod:`fleetlab.distributed.engine`).

- :mod:`~fleetlab.distributed.plan`: which heads and columns live on which rank (pure arithmetic);
- :mod:`~fleetlab.distributed.group`: joining the process group, the counted all-reduce;
- :mod:`~fleetlab.distributed.layers`: column- and row-parallel layers (manual, or Paddle's fleet layers);
- :mod:`~fleetlab.distributed.shard`: sharding a Fleet-style model or a PaddleFormers Llama in place;
- :mod:`~fleetlab.distributed.engine`: the hooks ``LLM`` calls, and the rank-agreement check;
- :mod:`~fleetlab.distributed.launch`: starting a job from Python; :mod:`~fleetlab.lab.tp_worker`:
  the reporting rank that tests, notebook and benchmark launch.
"""

from __future__ import annotations

from fleetlab.distributed.group import TensorParallelError, TensorParallelGroup, init_tensor_parallel
from fleetlab.distributed.plan import RankShard, ShardPlan, plan_shards
from fleetlab.distributed.shard import plan_for, shard_model, sharded_info

__all__ = ["RankShard", "ShardPlan", "TensorParallelError", "TensorParallelGroup", "init_tensor_parallel",
           "plan_for", "plan_shards", "shard_model", "sharded_info"]
