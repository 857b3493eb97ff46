"""Encoder outputs on a shared folder, in the layout of vLLM's shared-storage encoder-cache connector.

vLLM's `ECExampleConnector` (earlier `ECSharedStorageConnector`, vllm/distributed/ec_transfer/
ec_connector/) reads `<shared_storage_path>/<mm_hash>/encoder_cache.safetensors` and takes the tensor
named `ec_cache`: the item's merged tokens [tokens, hidden] as the language model consumes them, so
Qwen3-VL's DeepStack features are concatenated after the main embedding along the hidden dimension.
The client picks the `<mm_hash>` (the item's `id`) and passes the same string as the media's `uuid`
in its chat request. Files are written atomically: a reader never sees a partial file.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

FILE_NAME = "encoder_cache.safetensors"
TENSOR_KEY = "ec_cache"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def id_problem(item_id: str) -> str | None:
    """Why `item_id` cannot name a folder, or None. Safe characters only: no separators, no `..`."""
    if not _SAFE_ID.match(item_id):
        return "id must be 1-200 characters from A-Z a-z 0-9 _ . -"
    if ".." in item_id or item_id.startswith("."):
        return "id must not start with '.' nor contain '..'"
    return None


class ECSharedStorage:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def check(self) -> None:
        """At start-up: the folder exists (or can be made) and is writable."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-"):
            pass

    def path_for(self, item_id: str) -> Path:
        problem = id_problem(item_id)
        if problem:
            raise ValueError(problem)
        return self.root / item_id / FILE_NAME

    def write(self, item_id: str, tensor: torch.Tensor, metadata: dict[str, str] | None = None) -> Path:
        """Temp file in the target folder, fsync, rename over the target, fsync the folder."""
        target = self.path_for(item_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = save({TENSOR_KEY: tensor.detach().contiguous().cpu()}, metadata={"format": "pt", **(metadata or {})})
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)
        return target


def _fsync_dir(folder: Path) -> None:
    # Makes the rename durable; not every filesystem allows opening a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
