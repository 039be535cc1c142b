"""Transformer blocks at AutoPipe's sub-layer granularity (Fig. 3).

A transformer layer is two pipeline blocks, ResidualAttentionBlock and ResidualFFNBlock, so a
partition can cut between them; the activation crossing either cut is the same (B, T, d) hidden
state, so the finer granularity adds no communication.

Activations between blocks are a float tensor (B, T, d) for GPT, or a tuple
(hidden (B, T, d), attention_mask (B, T) int64) for BERT: every block passes the mask on unchanged
(it travels between stages without a gradient) and the head returns logits only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.recompute import recomputed
from ..runtime.tensor_parallel import vocab_logits, vocab_lookup


def split(x):
    """(hidden, mask) from a block's input: a tensor (no mask) or a (hidden, mask) tuple."""
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return x, None


def join(h: torch.Tensor, mask: Optional[torch.Tensor]):
    return h if mask is None else (h, mask)


class Embedding(nn.Module):
    """Token + learned position embedding (then LayerNorm for BERT), then dropout.

    Takes token ids (B, T), or a tuple (ids, attention_mask) whose mask is passed on."""

    def __init__(self, vocab_size: int, d_model: int, max_seq_len: int, dropout: float = 0.0, norm: bool = False):
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_seq_len, d_model)
        self.norm = nn.LayerNorm(d_model) if norm else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        ids, mask = split(x)
        T = ids.shape[1]
        if T > self.position.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.position.num_embeddings}")
        # self.token(ids), or its rows split over the vocabulary (tensor parallel)
        h = vocab_lookup(ids, self.token.weight) + self.position(torch.arange(T, device=ids.device))
        if self.norm is not None:
            h = self.norm(h)
        return join(self.drop(h), mask)


class SelfAttention(nn.Module):
    """Multi-head self-attention; causal, and/or keys masked out where attention_mask == 0."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, causal: bool = False):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head, self.causal, self.dropout = n_head, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # chunk(3) and -1 heads: under tensor parallelism this rank's qkv holds its heads' q, k and v (models/tensor_plan.py);
        # B and T from its output: under sequence parallelism `h` is this rank's part of the sequence, qkv gathers it
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, h.shape[-1] // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        bias = None
        if mask is not None:
            # additive bias rather than a boolean mask: an all-padding row then attends uniformly
            # instead of producing NaN (0 * NaN would still poison the loss's gradient)
            bias = torch.zeros(B, 1, 1, T, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(mask.view(B, 1, 1, T) == 0, torch.finfo(q.dtype).min)
            if self.causal:
                future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
                bias = bias.masked_fill(future, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            is_causal=self.causal and bias is None,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(h)))


class ResidualAttentionBlock(nn.Module):
    """x + Dropout(Attn(LN(x))), pre-norm."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, causal: bool = False, recompute: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout, causal)
        self.drop = nn.Dropout(dropout)
        self.recompute = recompute

    def inner(self, h: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return self.drop(self.attn(self.ln(h), mask))

    def forward(self, x):
        h, mask = split(x)
        if self.recompute and torch.is_grad_enabled():
            # store only the block's input; backward reruns inner() (dropout RNG state is replayed)
            out = recomputed(self, self.inner, h, mask)
        else:
            out = self.inner(h, mask)
        return join(h + out, mask)


class ResidualFFNBlock(nn.Module):
    """x + Dropout(MLP(LN(x))), pre-norm; MLP = Linear(d, 4d), GELU, Linear(4d, d)."""

    def __init__(self, d_model: int, dropout: float = 0.0, recompute: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)
        self.recompute = recompute

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.mlp(self.ln(h)))

    def forward(self, x):
        h, mask = split(x)
        if self.recompute and torch.is_grad_enabled():
            out = recomputed(self, self.inner, h)
        else:
            out = self.inner(h)
        return join(h + out, mask)


class LMHead(nn.Module):
    """Final LayerNorm, then logits against the token embedding matrix (GPT-2's tied head).

    `weight` is the embedding's very nn.Parameter: in one process it is one parameter; cut into
    stages, the pipeline strategy sums its gradients over the first and last stage."""

    def __init__(self, d_model: int, weight: nn.Parameter):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.weight = weight

    def forward(self, x) -> torch.Tensor:
        h, _ = split(x)
        return vocab_logits(self.ln(h), self.weight)  # F.linear, or split over the vocabulary (tensor parallel)


class MLMHead(nn.Module):
    """BERT's masked-LM head: final LayerNorm (pre-norm stack), dense + GELU + LayerNorm transform,
    then a decoder whose weight is the tied token embedding, plus a per-token bias."""

    def __init__(self, d_model: int, weight: nn.Parameter):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.dense = nn.Linear(d_model, d_model)
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(d_model)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[0]))

    def forward(self, x) -> torch.Tensor:
        h, _ = split(x)
        h = self.ln(self.act(self.dense(self.ln_f(h))))
        return vocab_logits(h, self.weight, self.bias)
