"""Models a user brings as they are, from small configs (nothing downloaded): Hugging Face GPT-2,
Llama and BERT, and a plain PyTorch model that loops over an nn.ModuleList in its forward; each
in an ordinary LightningModule, with the data and the one-process reference the tests compare to."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ = 61, 8


def gpt2(layers: int = 4, dtype=torch.float64):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config).to(dtype)


def llama(layers: int = 4, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def bert(layers: int = 4, dtype=torch.float64):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    return BertForMaskedLM(config).to(dtype)


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, h):
        return h + F.gelu(self.mix(self.norm(h)))


class LoopedLM(nn.Module):
    """A home-grown GPT-like model: blocks in a ModuleList, a loop in forward, a head tied to the embedding."""

    def __init__(self, layers: int = 4, width: int = 16):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)  # held by the model itself, not a module
        self.blocks = nn.ModuleList(Residual(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids, targets=None):
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def looped(layers: int = 4, dtype=torch.float64):
    return LoopedLM(layers).to(dtype)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "looped": looped}


class Tokens(Dataset):
    """Fixed token rows; for BERT an attention mask with padding and exactly two masked positions per row
    (a token-mean loss is then the same whether averaged per micro-batch or over the batch)."""

    def __init__(self, n: int = 24, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        self.mask[:, -1] = 0  # padding in every row: the model passes a mask to every micro-batch's blocks
        self.mask[::3, -2] = 0
        self.labels = torch.full((n, SEQ), -100)
        for i in range(n):
            at = torch.randperm(SEQ - 2, generator=g)[:2]
            self.labels[i, at] = self.ids[i, at]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"ids": self.ids[i], "mask": self.mask[i], "labels": self.labels[i]}


def loader(batch_size: int = 8) -> DataLoader:
    return DataLoader(Tokens(), batch_size=batch_size)


class UserLM(L.LightningModule):
    """What a user writes: the model as an attribute, the step calls it with keywords and returns its loss."""

    def __init__(self, kind: str, layers: int = 4, dtype=torch.float64, lr: float = 1e-2):
        super().__init__()
        self.kind, self.lr = kind, lr
        self.model = MODELS[kind](layers, dtype)

    def training_step(self, batch, batch_idx):
        ids = batch["ids"]
        if self.kind == "bert":
            out = self.model(input_ids=ids, attention_mask=batch["mask"], token_type_ids=torch.zeros_like(ids), labels=batch["labels"])
            loss = out.loss
        elif self.kind == "looped":
            loss = self.model(ids, targets=ids)[1]
        else:
            loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
