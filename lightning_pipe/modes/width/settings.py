"""The replicas' settings: `width` (checked with the world in `topology.py`), `shard`, `reshard` and
`shard_mixed_precision`, each on its own; which modes they combine with is the legality table's (`config.py`)."""

from __future__ import annotations

from typing import Any

from ...errors import SettingError, check_choice

SHARD = ("none", "optimizer", "full")
RESHARD = ("microbatch", "step")


def check_config(config: Any) -> None:
    value = config.shard
    if not isinstance(value, str) or value.lower() not in SHARD:
        raise SettingError(
            f"shard={value!r}; allowed values: 'none' (full replicas), 'optimizer' (ZeRO-1: the optimizer state sharded "
            "over the width's replicas), 'full' (FSDP2: parameters, gradients and optimizer state sharded per block)",
            "shard",
        )
    config.shard = value.lower()
    config.reshard = check_choice("reshard", config.reshard, list(RESHARD))
    if not isinstance(config.shard_mixed_precision, bool):
        raise SettingError(
            f"shard_mixed_precision={config.shard_mixed_precision!r}: true (shard=full under bf16-mixed: weights gathered "
            "in bf16, gradients reduced in fp32) or false (gathered in fp32)",
            "shard_mixed_precision",
        )


def check_trainer_full(trainer: Any) -> None:
    """What shard='full' cannot honour, before any process starts."""
    plugin = getattr(trainer, "precision_plugin", None)
    if getattr(plugin, "scaler", None) is not None:
        raise SettingError(
            "shard='full' with a GradScaler (precision='16-mixed') is not built: use bf16-mixed, bf16-true or 32-true",
            "shard",
        )


def strided_message(tensor: int, name: str) -> str:
    return (
        f"shard='full' with tensor={tensor} over {name}, a fused projection split as a strided shard (our GPT / BERT's "
        "q, k, v), is not built: FSDP2 cannot shard it once more over the replicas; use shard='none', or a model with "
        "separate q, k and v projections (e.g. Llama's)"
    )


def check_model_full(config: Any, model: Any) -> None:
    """Before spawning: our attention's fused q, k, v under shard='full' and tensor > 1 (`strided_message`)."""
    if config.tensor == 1 or callable(getattr(model, "parallelize_block", None)):
        return
    from ...models.blocks import SelfAttention

    fused = next((f"{n}.qkv" for n, m in model.named_modules() if isinstance(m, SelfAttention)), None)
    if fused is not None:
        raise SettingError(strided_message(config.tensor, fused), "shard")
