"""Partition control's settings: AutoPipe-RL's adaptive re-partitioning (the rule, our learned
predictor and arbiter, or the paper's networks) and how a switch moves blocks, each checked before
any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import SettingError, check_count
from ...schedules.spec import canonical

ADAPTIVE = {
    True: "rule",
    "rule": "rule",
    "true": "rule",
    "learned": "learned",
    "paper": "paper",
    False: False,
    None: False,
    "false": False,
    "off": False,
}
LEARNING = ("learned", "paper")  # the modes whose networks decide (no rule to tune)
SWITCHES = ("fine-grained", "stop")


def check_config(config: Any) -> None:
    value = config.adaptive.lower() if isinstance(config.adaptive, str) else config.adaptive
    if not isinstance(value, (bool, str, type(None))) or value not in ADAPTIVE:
        raise SettingError(f"adaptive={config.adaptive!r}: one of rule (or true), learned, paper, false", "adaptive")
    config.adaptive = ADAPTIVE[value]
    if config.adaptive == "learned" and not config.auto:
        _check_learned(config)
    if config.adaptive == "paper" and not config.auto:
        _check_paper(config)
    gain = config.adaptive_gain
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
        raise SettingError(f"adaptive_gain={gain!r}: a fraction in [0, 1), e.g. 0.05 for 5%", "adaptive_gain")
    hysteresis = config.adaptive_hysteresis
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
        raise SettingError(f"adaptive_hysteresis={hysteresis!r}: a fraction in [0, 1), e.g. 0.05", "adaptive_hysteresis")
    if hysteresis and config.adaptive in LEARNING:
        raise SettingError(
            f"adaptive_hysteresis={hysteresis!r} is the rule's (adaptive=rule); adaptive={config.adaptive}'s arbiter decides "
            "switches itself: set adaptive_hysteresis=0",
            "adaptive_hysteresis",
        )
    for name in ("adaptive_interval", "adaptive_window"):
        check_count(name, getattr(config, name))
    if config.adaptive_switch not in SWITCHES:
        raise SettingError(f"adaptive_switch={config.adaptive_switch!r}: one of fine-grained (AutoPipe-RL §4.4), stop", "adaptive_switch")


def _check_learned(config: Any) -> None:
    """The learned predictor reads the schedule it scores and was trained on each with fixed options
    (adaptive/offline.py SCHEDULE_OPTIONS): anything else is outside what it has seen."""
    from ...adaptive.features import SCHEDULES as LEARNED  # the schedules its predictor was trained on

    schedule = canonical(config.schedule)
    if schedule not in LEARNED:
        raise SettingError(
            f"adaptive=learned with schedule={config.schedule!r}: the learned predictor was not trained on it "
            f"(it knows {', '.join(LEARNED)}); use adaptive=rule",
            "adaptive",
        )
    trained = {"interleaved": ("chunks", 2), "wave": ("waves", 1), "hanayo": ("waves", 1)}.get(schedule)
    if trained is not None and getattr(config, trained[0]) != trained[1]:
        name, value = trained
        raise SettingError(
            f"adaptive=learned with schedule={config.schedule!r} and {name}={getattr(config, name)}: the learned predictor "
            f"was trained on {config.schedule} with {name}={value}; use that, or adaptive=rule (any {name})",
            name,
        )


def _check_paper(config: Any) -> None:
    """The paper's partition input is a layer-count array: one model chunk per worker."""
    from ...adaptive.paper_features import SINGLE_CHUNK  # the schedules its networks were trained on

    if canonical(config.schedule) not in SINGLE_CHUNK:
        raise SettingError(
            f"adaptive=paper with schedule={config.schedule!r}: the paper's networks take one model chunk per worker "
            f"(a layer-count array) and were trained on {', '.join(SINGLE_CHUNK)}; use one of those, or adaptive=learned",
            "adaptive",
        )


def check_world(config: Any, stages: int) -> None:
    """adaptive=learned / paper: the weight files for this depth exist and load (before any process starts)."""
    if config.adaptive == "paper":
        return _check_paper_depth(config, stages)
    if config.adaptive != "learned":
        return
    from ...adaptive.learned import load_learned

    try:
        load_learned(Path(config.adaptive_weights) if config.adaptive_weights else None, stages)
    except (OSError, ValueError) as error:
        raise SettingError(str(error), "adaptive_weights") from None


def _check_paper_depth(config: Any, stages: int) -> None:
    from ...adaptive.paper_decider import load_paper, shipped_depths

    folder = Path(config.adaptive_weights) if config.adaptive_weights else None
    depths = shipped_depths(folder)
    if stages not in depths:
        where = f" in {folder}" if folder else ""
        raise SettingError(
            f"adaptive=paper at depth {stages}: the paper's networks{where} cover depths {', '.join(map(str, depths)) or 'none'}; "
            "use one of those, or adaptive=learned",
            "adaptive",
        )
    try:
        load_paper(folder, stages)
    except (OSError, ValueError) as error:
        raise SettingError(str(error), "adaptive_weights") from None


def check_model(config: Any, num_blocks: int) -> None:
    """adaptive=paper: the paper's per-layer inputs are padded to a fixed number of layers."""
    if config.adaptive != "paper":
        return
    from ...adaptive.paper_features import L_MAX

    if num_blocks > L_MAX:
        raise SettingError(
            f"adaptive=paper with {num_blocks} blocks: the paper's per-layer inputs take at most {L_MAX} blocks; "
            "use adaptive=learned (any block count)",
            "adaptive",
        )
