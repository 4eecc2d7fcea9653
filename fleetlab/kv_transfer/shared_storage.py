"""``shared_storage``: KV blocks saved under a directory, loaded by any engine that points there.

Each full block of known tokens is saved, layer by layer as the layer writes it, to
``PATH/<key[:2]>/<key>/layer_<i>.safetensors`` (tensors ``k``, ``v`` ``[block_size,
num_kv_heads, head_dim]`` and the block's ``token_ids``), where ``key`` is the block's
token-hash chain (:func:`~fleetlab.kv_transfer.block_store.chain_keys`). A later request whose
prompt starts with the same blocks, in this engine, another process, or after a restart,
loads them instead of computing them. Files are written under a temporary name unique to the
writer (process, thread and a random part) and renamed into place, layers in order, so a block
counts as stored once its last layer's file exists: a reader never sees half a block, and
engines in one process or in several that save the same block at once each replace the file
with the same content.

In vLLM: ``ExampleConnector`` (``example_connector.py``, formerly ``SharedStorageConnector``
in ``shared_storage_connector.py``) saves per request and layer under a folder named by a hash
of the prompt; fleetlab keys per block, so prompts that share only a prefix share its files.

Options: ``path`` (the directory; created if missing).
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from fleetlab.kv_transfer.block_store import BlockStoreConnector, LoadError


class SharedStorageConnector(BlockStoreConnector):
    """Blocks in safetensors files under ``options["path"]``, one file per block and layer."""

    name = "shared_storage"
    options = {"path": None}

    @classmethod
    def check_options(cls, options: dict) -> dict:
        path = options.get("path")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"field path: the directory blocks are saved under (a str or path); got {path!r:.60}")
        existing = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"field path: {str(path)!r} cannot be a directory: {str(existing)!r} is a file")
        return {"path": str(path)}

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.root = Path(config.options["path"])
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"engine config: kv_transfer_config field path: cannot make directory "
                             f"{str(self.root)!r} ({exc.strerror or exc})") from exc

    def _file(self, key: str, layer_id: int) -> Path:
        return self.root / key[:2] / key / f"layer_{layer_id}.safetensors"

    def has(self, key: str) -> bool:
        return self._file(key, self.spec.num_layers - 1).exists()

    def read(self, key: str, layer_id: int):
        try:
            data = load_file(self._file(key, layer_id))
            return data["k"], data["v"], data["token_ids"].tolist()
        except (OSError, SafetensorError, KeyError) as exc:
            raise LoadError(f"{self._file(key, layer_id)}: {exc}") from exc

    def write(self, key: str, layer_id: int, k, v, token_ids) -> None:
        path = self._file(key, layer_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}.tmp")
        try:
            save_file({"k": np.ascontiguousarray(k), "v": np.ascontiguousarray(v),
                       "token_ids": np.asarray(token_ids, dtype=np.int64)}, tmp,
                      metadata={"dtype": self.spec.dtype, "layer": str(layer_id)})
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none (a rival writer's, same K/V)
        finally:
            tmp.unlink(missing_ok=True)
