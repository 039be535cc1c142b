"""Adaptive re-partitioning in the strategy (AutoPipe-RL part 1): monitor, decide, switch.

- Every training step (``pipeline.adaptive=true``): the `Monitor` measures the step and gathers
  every rank's numbers (one all_gather); the metrics are logged and kept in
  ``trainer.strategy.adaptive.monitor.latest`` for callbacks. Once a window of steps is measured,
  the candidates (one boundary between neighbouring workers moved) are scored and the `SwitchRule`
  may decide to switch; every rank decides alike from the same numbers. ``adaptive=learned`` (ours)
  and ``adaptive=paper`` (the paper's networks) decide on one rank instead and broadcast the verdict.
- ``strategy.repartition(bounds)``: a switch requested by the user (or a test), checked at once.
- A decided or requested switch starts at the next batch's start, before its training_step
  (`on_train_batch_start`). Fine-grained (AutoPipe-RL §4.4, `adaptive_switch`, `fine_switch.py`):
  that batch is the transition iteration, the pipeline keeps running, and the switch ends after its
  backward, before the optimizer step. Otherwise the pipeline stops there: every layer prepares
  (2BW drains, its stash moves with the blocks), the blocks move (`adaptive.switch`), then the
  stage's gradient groups, schedule and step runner are rebuilt (`lightning/compose.Training.switch`).
  Checkpoints written afterwards hold the new partition, which a resumed run reuses.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..adaptive.candidates import Scorer, SimulatorScorer, neighbour_candidates
from ..adaptive.fine_grained import early_microbatches
from ..adaptive.learned import LearnedDecider, load_learned
from ..adaptive.monitor import IterationMetrics, Monitor, StaticMetrics
from ..adaptive.paper_decider import PaperDecider, load_paper
from ..adaptive.policy import SwitchRule
from ..adaptive.switch import Bounds, check_bounds, plan_moves
from .context import RankContext
from .fine_switch import Switching, Transition, why_not_fine

log = logging.getLogger(__name__)
# set to 1: adaptive=learned records every decision's predictions, also by the offline network (benchmarks)
EVALUATE = "LIGHTNING_PIPE_ADAPTIVE_EVALUATE"


@dataclass
class SwitchRecord:
    """One switch, as logged: at which iteration, from which partition to which, why and at what cost."""

    iteration: int
    old: Bounds
    new: Bounds
    predicted_gain: Optional[float]  # None: requested by the user
    predicted_now_s: Optional[float]
    predicted_new_s: Optional[float]
    seconds: float = 0.0  # measured, the slowest rank's time with the pipeline stopped (its stall)
    moved_bytes: int = 0
    by: str = "rule"  # "requested" (repartition), "rule", "learned" or "paper" (an arbiter)
    early: Optional[int] = None  # fine-grained: micro-batches left on the old worker (None: the pipeline stopped)
    waited: float = 0.0  # fine-grained: seconds the new worker's compute waited for the transfers
    stopped_because: str = ""  # why a switch under adaptive_switch=fine-grained stopped the pipeline

    def line(self) -> str:
        if self.predicted_gain is None:
            why = "requested"
        elif self.by in ("learned", "paper"):
            why = (
                f"{self.by}: predictor {self.predicted_now_s * 1e3:.1f} -> {self.predicted_new_s * 1e3:.1f} ms per iteration, "
                "arbiter: switch"
            )
        else:
            why = f"predicted gain {self.predicted_gain:.1%} over the rest of the run"
        sizes = lambda b: [hi - lo for lo, hi in b]  # noqa: E731
        if self.early is not None:
            how = (
                f"fine-grained: {self.early} micro-batch(es) on the old worker, the new one waited {self.waited * 1e3:.1f} ms; "
                f"stopped {self.seconds * 1e3:.1f} ms"
            )
        else:
            how = f"pipeline stopped {self.seconds * 1e3:.1f} ms" + (f" ({self.stopped_because})" if self.stopped_because else "")
        return (
            f"adaptive: iteration {self.iteration}: partition {sizes(self.old)} -> {sizes(self.new)} blocks per chunk ({why}); "
            f"{how}, {self.moved_bytes / 1e6:.2f} MB moved"
        )


class Adaptive:
    """The strategy's re-partitioning: monitor (when adaptive), policy, and the switch itself."""

    def __init__(
        self,
        ctx: RankContext,
        switching: Switching,
        profile: Optional[Any],
        costs: Optional[Any],
        scorer: Optional[Scorer] = None,
    ):
        config = ctx.config
        self.ctx, self.switching = ctx, switching  # switching.switch(new): the stop-and-move switch, collective over the pipeline
        self.transition: Optional[tuple[Transition, Bounds, Optional[tuple], float]] = None  # a fine-grained switch under way
        self._stream: Optional[Any] = None  # the switch transfers' process group, made at the first fine-grained switch
        self.early: Optional[int] = None  # requested: micro-batches a fine-grained switch leaves on the old worker
        self._transition_step = -1  # the last fine-grained switch's transition iteration
        self.kind = config.adaptive  # False, "rule", "learned" or "paper"
        self.enabled = bool(self.kind)
        # adaptive=learned / paper: predictor + arbiter (decides on pipeline rank 0)
        self.decider: Optional[LearnedDecider | PaperDecider] = None
        self.evaluations: list[
            dict[str, Any]
        ] = []  # learned, rank 0, with LIGHTNING_PIPE_ADAPTIVE_EVALUATE=1: every decision's predictions
        self.rule = SwitchRule(
            gain=config.adaptive_gain,
            interval=config.adaptive_interval,
            window=config.adaptive_window,
            hysteresis=config.adaptive_hysteresis,
        )
        self.pending: Optional[tuple[Bounds, Optional[tuple[float, float, float]]]] = None
        self.switches: list[SwitchRecord] = []
        self.monitor: Optional[Monitor] = None
        self.scorer: Optional[Scorer] = None
        self.decision_seconds = 0.0  # candidates scored, over the run
        self._considered = -(10**9)  # iteration of the last scoring
        if self.enabled:
            if profile is None or costs is None:
                raise RuntimeError("adaptive=True needs the profile (it plans from one); none was made")
            topo = ctx.topology
            static = StaticMetrics.from_profile(profile)
            self.monitor = Monitor(
                static,
                ctx.stage_index,
                topo.depth,
                ctx.pipeline_group,
                ctx.device,
                ctx.pipeline_rank,
                window=config.adaptive_window,
                replicas=topo.width,
            )
            self.scorer = scorer or SimulatorScorer(static, costs)
            if self.kind == "learned":
                folder = Path(config.adaptive_weights) if config.adaptive_weights else None
                # the spec, not the name: the predictor reads the schedule and its options (advance_num)
                self.decider = LearnedDecider(load_learned(folder, topo.depth), static, config.schedule_spec, config.microbatches)
                self.offline = copy.deepcopy(self.decider.learned.predictor)  # before online adaptation, for evaluation
                self.scorer = self.decider.scorer
            if self.kind == "paper":  # the paper's networks for this depth (checked before any process started)
                folder = Path(config.adaptive_weights) if config.adaptive_weights else None
                self.decider = PaperDecider(load_paper(folder, topo.depth), static, config.microbatches, config.adaptive_window)
            # the learned decision is taken on one rank (pipeline rank 0; with replicas, the first
            # replica's) and sent to every rank that switches: the pipeline, or the whole job
            self.root = ctx.pipeline_rank(0) if topo.width == 1 else 0
            self.verdict_group = ctx.groups.pipeline if topo.width == 1 else None

    # ---- per step -----------------------------------------------------------------------------
    def begin_step(self, transport: Any) -> None:
        if self.monitor is not None:
            self.monitor.begin(transport)

    def end_step(self, executor: Any, microbatches: int) -> None:
        """After a training step's schedule (collective over the pipeline when monitoring)."""
        if self.monitor is None:
            return
        cut = self.ctx.cut
        iteration = self._iteration()
        metrics = self.monitor.end(executor, iteration, microbatches, cut.bounds, cut.placement)
        if metrics is None:
            return
        self._log(metrics)
        if metrics.step == self._transition_step:  # a mix of two partitions: logged, not kept for decisions
            if metrics in self.monitor.history:
                self.monitor.history.remove(metrics)
            return
        if (
            metrics.microbatches != self.ctx.config.microbatches
            or metrics.bounds != cut.bounds
            or self.pending is not None
            or self.transition is not None
        ):
            return  # a short last batch is a different schedule; a switch since or under way: not a basis for decisions
        if self.decider is not None and self.ctx.global_rank == self.root:
            self.decider.observe(list(self.monitor.history))  # the replay buffer of online adaptation
        # scored once per window of fresh measurements (not every step: the scoring is the costly part)
        if self.rule.allows(iteration, len(self.monitor.history)) and (iteration - self._considered) >= self.rule.window:
            self._considered = iteration
            started = time.perf_counter()
            self._consider(executor.schedule, iteration)
            self.decision_seconds += time.perf_counter() - started

    def _consider(self, schedule: Any, iteration: int) -> None:
        if self.decider is not None:
            return self._consider_learned(iteration)
        cut, window = self.ctx.cut, list(self.monitor.history)
        now = self.scorer(window, schedule, cut.bounds)
        scored = [(self.scorer(window, schedule, c), c) for c in neighbour_candidates(cut.bounds, cut.placement)]
        if not scored:
            return
        bandwidth = self._bandwidth(window)

        def cost(bounds: Bounds) -> float:  # weights and Adam's two moments of the blocks that move
            moved = sum(self.monitor.static.param_bytes[b] for m in plan_moves(cut.bounds, bounds, cut.placement) for b in m.blocks)
            return self.rule.cost(3 * moved, bandwidth)

        chosen = self.rule.choose(now, scored, self._left(), cost)
        if chosen is not None:
            best, gain, best_s = chosen
            self.pending = (best, (gain, now, best_s))

    def _bandwidth(self, window: list[IterationMetrics]) -> float:
        measured = [m.bandwidth() for m in window if m.bandwidth() == m.bandwidth()]
        return sorted(measured)[len(measured) // 2] if measured else 1e9

    def _consider_learned(self, iteration: int) -> None:
        """Pipeline rank 0 adapts the predictor, scores the candidates and asks the arbiter; every rank
        of the pipeline gets the verdict (one broadcast per window), so all switch alike."""
        ctx, window = self.ctx, list(self.monitor.history)
        box: list[Any] = [None]
        if ctx.global_rank == self.root:
            verdict = self.decider.decide(window, self._left(), iteration - self.rule.last_switch, self._bandwidth(window))
            if verdict is not None:
                box[0] = {"switch": verdict.switch, "best": verdict.best, "now": verdict.now_s, "best_s": verdict.best_s}
                self._log_value("adaptive/decision_ms", verdict.seconds * 1e3)
            if verdict is not None and self.kind == "learned" and os.environ.get(EVALUATE) == "1":
                offline = self.decider.scorer.predictor
                self.decider.scorer.predictor = self.offline  # the same candidates before online adaptation
                before = self.decider.scorer.score_many(window, [b for b, _ in verdict.scores], window[-1].chunk_rank)
                self.decider.scorer.predictor = offline
                self.evaluations.append(
                    {
                        "iteration": iteration,
                        "switch": verdict.switch,
                        "probability": verdict.probability,
                        "cost_s": verdict.cost_s,
                        "decision_s": verdict.seconds,
                        "adapt_s": verdict.adapt_seconds,
                        "measured_s": max(window[-1].wall_s),
                        "scores": [[[list(x) for x in b], t, t0] for (b, t), t0 in zip(verdict.scores, before)],
                    }
                )
        if ctx.topology.world_size > 1:
            dist.broadcast_object_list(box, self.root, group=self.verdict_group)
        verdict = box[0]
        if verdict is not None and verdict["switch"]:
            now, best = verdict["now"], verdict["best_s"]
            self.pending = (tuple(tuple(b) for b in verdict["best"]), ((now - best) / now, now, best))

    def _log_value(self, name: str, value: float) -> None:
        trainer = self.ctx.trainer
        for logger in trainer.loggers:
            logger.log_metrics({name: value}, step=trainer.global_step)

    def _left(self) -> Optional[float]:
        trainer = self.ctx.trainer
        total = trainer.estimated_stepping_batches
        if not isinstance(total, (int, float)) or total == float("inf"):
            return None
        return float(total) * trainer.accumulate_grad_batches - trainer.fit_loop.total_batch_idx

    def _iteration(self) -> int:
        return int(self.ctx.trainer.fit_loop.total_batch_idx)

    def _log(self, metrics: IterationMetrics) -> None:
        trainer = self.ctx.trainer
        for logger in trainer.loggers:
            logger.log_metrics(metrics.as_log(), step=trainer.global_step)

    # ---- switching ------------------------------------------------------------------------------
    def request(self, bounds: Sequence[Sequence[int]], early: Optional[int] = None) -> Bounds:
        """Switch to `bounds` (one [start, stop) per model chunk) at the next batch's start. Every
        rank of the pipeline must request the same (a callback runs on all of them)."""
        cut = self.ctx.cut
        new = check_bounds(bounds, sum(hi - lo for lo, hi in cut.bounds), cut.placement)
        if early is not None and (isinstance(early, bool) or not isinstance(early, int) or early < 0):
            raise ValueError(f"repartition(early={early!r}): a count of micro-batches >= 0, or None (chosen from the measurements)")
        self.pending, self.early = (new, None), early
        return new

    def _early_microbatches(self, move: Any) -> int:
        """k for a fine-grained switch: requested, or the micro-batches the new worker would reach
        before the moved weights arrive (from the last measured iteration), else 1."""
        if self.early is not None:
            return self.early
        latest = self.monitor.latest if self.monitor is not None else None
        if latest is None:
            return 1
        moved = sum(self.monitor.static.param_bytes[b] for b in move.blocks)
        forward = latest.forward_s[move.dst] / max(1, latest.microbatches)
        return early_microbatches(moved, self._bandwidth([latest]), forward, latest.microbatches)

    def apply_pending(self) -> Optional[SwitchRecord]:
        """At an iteration boundary (every rank of the pipeline, the same pending switch)."""
        if self.pending is None:
            return None
        new, why = self.pending
        self.pending = None
        ctx = self.ctx
        old = ctx.cut.bounds
        if new == old:
            return None
        if self.monitor is not None:
            self.monitor.flush()  # the gather in flight, of the old partition: read before anything moves
        started = time.perf_counter()
        stopped_because = ""
        if ctx.config.adaptive_switch == "fine-grained":
            move, stopped_because = why_not_fine(self.switching, new)
            if move is not None:
                if self._stream is None:
                    self._stream = ctx.groups.own_pipeline_group()
                transition = Transition(self.switching, move, new, self._early_microbatches(move), self._stream)
                self.transition = (transition, old, why, time.perf_counter() - started)
                return None
        result = self.switching.switch(new)
        return self._record(old, new, why, time.perf_counter() - started, result.sent_bytes, None, 0.0, stopped_because)

    def finish_transition(self) -> Optional[SwitchRecord]:
        """After the transition iteration's backward (every rank of the job): the fine-grained switch ends."""
        if self.transition is None:
            return None
        transition, old, why, begun = self.transition
        self.transition = None
        started = time.perf_counter()
        sent, waited = transition.finish()
        seconds = begun + time.perf_counter() - started
        self._transition_step = self._iteration()  # its measurements mix two partitions: not a basis for decisions
        return self._record(old, self.ctx.cut.bounds, why, seconds, sent, transition.early, waited, "")

    def _record(
        self,
        old: Bounds,
        new: Bounds,
        why: Optional[tuple],
        seconds: float,
        sent: int,
        early: Optional[int],
        waited: float,
        stopped_because: str,
    ) -> SwitchRecord:
        ctx = self.ctx
        self.early = None
        numbers = torch.tensor([seconds, waited, float(sent)], dtype=torch.float64, device=ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # everyone logs the slowest rank's times and all bytes
            slowest = numbers.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(numbers, op=dist.ReduceOp.SUM)
            numbers[:2] = slowest[:2]
        iteration = self._iteration()
        gain, now, best = why if why is not None else (None, None, None)
        by = "requested" if why is None else str(self.kind)
        record = SwitchRecord(
            iteration, old, new, gain, now, best, float(numbers[0]), int(numbers[2]), by, early, float(numbers[1]), stopped_because
        )
        self.switches.append(record)
        self.rule.switched(iteration, old)
        if self.monitor is not None:
            self.monitor.clear()
            window = [self.monitor.latest] if self.monitor.latest is not None else []
            bandwidth = self._bandwidth(window)
            if record.moved_bytes:
                self.rule.measured(record.seconds, record.moved_bytes, bandwidth)
            if self.decider is not None:
                moved = [b for m in plan_moves(old, new, ctx.cut.placement) for b in m.blocks]
                params = sum(self.monitor.static.param_bytes[b] for b in moved)
                self.decider.switched(params, bandwidth, len(moved), record.seconds, old=old, new=new)
        rank_zero_info(record.line())
        return record

    def close(self) -> None:
        """At the end of fit: no gather left in flight."""
        if self.monitor is not None:
            self.monitor.flush()

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = {"rule": self.rule.state_dict(), "switches": len(self.switches)}
        if self.decider is not None and self.ctx.global_rank == self.root:  # learned / paper: adapted online on this rank
            out[str(self.kind)] = self.decider.state_dict()  # "learned" or "paper": a resumed run of the other mode starts afresh
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rule.load_state_dict(state["rule"])
        if self.decider is not None and self.kind in state:  # a checkpoint of a rule run has none: shipped weights
            self.decider.load_state_dict(state[str(self.kind)])
