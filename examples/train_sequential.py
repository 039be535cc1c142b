"""Train your own nn.Sequential-shaped LightningModule with pipeline parallelism.

    python examples/train_sequential.py                      # 2 CPU processes, 1F1B, 4 micro-batches
    python examples/train_sequential.py --devices 4 --schedule gpipe --check

With --check, the script also trains the same model in one process and prints the largest
relative weight difference to it. In float64 on CPU it prints 3.90e-08 for the defaults (3 epochs
of 64 AdamW steps, 4 micro-batches; the same with --devices 4 and with --schedule gpipe),
1.45e-11 with --epochs 1, and 0.00e+00 with --microbatches 1: the micro-batch gradients are summed
in another order than the full batch's, and Adam's normalisation amplifies that rounding step
after step. (The tests hold the pipeline to <= 1e-10 over a few steps.)
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, depth: int = 8, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        # The pipeline: the module's single nn.Sequential child. Each block is a unit of partitioning.
        self.net = nn.Sequential(
            nn.Linear(16, width),
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
            nn.Linear(width, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)}


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5]
    return DataLoader(TensorDataset(x, y), batch_size=32)


def train(devices: int, schedule: str, microbatches: int, epochs: int) -> Regressor:
    model = Regressor().double()
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=microbatches) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False, enable_checkpointing=False)
    trainer.fit(model, data(2048, 0), data(256, 1))
    if trainer.is_global_zero:
        print(f"devices={devices} schedule={schedule}: val_loss={float(trainer.callback_metrics['val_loss']):.5f}")
    return model if trainer.is_global_zero else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also train in one process and compare weights")
    args = parser.parse_args()
    pipelined = train(args.devices, args.schedule, args.microbatches, args.epochs)
    if args.check and pipelined is not None:
        # Lightning's launcher re-runs this script in the other ranks; only rank 0 gets here with the
        # trained full model handed back, and compares it with a one-process run.
        reference = Regressor().double()
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(reference, data(2048, 0), data(256, 1))
        ref, got = reference.state_dict(), pipelined.state_dict()
        worst = max(((ref[k] - got[k]).abs().max() / ref[k].abs().max().clamp(min=1e-30)).item() for k in ref)
        print(f"max relative weight difference to single-process training: {worst:.2e}")
