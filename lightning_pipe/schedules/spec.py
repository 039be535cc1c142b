"""The schedule registry and `ScheduleSpec`: a schedule's name and options, checked once.

Adding a schedule is one generator function, one `REGISTRY` line (its options with their
defaults; for a multi-chunk schedule how many chunks it cuts and why a model is too small for
it) and one yaml in `conf/schedule/`. Everything else (the strategy's checks before spawning,
the planners, `schedule="auto"`, the CLI) asks the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

from ..errors import SettingError, check_count
from .actions import PipelineSchedule
from .advance import advance
from .gpipe import gpipe
from .interleaved import interleaved_1f1b, interleaved_chunks, interleaved_misfit
from .one_f_one_b import one_f_one_b
from .two_bw import pipedream_2bw
from .validate import validate
from .wave import wave, wave_chunks, wave_misfit
from .wave_hanayo import hanayo
from .zero_bubble import zb_h1
from .zero_bubble_auto import zb_auto
from .zero_bubble_v import zb_v, zb_v_chunks, zb_v_misfit


@dataclass(frozen=True)
class ScheduleKind:
    generator: Callable[..., PipelineSchedule]
    options: Mapping[str, int] = field(default_factory=dict)  # option -> default
    chunks: Optional[Callable[..., int]] = None  # (stages, **options) -> model chunks; None: one per rank
    misfit: Optional[Callable[..., str]] = None  # (stages, num_blocks, **options) -> why it does not fit
    versions: str = "flush"  # the weight-versions layer that runs it: "flush" or "2bw" (lightning_pipe.modes)
    zero_means_default: frozenset[str] = frozenset()  # options whose 0 stands for a depth-dependent default
    # built from the run's measured costs (planning/zero_bubble.py) where there are costs; the
    # generator is its form without them
    costed: bool = False
    split_backward: bool = False  # its backward runs as BI and a later W (zero bubble): a sharded stage reduces after the W


REGISTRY: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(gpipe),
    "1f1b": ScheduleKind(one_f_one_b),
    "interleaved": ScheduleKind(interleaved_1f1b, {"chunks": 2}, interleaved_chunks, interleaved_misfit),
    # Hanayo's placement with our greedy order (schedules/wave.py) ...
    "wave": ScheduleKind(wave, {"waves": 1}, wave_chunks, wave_misfit),
    # ... and with the paper's own order (schedules/wave_hanayo.py; docs/results/schedules.md compares them)
    "hanayo": ScheduleKind(hanayo, {"waves": 1}, wave_chunks, partial(wave_misfit, name="hanayo")),
    # AvgPipe's advance forward propagation: advance_num forwards before the first backward (0: K - 1, i.e. 1F1B)
    "advance": ScheduleKind(advance, {"advance_num": 0}, zero_means_default=frozenset({"advance_num"})),
    # PipeDream-2BW: no flush, one update per batch from the previous version (its own weight-versions layer)
    "2bw": ScheduleKind(pipedream_2bw, {"advance_num": 0}, versions="2bw", zero_means_default=frozenset({"advance_num"})),
    # zero bubble (Qi et al., ICLR 2024): backward split in BI (input gradient) and W (weight gradients)
    "zb-h1": ScheduleKind(zb_h1, split_backward=True),  # 1F1B's memory, W's deferred into its bubbles
    "zb-v": ScheduleKind(zb_v, chunks=zb_v_chunks, misfit=zb_v_misfit, split_backward=True),  # two chunks per rank in a V
    # the paper's automatic scheduler (§3.1): its heuristic on the profile's F / BI / W times
    "zb-auto": ScheduleKind(zb_auto, costed=True, split_backward=True),
}
ALIASES = {"flush": "1f1b"}  # PipeDream-Flush is our 1F1B (PipeDream-2BW paper, §3.2)
AUTO = "auto"  # not a schedule: the strategy and the plan command choose one of REGISTRY


def canonical(name: Any) -> Any:
    """The registry's name for `name` (lower case; "flush" is "1f1b")."""
    key = name.lower() if isinstance(name, str) else name
    return ALIASES.get(key, key)


def schedule_kind(name: Any) -> ScheduleKind:
    key = canonical(name)
    if key not in REGISTRY:
        raise SettingError(f"schedule={name!r} is not a known schedule; allowed values: {sorted(REGISTRY) + sorted(ALIASES)}", "schedule")
    return REGISTRY[key]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule by name with its options (``chunks`` for interleaved, ``waves`` for wave)."""

    name: str = "1f1b"
    options: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        kind = schedule_kind(self.name)
        object.__setattr__(self, "name", canonical(self.name))
        given = dict(self.options)
        unknown = sorted(set(given) - set(kind.options))
        if unknown:
            raise SettingError(f"schedule={self.name!r} takes no option {unknown}; its options: {list(kind.options) or 'none'}", unknown[0])
        for key, value in given.items():
            if not (value == 0 and key in kind.zero_means_default and not isinstance(value, bool)):
                check_count(key, value)
        object.__setattr__(self, "options", tuple(sorted({**kind.options, **given}.items())))

    @classmethod
    def of(cls, name: str, **options: int) -> "ScheduleSpec":
        return cls(name, tuple(sorted(options.items())))

    @classmethod
    def from_settings(cls, name: str, settings: Mapping[str, Any]) -> "ScheduleSpec":
        """The spec of `name` taking only its own options from a flat settings mapping (a config
        holds `chunks` and `waves` whatever the schedule)."""
        kind = schedule_kind(name)
        return cls(name, tuple((k, settings[k]) for k in kind.options if k in settings))

    @property
    def kind(self) -> ScheduleKind:
        return REGISTRY[self.name]

    @property
    def kwargs(self) -> dict[str, int]:
        return dict(self.options)

    @property
    def label(self) -> str:
        zero = self.kind.zero_means_default
        return self.name + "".join(f" {k}={'default' if v == 0 and k in zero else v}" for k, v in self.options)

    def chunk_count(self, stages: int) -> int:
        """Model chunks on `stages` ranks, without building the schedule: p, v·p or 2·p·W."""
        return self.kind.chunks(stages, **self.kwargs) if self.kind.chunks else stages

    def check(self, stages: int, num_blocks: int) -> None:
        """Every model chunk needs a block: name the setting to lower when there are too few."""
        if self.chunk_count(stages) <= num_blocks:
            return
        if self.kind.misfit is not None:
            # the option to lower (chunks, waves), else the width that sets the stages (zb-v)
            raise SettingError(self.kind.misfit(stages, num_blocks, **self.kwargs), self.options[0][0] if self.options else "width")
        raise SettingError(
            f"the pipeline has {stages} stages but the model only {num_blocks} blocks: use at most {num_blocks} "
            "stages (devices x nodes / width) or split the model into more blocks",
            "width",
        )

    def build(self, stages: int, microbatches: int, check: bool = True) -> PipelineSchedule:
        """Build and `validate`: an inconsistent schedule is an error here, never a hang at run time.
        A generator's own refusal (e.g. a micro-batch count it cannot use) names the setting."""
        try:
            schedule = self.kind.generator(stages, microbatches, **self.kwargs)
        except SettingError:
            raise
        except ValueError as err:
            raise SettingError(str(err), _setting_named_in(str(err))) from None
        if check:
            validate(schedule)
        return schedule

    def placement(self, stages: int, microbatches: int) -> tuple[int, ...]:
        """Which rank holds each model chunk (one chunk per rank for GPipe / 1F1B)."""
        return self.build(stages, microbatches).chunk_rank


def _setting_named_in(message: str) -> Optional[str]:
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None
