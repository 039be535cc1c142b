"""`schedule="auto"` against measurement on 2 real processes (issue 18 item 5): is auto's pick the
measured fastest?

Workloads (float32, 2 gloo processes x 1 thread, rank r pinned to core r, ``accelerator="cpu"``):

- ``mlp``:  bench_runtime.py's residual MLP (lightning_pipe.bench.mlp: hidden 512, 16 blocks, MSE,
            SGD), 64-row micro-batches (batch 64 x m), as a LightningModule
            (lightning_pipe.bench.mlp_module);
- ``gpt``:  gpt-tiny (CausalLM: 4 layers, hidden 128, byte vocabulary, 10 blocks), seq 128, batch 16
            (recipes/gpt-tiny-cpu.yaml), synthetic tokens (CausalLMDataModule(synthetic=True): offline);
- ``bert``: bert-tiny (MaskedLM, 10 blocks), seq 128, batch 16 (recipes/bert-tiny-cpu.yaml), synthetic.

For each workload and micro-batch count m:

1. One ``Trainer.fit`` with ``AutoPipeStrategy(schedule="auto", microbatches=m, partition=<method>)``:
   setup profiles the blocks and measures the message costs on the ranks, `choose_schedule` plans
   and simulates every candidate, and the run writes plan.json (every candidate's predicted
   iteration time, verdict and bounds; the messages) and profile.json into its default_root_dir.
2. Offline, from that profile.json: `choose_schedule` again on ``profile.costs(...)`` with the CPU
   link defaults the strategy uses (must reproduce plan.json's predictions: checked), and once more
   with the message terms zeroed (``send_overhead = recv_overhead = handoff_delay = 0``): what auto
   would have picked without the measured message costs.
3. Every candidate whose verdict is "runs" or "chosen" (plus the no-message pick, if auto rejected it)
   is trained for real with ``schedule=<candidate>``, the same partition method and
   ``profile=<the auto run's profile.json>``, so it plans from the very same profile and message
   costs; its plan.json's bounds are checked equal to the candidate's bounds in the auto run's.
   Candidates whose action lists and bounds are identical (on 2 ranks our greedy wave order and
   Hanayo's give the same lists at m = 2, 4) are trained once and share the measurement.
   ``--repeats`` rounds, candidates interleaved within a round; a run's step time is the median of
   rank 0's end-to-end step periods (``on_train_batch_end`` to ``on_train_batch_end``: Lightning's
   loop, data fetch and the optimizer step included) over ``--steps`` steps after ``--warmup``; a
   candidate's figure is the median over rounds. A run during which other processes used more than
   ``--max-foreign`` CPUs (over its timed steps) is repeated, at most ``--retries`` times.
4. Printed per workload: predicted (auto's simulation, with message costs) and measured ms, both
   ranks, measured / predicted; whether auto's pick is the measured fastest and its gap (target:
   within 5%); Spearman's rank correlation of predicted vs measured; the no-message pick and its
   measured gap.

    flock /tmp/bench.lock python benchmarks/bench_auto.py --save docs/auto_measured.json       # m = 4 and 2, ~20 min
    flock /tmp/bench.lock python benchmarks/bench_auto.py --quick                              # m = 4, 2 rounds
    python benchmarks/bench_auto.py --report docs/auto_measured.json                           # tables of a saved run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

from lightning_pipe.bench import provenance  # noqa: E402
from lightning_pipe.bench.launch import busy_seconds, machine_description, own_seconds, wait_for_quiet  # noqa: E402
from lightning_pipe.bench.stats import spearman  # noqa: E402

WORKLOADS = ("mlp", "gpt", "bert")
MLP_CFG = dict(hidden=512, mlp_ratio=1, blocks=16, lr=1e-3)
LM_SEQ, LM_BATCH = 128, 16
GAP_TARGET = 0.05


# ---- one Trainer run -----------------------------------------------------------------------------
def workload(name: str, m: int, steps: int) -> tuple[Any, dict]:
    """The LightningModule and fit()'s data argument (a DataLoader or a DataModule)."""
    torch.manual_seed(0)
    if name == "mlp":
        from torch.utils.data import DataLoader

        from lightning_pipe.bench.mlp_module import MLPModule, MLPRows

        cfg = dict(MLP_CFG, batch=64 * m)
        return MLPModule(cfg), {"train_dataloaders": DataLoader(MLPRows(cfg, steps), batch_size=cfg["batch"], shuffle=False)}
    from lightning_pipe.data import CausalLMDataModule, MaskedLMDataModule
    from lightning_pipe.models import CausalLM, MaskedLM

    lm, data = (CausalLM, CausalLMDataModule) if name == "gpt" else (MaskedLM, MaskedLMDataModule)
    module = lm(model=name + "-tiny", lr=1e-3, warmup_steps=2, max_steps=steps)
    dm = data(seq_len=LM_SEQ, batch_size=LM_BATCH, val_fraction=0.0, synthetic=True, synthetic_samples=LM_BATCH * steps, seed=0)
    return module, {"datamodule": dm}


def _pin(core: int) -> None:
    """Every thread of this process on one core, one intra-op thread."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass
    torch.set_num_threads(1)


def _clock(out: Path, warmup: int):
    from lightning.pytorch.callbacks import Callback

    class StepClock(Callback):
        """Pins the rank (before the strategy's setup profiles); stamps the end of every step, and this
        rank's CPU seconds and the machine's busy seconds around the setup and the timed steps."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.marks: dict[str, Any] = {}

        def setup(self, trainer, pl_module, stage):
            _pin(trainer.global_rank % (os.cpu_count() or 1))
            self.marks["setup"] = (time.perf_counter(), own_seconds(), busy_seconds())

        def on_train_start(self, trainer, pl_module):  # after the strategy's setup (profile, messages, plan)
            self.marks["ready"] = (time.perf_counter(), own_seconds(), busy_seconds())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.ends.append(now)
            if len(self.ends) == warmup:
                self.marks["start"] = (now, own_seconds(), busy_seconds())

        def on_train_end(self, trainer, pl_module):
            self.marks["end"] = (self.ends[-1], own_seconds(), busy_seconds())
            record = {"ends": self.ends, "marks": self.marks, "threads": torch.get_num_threads()}
            (out / f"clock.rank{trainer.global_rank}.json").write_text(json.dumps(record))

    return StepClock()


def train_once(name: str, m: int, strategy_kw: dict, args: argparse.Namespace, out: Path) -> dict:
    """One Trainer.fit on 2 processes (forked from this one); rank 0's step periods and the foreign load."""
    import lightning as L

    from lightning_pipe import AutoPipeStrategy

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    steps = args.warmup + args.steps
    module, data = workload(name, m, steps)
    strategy = AutoPipeStrategy(microbatches=m, partition=args.partition, start_method=args.start_method, **strategy_kw)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_clock(out, args.warmup)],
        default_root_dir=str(out),
    )
    started = time.perf_counter()
    trainer.fit(module, **data)
    wall = time.perf_counter() - started
    ranks = [json.loads((out / f"clock.rank{r}.json").read_text()) for r in range(2)]
    ends = ranks[0]["ends"][args.warmup - 1 :]
    periods = [b - a for a, b in zip(ends, ends[1:])]
    foreign = _foreign(ranks, "start", "end")
    plan = json.loads((out / "plan.json").read_text())
    trace = json.loads((out / "trace.json").read_text()) if (out / "trace.json").exists() else None
    return {
        "trace": trace,
        "step_ms": statistics.median(periods) * 1e3,
        "periods_ms": [round(p * 1e3, 3) for p in periods],
        "foreign_cpus": foreign,
        "setup_foreign_cpus": _foreign(ranks, "setup", "ready"),
        "dir": str(out),
        "threads": [r["threads"] for r in ranks],
        "wall_s": wall,
        "schedule": plan["schedule"],
        "options": plan["options"],
        "bounds": plan["bounds"],
    }


def _foreign(ranks: list[dict], first: str, last: str) -> float:
    """CPUs' worth of other processes' work between two marks: the machine's busy time less both ranks' own."""
    (t0, _, busy0), (t1, _, busy1) = ranks[0]["marks"][first], ranks[0]["marks"][last]
    if busy0 is None or busy1 is None:
        return 0.0
    own = sum(r["marks"][last][1] - r["marks"][first][1] for r in ranks)
    return max(0.0, (busy1 - busy0) - own) / max(t1 - t0, 1e-9)


def measure(name: str, m: int, strategy_kw: dict, args: argparse.Namespace, out: Path, setup_counts: bool = False) -> dict:
    """`train_once`, repeated while other processes disturbed it (at most --retries more times); the
    least disturbed attempt is kept. ``setup_counts``: a disturbed setup (the profile) counts too."""
    tries: list[dict] = []
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.quiet_wait, args.max_foreign, log=print)
        result = train_once(name, m, strategy_kw, args, out / f"try{attempt}")
        result["disturbance"] = max(result["foreign_cpus"], result["setup_foreign_cpus"] if setup_counts else 0.0)
        tries.append(result)
        if result["disturbance"] <= args.max_foreign:
            break
        if attempt < args.retries:
            print(f"    disturbed ({result['disturbance']:.2f} CPUs of other work): again", flush=True)
    best = min(tries, key=lambda r: r["disturbance"])
    best["foreign_tries"] = [round(r["disturbance"], 2) for r in tries]
    return best


# ---- the plan, offline from the auto run's profile ----------------------------------------------
def offline_choices(profile_path: Path, m: int, method: str, num_blocks_kinds: list[str]) -> tuple[Any, Any, Any]:
    """(choice with message costs, choice without them, the costs) from a saved profile, as the strategy plans."""
    from lightning_pipe.lightning.autoplan import DEFAULT_LINKS
    from lightning_pipe.planning.auto import choose_schedule
    from lightning_pipe.profiling import Profile

    profile = Profile.load(profile_path)
    costs = profile.costs(*DEFAULT_LINKS["cpu"])
    with_messages = choose_schedule(costs, 2, m, method=method, kinds=num_blocks_kinds)
    bare = dataclasses.replace(costs, send_overhead=0.0, recv_overhead=0.0, handoff_delay=0.0)
    without = choose_schedule(bare, 2, m, method=method, kinds=num_blocks_kinds)
    return with_messages, without, costs


def block_kinds(name: str, m: int) -> list[str]:
    from lightning_pipe.lightning.autoplan import KINDS

    module, _ = workload(name, m, 1)
    return [KINDS.get(type(b).__name__, "block") for b in (module.seq if name == "mlp" else module.model)]


def same_lists(a: dict, b: dict, m: int) -> bool:
    """Two candidates run the very same action lists on the same bounds (one measurement serves both)."""
    from lightning_pipe.schedules import build_schedule

    if a["bounds"] != b["bounds"]:
        return False
    sa, sb = build_schedule(a["schedule"], 2, m, **a["options"]), build_schedule(b["schedule"], 2, m, **b["options"])
    return sa.chunk_rank == sb.chunk_rank and sa.actions == sb.actions


def label(c: dict) -> str:
    return c["schedule"] + "".join(f" {k}={v}" for k, v in sorted(c["options"].items()))


# ---- one case: a workload at one m --------------------------------------------------------------
def run_case(name: str, m: int, args: argparse.Namespace, work: Path) -> dict:
    case_dir = work / f"{name}_m{m}"
    print(f"\n=== {name}, m = {m}: the schedule='auto' run", flush=True)
    auto = measure(name, m, {"schedule": "auto"}, args, case_dir / "auto", setup_counts=True)
    plan = json.loads((Path(auto["dir"]) / "plan.json").read_text())
    profile_path = case_dir / "profile.json"
    shutil.copy(Path(auto["dir"]) / "profile.json", profile_path)
    candidates = plan["schedule_choice"]["candidates"]
    print(f"auto chose {label(plan)} bounds {plan['bounds']}; its own steps {auto['step_ms']:.1f} ms", flush=True)
    print("messages: " + json.dumps({k: v for k, v in plan["messages"].items() if k != "handoff_quantiles"}), flush=True)

    kinds = block_kinds(name, m)
    with_msg, without, costs = offline_choices(profile_path, m, args.partition, kinds)
    replayed = {c.name: c.iteration_time for c in with_msg.candidates}
    for c in candidates:  # the offline replay is the strategy's own plan
        again = replayed[label(c)]
        assert (again == c["iteration_time"]) or abs(again / c["iteration_time"] - 1) < 1e-9, (label(c), again, c["iteration_time"])
    print(with_msg.table(), flush=True)
    print("without message costs:\n" + without.table(), flush=True)
    bare_pick = {"schedule": without.chosen.schedule, "options": dict(without.chosen.options)}
    bare_predicted = {c.name: c.iteration_time for c in without.candidates}

    runs = [c for c in candidates if c["verdict"] in ("runs", "chosen")]
    extra = [c for c in candidates if label(c) == label(bare_pick) and c not in runs]
    # one measurement per distinct (action lists, bounds): a group's first member stands for it
    groups: list[list[dict]] = []
    for c in runs + extra:
        group = next((g for g in groups if same_lists(c, g[0], m)), None)
        if group is None:
            groups.append([c])
        else:
            group.append(c)
    twins = {label(g[0]): [label(c) for c in g[1:]] for g in groups if len(g) > 1}
    print(
        f"running {len(groups)} distinct candidates x {args.repeats} rounds" + (f" (same lists and bounds: {twins})" if twins else ""),
        flush=True,
    )
    measured: dict[str, list[dict]] = {label(g[0]): [] for g in groups}
    for rnd in range(args.repeats):
        for g in groups:
            c = g[0]
            result = run_candidate(name, m, c, profile_path, args, case_dir / "run")
            measured[label(c)].append(result)
            print(
                f"  [{rnd + 1}/{args.repeats}] {label(c):<22} predicted {c['iteration_time'] * 1e3:7.2f} ms  measured {result['step_ms']:7.2f} ms "
                f"(other load {result['foreign_cpus']:.2f} CPUs, tries {result['foreign_tries']}, {result['wall_s']:.0f} s)",
                flush=True,
            )
    traced: dict[str, dict] = {}
    if args.trace:  # one more run of each with the executor's trace: where the time goes in one step
        for g in groups:
            c = g[0]
            result = run_candidate(name, m, c, profile_path, args, case_dir / "run", trace=True)
            traced[label(c)] = breakdown(c, result, costs, m)
            print(f"  traced {label(c):<22} " + json.dumps({k: round(v, 2) for k, v in traced[label(c)].items()}), flush=True)
    rows = []
    for g in groups:
        c = g[0]
        steps = [r["step_ms"] for r in measured[label(c)]]
        verdicts = [x["verdict"] for x in g]
        rows.append(
            {
                "candidate": label(c),
                "same_as": [label(x) for x in g[1:]],
                "labels": [label(x) for x in g],
                "schedule": c["schedule"],
                "options": c["options"],
                "verdict": "chosen" if "chosen" in verdicts else ("runs" if "runs" in verdicts else c["verdict"]),
                "bounds": c["bounds"],
                "messages_per_rank": message_counts(c, m),
                "predicted_ms": c["iteration_time"] * 1e3,
                "predicted_no_messages_ms": bare_predicted[label(c)] * 1e3,
                "measured_ms": statistics.median(steps),
                "measured_rounds_ms": steps,
                "foreign_cpus": [r["foreign_cpus"] for r in measured[label(c)]],
                "traced": traced.get(label(c)),
            }
        )
    return {
        "workload": name,
        "microbatches": m,
        "chosen": label(plan),
        "no_message_pick": label(bare_pick),
        "messages": plan["messages"],
        "cost_terms": {"send_overhead": costs.send_overhead, "recv_overhead": costs.recv_overhead, "handoff_delay": costs.handoff_delay},
        "candidates": candidates,
        "no_message_candidates": [c.to_dict() for c in without.candidates],
        "auto_run": {k: auto[k] for k in ("step_ms", "foreign_cpus", "setup_foreign_cpus", "foreign_tries", "wall_s")},
        "plan_seconds": plan["profiled_and_planned_seconds"],
        "rows": rows,
    }


def run_candidate(name: str, m: int, c: dict, profile_path: Path, args: argparse.Namespace, out: Path, trace: bool = False) -> dict:
    """A candidate planned from the auto run's profile; its bounds must be the auto run's."""
    kw = {"schedule": c["schedule"], "profile": str(profile_path), "trace": trace, **c["options"]}
    result = measure(name, m, kw, args, out)
    if result["bounds"] != c["bounds"] or (result["schedule"], result["options"]) != (c["schedule"], c["options"]):
        raise AssertionError(f"{label(c)}: the run planned {result['schedule']} {result['options']} {result['bounds']}, not {c['bounds']}")
    if not trace:
        result.pop("trace", None)
    return result


def message_counts(c: dict, m: int) -> list[int]:
    """Sends + receives per rank in one step."""
    from lightning_pipe.schedules import build_schedule

    s = build_schedule(c["schedule"], 2, m, **c["options"])
    return [sum(1 for a in acts if a.op.is_send or a.op.is_recv) for acts in s.actions]


def breakdown(c: dict, result: dict, costs: Any, m: int) -> dict:
    """One traced step against the simulation (ms): the pipeline's span, each rank's compute, the
    rest of the busiest rank's span; and the Lightning step around it."""
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    sim = simulate(build_schedule(c["schedule"], 2, m, **c["options"]), costs, [tuple(b) for b in c["bounds"]], critical_path=False)
    events = [e for e in result["trace"]["traceEvents"] if e.get("ph") == "X"]
    start = min(e["ts"] for e in events)
    span = (max(e["ts"] + e["dur"] for e in events) - start) / 1e3
    compute = [sum(e["dur"] for e in events if e["pid"] == r and e["cat"] == "compute") / 1e3 for r in range(2)]
    sim_compute = [sum(e.end - e.start for e in sim.computes(r)) * 1e3 for r in range(2)]
    return {
        "span_ms": span,
        "predicted_span_ms": sim.iteration_time * 1e3,
        "compute_ms_rank0": compute[0],
        "compute_ms_rank1": compute[1],
        "predicted_compute_ms_rank0": sim_compute[0],
        "predicted_compute_ms_rank1": sim_compute[1],
        "compute_stretch": max(compute) / max(sim_compute),
        "rest_ms": span - max(compute),
        "predicted_rest_ms": sim.iteration_time * 1e3 - max(sim_compute),
        "step_ms": result["step_ms"],
    }


# ---- report --------------------------------------------------------------------------------------
def _row_of(case: dict, name: str) -> Optional[dict]:
    return next((r for r in case["rows"] if name in r["labels"]), None)


def summarize(case: dict) -> dict:
    """Over the distinct candidates measured (twins with the same lists and bounds count once)."""
    rows = case["rows"]
    order_m = sorted(rows, key=lambda r: r["measured_ms"])
    order_p = sorted(rows, key=lambda r: r["predicted_ms"])
    best = order_m[0]
    pick = _row_of(case, case["chosen"])
    bare = _row_of(case, case["no_message_pick"])
    gap = pick["measured_ms"] / best["measured_ms"] - 1
    return {
        "best": best["candidate"],
        "best_ms": best["measured_ms"],
        "pick": case["chosen"],
        "pick_ms": pick["measured_ms"],
        "pick_is_fastest": pick is best,
        "gap": gap,
        "met": gap <= GAP_TARGET,
        "spearman": spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows]),
        "ratios": {r["candidate"]: r["measured_ms"] / r["predicted_ms"] for r in rows},
        "rank_measured": {r["candidate"]: order_m.index(r) + 1 for r in rows},
        "rank_predicted": {r["candidate"]: order_p.index(r) + 1 for r in rows},
        "no_message_pick": case["no_message_pick"],
        "no_message_gap": None if bare is None else bare["measured_ms"] / best["measured_ms"] - 1,
        "spearman_no_messages": spearman([r["predicted_no_messages_ms"] for r in rows], [r["measured_ms"] for r in rows]),
    }


def report(case: dict) -> str:
    s = summarize(case)
    msgs = case["cost_terms"]
    lines = [
        f"**{case['workload']}, m = {case['microbatches']}** — message terms from the auto run: send "
        f"{msgs['send_overhead'] * 1e6:.0f} us, receive {msgs['recv_overhead'] * 1e6:.0f} us, hand-off delay "
        f"{msgs['handoff_delay'] * 1e6:.0f} us per message ({case['messages']['nbytes']} B)",
        "",
        "| candidate | chunks (blocks) | messages / rank | predicted ms | predicted, no messages | measured ms (rounds) | "
        "measured / predicted | rank predicted | rank measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(case["rows"], key=lambda r: r["predicted_ms"]):
        name = " = ".join(r["labels"])
        if case["chosen"] in r["labels"]:
            name = f"**{name} (auto)**"
        if r["verdict"] not in ("runs", "chosen"):
            name += " (auto rejected: " + r["verdict"].split(" (")[0] + ")"
        rounds = ", ".join(f"{x:.1f}" for x in r["measured_rounds_ms"])
        sizes = "/".join(str(b - a) for a, b in r["bounds"])
        lines.append(
            f"| {name} | {len(r['bounds'])} ({sizes}) | {max(r['messages_per_rank'])} | {r['predicted_ms']:.1f} | "
            f"{r['predicted_no_messages_ms']:.1f} | {r['measured_ms']:.1f} ({rounds}) | {s['ratios'][r['candidate']]:.2f} | "
            f"{s['rank_predicted'][r['candidate']]} | {s['rank_measured'][r['candidate']]} |"
        )
    verdict = "met" if s["met"] else "MISSED"
    lines += [
        "",
        f"auto's pick {s['pick']}: {s['pick_ms']:.1f} ms, "
        + (
            "the measured fastest"
            if s["pick_is_fastest"]
            else f"{s['gap']:+.1%} vs the measured fastest {s['best']} ({s['best_ms']:.1f} ms)"
        )
        + f" (target within {GAP_TARGET:.0%}: **{verdict}**); Spearman predicted vs measured {s['spearman']:+.2f} "
        f"(without message costs {s['spearman_no_messages']:+.2f}); measured / predicted {min(s['ratios'].values()):.2f}-"
        f"{max(s['ratios'].values()):.2f}.",
        f"Without message costs auto would pick {s['no_message_pick']}"
        + (
            " (not measured)"
            if s["no_message_gap"] is None
            else (" (the same pick)" if _row_of(case, s["no_message_pick"]) is _row_of(case, s["pick"]) else "")
            + f": {s['no_message_gap']:+.1%} vs the measured fastest"
        )
        + ".",
    ]
    traced = [r for r in case["rows"] if r.get("traced")]
    if traced:
        lines += [
            "",
            "| one traced step | span ms (predicted) | compute ms, busiest rank (predicted) | compute stretch | "
            "rest of the span ms (predicted) | Lightning step ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(traced, key=lambda r: r["predicted_ms"]):
            t = r["traced"]
            busiest = max(t["compute_ms_rank0"], t["compute_ms_rank1"])
            pbusiest = max(t["predicted_compute_ms_rank0"], t["predicted_compute_ms_rank1"])
            lines.append(
                f"| {r['candidate']} | {t['span_ms']:.1f} ({t['predicted_span_ms']:.1f}) | {busiest:.1f} ({pbusiest:.1f}) | "
                f"{t['compute_stretch']:.2f} | {t['rest_ms']:.1f} ({t['predicted_rest_ms']:.1f}) | {t['step_ms']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--microbatches", default="4,2", help="comma-separated micro-batch counts")
    p.add_argument("--partition", default="autopipe", help="the partition method, the same for auto and every candidate")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the candidates; a candidate's figure is the median")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15, help="timed steps per run")
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--max-foreign", type=float, default=0.15)
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument("--start-method", default="fork", choices=("fork", "spawn"))
    p.add_argument("--no-trace", dest="trace", action="store_false", help="skip the traced run of each candidate")
    p.add_argument("--quick", action="store_true", help="m = 4 only, 2 rounds, 10 timed steps")
    p.add_argument("--work", default=None, help="folder for the runs' outputs (default: a temporary one)")
    p.add_argument("--save", default=None, help="write the raw results as JSON here")
    p.add_argument("--report", default=None, help="print the tables of a saved JSON and exit")
    args = p.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(saved["provenance"] + "\n" + saved["command"])
        for case in saved["cases"]:
            print("\n" + report(case))
        return
    if args.quick:
        args.microbatches, args.repeats, args.steps = "4", 2, 10
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for logger in ("lightning.pytorch", "lightning.fabric", "lightning_pipe"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_auto_"))
    header = provenance()
    command = "python benchmarks/bench_auto.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("save", "report", "work", "quick") and v is not None
    )
    print(header + "\n" + command, flush=True)
    started = time.perf_counter()
    cases = []
    for m in [int(x) for x in args.microbatches.split(",")]:
        for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            cases.append(run_case(name, m, args, work))
            print("\n" + report(cases[-1]), flush=True)
            if args.save:  # after every case: a cut-short run keeps what it measured
                out = {
                    "provenance": header,
                    "machine": machine_description(),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": command,
                    "wall_s": time.perf_counter() - started,
                    "cases": cases,
                }
                Path(args.save).write_text(json.dumps(out, indent=1))
    print(f"\n{len(cases)} cases in {time.perf_counter() - started:.0f} s")
    for case in cases:
        print("\n" + report(case))


if __name__ == "__main__":
    main()
