"""Models the front end cannot cut are refused before any process starts, in one message naming the
module or call at fault and the fix (blocks=..., configure_pipeline())."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hf_models import VOCAB, Residual, loader, trainer_kwargs
from torch import nn

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.lightning.stage import PipelineSetupError

pytestmark = pytest.mark.timeout(60)


class Skips(nn.Module):
    """Data-dependent control flow across blocks: which blocks run depends on the tokens."""

    def __init__(self):
        super().__init__()
        self.tok, self.blocks, self.head = nn.Embedding(VOCAB, 8), nn.ModuleList(Residual(8) for _ in range(4)), nn.Linear(8, VOCAB)

    def forward(self, ids):
        h = self.tok(ids)
        for i, block in enumerate(self.blocks):
            if i % 2 == 0 or bool(h.sum() > 1e9):
                h = block(h)
        return self.head(h)


class PeeksIntoABlock(Skips):
    """A block's weight used after the loop, outside its block."""

    def forward(self, ids):
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h + self.blocks[0].mix.bias)


class SharedScale(nn.Module):
    def __init__(self, scale: nn.Parameter):
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), [scale]  # a reference, not a registered parameter

    def forward(self, h):
        return h + self.lin(h) * self.scale[0]


class ScaleOutside(nn.Module):
    """A parameter held by the model but used inside every block."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.tok, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.blocks = nn.ModuleList(SharedScale(self.scale) for _ in range(4))

    def forward(self, ids):
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Between(Skips):
    """The residual added by the loop, between blocks."""

    def forward(self, ids):
        h = self.tok(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, ids):
        return self.head(self.tok(ids))


class Lit(L.LightningModule):
    def __init__(self, model, twice: bool = False):
        super().__init__()
        self.model, self.twice = model, twice

    def training_step(self, batch, batch_idx):
        ids = batch["ids"]
        logits = self.model(ids)
        if self.twice:
            logits = logits + self.model(ids.flip(1))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model, **settings):
    strategy = AutoPipeStrategy(start_method="fork", partition="uniform", **settings)
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=1)).fit(model, loader())


@pytest.mark.parametrize(
    "model,settings,match",
    [
        (Lit(Skips()), {}, r"called its 4 blocks \(blocks\) in the order \[0, 2\].*no data-dependent control flow.*blocks="),
        (Lit(PeeksIntoABlock()), {}, r"blocks\.0\.mix\.bias belongs to block 0 of blocks but is used after the blocks"),
        (Lit(ScaleOutside()), {}, r"scale is held outside the blocks of blocks but used inside block 0"),
        (Lit(Between()), {}, r"computes .* of block 1 \(blocks\.1\) between blocks.*configure_pipeline\(\)"),
        (Lit(Skips(), twice=True), {}, r"Lit\.training_step calls self\.model\(\.\.\.\) 2 times"),
        (Lit(Flat()), {}, r"Lit has no pipeline: no nn\.Sequential child, no configure_pipeline\(\) and no nn\.ModuleList"),
        (Lit(Skips()), {"blocks": "model.nope"}, r"blocks='model\.nope': Lit has no submodule at that path"),
        (Lit(Skips()), {"blocks": "model.tok"}, r"blocks='model\.tok' is a Embedding, not an nn\.ModuleList"),
    ],
    ids=[
        "control-flow",
        "weight-outside-its-block",
        "shared-parameter",
        "code-between-blocks",
        "called-twice",
        "no-blocks",
        "bad-path",
        "not-a-list",
    ],
)
def test_refused_before_spawning(model, settings, match):
    with pytest.raises(PipelineSetupError, match=match):
        fit(model, **settings)
    assert not torch.distributed.is_initialized(), "refused in the launching process: nothing started"
