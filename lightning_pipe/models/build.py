"""Assemble GPT and BERT as an nn.Sequential of sub-layer blocks, initialised as GPT-2 does.

Initialisation is block by block from a seed (models/init.py), so a pipeline rank that creates only
its own blocks from a meta-device model gets the values a one-process run has. Building consumes
exactly one number of the global generator (the seed, unless one is given), on CPU and on meta alike.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .blocks import Embedding, LMHead, MLMHead, ResidualAttentionBlock, ResidualFFNBlock
from .config import ModelConfig
from .init import block_generator, draw_seed, is_meta


def _layers(cfg: ModelConfig, causal: bool) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for _ in range(cfg.n_layer):
        blocks.append(ResidualAttentionBlock(cfg.d_model, cfg.n_head, cfg.dropout, causal, cfg.recompute))
        blocks.append(ResidualFFNBlock(cfg.d_model, cfg.dropout, cfg.recompute))
    return blocks


def _assemble(cfg: ModelConfig, causal: bool, seed: Optional[int]) -> nn.Sequential:
    seed = draw_seed() if seed is None else seed
    with torch.random.fork_rng(devices=[]):  # torch's own layer init draws nothing from the caller's generator
        embed = Embedding(cfg.vocab_size, cfg.d_model, cfg.max_seq_len, cfg.dropout, norm=not causal)
        head = (LMHead if causal else MLMHead)(cfg.d_model, embed.token.weight)
        model = nn.Sequential(embed, *_layers(cfg, causal=causal), head)
    model.init_seed = seed  # type: ignore[assignment]  # plain attribute: not a parameter, not in the state dict
    if not is_meta(model):
        for index, block in enumerate(model):
            init_block(block, index, seed, cfg.n_layer)
    return model


def build_gpt(cfg: ModelConfig, seed: Optional[int] = None) -> nn.Sequential:
    """Decoder-only causal LM: ids (B, T) -> logits (B, T, vocab); 2 * n_layer + 2 blocks."""
    return _assemble(cfg, causal=True, seed=seed)


def build_bert(cfg: ModelConfig, seed: Optional[int] = None) -> nn.Sequential:
    """Encoder masked LM: (ids, attention_mask) -> logits (B, T, vocab); 2 * n_layer + 2 blocks.

    No token-type embeddings and no pooler: masked-LM pre-training alone needs neither."""
    return _assemble(cfg, causal=False, seed=seed)


def init_block(block: nn.Module, index: int, seed: int, n_layer: int) -> None:
    """Block `index`'s initial values from the model's seed alone (see models/init.py): drawn by a
    CPU generator of their own and copied in, so they are the same on any device and leave every
    global generator (the CPU's and the GPU's) as it was."""
    with torch.no_grad():
        init_weights(block, n_layer, generator=block_generator(seed, index))


def init_weights(model: nn.Module, n_layer: int, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    """N(0, 0.02) weights, zero biases, LayerNorm gains one; the projections that write into the
    residual stream get std / sqrt(2 * n_layer) so the stream's variance does not grow with depth
    (GPT-2). A head's tied weight is the embedding's: initialised with the embedding's block.
    `generator`: a CPU generator the values are drawn from (None: a fresh one from the global CPU's)."""
    g = generator if generator is not None else torch.Generator().manual_seed(draw_seed())

    def normal(t: torch.Tensor, sd: float) -> None:
        t.copy_(torch.empty(t.shape, dtype=t.dtype, device="cpu").normal_(0.0, sd, generator=g))  # not the context's device

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out = name.endswith(".proj")  # SelfAttention.proj and MLP.proj
            normal(module.weight, std / math.sqrt(2 * n_layer) if out else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            normal(module.weight, std)  # also the tied head's weight
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()  # a meta-built block has no values yet
        if isinstance(module, MLMHead):
            nn.init.zeros_(module.bias)


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements, each shared parameter (the tied embedding) counted once."""
    unique = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values())
