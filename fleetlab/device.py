"""Moving host arrays to the device, the one way the engine's step path does it.

``paddle.to_tensor(ndarray)`` in Paddle 3.3.1 leaks one Python list per call (the keyword
names of the C++ ``Tensor`` constructor; README "Known library issues" shows it), so an
engine that uploads a dozen arrays a step grows without end. :func:`upload` allocates with
``paddle.empty`` and fills its storage as ``Tensor.set_value`` does (without that method's
checks, which cost more than the copy of a step's small arrays): neither leaks.
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
        fill(tensor, array)
    return tensor


def fill(tensor: paddle.Tensor, array: np.ndarray) -> None:
    """Copy ``array`` (same shape and dtype) into ``tensor``'s storage, which keeps its address.

    What ``Tensor.set_value`` ends in, without its checks (they cost more than copying a step's
    small arrays); the engine's callers pass what they built to match.
    """
    tensor.value().get_tensor().set(array, paddle.device.device_to_place(paddle.device.get_device()))


def upload_packed(*arrays) -> list[paddle.Tensor]:
    """Integer arrays (any shapes, any integer dtypes) sent to the device in one copy; returns a
    tensor of each array's own dtype and shape (slices of one int64 buffer).

    A step sends half a dozen small arrays (positions, ``slot_mapping``, input ids, ...): each
    upload costs an allocation and a copy whatever its size, so packing them costs about one.
    (vLLM keeps persistent ``CpuGpuBuffer`` s instead, whose fixed addresses a CUDA graph can
    replay; a fresh buffer per call keeps each step's tensors its own, so a learner holding an
    earlier step's metadata still reads that step's values.)
    """
    arrays = [np.asarray(a) for a in arrays]
    assert all(a.dtype.kind in "iu" for a in arrays), "upload_packed carries integer arrays"
    packed = upload(np.concatenate([a.reshape(-1) for a in arrays], dtype=np.int64))
    tensors = paddle.split(packed, [a.size for a in arrays]) if packed.shape[0] else [packed] * len(arrays)
    tensors = [t if a.dtype == np.int64 else t.astype(str(a.dtype)) for t, a in zip(tensors, arrays)]
    return [t if a.ndim == 1 else t.reshape(list(a.shape)) for t, a in zip(tensors, arrays)]


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
