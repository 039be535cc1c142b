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


def loader(batch_size: int = 8, n: int = 24) -> DataLoader:
    return DataLoader(Tokens(n), batch_size=batch_size)


class UserLM(L.LightningModule):
    """What a user writes: the model as an attribute, the step calls it with keywords and returns its loss."""

    def __init__(self, kind: str, layers: int = 4, dtype=torch.float64, lr: float = 1e-2):
        super().__init__()
        self.kind, self.lr = kind, lr
        self.model = MODELS[kind](layers, dtype)

    def loss(self, batch):
        ids = batch["ids"]
        if self.kind == "bert":
            out = self.model(input_ids=ids, attention_mask=batch["mask"], token_type_ids=torch.zeros_like(ids), labels=batch["labels"])
            return out.loss
        if self.kind == "looped":
            return self.model(ids, targets=ids)[1]
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        ids = batch["ids"]
        if self.kind == "looped":
            return self.model(ids)[0].argmax(-1)
        if self.kind == "bert":
            return self.model(input_ids=ids, attention_mask=batch["mask"], token_type_ids=torch.zeros_like(ids)).logits.argmax(-1)
        return self.model(input_ids=ids).logits.argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


# ---- one-process references ----------------------------------------------------------------------
def trainer_kwargs(**overrides):
    kw = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=False,
    )  # fmt: skip
    kw.update(overrides)
    return kw


def pair(kind: str, layers: int = 6, **kw):
    """(reference, model): two UserLMs with the same initial weights."""
    torch.manual_seed(0)
    ref = UserLM(kind, layers, **kw)
    model = UserLM(kind, layers, **kw)
    model.load_state_dict(ref.state_dict())
    return ref, model


def train_single(model, steps: int, data=None) -> None:
    L.Trainer(devices=1, **trainer_kwargs(max_steps=steps)).fit(model, data or loader())


def close(a: dict, b: dict) -> float:
    """The largest difference between two state dicts, relative to max(|a|, 1) per tensor. Not relative
    to |a| alone: a parameter whose gradient is mathematically zero (BERT's attention key biases: softmax
    ignores a constant added over the keys) gets rounding noise that AdamW normalises into updates of
    ~1e-11 around its zero start, the same size in both runs but not the same noise."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((b[k].double() - a[k].double()).abs().max() / a[k].double().abs().max().clamp(min=1.0)).item() for k in a)


def batches(steps: int, batch_size: int = 8) -> list:
    out: list = []
    while len(out) < steps:
        out += list(loader(batch_size))
    return out[:steps]


def reference_2bw(ref: "UserLM", steps: int, data=None) -> None:
    """PipeDream-2BW's rule in one process: W(t+1) = W(t) - step(grad f(W(t-1); batch t)) (`data`: a loader of
    the global batches, else `batches`)."""
    import copy

    opt = ref.configure_optimizers()
    previous = copy.deepcopy(ref)
    for t, batch in enumerate(list(data)[:steps] if data is not None else batches(steps)):
        at = previous if t >= 1 else copy.deepcopy(ref)  # W(max(t - 1, 0))
        at.zero_grad()
        at.training_step(batch, t).backward()
        previous = copy.deepcopy(ref)
        for p, q in zip(ref.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        opt.step()


def reference_avgpipe(ref: "UserLM", steps: int, pipelines: int, alpha: float) -> dict:
    """AvgPipe's elastic averaging in one process (staleness 0): each pipeline n takes its own AdamW
    step Δ_n on its shard, W_n <- (1 - α) W_n + α W_ref + Δ_n, W_ref <- W_ref + mean_n Δ_n. Returns W_ref."""
    import copy
    import os

    from torch.utils.data import DistributedSampler

    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    models = [copy.deepcopy(ref) for _ in range(pipelines)]
    opts = [m.configure_optimizers() for m in models]
    data = []
    for n in range(pipelines):
        sampler = DistributedSampler(Tokens(), num_replicas=pipelines, rank=n, shuffle=True, seed=seed)
        rows, epoch = [], 0
        while len(rows) < steps:
            sampler.set_epoch(epoch)
            rows += list(DataLoader(Tokens(), batch_size=8, sampler=sampler))
            epoch += 1
        data.append(rows[:steps])
    w_ref = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for t in range(steps):
        deltas = []
        for n, (model, opt) in enumerate(zip(models, opts)):
            model.zero_grad()
            model.training_step(data[n][t], t).backward()
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            opt.step()
            delta = {k: v.detach() - before[k] for k, v in model.named_parameters()}
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_((1 - alpha) * before[k] + alpha * w_ref[k] + delta[k])
            deltas.append(delta)
        w_ref = {k: w_ref[k] + sum(d[k] for d in deltas) / pipelines for k in w_ref}
    return w_ref


def two_replica_data(steps: int) -> "DataLoader":
    """One process's batches for a run of 2 replicas reading 8 rows each: Lightning's DistributedSampler (shuffle,
    the run's seed) deals replica r the rows perm[r::2] of each epoch; a step is the union of both replicas' k-th
    batches."""
    import os

    seed, rows = int(os.environ.get("PL_GLOBAL_SEED", 0)), len(Tokens())
    out, epoch = [], 0
    while len(out) < steps:
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        shards = [perm[r::2] for r in range(2)]
        out += [shards[0][k : k + 8] + shards[1][k : k + 8] for k in range(0, rows // 2, 8)]
        epoch += 1
    return DataLoader(Tokens(), batch_sampler=out[:steps])
