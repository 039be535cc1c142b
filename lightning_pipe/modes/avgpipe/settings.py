"""AvgPipe's settings (§4-5): the parallel pipelines, the elastic pull, and the tuner of (M, N),
each checked on its own before any process starts. Which schedules and modes combine with them is
the legality table's (`config.py`)."""

from __future__ import annotations

from typing import Any

from ...errors import SettingError, check_count

TUNE_MODELS = ("paper", "calibrated")


def check_config(config: Any) -> None:
    if not isinstance(config.share_devices, bool):
        raise SettingError(f"share_devices={config.share_devices!r}: true (N processes per device) or false", "share_devices")
    if config.pipelines is None:
        for name in ("alpha", "staleness"):
            if getattr(config, name) not in (None, 0):
                raise SettingError(f"{name}={getattr(config, name)!r} is an AvgPipe setting: set pipelines=N too (N >= 1)", name)
    else:
        check_count("pipelines", config.pipelines)
        alpha = config.alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
            raise SettingError(f"alpha={alpha!r}: a number in [0, 1], or None for 1 / pipelines", "alpha")
        if isinstance(config.staleness, bool) or not isinstance(config.staleness, int) or config.staleness < 0:
            raise SettingError(f"staleness={config.staleness!r}: an integer >= 0 (0: synchronous and deterministic)", "staleness")
    _check_tuner(config)


def _check_tuner(config: Any) -> None:
    """The tuner (§5.2): profile steps, the model that predicts the grid, the grid's M and N."""
    if not isinstance(config.tune, bool):
        raise SettingError(f"tune={config.tune!r}: true or false", "tune")
    check_count("tune_batches", config.tune_batches)
    if config.tune_model not in TUNE_MODELS:
        raise SettingError(f"tune_model={config.tune_model!r}: one of 'paper' (Eq. 1-8), 'calibrated' (ours)", "tune_model")
    for name in ("tune_microbatches", "tune_pipelines"):
        value = getattr(config, name)
        if value is None:
            continue
        try:
            values = sorted(set(value))
        except TypeError:
            raise SettingError(f"{name}={value!r}: a list of integers >= 1", name) from None
        if not values:
            raise SettingError(f"{name}=[]: list at least one value (integers >= 1), or null for the default grid", name)
        for v in values:
            check_count(name, v)
        setattr(config, name, values)
