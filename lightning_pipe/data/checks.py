"""Validation of data settings; messages name the config key (``data.*``) to change."""

from __future__ import annotations

from typing import Any, Optional


def check_seq_len(seq_len: int, max_seq_len: Optional[int] = None) -> None:
    """`seq_len` must be >= 1 and fit the model's context `max_seq_len` (if known)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len!r}: must be an integer >= 1")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds the model's context length (max_seq_len={max_seq_len}): "
            f"lower data.seq_len to at most {max_seq_len}, or build the model with a longer context"
        )


def check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"data.{name}={value!r}: must be an integer >= 1")


def check_fraction(name: str, value: float, low_open: bool) -> None:
    """`value` in (0, 1] if `low_open`, else in [0, 1)."""
    ok = 0.0 < value <= 1.0 if low_open else 0.0 <= value < 1.0
    if not ok:
        interval = "(0, 1]" if low_open else "[0, 1)"
        raise ValueError(f"data.{name}={value!r}: must be in {interval}")


def check_vocab(vocab_size: int, model_vocab_size: Optional[int], source: str) -> None:
    """The data's ids (`vocab_size` of them, from `source`: the setting that chose them) must all be
    rows of the model's embedding (`model_vocab_size`, if known). A larger model vocabulary is fine
    (the paper-size recipes keep theirs; the upper ids go unused)."""
    if model_vocab_size is None or vocab_size <= model_vocab_size:
        return
    raise ValueError(
        f"{source}: {vocab_size} token ids, more than the model's embedding holds (model.model.vocab_size={model_vocab_size}): "
        f"ids >= {model_vocab_size} would index past it; give the model {vocab_size} or more ids (+model.model.vocab_size={vocab_size} "
        f"on the command line, ModelConfig(vocab_size=...) in Python) or use a tokenizer with at most {model_vocab_size} ids"
    )


def model_vocab_size(model: Any) -> Optional[int]:
    """The vocabulary size of a lightning_pipe language model (its `config.vocab_size`), else None."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_model_vocab(model: Any, datamodule: Any) -> None:
    """`check_vocab` for a model and a lightning_pipe data module (anything else passes): for callers
    that hold both, such as a strategy's checks before `fit` launches its processes."""
    need = getattr(datamodule, "vocab_size", None)
    if isinstance(need, int):
        check_vocab(need, model_vocab_size(model), getattr(datamodule, "vocab_source", "the data module"))
