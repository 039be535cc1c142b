"""Assemble GPT and BERT as an nn.Sequential of sub-layer blocks, initialised as GPT-2 does."""

from __future__ import annotations

import math

from torch import nn

from .blocks import Embedding, LMHead, MLMHead, ResidualAttentionBlock, ResidualFFNBlock
from .config import ModelConfig


def _layers(cfg: ModelConfig, causal: bool) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for _ in range(cfg.n_layer):
        blocks.append(ResidualAttentionBlock(cfg.d_model, cfg.n_head, cfg.dropout, causal, cfg.recompute))
        blocks.append(ResidualFFNBlock(cfg.d_model, cfg.dropout, cfg.recompute))
    return blocks


def build_gpt(cfg: ModelConfig) -> nn.Sequential:
    """Decoder-only causal LM: ids (B, T) -> logits (B, T, vocab); 2 * n_layer + 2 blocks."""
    embed = Embedding(cfg.vocab_size, cfg.d_model, cfg.max_seq_len, cfg.dropout)
    model = nn.Sequential(embed, *_layers(cfg, causal=True), LMHead(cfg.d_model, embed.token.weight))
    init_weights(model, cfg.n_layer)
    return model


def build_bert(cfg: ModelConfig) -> nn.Sequential:
    """Encoder masked LM: (ids, attention_mask) -> logits (B, T, vocab); 2 * n_layer + 2 blocks.

    No token-type embeddings and no pooler: masked-LM pre-training alone needs neither."""
    embed = Embedding(cfg.vocab_size, cfg.d_model, cfg.max_seq_len, cfg.dropout, norm=True)
    model = nn.Sequential(embed, *_layers(cfg, causal=False), MLMHead(cfg.d_model, embed.token.weight))
    init_weights(model, cfg.n_layer)
    return model


def init_weights(model: nn.Module, n_layer: int, std: float = 0.02) -> None:
    """N(0, 0.02) weights, zero biases; the projections that write into the residual stream get
    std / sqrt(2 * n_layer) so the stream's variance does not grow with depth (GPT-2)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out = name.endswith(".proj")  # SelfAttention.proj and MLP.proj
            nn.init.normal_(module.weight, 0.0, std / math.sqrt(2 * n_layer) if out else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)  # also the tied head's weight


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements, each shared parameter (the tied embedding) counted once."""
    unique = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values())
