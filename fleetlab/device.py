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
    tensor = paddle.empty(list(array.shape), dtype=_paddle_dtype(array.dtype))
    if array.size:
        fill(tensor, array)
    return tensor


_PADDLE_DTYPES: dict[np.dtype, object] = {}


def _paddle_dtype(dtype: np.dtype):
    """Paddle's dtype for a numpy one, remembered (converting the name costs more than a small copy)."""
    if dtype not in _PADDLE_DTYPES:
        _PADDLE_DTYPES[dtype] = paddle.empty([0], dtype=dtype.name).dtype
    return _PADDLE_DTYPES[dtype]


def fill(tensor: paddle.Tensor, array: np.ndarray) -> None:
    """Copy ``array`` (same shape and dtype) into ``tensor``'s storage, which keeps its address.

    What ``Tensor.set_value`` ends in, without its checks (they cost more than copying a step's
    small arrays); the engine's callers pass what they built to match.
    """
    tensor.value().get_tensor().set(array, paddle.device.device_to_place(paddle.device.get_device()))


class Packer:
    """Collects host arrays, uploads them as one flat copy per dtype, hands back device views.

    A step sends many small arrays (positions, ``slot_mapping``, input ids, a backend's plan):
    each upload costs an allocation and a copy whatever its size, so packing them costs about
    one per dtype. ``add`` each array (it returns a handle), ``upload`` once, then ``get`` each
    handle's tensor. (vLLM keeps persistent ``CpuGpuBuffer`` s instead, whose fixed addresses a
    CUDA graph can replay; a fresh buffer per upload keeps each step's tensors its own, so a
    learner holding an earlier step's metadata still reads that step's values.)
    """

    def __init__(self) -> None:
        self._parts: dict[np.dtype, list[np.ndarray]] = {}
        self._sizes: dict[np.dtype, int] = {}
        self._flat: dict[np.dtype, paddle.Tensor] = {}

    def add(self, array) -> tuple:
        array = np.ascontiguousarray(array)
        dtype, size = array.dtype, array.size  # keyed by the dtype object: str(dtype) costs more than a copy
        self._parts.setdefault(dtype, []).append(array.reshape(-1))
        offset = self._sizes.get(dtype, 0)
        self._sizes[dtype] = offset + size
        return dtype, offset, size, array.shape

    def upload(self) -> None:
        self._flat = {dtype: upload(parts[0] if len(parts) == 1 else np.concatenate(parts))
                      for dtype, parts in self._parts.items()}

    def get(self, handle) -> paddle.Tensor:
        dtype, offset, size, shape = handle
        flat = self._flat[dtype]
        if len(shape) != 1:
            return flat[offset: offset + size].reshape(list(shape))
        return flat if size == flat.shape[0] else flat[offset: offset + size]


def upload_packed(*arrays) -> list[paddle.Tensor]:
    """The arrays as device tensors of their own dtypes and shapes, in one copy per dtype
    (a :class:`Packer` used once)."""
    packer = Packer()
    handles = [packer.add(a) for a in arrays]
    packer.upload()
    return [packer.get(h) for h in handles]


def check_model_dtype_runs(dtype, what: str = "model") -> None:
    """Raise ``ValueError`` naming the dtype and the device when Paddle cannot run a model of
    ``dtype`` on its current device (half precision on a CPU), before any work starts."""
    name = str(dtype).removeprefix("paddle.")
    device = paddle.device.get_device()
    # What Paddle 3.3's CPU build has no matmul/softmax kernels for (measured: a bf16 or fp16
    # ``linear`` raises "kernel ... (CPU, ..., bfloat16) of kernel `matmul` is not registered").
    if device.startswith("cpu") and name in ("bfloat16", "float16"):
        raise ValueError(
            f"{what} dtype {name!r} cannot run on device {device!r}: Paddle's CPU build has no {name} "
            "matmul or softmax kernels. On a CPU use float32 (model.to(dtype='float32')); bfloat16 and "
            "float16 run on a GPU (paddlepaddle-gpu, see README)")
