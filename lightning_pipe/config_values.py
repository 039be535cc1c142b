"""Values of settings that are more than a choice: byte sizes, per-stage flags, a partition."""

from __future__ import annotations

from typing import Any, Optional

from .errors import SettingError
from .planning.partition import PartitionSpec
from .planning.partitioners import PARTITIONERS


def check_recompute(value: Any) -> Any:
    if not isinstance(value, (bool, str)) and hasattr(value, "__iter__"):  # a list (Hydra: a ListConfig)
        stages = list(value)
        if not stages or any(not isinstance(r, bool) for r in stages):
            raise SettingError(f"recompute={stages!r}: true, false, or a list of true/false, one per stage", "recompute")
        return stages
    if not isinstance(value, bool):
        raise SettingError(f"recompute={value!r}: true, false, or a list of true/false, one per stage", "recompute")
    return value


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(value: Any, setting: str = "memory_limit") -> Optional[float]:
    """A byte count from a number or a size such as "16GB", "80 GiB", "512MB" (powers of 1024); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "").removesuffix("ib").removesuffix("b")
        unit = text[-1] if text and text[-1] in _UNITS else ""
        try:
            number = float(text[: len(text) - len(unit)])
        except ValueError:
            number = -1.0
        if number > 0:
            return number * _UNITS[unit]
    elif not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0:
        return float(value)
    raise SettingError(
        f"{setting}={value!r}: bytes per device, a number > 0 or a size such as 16GB, 80GiB, 512MB (powers of 1024), "
        "or None (the device's memory)",
        setting,
    )


def check_partition(value: Any) -> PartitionSpec:
    if isinstance(value, str):
        if value not in PARTITIONERS:
            raise SettingError(
                f"partition={value!r} is not a known method; allowed: {sorted(PARTITIONERS)} or a list of blocks per stage", "partition"
            )
        return value
    try:
        sizes = list(value)
    except TypeError:
        raise SettingError(
            f"partition={value!r}: a method name ({sorted(PARTITIONERS)}) or a list of blocks per stage", "partition"
        ) from None
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise SettingError(f"partition={sizes}: a list of blocks per stage must hold integers >= 1, one per stage", "partition")
    return sizes
