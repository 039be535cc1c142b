"""Validation of data settings; messages name the config key (``data.*``) to change."""

from __future__ import annotations

from typing import Optional


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
