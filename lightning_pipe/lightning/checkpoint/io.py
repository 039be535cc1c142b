"""The strategy's default CheckpointIO: a checkpoint file written straight to disk.

Lightning's `TorchCheckpointIO` serialises the whole checkpoint into an in-memory buffer, then
writes a copy of that buffer: twice the checkpoint in rank 0's memory, for a full checkpoint the
whole model's weights and optimizer states. This one, for local paths, writes with torch.save into
a temporary file beside the target and renames it over the target: atomic the same way (a reader
never sees a half-written file, a failure leaves none behind), without the buffer. Remote paths
(fsspec URLs) go through Lightning's own writer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override


class StreamedCheckpointIO(TorchCheckpointIO):
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)  # its refusal / a remote store
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise
