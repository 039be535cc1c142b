"""LightningModules for Hugging Face models, trained as they are (`pip install "lightning-pipe[hf]"`).

The model is an unmodified `transformers` model (`AutoModelForCausalLM.from_config`, or
`AutoModelForMaskedLM` for BERT-like ones) held as `self.model`; each step calls it once, as a user
would. It has no `nn.Sequential` of blocks: the strategy's front end cuts it at its repeated blocks
(`lightning_pipe.frontend`), a pipeline of [First, block 0 .. n-1, Last]. Its config is either a
built-in tiny one named by model type (`gpt2`, `llama`, `bert`: sizes that train in minutes on 2
CPU processes, the byte vocabulary) or a local `config.json` / a folder holding one; `model`
replaces any of its fields (e.g. `vocab_size` for a trained tokenizer). Nothing is downloaded.

The batches are the data modules' (`lightning_pipe.data`): causal LM `(input_ids, targets)`,
masked LM `(input_ids, attention_mask, labels)`, and the loss is computed from the logits as
`CausalLM` / `MaskedLM` compute it (every target token counts; masked LM: the predicted positions),
so `train_loss`, `val_loss` and `val_ppl` mean the same as for the in-house models.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from .config import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID
from .lit import adamw_warmup_cosine

HF_EXTRA = 'pip install "lightning-pipe[hf]"'

# Tiny configs by model type: about the size of gpt-tiny / bert-tiny (4 layers, hidden 128), the byte
# vocabulary and its special ids; a trained tokenizer's size is set with model={"vocab_size": N}.
BUILTIN: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256),
    "llama": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=128,
        intermediate_size=344,
        max_position_embeddings=256,
    ),
    "bert": dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128, intermediate_size=512, max_position_embeddings=128),
}
_BYTES = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModuleNotFoundError(f"the Hugging Face models need the transformers package, which is not installed: {HF_EXTRA}") from None
    return transformers


def is_dropout_field(name: str) -> bool:
    """A config field that is a dropout probability (resid_pdrop, attention_dropout, hidden_dropout_prob, ...)."""
    return name.endswith(("pdrop", "dropout", "dropout_prob"))


def hf_config(config: str, overrides: Optional[dict] = None, dropout: Optional[float] = None) -> Any:
    """The transformers config: built-in `config` (a model type) or read from a local file / folder,
    `overrides` set on it, and every dropout probability set to `dropout` unless it is None."""
    transformers = _transformers()
    if config in BUILTIN:
        made = transformers.AutoConfig.for_model(config, **{**_BYTES, **BUILTIN[config]})
    else:
        path = os.path.expanduser(str(config))
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"model.config={config!r}: no such file or directory; give a config.json or a folder holding one, "
                f"or a built-in config: {', '.join(BUILTIN)}"
            )
        try:  # local files only: a path never becomes a download
            made = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            raise ValueError(f"model.config={config!r}: not a readable Hugging Face config ({first.strip()})") from None
    for key, value in (overrides or {}).items():
        if not hasattr(made, key):
            raise ValueError(f"model.model.{key}: {type(made).__name__} has no field {key!r}")
        setattr(made, key, value)
    if dropout is not None:
        # Under pipelining each stage draws its dropout masks from its own random stream, so a run with
        # dropout is a valid training run but not the bit-for-bit copy of one process's (dropout 0 is).
        for key in made.to_dict():
            if is_dropout_field(key) and isinstance(getattr(made, key), (int, float)):
                setattr(made, key, float(dropout))
    return made


class _HFLanguageModel(L.LightningModule):
    auto_class = ""  # the transformers Auto class that builds the model from its config
    default_config = ""

    def __init__(
        self,
        config: Optional[str] = None,
        model: Optional[dict] = None,
        dropout: Optional[float] = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
    ):
        """`config`: a built-in tiny config (gpt2, llama, bert) or a config.json / folder; `model`: its
        fields replaced; `dropout`: every dropout probability (None: the config's own, e.g. GPT-2's 0.1).

        Under a meta-device context (the CLI's `empty_init`, `trainer.init_module(empty_init=True)`) the
        model is built empty and each rank creates only its blocks: with the model's own initialisation per
        block, or from the folder's safetensors files when `config` is a folder holding them
        (lightning_pipe/frontend/weights.py)."""
        super().__init__()
        model = dict(model or {})
        self.save_hyperparameters()
        self.config = hf_config(config or self.default_config, model, dropout)
        self.model = getattr(_transformers(), self.auto_class).from_config(self.config)
        with torch.device("cpu"):  # real metric states even when the model is built on the meta device
            self.val_ppl = Perplexity(ignore_index=-100)

    def _logits_and_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        _, loss, _ = self._logits_and_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits, loss, targets = self._logits_and_loss(batch)
        self.val_ppl(logits.float(), targets)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._logits_and_loss(batch)[1])

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)  # as CausalLM / MaskedLM


class HFCausalLM(_HFLanguageModel):
    """A Hugging Face causal LM on `(input_ids, targets)` batches (targets = input_ids shifted by one):
    mean cross-entropy over all B * T targets, from the model's logits."""

    auto_class = "AutoModelForCausalLM"
    default_config = "gpt2"

    def _logits_and_loss(self, batch):
        ids, targets = batch
        logits = self.model(input_ids=ids).logits
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), targets


class HFMaskedLM(_HFLanguageModel):
    """A Hugging Face masked LM (BERT-like) on `(input_ids, attention_mask, labels)` batches: mean
    cross-entropy over the predicted positions (labels -100 elsewhere)."""

    auto_class = "AutoModelForMaskedLM"
    default_config = "bert"

    def _logits_and_loss(self, batch):
        ids, mask, labels = batch
        logits = self.model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).logits
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100), labels
