"""A Hugging Face model's own tensor-parallel plan (`config.base_model_tp_plan`, e.g. Llama's
{"layers.*.self_attn.q_proj": "colwise", ...}) as torch styles for one traced block: each per-layer entry
applies to the block's submodules whose names end with the part after "layers.*.". No Lightning."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..runtime.tensor_parallel import Plan

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def hf_plan_of(model: Any) -> Optional[Mapping[str, str]]:
    """The model's `config.base_model_tp_plan`, or None (no config, or a model without one, e.g. GPT-2)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if plan else None


def hf_tensor_plan(block: nn.Module, base_plan: Mapping[str, str]) -> Plan:
    """`base_plan`'s per-layer entries matched in `block`; raises ValueError naming a style we do not map."""
    plan: dict[str, Any] = {}
    for pattern, kind in base_plan.items():
        if "*." not in pattern:
            continue  # not per layer (an embedding or head entry): that block stays whole
        suffix = pattern.split("*.", 1)[1]
        # a traced block holds the model's modules under their paths with "/" for "." (pipeline.encode)
        names = [n for n, _ in block.named_modules() if _matches(n.replace("/", "."), suffix)]
        if names and kind not in STYLES:
            raise ValueError(f"the model's tensor-parallel plan asks {kind!r} for {pattern!r}; supported styles: {sorted(STYLES)}")
        for name in names:
            plan[name] = STYLES[kind]()
    return plan


def _matches(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)
