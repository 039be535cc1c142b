"""LightningModules for causal-LM (GPT) and masked-LM (BERT) training.

The whole model is `self.model`, the module's only nn.Sequential child and the only place with
parameters, so `Trainer(strategy="autopipe")` can cut it into stages. Each step calls it once.
Validation metrics are torchmetrics objects, logged as such: their states add up over the batches
(and over pipelines and replicas), so the epoch's perplexity is exp of the mean over all tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict
from typing import Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from .build import build_bert, build_gpt, init_block
from .config import ModelConfig, resolve_config


def warmup_cosine(step: int, warmup_steps: int, max_steps: Optional[int], min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to `min_lr_ratio`
    at `max_steps` (held there afterwards); constant after warmup when max_steps is None."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps is None or max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _LanguageModel(L.LightningModule):
    default_model = ""

    def __init__(
        self,
        model: Union[str, dict, ModelConfig, None] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
    ):
        super().__init__()
        if model is None:
            model = self.default_model
        cfg = resolve_config(model)
        if isinstance(model, ModelConfig):
            model = asdict(model)  # plain dict in hparams: checkpoints reload without pickled classes
        self.save_hyperparameters()  # reads the arguments from this frame's locals, so `model` as rewritten above
        self.config = cfg
        self.model = self.build(cfg)
        self.init_seed: int = self.model.init_seed
        with torch.device("cpu"):  # real (small) states even when the model is built empty on the meta device
            self.make_metrics()

    def make_metrics(self) -> None:
        """Validation metrics (a hook, not an __init__ override: save_hyperparameters reads every __init__ frame)."""
        self.val_ppl = Perplexity(ignore_index=-100)

    def init_pipeline_block(self, index: int, block: torch.nn.Module) -> None:
        """Initial values of block `index` (called by the strategy for the blocks a rank creates
        from a meta-device model): exactly those the block gets here in one process."""
        init_block(block, index, self.init_seed, self.config.n_layer)

    @staticmethod
    def build(cfg: ModelConfig):
        raise NotImplementedError

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)


class CausalLM(_LanguageModel):
    """GPT trained on next-token prediction.

    Batch: (input_ids (B, T) int64, targets (B, T) int64), targets = input_ids shifted by one.
    Loss: mean cross-entropy over all B * T tokens. Under micro-batching the strategy averages
    micro-batch losses weighted by their sample counts, which equals this token mean because every
    sample has T tokens (do not put ignore_index=-100 padding in targets, or the two differ)."""

    default_model = "gpt-tiny"
    build = staticmethod(build_gpt)

    def _loss(self, batch) -> torch.Tensor:
        ids, targets = batch
        logits = self.model(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        logits = self.model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.val_ppl(logits.float(), targets)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        ids = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.model(ids)


class MaskedLM(_LanguageModel):
    """BERT trained on masked-token prediction.

    Batch: (input_ids (B, T) int64, attention_mask (B, T) int64 with 1 = token, 0 = padding,
    labels (B, T) int64 = original id at predicted positions, -100 elsewhere).
    Loss: mean cross-entropy over predicted positions. ASSUMPTION for exactness under
    micro-batching: the data puts the same number of predicted positions in every sample, so this
    token mean equals the mean of per-sample means, which is what the strategy's sample-weighted
    average of micro-batch losses computes."""

    default_model = "bert-tiny"
    build = staticmethod(build_bert)

    def make_metrics(self) -> None:
        super().make_metrics()
        # masked-token accuracy over the predicted positions (every one counts once, whatever its batch)
        self.val_acc = MulticlassAccuracy(num_classes=self.config.vocab_size, average="micro", ignore_index=-100)

    def _forward(self, batch):
        ids, mask, labels = batch
        logits = self.model((ids, mask))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss, logits, labels

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._forward(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, labels = self._forward(batch)
        self.val_acc(logits.argmax(-1).flatten(), labels.flatten())
        self.val_ppl(logits.float(), labels)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", self.val_acc)
        self.log("val_ppl", self.val_ppl)

    def test_step(self, batch, batch_idx):
        loss, _, _ = self._forward(batch)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx):
        ids, mask = batch[0], batch[1]
        return self.model((ids, mask))


def adamw_warmup_cosine(module: L.LightningModule) -> dict:
    """AdamW over `module`'s parameters from its hparams (lr, betas, weight_decay), warmup then cosine decay.

    Matrices (linear and embedding weights) decay, biases and norm gains do not (nanoGPT);
    module.parameters() lists a tied weight once, and under the pipeline only this rank's blocks."""
    hp = module.hparams
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # an empty group is kept (a stage holding only the embedding): every stage's optimizer has the same groups,
    # so a checkpoint resumes at any depth
    opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
    factor = functools.partial(warmup_cosine, warmup_steps=hp.warmup_steps, max_steps=hp.max_steps, min_lr_ratio=hp.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
