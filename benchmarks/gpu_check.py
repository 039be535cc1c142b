"""The prepared GPU check: `python -m benchmarks.gpu_check [--smoke] [--out DIR]`.

One command, one JSON + markdown report, on one accelerator (under 8 minutes on an H100 / H200):

1. the strategy on one GPU (a one-stage pipeline: the CUDA device, events and streams the
   runtime uses) against a plain one-process Trainer run: the same weights after a few steps;
   two processes sharing one GPU are not run (NCCL refuses two ranks on one device and gloo has no
   CUDA point-to-point), and the report says so;
2. PipeDream-2BW and AvgPipe(2BW) (N = 1, its reference process on the host) on one GPU; AvgPipe's
   shared layout: N = 2 pipelines as two processes on the one GPU (the world group gloo, the
   reference exchange on the host), against the same run on CPU processes;
3. bf16-mixed and 16-mixed through the Trainer's precision plugin (the pipeline-aware subclass):
   the loss falls and stays finite, and ends within a tolerance of the plain Trainer's;
4. CUDA-timed block profiles of GPT-2 345M and 1.3B in bf16, saved as profile files, and the
   monitor's CUDA-event meter on a timed step;
5. the planners on those measured profiles for 8 and 16 GPUs: AutoPipe, `schedule="auto"` and
   PipeDream-2BW's planner (from a sized profile at micro-batch sizes 1, 2, 4), with their tables;
6. peak memory of each stage of the 2BW planner's 8-GPU choice for GPT-2 345M, run on the GPU one
   stage at a time (its in-flight micro-batches, gradients, Adam state, 2BW's second version),
   against the planner's memory model;
7. on a machine with 4 or 8 GPUs, NCCL's paths of the mesh's dimensions: pp2 x dp2 with each `shard` (2BW over
   FSDP2 too, and `schedule="auto"` with its all-gathers timed over NCCL) against whole replicas, pp2 x tp2 against pp4 and pp2 x dp2 x tp2 against pp4 x dp2 (a section
   says "not run" on fewer GPUs);
8. torch.compile per block (`compile=True`'s in-place `nn.Module.compile`): GPT-2 345M's blocks in bf16,
   eager against compiled forward + backward ms per block (CUDA-timed profiles), and the compiled
   blocks' output against eager's.

`--smoke` runs the same sections small on the CPU (GPT-tiny; planners for 2 and 4 stages): what CI
runs, so the check cannot rot between runs on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness import provenance
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.adaptive.meter import StepMeter
from lightning_pipe.models import CausalLM, build_gpt, get_model_config
from lightning_pipe.planning import plan
from lightning_pipe.planning.auto import choose_schedule
from lightning_pipe.planning.entry import block_kinds
from lightning_pipe.planning.two_bw import plan_2bw
from lightning_pipe.planning.two_bw_costs import hardware
from lightning_pipe.profiling import Profile, profile_blocks
from lightning_pipe.profiling.sized import profile_sizes

SECTIONS: list[tuple[str, Callable[[argparse.Namespace, dict], Any]]] = []


def section(name: str) -> Callable:
    def register(fn: Callable) -> Callable:
        SECTIONS.append((name, fn))
        return fn

    return register


def device_of(args: argparse.Namespace) -> torch.device:
    return torch.device("cpu") if args.smoke else torch.device("cuda", 0)


# ---- 1, 2: the strategy through the Trainer ----------------------------------------------------------
def _data(seq: int, rows: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 260, (rows, seq + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=16)


def _fit(
    strategy: Any, precision: str, steps: int, args: argparse.Namespace, empty: Optional[bool] = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`empty`: the module is created in `trainer.init_module(empty_init=empty)` (None: before the trainer)."""
    torch.manual_seed(0)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    trainer = L.Trainer(
        accelerator=device_of(args).type,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Record()],
        default_root_dir=str(args.out),
    )
    with trainer.init_module(empty_init=empty) if empty is not None else contextlib.nullcontext():
        module = CausalLM("gpt-tiny", lr=1e-3, weight_decay=0.0)
    trainer.fit(module, _data(32))
    return losses, {k: v.detach().double().cpu() for k, v in module.state_dict().items()}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in b)


@section("strategy on one GPU")
def one_gpu(args: argparse.Namespace, report: dict) -> dict:
    # float64: Adam turns float32's summation-order noise in near-zero gradients into visible steps,
    # so the exactness contract (<= 1e-10 relative) is checked where it is defined
    _, reference = _fit("auto", "64-true", 4, args)
    out = {}
    for schedule in ("1f1b", "interleaved") if args.smoke else ("1f1b", "gpipe", "interleaved", "wave"):
        losses, weights = _fit(AutoPipeStrategy(schedule=schedule, microbatches=4, partition="uniform"), "64-true", 4, args)
        out[schedule] = {"max_rel_error_vs_plain_trainer": _max_rel(weights, reference), "losses": losses}
        assert out[schedule]["max_rel_error_vs_plain_trainer"] <= 1e-10, out[schedule]
    # created empty (meta): the stage is created on the CPU and moved; the reference is created in
    # the trainer's init context too, so both initialise in float64
    _, reference = _fit("auto", "64-true", 4, args, empty=False)
    _, weights = _fit(AutoPipeStrategy(schedule="1f1b", microbatches=4, partition="uniform"), "64-true", 4, args, empty=True)
    out["created empty"] = {"max_rel_error_vs_plain_trainer": _max_rel(weights, reference)}
    assert out["created empty"]["max_rel_error_vs_plain_trainer"] <= 1e-10, out["created empty"]
    out["two processes on one GPU"] = "AvgPipe's shared layout, next section (a pipeline of one stage: no point-to-point)"
    return out


@section("2BW and AvgPipe(2BW) on one GPU")
def versions(args: argparse.Namespace, report: dict) -> dict:
    # one stage: PipeDream-2BW's double buffer on the device; AvgPipe(2BW) with N = 1 (its reference
    # process on the host: every update copied out, the reference copied back and pulled in) equals
    # plain 2BW up to rounding, the drain at the end of fit included
    kw = dict(schedule="2bw", microbatches=4, partition="uniform")
    _, plain = _fit(AutoPipeStrategy(**kw), "64-true", 6, args)
    _, averaged = _fit(AutoPipeStrategy(pipelines=1, **kw), "64-true", 6, args)
    out = {"AvgPipe(2BW) N=1 vs 2BW: max rel error": _max_rel(averaged, plain)}
    assert out["AvgPipe(2BW) N=1 vs 2BW: max rel error"] <= 1e-10, out
    return out


@section("precision plugin")
def precision(args: argparse.Namespace, report: dict) -> dict:
    out = {}
    for name in ("bf16-mixed",) if args.smoke else ("bf16-mixed", "16-mixed"):
        plain, _ = _fit("auto", name, 8, args)
        ours, _ = _fit(AutoPipeStrategy(schedule="1f1b", microbatches=4, partition="uniform"), name, 8, args)
        out[name] = {"ours": ours, "plain trainer": plain}
        assert all(math.isfinite(x) for x in ours) and ours[-1] < ours[0], ours
        assert abs(ours[-1] - plain[-1]) <= 0.05 * abs(plain[-1]), (ours[-1], plain[-1])
    return out


# ---- 3, 4: measured profiles and the planners on them -------------------------------------------------
def _models(args: argparse.Namespace) -> list[str]:
    return ["gpt-tiny"] if args.smoke else ["gpt2-345m", "gpt2-1.3b"]


def _blocks(name: str, dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_gpt(get_model_config(name)).to(dtype)


def _ids(b: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 260, (b, seq), device=device)


@section("CUDA-timed block profiles")
def profiles(args: argparse.Namespace, report: dict) -> dict:
    device, dtype = device_of(args), torch.float32 if args.smoke else torch.bfloat16
    out = {}
    for name in _models(args):
        blocks = _blocks(name, dtype)
        started = time.perf_counter()
        measured = profile_blocks(list(blocks), _ids(args.mbs, args.seq, device), device, model=name, repeats=3, warmup=1)
        field = lambda f, measured=measured: [measured[i][f] for i in sorted(measured)]  # noqa: E731
        profile = Profile(
            name, args.mbs, str(dtype).replace("torch.", ""), device.type, field("forward"), field("backward"),
            field("activation_bytes"), field("param_bytes"), field("peak_memory"), [type(b).__name__ for b in blocks],
        )  # fmt: skip
        path = profile.save(Path(args.out) / f"profile_{name}.json")
        report.setdefault("_profiles", {})[name] = (profile, [type(b).__name__ for b in blocks])
        out[name] = {
            "file": str(path),
            "blocks": len(blocks),
            "seconds": time.perf_counter() - started,
            "forward_ms_total": 1e3 * sum(profile.forward),
            "backward_ms_total": 1e3 * sum(profile.backward),
        }
    meter = StepMeter(device)  # the monitor's timing: CUDA events on a GPU
    blocks = _blocks(_models(args)[0], dtype).to(device)
    for _ in range(2):  # the first step pays CUDA's lazy start-up (handles, kernels): time the second
        meter.reset()
        started = time.perf_counter()
        mark = meter.start()
        y = blocks(_ids(args.mbs, args.seq, device)).float().mean()
        meter.stop(mark, forward=True)
        mark = meter.start()
        y.backward()
        meter.stop(mark, forward=False)
        forward, backward, _ = meter.finish()  # synchronises on the last event
        wall = time.perf_counter() - started
    out["monitor meter"] = {"cuda events": meter.cuda, "forward ms": 1e3 * forward, "backward ms": 1e3 * backward, "wall ms": 1e3 * wall}
    assert 0 < forward + backward <= wall * 1.05, out["monitor meter"]
    return out


@section("planners on the measured profiles")
def planners(args: argparse.Namespace, report: dict) -> dict:
    out = {}
    device_type = device_of(args).type
    for name, (profile, names) in report.get("_profiles", {}).items():
        costs, kinds = profile.costs(25e9, 20e-6), block_kinds(names)
        for gpus in (2, 4) if args.smoke else (8, 16):
            m = 4 * gpus
            autopipe = plan(costs, gpus, m, method="autopipe", schedule="1f1b", kinds=kinds)
            auto = choose_schedule(costs, gpus, m, method="autopipe", kinds=kinds)
            out[f"{name} on {gpus}"] = {"autopipe": autopipe.table(), "auto": auto.table()}
        blocks = _blocks(name, torch.float32 if args.smoke else torch.bfloat16)
        device = device_of(args)
        sized = profile_sizes(list(blocks), lambda b, device=device: _ids(b, args.seq, device), [1, 2, 4], device, model=name, repeats=2)
        gpus = 4 if args.smoke else 8
        hw = hardware(gpus, gpus, device_type, None if args.smoke else 80e9)
        two_bw = plan_2bw(sized, hw, 8 * gpus, ("2bw", "1f1b"))
        out[f"{name} 2BW planner on {gpus}"] = two_bw.table()
        report.setdefault("_two_bw", {})[name] = (two_bw, blocks)
    return out


# ---- 5: memory per stage against the planner's model -------------------------------------------------
@section("peak memory per stage")
def memory(args: argparse.Namespace, report: dict) -> dict:
    name = _models(args)[0]
    two_bw, blocks = report["_two_bw"][name]
    c, device = two_bw.chosen, device_of(args)
    out = {"configuration": f"w={c.width} d={c.depth} b={c.microbatch_size} g={c.microbatches} {c.schedule} r={c.recompute}"}
    width = get_model_config(name).d_model
    for s, ((a, b), predicted) in enumerate(zip(c.bounds, c.stage_memory)):
        cuda = device.type == "cuda"
        if cuda:  # what other sections left allocated is not this stage's: measure from here
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        base = float(torch.cuda.memory_allocated(device)) if cuda else 0.0
        stage = copy.deepcopy(blocks[a:b]).to(device)
        optimizer = torch.optim.Adam(stage.parameters())
        in_flight = c.microbatches if c.schedule == "gpipe" else min(c.depth - s, c.microbatches)
        versions = [p.detach().clone() for p in stage.parameters()] if c.schedule == "2bw" else []
        outputs = []
        for _ in range(in_flight):  # 1F1B's (or GPipe's) activations held at the stage's peak
            x = (
                _ids(c.microbatch_size, args.seq, device)
                if a == 0
                else torch.randn(
                    c.microbatch_size, args.seq, width, device=device, dtype=next(stage.parameters()).dtype, requires_grad=True
                )
            )
            outputs.append(stage(x))
        for y in outputs:
            y.float().mean().backward()
        optimizer.step()
        measured = float(torch.cuda.max_memory_allocated(device)) - base if cuda else float("nan")
        out[f"stage {s}"] = {
            "blocks": f"{a}..{b - 1}",
            "in_flight": in_flight,
            "allocated_before_bytes": base,
            "predicted_bytes": predicted,
            "measured_bytes": measured,
            "ratio": measured / predicted,
        }
        del stage, optimizer, outputs, versions
    return out


def _fresh_fit(strategy: Any, accelerator: str, devices: int, steps: int, out: str) -> dict[str, torch.Tensor]:
    """A multi-process fit from this process (float64, GPT-tiny); the model the run hands back."""
    if torch.distributed.is_initialized():  # an earlier one-process section's group: its store holds MASTER_PORT
        torch.distributed.destroy_process_group()
    os.environ.pop("MASTER_PORT", None)  # the launcher picks a free one
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, precision="64-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    module = CausalLM("gpt-tiny", lr=1e-3, weight_decay=0.0)
    trainer.fit(module, _data(32))
    return {k: v.detach().double().cpu() for k, v in module.state_dict().items()}


def _avgpipe_shared(accelerator: str, start: str, out: str) -> dict[str, torch.Tensor]:
    """AvgPipe N = 2 on one device (2 processes sharing it), 6 steps; the reference model back."""
    return _fresh_fit(AutoPipeStrategy(pipelines=2, microbatches=4, partition="uniform", start_method=start), accelerator, 1, 6, out)


@section("AvgPipe: two pipelines sharing one GPU")
def shared(args: argparse.Namespace, report: dict) -> dict:
    # the paper's layout on one device: both pipelines' processes on it, the world group gloo (NCCL holds
    # one rank per GPU), each pipeline one stage; the same job on CPU processes follows the AvgPipe rule
    # exactly (tests/test_shared_devices.py), so the GPU run must agree with it up to float64 rounding
    # fork: not after CUDA is initialised, nor from this process's threads of earlier sections; the smoke (no CUDA)
    # forks its ranks from a fresh server, one interpreter start instead of one per rank
    start = "forkserver" if args.smoke else "spawn"
    on_cpu = _avgpipe_shared("cpu", start, str(args.out))
    if args.smoke:
        return {"ran on CPU processes (smoke)": sorted(on_cpu)[:3]}
    on_gpu = _avgpipe_shared("gpu", start, str(args.out))
    out = {"max rel error, GPU-shared vs CPU processes": _max_rel(on_gpu, on_cpu)}
    assert out["max rel error, GPU-shared vs CPU processes"] <= 1e-10, out
    return out


def _sharded(accelerator: str, shard: str, out: str, schedule: str = "1f1b", **settings: Any) -> dict[str, torch.Tensor]:
    """pp2 x dp2 on 4 devices (NCCL on GPUs), 4 steps, `shard` over the 2 replicas; the model back."""
    strategy = AutoPipeStrategy(
        width=2, shard=shard, schedule=schedule, microbatches=4, partition="uniform", start_method="spawn", **settings
    )
    return _fresh_fit(strategy, accelerator, 4, 4, out)


@section("pipeline x sharded data parallel on 4 GPUs")
def sharded(args: argparse.Namespace, report: dict) -> dict:
    # NCCL's paths of shard="optimizer" (the owners' broadcast) and shard="full" (FSDP2's all-gather and
    # reduce-scatter on a mesh of the stage's replicas; under zero bubble, the reduce-scatter after the last W)
    # against whole replicas on the same 4 GPUs (those equal one process on CPU: tests/test_strategy.py,
    # tests/test_zero.py run all of them there)
    if args.smoke:
        return {"not run on CPU": "4 processes; tests/test_zero.py runs every shard setting on CPU processes"}
    if torch.cuda.device_count() < 4:
        return {"not run": f"needs 4 GPUs (pp2 x dp2), this machine has {torch.cuda.device_count()}"}
    whole = _sharded("gpu", "none", str(args.out))
    out = {f"shard={s}: max rel error vs shard=none": _max_rel(_sharded("gpu", s, str(args.out)), whole) for s in ("optimizer", "full")}
    out["shard=full, zb-h1: max rel error vs shard=none"] = _max_rel(_sharded("gpu", "full", str(args.out), "zb-h1"), whole)
    # schedule="auto" priced with FSDP2's all-gathers timed over NCCL at setup; any schedule it picks is synchronous
    out["shard=full, schedule=auto: max rel error vs shard=none"] = _max_rel(_sharded("gpu", "full", str(args.out), "auto"), whole)
    # 2BW's rule with each rank's shard of the stashed version (FSDP2 gathering it for forward and backward)
    two_bw = _sharded("gpu", "none", str(args.out), "2bw")
    out["shard=full, 2bw: max rel error vs 2bw, shard=none"] = _max_rel(_sharded("gpu", "full", str(args.out), "2bw"), two_bw)
    assert all(v <= 1e-10 for v in out.values()), out
    return out


def _tensor(accelerator: str, devices: int, out: str, **settings: Any) -> dict[str, torch.Tensor]:
    """GPT-tiny on `devices` devices, 4 steps, float64; the model back."""
    strategy = AutoPipeStrategy(microbatches=4, partition="uniform", start_method="spawn", **settings)
    return _fresh_fit(strategy, accelerator, devices, 4, out)


@section("pipeline x tensor parallel on 4 and 8 GPUs")
def tensor(args: argparse.Namespace, report: dict) -> dict:
    # NCCL's paths of tensor=2 (the row-parallel all-reduces, the fused q, k, v's strided shards, the
    # pipeline's messages between tensor ranks) against pp4 on the same GPUs (both equal one process on CPU:
    # tests/test_tensor_parallel.py); on 8 GPUs pp2 x dp2 x tp2, the replicas' all-reduce beside tp's
    if args.smoke:
        return {"not run on CPU": "4 and 8 processes; tests/test_tensor_parallel*.py run them on CPU processes"}
    gpus = torch.cuda.device_count()
    if gpus < 4:
        return {"not run": f"needs 4 GPUs (pp2 x tp2), this machine has {gpus}"}
    pipeline = _tensor("gpu", 4, str(args.out))
    out = {"pp2 x tp2: max rel error vs pp4": _max_rel(_tensor("gpu", 4, str(args.out), tensor=2), pipeline)}
    if gpus >= 8:
        wide = _tensor("gpu", 8, str(args.out), width=2)
        out["pp2 x dp2 x tp2: max rel error vs pp4 x dp2"] = _max_rel(_tensor("gpu", 8, str(args.out), width=2, tensor=2), wide)
    assert all(v <= 1e-10 for v in out.values()), out
    return out


@section("torch.compile per block")
def compiled(args: argparse.Namespace, report: dict) -> dict:
    from lightning_pipe.lightning.compiling import compile_blocks

    device, dtype, name = device_of(args), torch.float32 if args.smoke else torch.bfloat16, _models(args)[0]
    blocks, ids = _blocks(name, dtype), _ids(args.mbs, args.seq, device)
    timed = {}
    for kind in ("eager", "compiled"):
        if kind == "compiled":
            compile_blocks(blocks)
        # warm-up 2: the first pass compiles each block (Inductor), the second pays no compile
        measured = profile_blocks(list(blocks), ids, device, model=name, repeats=5, warmup=2)
        timed[kind] = [1e3 * (measured[i]["forward"] + measured[i]["backward"]) for i in sorted(measured)]
        if kind == "eager":
            with torch.no_grad():
                reference = blocks.to(device)(ids).float()
            blocks.to("cpu")
    with torch.no_grad():
        output = blocks.to(device)(ids).float()
    blocks.to("cpu")
    per_block = {
        f"{i} {type(b).__name__}": {"eager ms": e, "compiled ms": c, "compiled / eager": c / e}
        for i, (b, e, c) in enumerate(zip(blocks, timed["eager"], timed["compiled"]))
    }
    eager, comp = sum(timed["eager"]), sum(timed["compiled"])
    error = float((output - reference).abs().max() / reference.abs().max())
    assert math.isfinite(error) and error < (1e-4 if args.smoke else 5e-2), error  # bf16 kernels fuse differently
    return {"model": name, "dtype": str(dtype), "whole model ms": {"eager": eager, "compiled": comp, "compiled / eager": comp / eager},
            "max relative output difference": error, "per block": per_block}  # fmt: skip


# ---- the report -----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = device_of(args)
    report: dict[str, Any] = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "sections": {},
    }
    for name, fn in SECTIONS:
        if args.only and not any(part.lower() in name.lower() for part in args.only):
            continue
        started = time.perf_counter()
        try:
            result, status = fn(args, report), "ok"
        except Exception:  # noqa: BLE001 - one section failing must not hide the others' results
            result, status = traceback.format_exc(limit=6), "failed"
        report["sections"][name] = {"status": status, "seconds": time.perf_counter() - started, "result": result}
        print(f"[gpu_check] {name}: {status} ({time.perf_counter() - started:.1f} s)", flush=True)
    for key in [k for k in report if k.startswith("_")]:
        del report[key]
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (Path(args.out) / "gpu_check.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "", f"{report['provenance']}; torch {report['torch']}", ""]
    for name, s in report["sections"].items():
        lines += [f"## {name}: {s['status']} ({s['seconds']:.1f} s)", ""]
        result = s["result"]
        if isinstance(result, dict):
            for key, value in result.items():
                text = value if isinstance(value, str) and "\n" in value else json.dumps(value, default=str)
                lines += [f"**{key}**", "", "```", text, "```", ""]
        else:
            lines += ["```", str(result), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the small CPU version (what CI runs)")
    parser.add_argument("--out", default="gpu_check", help="folder for the report and the profiles")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: 1024 on GPU, 32 smoke)")
    parser.add_argument("--mbs", type=int, default=None, help="micro-batch size of the block profiles (default 4, smoke 2)")
    parser.add_argument("--only", nargs="*", default=[], help="run the sections whose names contain one of these words")
    args = parser.parse_args()
    args.seq = args.seq or (32 if args.smoke else 1024)
    args.mbs = args.mbs or (2 if args.smoke else 4)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU version")
    report = run(args)
    failed = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    print(f"[gpu_check] report: {args.out}/gpu_check.md" + (f"; FAILED: {failed}" if failed else "; all sections ok"))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
