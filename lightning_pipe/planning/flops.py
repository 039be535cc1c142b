"""Analytic cost profiles of GPT / BERT at sub-layer granularity, for planning without a GPU.

Per micro-batch of b sequences of T tokens, hidden size d, vocabulary V (forward FLOPs, a
multiply-add counting 2):

    embedding   memory bound: a fixed kernel overhead plus reading two embedding rows and
                writing the sum, 3 b T d elements (BERT's LayerNorm adds a pass)
    attention   8 b T d^2 (QKV and output projections) + 4 b T^2 d (scores and weighted sum)
    ffn         16 b T d^2 (d -> 4d -> d)
    head        2 b T d V logits (BERT: plus its d x d transform)
    LayerNorm   about 5 b T d, where a block has one

Backward is twice the forward (three times for attention / FFN blocks with recompute, which run
their forward again). Time is FLOPs / `device_flops`; what crosses a stage boundary is the hidden
state, b T d values of `dtype_bytes` (BERT also passes its int64 attention mask along).
"""

from __future__ import annotations

from typing import Optional

from ..simulation import CostModel

DEVICE_FLOPS = 100e12  # a modern accelerator's sustained bf16 matmul rate
MEMORY_BANDWIDTH = 1.0e12  # bytes / s of device memory (what the embedding lookup is bound by)
KERNEL_OVERHEAD = 10e-6  # s: launch and small-kernel overhead that dominates a light block
LINK_BANDWIDTH = 12.5e9  # bytes / s: 100 Gb/s InfiniBand, the paper's cluster
LINK_LATENCY = 10e-6  # s
LN_FLOPS = 5  # per element: mean, variance, normalise, scale, shift

PROFILE_MODELS = ("gpt2-345m", "gpt2-762m", "gpt2-1.3b", "bert-large")


def transformer_costs(
    model,
    microbatch_size: int,
    seq_len: Optional[int] = None,
    *,
    family: Optional[str] = None,
    device_flops: float = DEVICE_FLOPS,
    memory_bandwidth: float = MEMORY_BANDWIDTH,
    kernel_overhead: float = KERNEL_OVERHEAD,
    bandwidth: float = LINK_BANDWIDTH,
    latency: float = LINK_LATENCY,
    dtype_bytes: int = 2,
) -> tuple[CostModel, tuple[str, ...]]:
    """(costs, kinds) of `model` (a MODEL_CONFIGS name, a dict or a ModelConfig) built as
    `build_gpt` / `build_bert` build it: embedding, [attention, ffn] x n_layer, head.

    `family` is 'gpt' or 'bert'; by default a name starting with 'bert' is BERT, anything else GPT.
    `seq_len` defaults to the model's max_seq_len."""
    # imported here: lightning_pipe.models pulls in its LightningModules, planning stays light
    from ..models.config import resolve_config

    cfg = resolve_config(model)
    if family is None:
        family = "bert" if isinstance(model, str) and model.lower().startswith("bert") else "gpt"
    if family not in ("gpt", "bert"):
        raise ValueError(f"family={family!r}: allowed values are 'gpt' and 'bert'")
    T = cfg.max_seq_len if seq_len is None else seq_len
    if microbatch_size < 1 or not 1 <= T <= cfg.max_seq_len:
        raise ValueError(f"microbatch_size={microbatch_size}, seq_len={T}: need microbatch_size >= 1 and 1 <= seq_len <= {cfg.max_seq_len}")
    if not (device_flops > 0 and memory_bandwidth > 0):
        raise ValueError("device_flops and memory_bandwidth must be > 0")
    bert = family == "bert"
    b, d, V = microbatch_size, cfg.d_model, cfg.vocab_size
    tokens = b * T
    ln = LN_FLOPS * tokens * d

    embed_passes = 3 + (2 if bert else 0)  # gather two rows, write the sum; LayerNorm reads and writes again
    embed_time = kernel_overhead + embed_passes * tokens * d * dtype_bytes / memory_bandwidth
    attention = 8 * tokens * d * d + 4 * b * T * T * d + ln
    ffn = 16 * tokens * d * d + ln
    head = 2 * tokens * d * V + ln + ((2 * tokens * d * d + 2 * ln) if bert else 0)

    recompute = 3.0 if cfg.recompute else 2.0
    layer_f = [attention / device_flops, ffn / device_flops] * cfg.n_layer
    forward = [embed_time, *layer_f, head / device_flops]
    backward = [2.0 * embed_time, *(recompute * t for t in layer_f), 2.0 * head / device_flops]

    hidden = tokens * d * dtype_bytes + (tokens * 8 if bert else 0)
    activation = [hidden] * (1 + 2 * cfg.n_layer) + [tokens * V * dtype_bytes]  # the head's output: logits

    embed_params = V * d + cfg.max_seq_len * d + (2 * d if bert else 0)
    attention_params = 4 * d * d + 4 * d + 2 * d  # qkv, proj, LayerNorm
    ffn_params = 8 * d * d + 5 * d + 2 * d  # fc, proj, LayerNorm
    # the last stage keeps its own copy of the tied embedding matrix, so the head counts it too
    head_params = V * d + 2 * d + ((d * d + d + 2 * d + V) if bert else 0)
    params = [embed_params, *([attention_params, ffn_params] * cfg.n_layer), head_params]

    costs = CostModel(
        tuple(forward),
        tuple(backward),
        activation_bytes=tuple(float(a) for a in activation),
        param_bytes=tuple(float(p * dtype_bytes) for p in params),
        bandwidth=bandwidth,
        latency=latency,
    )
    kinds = ("embedding", *(["attention", "ffn"] * cfg.n_layer), "head")
    return costs, kinds
