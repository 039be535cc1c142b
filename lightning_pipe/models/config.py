"""Model sizes: a dataclass config and the named registry (AutoPipe Table I plus tiny CPU models)."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Byte-level vocabulary of the tiny models: 256 byte values, then 4 special tokens.
PAD_ID, MASK_ID, BOS_ID, EOS_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 260


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    n_layer: int  # transformer layers; each is two pipeline blocks (attention, FFN)
    n_head: int
    d_model: int  # hidden size; the FFN is 4 * d_model wide
    max_seq_len: int  # learned position embeddings cover this many positions
    dropout: float = 0.0  # 0 keeps runs deterministic and comparable across pipelines
    recompute: bool = False  # recompute each attention/FFN block in backward instead of storing its activations

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # AutoPipe Table I (GPT-2 sizes from Megatron-LM; BERT-large from Devlin et al.)
    "gpt2-345m": ModelConfig(vocab_size=50257, n_layer=24, n_head=16, d_model=1024, max_seq_len=1024),
    "gpt2-762m": ModelConfig(vocab_size=50257, n_layer=36, n_head=20, d_model=1280, max_seq_len=1024),
    "gpt2-1.3b": ModelConfig(vocab_size=50257, n_layer=24, n_head=16, d_model=2048, max_seq_len=1024),
    "bert-large": ModelConfig(vocab_size=30522, n_layer=24, n_head=16, d_model=1024, max_seq_len=512),
    # tiny byte-level models that train on 2 CPU cores
    "gpt-tiny": ModelConfig(vocab_size=BYTE_VOCAB_SIZE, n_layer=4, n_head=4, d_model=128, max_seq_len=256),
    "bert-tiny": ModelConfig(vocab_size=BYTE_VOCAB_SIZE, n_layer=4, n_head=4, d_model=128, max_seq_len=128),
}


def get_model_config(name: str, **overrides) -> ModelConfig:
    """The registered config `name`, with fields replaced by `overrides` (e.g. recompute=True)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model name {name!r}; allowed names: {', '.join(MODEL_CONFIGS)}")
    return replace(MODEL_CONFIGS[name], **overrides)


def resolve_config(model: "str | dict | ModelConfig") -> ModelConfig:
    """A name, a dict of fields (as stored in a checkpoint's hparams) or a config -> a config."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        return get_model_config(model)
    if isinstance(model, dict):
        return ModelConfig(**model)
    raise TypeError(f"model must be a name, a dict or a ModelConfig, got {type(model).__name__}")
