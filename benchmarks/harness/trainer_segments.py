"""Where the Trainer path's step goes, per rank (bench_runtime.py --segments): the strategy's step,
its log exchange, Lightning's log of the values, the optimizer step, the per-step SIGTERM check
(ours, in place of Lightning's broadcast: lightning/signals.py) and the rest, timed by wrapping those methods."""

from __future__ import annotations

import statistics
import time


def stamp_segments() -> list[dict]:
    """Wrap the strategy's step (PipelineSteps.train), its log exchange, the replay into
    ``module.log``, the optimizer step and the per-step SIGTERM check: each step records when they
    start and end (perf_counter); one dict per step."""
    from lightning_pipe.lightning import steps as steps_module
    from lightning_pipe.lightning.logs import LogBroadcaster

    stamps: list[dict] = []

    def stamped(fn, before: str | None, after: str):
        def wrapper(*args, **kwargs):
            if before == "start":
                stamps.append({})
            if not stamps:  # the first step's SIGTERM check
                return fn(*args, **kwargs)
            stamps[-1].update({before: time.perf_counter()} if before else {})
            result = fn(*args, **kwargs)
            stamps[-1][after] = time.perf_counter()
            return result

        return wrapper

    from lightning_pipe.lightning.signals import StepSignals
    from lightning_pipe.lightning.strategy import AutoPipeStrategy

    # step i's SIGTERM check comes before its start: its stamps go to step i - 1's dict
    StepSignals.per_step = stamped(StepSignals.per_step, "sigterm", "sigterm end")
    AutoPipeStrategy.optimizer_step = stamped(AutoPipeStrategy.optimizer_step, None, "stepped")
    steps_module.PipelineSteps.train = stamped(steps_module.PipelineSteps.train, "start", "end")
    LogBroadcaster.exchange = stamped(LogBroadcaster.exchange, "exchange", "exchanged")
    steps_module.replay = stamped(steps_module.replay, "log", "logged")
    return stamps


def segments(timed: list[dict]) -> dict[str, float]:
    """Medians (ms) over the timed steps' stamps."""
    med = lambda a, b: 1e3 * statistics.median(s[b] - s[a] for s in timed if a in s and b in s)  # noqa: E731
    early = sum("exchange" not in s for s in timed) / len(timed)
    return {
        "step": med("start", "end"),  # the strategy's training step: split, gradients set aside, executor, logs
        "exchange": med("exchange", "exchanged") if early < 1 else 0.0,  # at the step's end (not when logged early)
        "log": med("log", "logged"),  # Lightning's log of the exchanged values, during or after the schedule
        "logged during the schedule (share of steps)": early,
        "optimizer": med("end", "stepped"),  # the closure's end, the gradients put back, the optimizer's step
        "to the SIGTERM check": med("stepped", "sigterm"),  # hooks, Lightning's logger connector
        "SIGTERM check": med("sigterm", "sigterm end"),  # ours (signals.py), before each step
        "to the step": 1e3 * statistics.median(b["start"] - a["sigterm end"] for a, b in zip(timed, timed[1:]) if "sigterm end" in a),
        "between steps": 1e3 * statistics.median(b["start"] - a["end"] for a, b in zip(timed, timed[1:])),
    }
