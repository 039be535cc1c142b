"""GPT and BERT built as pipelines of sub-layer blocks, and LightningModules that train them."""

from .blocks import (
    MLP,
    Embedding,
    LMHead,
    MLMHead,
    ResidualAttentionBlock,
    ResidualFFNBlock,
    SelfAttention,
)
from .build import build_bert, build_gpt, count_parameters, init_weights
from .config import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    MASK_ID,
    MODEL_CONFIGS,
    PAD_ID,
    ModelConfig,
    get_model_config,
    resolve_config,
)
from .lit import CausalLM, MaskedLM, warmup_cosine

__all__ = [
    "BOS_ID",
    "BYTE_VOCAB_SIZE",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "ModelConfig",
    "MODEL_CONFIGS",
    "get_model_config",
    "resolve_config",
    "Embedding",
    "SelfAttention",
    "MLP",
    "ResidualAttentionBlock",
    "ResidualFFNBlock",
    "LMHead",
    "MLMHead",
    "build_gpt",
    "build_bert",
    "count_parameters",
    "init_weights",
    "CausalLM",
    "MaskedLM",
    "warmup_cosine",
]
