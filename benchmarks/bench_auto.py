"""`schedule="auto"` against measurement on 2 real processes (issue 18 item 5): is auto's pick the
measured fastest? For each workload (mlp, gpt-tiny, bert-tiny) and m: one auto run profiles, measures
the message costs and picks; every candidate it let run (and its no-message-costs pick) is then
trained through the Trainer from that same profile, in interleaved rounds. Results: docs/predictions.md.

    flock /tmp/bench.lock python benchmarks/bench_auto.py --save docs/auto_measured.json       # m = 4 and 2, ~20 min
    flock /tmp/bench.lock python benchmarks/bench_auto.py --workloads mlp --microbatches 4 --save out.json
    python benchmarks/bench_auto.py --report docs/auto_measured.json                           # tables of a saved run
    python benchmarks/bench_auto.py --quick                                                    # smoke: mlp, m = 2, 2 steps
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from lightning_pipe.bench.harness import Bench, Table, interleave, ints, names, pin_threads

pin_threads(1)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pipe import AutoPipeStrategy  # noqa: E402
from lightning_pipe.bench.mlp_module import MLPModule, MLPRows  # noqa: E402
from lightning_pipe.bench.stats import spearman  # noqa: E402
from lightning_pipe.bench.trainer_runs import fit_timed, quiet_lightning, undisturbed  # noqa: E402
from lightning_pipe.data import CausalLMDataModule, MaskedLMDataModule  # noqa: E402
from lightning_pipe.models import CausalLM, MaskedLM  # noqa: E402
from lightning_pipe.planning.auto import choose_schedule  # noqa: E402
from lightning_pipe.planning.entry import DEFAULT_LINKS, block_kinds  # noqa: E402
from lightning_pipe.profiling import Profile  # noqa: E402
from lightning_pipe.schedules import build_schedule  # noqa: E402

WORKLOADS = ["mlp", "gpt", "bert"]
MLP_CFG = dict(hidden=512, mlp_ratio=1, blocks=16, lr=1e-3)  # bench_runtime's residual MLP, 64-row micro-batches
LM_SEQ, LM_BATCH = 128, 16  # recipes/{gpt,bert}-tiny-cpu.yaml, synthetic tokens
GAP_TARGET = 0.05
PARTITION = "autopipe"


def workload(name: str, m: int, steps: int) -> tuple[Any, dict]:
    """The LightningModule and fit()'s data argument."""
    torch.manual_seed(0)
    if name == "mlp":
        cfg = dict(MLP_CFG, batch=64 * m)
        return MLPModule(cfg), {"train_dataloaders": DataLoader(MLPRows(cfg, steps), batch_size=cfg["batch"], shuffle=False)}
    lm, data = (CausalLM, CausalLMDataModule) if name == "gpt" else (MaskedLM, MaskedLMDataModule)
    module = lm(model=name + "-tiny", lr=1e-3, warmup_steps=2, max_steps=steps)
    dm = data(seq_len=LM_SEQ, batch_size=LM_BATCH, val_fraction=0.0, synthetic=True, synthetic_samples=LM_BATCH * steps, seed=0)
    return module, {"datamodule": dm}


def train(bench: Bench, name: str, m: int, kw: dict, out: Path, setup_counts: bool = False) -> dict:
    """One Trainer.fit (repeated while disturbed); its plan.json's schedule, options and bounds."""
    args = bench.args

    def fit(attempt: int) -> dict:
        module, data = workload(name, m, args.warmup + args.steps)
        strategy = AutoPipeStrategy(microbatches=m, partition=PARTITION, start_method="fork", **kw)
        trainer = dict(precision="32-true", limit_val_batches=0, num_sanity_val_steps=0)
        return fit_timed(module, data, strategy, args.warmup, args.steps, out / f"try{attempt}", **trainer)

    result = undisturbed(fit, args, bench.patient, setup_counts, log=bench.log)
    plan = json.loads((Path(result["dir"]) / "plan.json").read_text())
    return dict(result, **{k: plan[k] for k in ("schedule", "options", "bounds")})


def label(c: dict) -> str:
    return c["schedule"] + "".join(f" {k}={v}" for k, v in sorted(c["options"].items()))


def built(c: dict, m: int):
    return build_schedule(c["schedule"], 2, m, **c["options"])


def run_case(bench: Bench, name: str, m: int, work: Path) -> dict:
    case_dir = work / f"{name}_m{m}"
    bench.log(f"\n=== {name}, m = {m}: the schedule='auto' run")
    auto = train(bench, name, m, {"schedule": "auto"}, case_dir / "auto", setup_counts=True)
    plan = json.loads((Path(auto["dir"]) / "plan.json").read_text())
    profile_path = case_dir / "profile.json"
    shutil.copy(Path(auto["dir"]) / "profile.json", profile_path)
    candidates = plan["schedule_choice"]["candidates"]
    bench.log(f"auto chose {label(plan)} bounds {plan['bounds']}; its own steps {auto['step_ms']:.1f} ms")

    # offline from the auto run's profile, as the strategy plans: with the message costs (must reproduce
    # plan.json), and with them zeroed (what auto would pick without the measured message costs)
    module, _ = workload(name, m, 1)
    kinds = block_kinds([type(b).__name__ for b in (module.seq if name == "mlp" else module.model)])
    costs = Profile.load(profile_path).costs(*DEFAULT_LINKS["cpu"])
    with_msg = choose_schedule(costs, 2, m, method=PARTITION, kinds=kinds)
    bare = dataclasses.replace(costs, send_overhead=0.0, recv_overhead=0.0, handoff_delay=0.0)
    without = choose_schedule(bare, 2, m, method=PARTITION, kinds=kinds)
    replayed = {c.name: c.iteration_time for c in with_msg.candidates}
    for c in candidates:
        assert abs(replayed[label(c)] / c["iteration_time"] - 1) < 1e-9, (label(c), replayed[label(c)], c["iteration_time"])
    bench.log(with_msg.table() + "\nwithout message costs:\n" + without.table())
    bare_pick = {"schedule": without.chosen.schedule, "options": dict(without.chosen.options)}
    bare_predicted = {c.name: c.iteration_time for c in without.candidates}

    # one measurement per distinct (action lists, bounds): on 2 ranks wave and Hanayo give the same lists
    runs = [c for c in candidates if c["verdict"] in ("runs", "chosen") or label(c) == label(bare_pick)]
    groups: list[list[dict]] = []
    for c in runs:
        same = lambda g: g[0]["bounds"] == c["bounds"] and built(g[0], m).actions == built(c, m).actions  # noqa: E731
        group = next((g for g in groups if same(g)), None)
        groups.append([c]) if group is None else group.append(c)

    def run(g: list[dict], rnd: int) -> dict:
        c = g[0]
        kw = {"schedule": c["schedule"], "profile": str(profile_path), **c["options"]}
        r = train(bench, name, m, kw, case_dir / "run")
        if (r["schedule"], r["options"], r["bounds"]) != (c["schedule"], c["options"], c["bounds"]):
            raise AssertionError(f"{label(c)}: the run planned {r['schedule']} {r['options']} {r['bounds']}, not {c['bounds']}")
        bench.log(f"  [{rnd + 1}] {label(c):<22} predicted {c['iteration_time'] * 1e3:7.2f} ms  measured {r['step_ms']:7.2f} ms")
        return r

    measured = interleave(groups, bench.args.rounds, run)
    rows = []
    for g, results in zip(groups, measured):
        c, verdicts, steps = g[0], [x["verdict"] for x in g], [r["step_ms"] for r in results]
        rows.append({"candidate": label(c), "labels": [label(x) for x in g], "bounds": c["bounds"], "measured_rounds_ms": steps,
                     "verdict": "chosen" if "chosen" in verdicts else ("runs" if "runs" in verdicts else c["verdict"]),
                     "messages_per_rank": [sum(1 for a in acts if a.op.is_send or a.op.is_recv) for acts in built(c, m).actions],
                     "predicted_ms": c["iteration_time"] * 1e3, "predicted_no_messages_ms": bare_predicted[label(c)] * 1e3,
                     "measured_ms": statistics.median(steps), "foreign_cpus": [r["foreign_cpus"] for r in results]})  # fmt: skip
    terms = ("send_overhead", "recv_overhead", "handoff_delay")
    return {"workload": name, "microbatches": m, "chosen": label(plan), "no_message_pick": label(bare_pick), "messages": plan["messages"],
            "cost_terms": {k: getattr(costs, k) for k in terms}, "candidates": candidates, "plan_seconds": plan["profiled_and_planned_seconds"],
            "auto_run": {k: auto[k] for k in ("step_ms", "foreign_cpus", "setup_foreign_cpus", "foreign_tries", "wall_s")}, "rows": rows}  # fmt: skip


def report(bench: Bench, case: dict) -> None:
    rows = case["rows"]
    row_of = lambda name: next((r for r in rows if name in r["labels"]), None)  # noqa: E731
    order_m, order_p = sorted(rows, key=lambda r: r["measured_ms"]), sorted(rows, key=lambda r: r["predicted_ms"])
    best, pick, bare = order_m[0], row_of(case["chosen"]), row_of(case["no_message_pick"])
    ratios = [r["measured_ms"] / r["predicted_ms"] for r in rows]
    t = Table("candidate", "chunks (blocks)", "messages / rank", "predicted ms", "predicted, no messages", "measured ms (rounds)",
              "measured / predicted", "rank predicted", "rank measured", align="llrrrrrrr")  # fmt: skip
    for r in order_p:
        name = f"**{' = '.join(r['labels'])} (auto)**" if r is pick else " = ".join(r["labels"])
        name += "" if r["verdict"] in ("runs", "chosen") else " (auto rejected: " + r["verdict"].split(" (")[0] + ")"
        t.add(
            name, f"{len(r['bounds'])} ({'/'.join(str(b - a) for a, b in r['bounds'])})", max(r["messages_per_rank"]), f"{r['predicted_ms']:.1f}",
            f"{r['predicted_no_messages_ms']:.1f}", f"{r['measured_ms']:.1f} ({', '.join(f'{x:.1f}' for x in r['measured_rounds_ms'])})",
            f"{r['measured_ms'] / r['predicted_ms']:.2f}", order_p.index(r) + 1, order_m.index(r) + 1,
        )  # fmt: skip
    us = {k: v * 1e6 for k, v in case["cost_terms"].items()}
    bench.table(t, f"**{case['workload']}, m = {case['microbatches']}** — message terms from the auto run: send {us['send_overhead']:.0f} us, "
                   f"receive {us['recv_overhead']:.0f} us, hand-off delay {us['handoff_delay']:.0f} us per message ({case['messages']['nbytes']} B)")  # fmt: skip
    gap = pick["measured_ms"] / best["measured_ms"] - 1
    sp = lambda key: spearman([r[key] for r in rows], [r["measured_ms"] for r in rows])  # noqa: E731
    vs = lambda r: f"{r['measured_ms'] / best['measured_ms'] - 1:+.1%} vs the measured fastest"  # noqa: E731
    fastest = "the measured fastest" if pick is best else f"{vs(pick)} {best['candidate']} ({best['measured_ms']:.1f} ms)"
    bare_text = " (not measured)" if bare is None else (" (the same pick)" if bare is pick else "") + f": {vs(bare)}"
    bench.say(
        f"auto's pick {case['chosen']}: {pick['measured_ms']:.1f} ms, {fastest} (target within {GAP_TARGET:.0%}: "
        f"**{'met' if gap <= GAP_TARGET else 'MISSED'}**); Spearman predicted vs measured {sp('predicted_ms'):+.2f} (without message "
        f"costs {sp('predicted_no_messages_ms'):+.2f}); measured / predicted {min(ratios):.2f}-{max(ratios):.2f}.\n"
        f"Without message costs auto would pick {case['no_message_pick']}{bare_text}.\n"
    )


def main() -> None:
    quick = dict(microbatches=[2], workloads=["mlp"])
    bench = Bench(__doc__, quick, rounds=3, steps=15, warmup=5, retries=1, max_foreign=0.15, quiet_wait=5.0, budget=float("inf"))
    p = bench.parser
    p.add_argument("--workloads", type=names, default=WORKLOADS, help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--microbatches", type=ints, default=[4, 2], help="comma-separated micro-batch counts")
    p.add_argument("--work", default=None, help="folder for the runs' outputs (default: a temporary one)")
    p.add_argument("--save", default=None, help="write the raw results as JSON here (after every case)")
    p.add_argument("--report", default=None, help="print the tables of a saved JSON; run nothing")
    args = bench.parse()
    if args.report:
        for case in json.loads(Path(args.report).read_text())["cases"]:
            report(bench, case)
        return bench.finish()
    quiet_lightning()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_auto_"))
    cases: list[dict] = []
    for m in args.microbatches:
        for name in args.workloads:
            cases.append(run_case(bench, name, m, work))
            report(bench, cases[-1])
            bench.keep("cases", cases)
            if args.save:  # after every case: a cut-short run keeps what it measured
                Path(args.save).write_text(json.dumps({"provenance": bench.provenance, "command": bench.command, "cases": cases}, indent=1))
    bench.finish()


if __name__ == "__main__":
    main()
