"""Moving host arrays to the device, the one way the engine's step path does it.

``paddle.to_tensor(ndarray)`` in Paddle 3.3.1 leaks one Python list per call (the keyword
names of the C++ ``Tensor`` constructor; README "Known library issues" shows it), so an
engine that uploads a dozen arrays a step grows without end. :func:`upload` allocates with
``paddle.empty`` and fills with ``Tensor.set_value``, which leak nothing and cost about the
same.
"""

from __future__ import annotations

import numpy as np
import paddle


def upload(array, dtype=None) -> paddle.Tensor:
    """``array`` (anything numpy takes) as a tensor on Paddle's current device.

    ``dtype``: a numpy dtype to convert to first (default: the array's own).
    """
    array = np.ascontiguousarray(array, dtype=dtype)
    tensor = paddle.empty(list(array.shape), dtype=str(array.dtype))
    if array.size:
        tensor.set_value(array)
    return tensor


class StagingBuffer:
    """The step's small integer arrays (positions, ``slot_mapping``, input ids, ...) sent to the
    device through one persistent buffer: each :meth:`upload` is one host-to-device copy, and
    what it returns are slices of the device buffer.

    Half a dozen separate uploads a step cost half a dozen allocations and copies, more than
    the arrays' contents; vLLM's model runner keeps persistent ``CpuGpuBuffer`` s for the same
    reason (their fixed addresses are also what a captured CUDA graph replays). Arrays go in
    at a cursor that :meth:`reset` rewinds once per step: the step's one device-to-host read
    has finished every kernel of the previous step before its slices are overwritten.
    """

    def __init__(self, capacity: int = 4096):
        self.host = np.zeros(capacity, dtype=np.int64)
        self.device = upload(self.host)
        self.cursor = 0

    def reset(self) -> None:
        self.cursor = 0

    def upload(self, *arrays: np.ndarray) -> list[paddle.Tensor]:
        """Each integer array (any shape) as a device tensor of its own dtype and shape."""
        arrays = [np.asarray(a) for a in arrays]
        assert all(a.dtype.kind in "iu" for a in arrays), "only integer arrays travel as int64"
        sizes = [a.size for a in arrays]
        end = self.cursor + sum(sizes)
        if end > len(self.host):  # grow; tensors handed out before keep the old buffer alive
            self.host = np.concatenate([self.host, np.zeros(max(end, 2 * len(self.host)), np.int64)])
            self.device = upload(self.host)
        start = self.cursor
        for a, n in zip(arrays, sizes):
            self.host[start: start + n] = a.reshape(-1)
            start += n
        self.device.set_value(self.host)  # in place: one copy for all of them
        tensors = []
        for a, n in zip(arrays, sizes):
            t = self.device[self.cursor: self.cursor + n] if n else paddle.empty([0], dtype="int64")
            t = t if a.dtype == np.int64 else t.astype(str(a.dtype))
            tensors.append(t if a.ndim == 1 else t.reshape(list(a.shape)))
            self.cursor += n
        return tensors


# What Paddle 3.3's CPU build has no matmul/softmax kernels for (measured: a bf16 or fp16
# ``linear`` raises "kernel ... (CPU, ..., bfloat16) of kernel `matmul` is not registered").
CPU_UNSUPPORTED_DTYPES = ("bfloat16", "float16")


def check_model_dtype_runs(dtype, what: str = "model") -> None:
    """Raise ``ValueError`` naming the dtype and the device when Paddle cannot run a model of
    ``dtype`` on its current device (half precision on a CPU), before any work starts."""
    name = str(dtype).removeprefix("paddle.")
    device = paddle.device.get_device()
    if device.startswith("cpu") and name in CPU_UNSUPPORTED_DTYPES:
        raise ValueError(
            f"{what} dtype {name!r} cannot run on device {device!r}: Paddle's CPU build has no {name} "
            "matmul or softmax kernels. On a CPU use float32 (model.to(dtype='float32')); bfloat16 and "
            "float16 run on a GPU (paddlepaddle-gpu, see README)")
