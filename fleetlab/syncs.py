"""Count host-device synchronisations: every read of a device tensor into Python, every upload.

On a GPU, reading a tensor on the host (``.numpy()``, ``.item()``, ``.tolist()``,
``int(t)``, ``float(t)``, ``if t:``) waits for every kernel queued before it: the CPU stalls
until the GPU is done, and the GPU then idles until the CPU queues more work. A step that
reads once (its sampled tokens) keeps the GPU busy; one that reads per layer or per request
serialises the two. (vLLM's async scheduling goes further and hides even that one read
behind the next step's planning.) Uploads (``paddle.to_tensor``, ``Tensor.set_value``,
``paddle.assign`` of host data, and :func:`fleetlab.device.fill`, through which the engine
uploads) do not stall, but each costs a launch and a copy: their
count should not grow with the batch or the model's depth.

    with fleetlab.syncs.count_syncs() as log:
        llm.step()
    print(log.num_reads, log.num_uploads, log.by_site())

On a CPU nothing really waits, but the same calls are made: counting them here tells what
the step would cost on a GPU. Nested calls (``item()`` calling ``numpy()``) count once.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import paddle

from fleetlab import device

READS = ("numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__")
UPLOADS = ("set_value",)
_local = threading.local()


@dataclass(slots=True)
class SyncEvent:
    """One synchronisation: ``kind`` ``"read"`` or ``"upload"``, the Paddle ``api`` called,
    and the ``site`` (``file:line in function``) of the caller outside Paddle."""

    kind: str
    api: str
    site: str


@dataclass(slots=True)
class SyncLog:
    """The synchronisations seen inside one ``count_syncs()`` block."""

    events: list[SyncEvent] = field(default_factory=list)

    @property
    def reads(self) -> list[SyncEvent]:
        return [e for e in self.events if e.kind == "read"]

    @property
    def uploads(self) -> list[SyncEvent]:
        return [e for e in self.events if e.kind == "upload"]

    @property
    def num_reads(self) -> int:
        return len(self.reads)

    @property
    def num_uploads(self) -> int:
        return len(self.uploads)

    def by_site(self, kind: str | None = None) -> Counter:
        """``Counter`` of ``(kind, api, site)`` (only ``kind`` if given)."""
        return Counter((e.kind, e.api, e.site) for e in self.events if kind in (None, e.kind))


_HELPERS = ("fleetlab/syncs.py", "fleetlab/device.py")  # report who called them instead


def _site() -> str:
    """The innermost caller outside Paddle, this module and the upload helper."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace("\\", "/")
        if "/paddle/" not in path and not path.endswith(_HELPERS):
            short = path.rsplit("/fleetlab/", 1)[-1] if "/fleetlab/" in path else path
            return f"{short}:{frame.lineno} in {frame.name}"
    return "?"


def _wrap(original, kind: str, api: str, log: SyncLog, counts=lambda *a, **k: True):
    def wrapper(*args, **kwargs):
        if getattr(_local, "depth", 0) or not counts(*args, **kwargs):
            return original(*args, **kwargs)
        _local.depth = 1
        try:
            log.events.append(SyncEvent(kind, api, _site()))
            return original(*args, **kwargs)
        finally:
            _local.depth = 0

    return wrapper


def _host_data(value, *args, **kwargs) -> bool:
    """``paddle.assign``'s first argument is host data (an upload), not a device tensor (a copy)."""
    return not isinstance(value, paddle.Tensor)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncLog]:
    """Record every device-to-host read and host-to-device upload in the block (see module doc)."""
    log = SyncLog()
    patched = [(paddle.Tensor, name, getattr(paddle.Tensor, name)) for name in READS + UPLOADS]
    patched += [(paddle, "to_tensor", paddle.to_tensor), (paddle, "assign", paddle.assign),
                (device, "fill", device.fill)]
    try:
        for owner, name, original in patched:
            if owner is not paddle.Tensor:
                counts = _host_data if name == "assign" else (lambda *a, **k: True)
                setattr(owner, name, _wrap(original, "upload", name, log, counts))
            else:
                setattr(owner, name, _wrap(original, "upload" if name in UPLOADS else "read", name, log))
        yield log
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def describe(log: SyncLog) -> str:
    """A short table of a log's synchronisations by call site, for notebooks."""
    lines = [f"{log.num_reads} device-to-host reads, {log.num_uploads} uploads"]
    for (kind, api, site), n in sorted(log.by_site().items(), key=lambda kv: (kv[0][0], -kv[1])):
        lines.append(f"  {kind:6s} {n:4d} x {api:10s} {site}")
    return "\n".join(lines)


__all__ = ["SyncEvent", "SyncLog", "count_syncs", "describe"]
