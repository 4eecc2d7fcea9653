"""The tensor-parallel process group on Paddle's own distributed runtime.

A tensor-parallel program is SPMD: ``python -m paddle.distributed.launch --nproc_per_node N
prog.py`` starts ``N`` copies of ``prog.py``, one per rank, with ``PADDLE_TRAINER_ID`` and
``PADDLE_TRAINERS_NUM`` in their environment. :func:`init_tensor_parallel` joins them
(``paddle.distributed.init_parallel_env``: gloo on CPU, NCCL on GPUs) and returns a
:class:`TensorParallelGroup` whose :meth:`~TensorParallelGroup.all_reduce` every row-parallel
layer calls. It counts and times each call, and turns a collective that fails because a
peer died into a :class:`TensorParallelError` that says so.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NoReturn

import paddle
import paddle.distributed as dist

logger = logging.getLogger(__name__)

LAUNCH_HINT = ("start the program with `python -m paddle.distributed.launch --nproc_per_node {n} "
               "your_program.py` (or `python -m fleetlab demo --tensor-parallel-size {n}`, which does it)")


class TensorParallelError(RuntimeError):
    """A collective failed: a peer rank died, or stopped answering within the backend's timeout."""


@dataclass(slots=True)
class AllReduceRecord:
    """One all-reduce: which layer called it, the tensor shape, its bytes and seconds."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    seconds: float


@dataclass(slots=True)
class CommStats:
    """Running totals of the all-reduces of one rank (``recording`` also keeps each call)."""

    num_calls: int = 0
    seconds: float = 0.0
    nbytes: int = 0
    recording: bool = False
    records: list[AllReduceRecord] = field(default_factory=list)

    def reset(self) -> None:
        self.num_calls, self.seconds, self.nbytes = 0, 0.0, 0
        self.records.clear()


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group.

    rank, size: this rank and the number of ranks. backend: ``"gloo"``, ``"nccl"``...
    group: the ``paddle.distributed`` group (``None`` when ``size == 1``).
    layers: ``"manual"`` or ``"paddle"``, the layers models are sharded into for this group.
    stats: the :class:`CommStats` of the all-reduces made through :meth:`all_reduce` (the
      ``"manual"`` layers; Paddle's ``RowParallelLinear`` reduces inside itself, uncounted).
    """

    def __init__(self, rank: int, size: int, group=None, backend: str = "none", layers: str = "manual"):
        self.rank = rank
        self.size = size
        self.group = group
        self.backend = backend
        self.layers = layers
        self.stats = CommStats()

    def all_reduce(self, x: paddle.Tensor, name: str = "") -> paddle.Tensor:
        """Sum ``x`` over the ranks, in place, and return it (any shape; a no-op for one rank).

        ``name`` labels the call in ``stats.records`` (e.g. ``"layer 2 attention out"``).
        On GPUs the call is asynchronous to the host, so its time is the launch time unless
        something synchronizes; on CPU (gloo) it is the whole exchange.
        """
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            raise self._error(f"all-reduce {name or ''} of {list(x.shape)}", e) from e
        dt = time.perf_counter() - t0
        s = self.stats
        nbytes = math.prod(x.shape) * x.element_size()
        s.num_calls += 1
        s.seconds += dt
        s.nbytes += nbytes
        if s.recording:
            s.records.append(AllReduceRecord(name, tuple(x.shape), nbytes, dt))
        return x

    def check_agree(self, value: int, what: str) -> None:
        """Raise :class:`TensorParallelError` on every rank unless all ranks pass the same
        ``value`` (an int64 fingerprint). Costs one all-reduce of two int64s."""
        if self.size == 1:
            return
        value = int(value) & 0x7FFFFFFFFFFFFFFF
        t = paddle.to_tensor([value, -value], dtype="int64")
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise self._error(f"agreement check of {what}", e) from e
        high, neg_low = (int(v) for v in t.numpy())
        if high != -neg_low:
            raise TensorParallelError(
                f"tensor-parallel rank {self.rank}/{self.size}: ranks disagree on {what} "
                f"(this rank's fingerprint {value}, highest {high}, lowest {-neg_low}). Every rank must "
                "add the same requests in the same order with the same sampling params; the scheduler "
                "runs on every rank and must see identical inputs.")

    def stopped_by_launcher(self, signum, frame) -> None:
        """The SIGTERM handler of a joined rank: Paddle's launcher stops every rank once one exits, so
        a rank busy computing when its peer died is told why it stops (instead of Paddle's bare
        "Termination signal" report, which names no peer)."""
        raise TensorParallelError(f"tensor-parallel rank {self.rank}/{self.size}: stopped by SIGTERM, which the "
                                  "launcher sends every rank once one exits: a peer rank died or exited; this rank "
                                  "stops too")

    def _error(self, what: str, cause: Exception) -> TensorParallelError:
        msg = (f"tensor-parallel rank {self.rank}/{self.size}: {what} failed on backend {self.backend!r}: "
               f"a peer rank died or stopped answering; this rank stops too. ({str(cause).strip()[:200]})")
        logger.error(msg)
        return TensorParallelError(msg)

    def __repr__(self) -> str:
        return f"<TensorParallelGroup rank {self.rank}/{self.size} on {self.backend}>"


def launched_world_size() -> int:
    """Ranks the launcher started (``PADDLE_TRAINERS_NUM``); 1 outside a launch."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def launched_rank() -> int:
    """This process's rank from the launcher (``PADDLE_TRAINER_ID``); 0 outside a launch."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


_GROUPS: dict[int, TensorParallelGroup] = {}


def init_tensor_parallel(tensor_parallel_size: int, layers: str = "auto") -> TensorParallelGroup:
    """Join (once per process) the group of ``tensor_parallel_size`` launched ranks.

    ``1`` returns a single-rank group without touching ``paddle.distributed``. Otherwise the
    program must have been started by ``paddle.distributed.launch`` with exactly that many
    processes, or a ``ValueError`` says how to start it. On a GPU build each rank is put on
    its own device (``gpu:<local rank>``) before anything is allocated.

    ``layers`` picks the tensor-parallel layers the model will be sharded into (the group's
    ``layers``): ``"manual"`` joins with ``paddle.distributed.init_parallel_env``;
    ``"paddle"`` joins with ``fleet.init`` (model-parallel degree ``N``), which Paddle's
    ``ColumnParallelLinear``/``RowParallelLinear`` need; ``"auto"``: ``"paddle"`` on NCCL,
    ``"manual"`` on gloo (where ``RowParallelLinear`` cannot run).
    """
    if layers not in ("auto", "manual", "paddle"):
        raise ValueError(f"tensor parallel layers={layers!r} must be 'auto', 'manual' or 'paddle'")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"engine config: tensor_parallel_size={tensor_parallel_size!r} must be an int >= 1")
    if tensor_parallel_size in _GROUPS:
        return _GROUPS[tensor_parallel_size]
    if tensor_parallel_size == 1:
        _GROUPS[1] = TensorParallelGroup(0, 1)
        return _GROUPS[1]
    world = launched_world_size()
    if "PADDLE_TRAINER_ID" not in os.environ or world == 1:
        raise ValueError(f"engine config: tensor_parallel_size={tensor_parallel_size} needs one process per "
                         f"rank, but this process was not launched as one: "
                         + LAUNCH_HINT.format(n=tensor_parallel_size))
    if world != tensor_parallel_size:
        raise ValueError(f"engine config: tensor_parallel_size={tensor_parallel_size} but the launcher started "
                         f"{world} processes (--nproc_per_node); make them equal")
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        local = int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")))
        paddle.set_device(f"gpu:{local}")
    t0 = time.perf_counter()
    backend = os.environ.get("PADDLE_DISTRI_BACKEND") or ("nccl" if paddle.is_compiled_with_cuda() else "gloo")
    if layers == "auto":
        layers = "paddle" if backend == "nccl" else "manual"
    if layers == "paddle":
        group = join_with_fleet(tensor_parallel_size)
        tp = TensorParallelGroup(group.rank, group.nranks, group, backend)
    else:
        group = dist.init_parallel_env()  # returns the existing default group when already joined
        tp = TensorParallelGroup(dist.get_rank(), dist.get_world_size(), group, backend)
    tp.layers = layers
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, tp.stopped_by_launcher)
    logger.info("joined %r (%s layers) in %.2f s", tp, layers, time.perf_counter() - t0)
    _GROUPS[tensor_parallel_size] = tp
    return tp


def leave_together(code: int = 0) -> NoReturn:
    """End a launched rank once every rank is done (a barrier), without interpreter teardown: a
    rank tearing Paddle's process group down while a peer still held its sockets was seen to
    abort (SIGABRT) after its work, failing a job whose answers were all printed."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join_with_fleet(tensor_parallel_size: int):
    """``fleet.init`` with model-parallel degree ``N``; returns its model-parallel group.

    ``mp_async_allreduce`` + ``mp_skip_c_identity`` make ``ColumnParallelLinear`` skip
    ``c_identity`` (an identity in the forward pass; it exists for the backward all-reduce),
    the setting under which it was seen to run on CPU too.
    """
    strategy = dist.fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": tensor_parallel_size, "pp_degree": 1}
    strategy.hybrid_configs["mp_configs"].mp_async_allreduce = True
    strategy.hybrid_configs["mp_configs"].mp_skip_c_identity = True
    dist.fleet.init(is_collective=True, strategy=strategy)
    return dist.fleet.get_hybrid_communicate_group().get_model_parallel_group()
