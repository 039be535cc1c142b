"""The legality table: which pipeline settings combine, the only place that names modes.

Each row refuses one setting where a combination is not built, with a message naming the setting
and what to set instead; `PipelineConfig.__post_init__` walks the rows after checking each setting
on its own, so every refusal comes before any process starts. A mode's checks of its own settings
are in ``modes/<mode>/settings.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .modes.two_bw import settings as two_bw
from .planning.partitioners import PARTITIONERS
from .schedules import REGISTRY

PipelineConfig = Any  # config.PipelineConfig, which walks this table: the rows read its fields

MULTI_CHUNK = tuple(name for name, kind in REGISTRY.items() if kind.chunks is not None)
COSTED = tuple(name for name, kind in REGISTRY.items() if kind.costed)  # built from the run's profile (zb-auto)
SLICED = tuple(name for name in REGISTRY if name not in MULTI_CHUNK + COSTED + ("2bw", "advance"))  # whose warm-up the slicer halves
ALGORITHM2_SCHEDULES = ("1f1b",)  # AutoPipe's Algorithm 2 slices 1F1B
ADVANCE_NUM_SCHEDULES = ("advance", "2bw")  # the schedules with AvgPipe(2BW)'s advance forward order
COMPILE_VALUES = (False, True, "auto")  # auto: schedule='auto' weighs eager against compiled blocks
COMPILE_EXCLUDED = ("zb-h1", "zb-v", "zb-auto")  # a split backward (autograd.grad on a block's inputs, then its weights)


@dataclass(frozen=True)
class Legality:
    """A row: `setting` is refused where `illegal(config)` holds, saying `message(config)`."""

    setting: str
    illegal: Callable[[PipelineConfig], bool]
    message: Callable[[PipelineConfig], str]


def _planner_excludes(c: PipelineConfig) -> str:
    return "pipelines (AvgPipe)" if c.pipelines is not None else ("adaptive" if c.adaptive else "tune")


LEGALITY: tuple[Legality, ...] = (
    Legality(
        "compile",
        lambda c: c.compile is True and c.schedule in COMPILE_EXCLUDED,
        lambda c: (
            f"compile=True with schedule={c.schedule!r}: a split backward (zero bubble) of a compiled block is not built; set compile=False"
        ),
    ),
    Legality(
        "compile",
        lambda c: c.compile == "auto" and not c.auto,
        lambda c: (
            f"compile='auto' weighs eager against compiled blocks within schedule='auto', not schedule={c.schedule!r}: "
            "set schedule='auto', or compile=True or False"
        ),
    ),
    Legality(
        "reshard",
        lambda c: c.reshard != "microbatch" and c.shard != "full",
        lambda c: f"reshard={c.reshard!r} is a setting of shard='full' (when FSDP2 frees gathered weights), not shard={c.shard!r}",
    ),
    Legality(
        "shard_mixed_precision",
        lambda c: c.shard_mixed_precision is not True and c.shard != "full",
        lambda c: (
            f"shard_mixed_precision={c.shard_mixed_precision!r} is a setting of shard='full' (the dtype FSDP2 gathers "
            f"weights in under bf16-mixed), not shard={c.shard!r}"
        ),
    ),
    Legality(
        "shard",
        lambda c: c.shard != "none" and c.pipelines is not None,
        lambda c: (
            f"shard={c.shard!r} shards over the width's replicas; AvgPipe's pipelines (pipelines={c.pipelines}) train apart: set shard='none'"
        ),
    ),
    Legality(
        "shard",
        lambda c: c.shard != "none" and c.pipelines is None and c.planner is None and c.width < 2,
        lambda c: (
            f"shard={c.shard!r} shards the optimizer state over the replicas, and width={c.width} has none: set width >= 2 or shard='none'"
        ),
    ),
    Legality(
        "shard",
        lambda c: c.shard == "full" and c.planner is not None and c.planner_2bw_cost != "simulated",
        lambda c: (
            f"shard='full' with planner_2bw_cost={c.planner_2bw_cost!r}: the paper's closed forms price no FSDP2 "
            "gathers; set planner_2bw_cost='simulated' (ours)"
        ),
    ),
    Legality(
        "reshard",
        lambda c: c.reshard == "step" and c.shard == "full" and c.schedule == "2bw",
        lambda c: (
            "reshard='step' keeps one gathered copy of each block's weights over a step, and schedule='2bw' runs "
            "consecutive micro-batches on two weight versions: set reshard='microbatch'"
        ),
    ),
    Legality(
        "shard",
        lambda c: c.shard != "none" and bool(c.adaptive),
        lambda c: (
            f"shard={c.shard!r} with adaptive={c.adaptive!r}: a live switch moves blocks with their optimizer state, which is "
            "spread over the replicas (not built); set shard='none' or adaptive=false"
        ),
    ),
    Legality(
        "tensor",
        lambda c: c.tensor > 1 and c.planner is not None and c.planner_2bw_cost != "simulated",
        lambda c: (
            f"tensor={c.tensor} with planner_2bw_cost={c.planner_2bw_cost!r}: the paper's closed forms price no tensor "
            "parallelism; set planner_2bw_cost='simulated' (ours)"
        ),
    ),
    Legality(
        "sequence_parallel",
        lambda c: c.sequence_parallel is True and c.tensor == 1,
        lambda c: "sequence_parallel=True splits the sequence over the tensor ranks: it needs tensor > 1",
    ),
    Legality(
        "loss_parallel",
        lambda c: c.loss_parallel is True and c.tensor == 1,
        lambda c: "loss_parallel=True splits the logits over the tensor ranks' vocabulary: it needs tensor > 1",
    ),
    Legality(
        "tensor",
        lambda c: c.tensor > 1 and (c.pipelines is not None or bool(c.adaptive) or c.tune is True),
        lambda c: (
            f"tensor={c.tensor} with {'pipelines (AvgPipe)' if c.pipelines is not None else 'adaptive' if c.adaptive else 'tune'}"
            " is not built (their planners and live switches move or size whole blocks); set tensor=1"
        ),
    ),
    Legality(
        "width",
        lambda c: c.pipelines is not None and c.width != 1,
        lambda c: f"pipelines={c.pipelines} and width={c.width}: AvgPipe's parallel pipelines replace the replicas; set width=1",
    ),
    Legality(
        "schedule",
        lambda c: c.pipelines is not None and c.auto,
        lambda c: (
            f"pipelines={c.pipelines}: AvgPipe runs one schedule you name (gpipe, 1f1b, interleaved, wave, hanayo, "
            "advance, zb-h1, zb-v or 2bw), not 'auto'"
        ),
    ),
    Legality(
        "schedule",
        lambda c: c.pipelines is not None and c.schedule in COSTED,
        lambda c: (
            f"pipelines={c.pipelines}: schedule={c.schedule!r} is built from one pipeline's profile, which AvgPipe's "
            "parallel pipelines do not take (not built); name zb-h1 or zb-v"
        ),
    ),
    Legality(
        "advance_num",
        lambda c: c.advance_num is not None and c.schedule not in ADVANCE_NUM_SCHEDULES,
        lambda c: (
            f"advance_num={c.advance_num!r} is a setting of schedule='advance' or '2bw' (AvgPipe(2BW)'s advance forward "
            f"order), not {c.schedule!r}"
        ),
    ),
    Legality(
        "slicer",
        lambda c: bool(c.slicer) and not c.auto and c.schedule not in SLICED,
        lambda c: f"slicer={c.slicer!r} works with schedule='gpipe' or '1f1b', not {c.schedule!r}",
    ),
    Legality(
        "slicer_method",
        lambda c: c.slicer_method == "algorithm2" and (c.auto or c.schedule_spec.name not in ALGORITHM2_SCHEDULES),
        lambda c: f"slicer_method='algorithm2' slices 1F1B (AutoPipe's Algorithm 2), not schedule={c.schedule!r}: use 'sweep'",
    ),
    Legality(
        "schedule",
        lambda c: c.planner is not None and not c.auto and c.schedule not in two_bw.PLANNED_SCHEDULES,
        lambda c: f"planner=2bw plans schedule 2bw, 1f1b or gpipe (auto: all three), not schedule={c.schedule!r}",
    ),
    Legality(
        "planner",
        lambda c: c.planner is not None and (c.pipelines is not None or bool(c.adaptive) or c.tune),
        lambda c: f"planner=2bw chooses width and depth itself: it does not combine with {_planner_excludes(c)}",
    ),
    Legality(
        "partition",
        lambda c: c.planner is not None and not isinstance(c.partition, str),
        lambda c: (
            f"planner=2bw plans the partition for the depth it chooses: partition={c.partition!r} must be a method "
            f"name, one of {sorted(PARTITIONERS)}"
        ),
    ),
    Legality(
        "partition",
        lambda c: c.auto and not isinstance(c.partition, str),
        lambda c: (
            f"schedule='auto' plans its own partition for each candidate schedule: partition={c.partition!r} "
            f"must be a method name, one of {sorted(PARTITIONERS)}"
        ),
    ),
    Legality(
        "adaptive",
        lambda c: c.adaptive == "learned" and c.auto,
        lambda c: (
            "adaptive=learned with schedule='auto': the learned predictor reads the schedule it scores; name one "
            "(gpipe, 1f1b, interleaved, wave, hanayo, advance or 2bw), or use adaptive=rule"
        ),
    ),
    Legality(
        "adaptive",
        lambda c: c.adaptive == "paper" and c.auto,
        lambda c: (
            "adaptive=paper with schedule='auto': the paper's networks take one model chunk per worker; name one "
            "(gpipe, 1f1b, advance or 2bw), or use adaptive=rule"
        ),
    ),
)
