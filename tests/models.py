"""Small models, data and a single-process reference, shared by the tests."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def mlp_blocks(n: int = 6, width: int = 8, classes: int = 3) -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n - 1)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


class MaskedEmbed(nn.Module):
    """Token ids -> (hidden, mask): a tuple activation carrying an integer mask."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, ids):
        mask = (ids % 5 != 0).long()  # an integer tensor that travels without a gradient
        return self.emb(ids), mask


class MaskedMix(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, inputs):
        h, mask = inputs
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1).to(h.dtype) + h, mask


class MaskedPool(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.head = nn.Linear(width, classes)

    def forward(self, inputs):
        h, mask = inputs
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def masked_blocks(vocab: int = 17, width: int = 8, classes: int = 3, mixes: int = 3) -> nn.Sequential:
    return nn.Sequential(MaskedEmbed(vocab, width), *[MaskedMix(width) for _ in range(mixes)], MaskedPool(width, classes))


class TiedEmbed(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.emb(ids).mean(1)


class TiedHead(nn.Module):
    """Scores against the embedding matrix: the same nn.Parameter as the first block's."""

    def __init__(self, embed: TiedEmbed):
        super().__init__()
        self.weight = embed.emb.weight

    def forward(self, h):
        return h @ self.weight.t()


def tied_blocks(vocab: int = 11, width: int = 8, mixes: int = 3) -> nn.Sequential:
    embed = TiedEmbed(vocab, width)
    mix = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(mixes)]
    return nn.Sequential(embed, *mix, TiedHead(embed))


class LitSeq(L.LightningModule):
    """A user's module: one nn.Sequential, a loss, logging, AdamW with an LR scheduler."""

    def __init__(
        self,
        blocks: int = 6,
        width: int = 8,
        lr: float = 1e-2,
        dtype: str = "float64",
        masked: bool = False,
        seed: int = 0,
        tied: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        if tied:
            self.seq = tied_blocks(width=width)
        else:
            self.seq = masked_blocks(width=width) if masked else mlp_blocks(blocks, width)
        self.seq.to(getattr(torch, dtype))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.seq(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.seq(x), y)
        self.log("val_loss", loss)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self.seq(x), y))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.seq(x)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(
    n: int = 46, width: int = 8, dtype: torch.dtype = torch.float64, masked: bool = False, seed: int = 1, tied: bool = False
) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if tied:
        return TensorDataset(torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n,), generator=g))
    if masked:
        x = torch.randint(0, 17, (n, 5), generator=g)
    else:
        x = torch.randn(n, width, generator=g, dtype=dtype)
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


class EpochPerm(torch.utils.data.Sampler):
    """What Lightning's DistributedSampler (shuffle, seed 0) deals out, on one process: each epoch
    torch.randperm(n) seeded by the epoch; replica r of w gets perm[r::w], so a step of w replicas
    with k rows each covers perm[w k s : w k (s + 1)], the single-process global batch."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


# Trainer runs in tests fork their workers from the fork server (conftest.py): about 1 s per 2-process fit
# instead of 10-17 s for spawn's fresh interpreters on 2 cores, and no fork of pytest's own (threaded)
# process. spawn, fork and popen keep tests of their own (test_empty_init, test_launchers, the CLI tests).
START = "forkserver"


def loader(batch_size: int = 10, **kwargs) -> DataLoader:
    return DataLoader(dataset(**kwargs), batch_size=batch_size)


def trainer_kwargs(**overrides):
    kw = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=4,
        num_sanity_val_steps=0,
    )
    kw.update(overrides)
    return kw


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        ref = a[k].double()
        scale = ref.abs().max().clamp(min=1e-30)
        worst = max(worst, ((b[k].double() - ref).abs().max() / scale).item())
    return worst
