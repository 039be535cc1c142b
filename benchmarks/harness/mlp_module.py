"""bench_runtime.py's residual MLP (`benchmarks.harness.mlp`) as a LightningModule, for benchmarks
that go through ``Trainer(strategy=AutoPipeStrategy(...))``.

The blocks are the module's only ``nn.Sequential`` child (``self.seq``), which is how the strategy
finds the pipeline; the MSE loss is computed in ``training_step`` after the pipeline call, so the
planner's profile charges it to the last block, as the last stage pays it. Unlike the rest of
``benchmarks.harness`` this imports Lightning (import it only where Lightning is wanted).
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import Dataset

from .mlp import loss_fn, make_data, make_model


class MLPModule(L.LightningModule):
    """``make_model(cfg)`` trained with MSE and SGD (``cfg["lr"]``); logs its loss, as users' steps do."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        self.seq = make_model(self.cfg)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.seq(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.cfg["lr"])


class MLPRows(Dataset):
    """``make_data(cfg)``'s batches as rows (a map-style dataset: the planner's profile samples a
    micro-batch from it): with ``DataLoader(batch_size=cfg["batch"])`` step i sees batch i mod 4."""

    def __init__(self, cfg: dict, steps: int):
        batches = make_data(cfg)
        self.x = torch.cat([x for x, _ in batches])
        self.y = torch.cat([y for _, y in batches])
        self.length = steps * cfg["batch"]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i %= len(self.x)
        return self.x[i], self.y[i]
