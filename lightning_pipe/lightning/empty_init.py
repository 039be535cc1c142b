"""Creating the model empty: each rank later creates only the blocks of its stage.

`trainer.init_module(empty_init=True)` and `configure_model()` (Lightning's two ways to create a
large model) create it on the meta device here: shapes and dtypes (the precision plugin's, e.g.
bf16-true), no storage. The strategy plans from block-by-block profiles and, when it cuts the model,
allocates and initialises its own blocks only (`cutting`, `models/init.py`). Everything created
in `configure_model()` is empty, so create metrics and other non-pipeline state in `__init__`
under `with torch.device("cpu"):` (a torchmetrics state made on the meta device has lost its initial value).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from typing_extensions import override

from ..models.init import is_meta


class EmptyInitMixin:
    precision_plugin: Any

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):
            yield

    @override
    def teardown(self) -> None:
        module = getattr(self, "lightning_module", None)
        if module is None or not is_meta(module):
            return super().teardown()  # type: ignore[misc]
        # Still empty (a failure before the cut): Lightning's teardown moves the module to the CPU,
        # which a meta tensor cannot do, and that error would hide the one that ended the run.
        module.cpu = lambda: module  # type: ignore[method-assign]
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            del module.cpu
