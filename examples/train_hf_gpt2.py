"""Train a Hugging Face model, as it is, with pipeline parallelism.

    python examples/train_hf_gpt2.py                          # 2 CPU processes, 1F1B, 4 micro-batches
    python examples/train_hf_gpt2.py --devices 4 --schedule interleaved --check
    python examples/train_hf_gpt2.py --model llama            # any causal LM from transformers

The LightningModule holds `GPT2LMHeadModel(config)` (built from a small config: nothing is
downloaded) and its step returns the model's own loss. The strategy finds the model's repeated
blocks (`transformer.h`), cuts its forward around them (embeddings before, final norm + head + loss
after) and trains it across the processes; after `fit` the module holds the same
`GPT2LMHeadModel` object with the trained weights, so `save_pretrained` works as usual.

With --check the script also trains the model in one process (float64, dropout 0) and prints the
largest weight difference to it, relative to max(|w|, 1).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy

VOCAB, SEQ = 256, 32


def build(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=6, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class LM(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about pipelines."""

    def __init__(self, kind: str = "gpt2", lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.model = build(kind).double()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB - SEQ, (n, 1), generator=g)
    ids = (start + torch.arange(SEQ)) % VOCAB  # counting sequences: a pattern the model can learn
    return DataLoader(TensorDataset(ids), batch_size=16)


def train(kind: str, devices: int, schedule: str, microbatches: int, steps: int, strategy: bool = True) -> LM:
    model = LM(kind)
    kw = dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_model_summary=False)
    if strategy:
        pipeline = AutoPipeStrategy(schedule=schedule, microbatches=microbatches, start_method="fork")
        L.Trainer(devices=devices, strategy=pipeline, **kw).fit(model, data())
    else:
        L.Trainer(devices=1, **kw).fit(model, data())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--check", action="store_true", help="also train in one process and compare the weights")
    args = parser.parse_args()
    model = train(args.model, args.devices, args.schedule, args.microbatches, args.steps)
    ids = next(iter(data()))[0]
    with torch.no_grad():
        loss = model.model(input_ids=ids, labels=ids).loss
    print(f"{type(model.model).__name__} after {args.steps} steps on {args.devices} processes: loss {loss.item():.4f}")
    if args.check:
        ref = train(args.model, args.devices, args.schedule, args.microbatches, args.steps, strategy=False)
        a, b = ref.state_dict(), model.state_dict()
        worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1.0)).item() for k in a)
        print(f"largest weight difference to one process: {worst:.2e}")


if __name__ == "__main__":
    main()
