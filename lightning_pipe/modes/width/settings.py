"""The replicas' settings: `width` (checked with the world in `topology.py`) and `shard`, each on its
own; which modes `shard` combines with is the legality table's (`config.py`)."""

from __future__ import annotations

from typing import Any

from ...errors import SettingError

SHARD = ("none", "optimizer")  # "full" (FSDP2 per block) is not built yet: refused with its own line


def check_config(config: Any) -> None:
    value = config.shard
    if value == "full":
        raise SettingError(
            "shard='full' (FSDP2's fully_shard per block) is not built yet; allowed values: 'none' (full replicas), "
            "'optimizer' (ZeRO-1: the optimizer state sharded over the width's replicas)",
            "shard",
        )
    if not isinstance(value, str) or value.lower() not in SHARD:
        raise SettingError(
            f"shard={value!r}; allowed values: 'none' (full replicas), 'optimizer' (ZeRO-1: the optimizer state sharded "
            "over the width's replicas)",
            "shard",
        )
    config.shard = value.lower()
