"""The front end's cost: Hugging Face GPT-2 trained as it is (a model that loops over its blocks, traced
and cut by lightning_pipe.frontend) against the same-size model written as our nn.Sequential GPT, and
the front end's setup (convert, trace, plan) for GPT-2 1.3B built on the meta device. Results:
docs/benchmarks_frontend.md (raw: docs/benchmarks_frontend.json).

Parts (``--parts``, all by default):

- ``throughput``: samples/s through ``Trainer(strategy=AutoPipeStrategy(schedule="1f1b"))`` on 2 gloo
  processes x 1 thread, the partition fixed to the same layers per stage on both sides (HF: [First,
  layers 0..n/2-1] | [layers n/2..n-1, Last]; ours: [embedding, n/2 x (attention, FFN)] | [n/2 x
  (attention, FFN), head]), the same micro-batches; and each model through the Trainer in one process.
  Interleaved rounds; medians and min..max of rounds.
- ``overhead``: one process, one thread, one micro-batch: forward + backward of the whole model and of
  each stage's share, HF as it is against its traced pipeline's adapters on the same weights (and ours);
  the adapters' forwards against the code they stand for (what the front end itself costs, and where).
- ``planning``: GPT-2 1.3B (24 layers, hidden 2048, 16 heads, vocabulary 50257, 1024 positions) as a
  user's HF model built on the meta device: the time to build it, `convert`, `trace` (on the meta-built
  model, with one sequence of --trace-tokens tokens) and plan the partition on --plan-stages stages with
  the strategy's `plan_run` (AutoPipe, 1F1B, m = 2 x stages) on analytic costs (planning/flops.py,
  attention + FFN summed per HF block; the strategy cannot profile a meta-built model).

    flock /tmp/bench.lock python benchmarks/bench_frontend.py --rounds 5 --json docs/benchmarks_frontend.json
    python benchmarks/bench_frontend.py --parts overhead --rounds 7
    python benchmarks/bench_frontend.py --quick
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import time
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_pipe.bench.harness import Bench, Table, interleave, spread
from lightning_pipe.bench.launch import OTHER_JOBS, CpuClock, foreign_load, wait_for_quiet
from lightning_pipe.bench.trainer_runs import quiet_lightning

MODES = ["hf-1f1b", "ours-1f1b", "hf-single", "ours-single"]
PARTS = ["throughput", "overhead", "planning"]
BIG = dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257, n_positions=1024)  # GPT-2 1.3B (planning/flops.py's gpt2-1.3b)


# ---- the two models, as a user writes them ----------------------------------------------------------
def hf_model(cfg: dict, **sizes: Any):
    """GPT2LMHeadModel from a config: dropout 0, exact GELU (ours uses nn.GELU(); GPT-2's default
    gelu_new is a Python tanh formula, several elementwise kernels), the head tied to the embedding,
    no key/value cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    fields = dict(n_layer=cfg["layers"], n_embd=cfg["hidden"], n_head=cfg["heads"], vocab_size=cfg["vocab"], n_positions=cfg["seq"])
    fields.update(sizes)
    config = GPT2Config(
        **fields, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
    )
    config.loss_type = "ForCausalLM"  # transformers' default for this model, named (no warning)
    config.use_cache = False  # as the front end sets it (else every forward fills a key/value cache, in one process too)
    return GPT2LMHeadModel(config)


def our_model(cfg: dict):
    from lightning_pipe.models import ModelConfig, build_gpt

    return build_gpt(
        ModelConfig(vocab_size=cfg["vocab"], n_layer=cfg["layers"], n_head=cfg["heads"], d_model=cfg["hidden"], max_seq_len=cfg["seq"]),
        seed=0,
    )


class HFUser(L.LightningModule):
    """The user's module: the HF model as an attribute; the step returns the model's own loss."""

    def __init__(self, cfg: dict, model: Any = None):
        super().__init__()
        self.lr = cfg["lr"]
        self.model = model if model is not None else hf_model(cfg)

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        loss = self.model(input_ids=ids, labels=ids).loss  # HF shifts the labels: T - 1 targets per row
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class OursLM(L.LightningModule):
    """Our GPT (an nn.Sequential of sub-layer blocks): next-token cross-entropy over T targets per row."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.lr = cfg["lr"]
        self.model = our_model(cfg)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TokenRows(Dataset):
    """Random token rows (ids, next ids), the same for every mode."""

    def __init__(self, cfg: dict, rows: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, cfg["vocab"], (rows, cfg["seq"] + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i, :-1], self.ids[i, 1:]


def partition(kind: str, layers: int) -> list[int]:
    """Blocks per stage, half the layers on each: HF [First + n/2 layers, n/2 layers + Last], ours
    [embedding + n/2 (attention, FFN), n/2 (attention, FFN) + head]."""
    half = layers // 2
    return [1 + half, layers - half + 1] if kind == "hf" else [1 + 2 * half, 2 * (layers - half) + 1]


# ---- throughput: the Trainer on 2 processes and on 1 -------------------------------------------------
def fit_job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """One ``Trainer.fit`` in the launched processes (as under torchrun: the environment says they
    exist); warm-up steps, then timed steps between two barriers."""
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    from lightning.pytorch.callbacks import Callback

    quiet_lightning()
    kind = mode.split("-")[0]
    torch.manual_seed(0)
    module = HFUser(cfg) if kind == "hf" else OursLM(cfg)
    last = cfg["warmup"] + cfg["steps"] - 1
    barrier = dist.barrier if world > 1 else (lambda: None)

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = self.t = self.total = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["warmup"]:
                barrier()
                self.start = time.perf_counter()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= cfg["warmup"]:
                self.times.append(time.perf_counter() - self.t)
            if batch_idx == last:
                barrier()
                self.total = time.perf_counter() - self.start

    clock = Clock()
    kwargs = dict(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    kwargs.update(enable_model_summary=False, num_sanity_val_steps=0, max_steps=last + 1, callbacks=[clock])
    if world > 1:
        from lightning_pipe import AutoPipeStrategy

        kwargs["strategy"] = AutoPipeStrategy(schedule="1f1b", microbatches=cfg["microbatches"], partition=partition(kind, cfg["layers"]))
    data = DataLoader(TokenRows(cfg, (last + 1) * cfg["batch"]), batch_size=cfg["batch"])
    L.Trainer(**kwargs).fit(module, data)
    return {"total": clock.total, "times": clock.times}


def throughput(bench: Bench, args: Any, cfg: dict) -> dict:
    modes = [m for m in MODES if m in args.modes]

    def run(mode: str, r: int) -> dict:
        world = 1 if mode.endswith("single") else 2
        label = f"round {r + 1}/{args.rounds} {mode}"
        results, foreign = bench.run(fit_job, world, mode, cfg, label=label)
        total = max(res["total"] for res in results)
        step = max(statistics.median(res["times"]) for res in results)
        out = {"samples_s": cfg["steps"] * cfg["batch"] / total, "step_ms": 1e3 * step, "foreign": foreign}
        bench.log(
            f"  {label:28s} {out['samples_s']:7.1f} samples/s ({1e3 * total / cfg['steps']:.1f} ms/step, other load {foreign:.2f} CPUs)"
        )
        return out

    rounds = dict(zip(modes, interleave(modes, args.rounds, run)))
    bench.keep("throughput", rounds)
    rate = {m: spread(x["samples_s"] for x in rounds[m]) for m in modes}
    table = Table(
        "mode", "samples/s, median (min..max)", "ms/step (median step)", "vs one process of the same model", "other load (CPUs, max)"
    )
    for m in modes:
        single = f"{m.split('-')[0]}-single"
        vs = f"{rate[m].median / rate[single].median:.3f}x" if single in rate and m != single else ""
        steps = spread(x["step_ms"] for x in rounds[m])
        table.add(m, rate[m].fmt(), f"{steps.median:.1f}", vs, f"{max(x['foreign'] for x in rounds[m]):.2f}")
    bench.table(table, f"Throughput ({args.rounds} interleaved rounds, {cfg['steps']} timed steps after {cfg['warmup']} each):")
    ratios = {}
    for kind in ("1f1b", "single"):
        hf, ours = f"hf-{kind}", f"ours-{kind}"
        if hf in rounds and ours in rounds:
            paired = spread(a["samples_s"] / b["samples_s"] for a, b in zip(rounds[hf], rounds[ours]))
            ratios[kind] = (rate[hf].median / rate[ours].median, paired)
            target = " (target >= 0.97: the traced cut's overhead <= 3%)" if kind == "1f1b" else ""
            bench.say(
                f"HF / ours, {kind}: {ratios[kind][0]:.3f} (medians of rounds); per round {paired.fmt(digits=3)}{target}"
                + (f" -> {'met' if ratios[kind][0] >= 0.97 else 'NOT met'}" if target else "")
            )
    if len(ratios) == 2:
        bench.say(
            f"HF / ours under the pipeline relative to HF / ours in one process: {ratios['1f1b'][0] / ratios['single'][0]:.3f} "
            "(the model code's own difference divided out)"
        )
    bench.say()
    return {"rate": rate, "ratios": ratios}


# ---- overhead: one process, one micro-batch -----------------------------------------------------------
class _Stop(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args_, self.kwargs_ = args, kwargs


def _stop_at(block: torch.nn.Module):
    """A pre-hook that stops the model's forward when `block` is called, with its call."""

    def hook(_m, args, kwargs):
        raise _Stop(args, kwargs)

    return block.register_forward_pre_hook(hook, with_kwargs=True)


def _until(model: torch.nn.Module, block: torch.nn.Module, **call: Any) -> tuple[tuple, dict]:
    """The model's forward (HF's own code) up to `block`'s call; that call (args, kwargs)."""
    handle = _stop_at(block)
    try:
        model(**call)
    except _Stop as stop:
        return stop.args_, stop.kwargs_
    finally:
        handle.remove()
    raise RuntimeError(f"{type(model).__name__} never called {type(block).__name__}")


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def timer(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median seconds of `reps` calls of `fn` (after `warmup` untimed ones)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def overhead(bench: Bench, args: Any, cfg: dict) -> dict:
    from lightning_pipe.frontend import convert, trace

    torch.manual_seed(0)
    plain = hf_model(cfg)
    user = HFUser(cfg, copy.deepcopy(plain))  # the same weights, converted
    mbs, n, half = cfg["batch"] // cfg["microbatches"], cfg["layers"], cfg["layers"] // 2
    rows = TokenRows(cfg, mbs)
    ids, targets = rows.ids[:, :-1], rows.ids[:, 1:]
    started = time.perf_counter()
    path, pipe = convert(user)
    converted = time.perf_counter() - started
    trace(user, path, pipe, (ids, targets))
    traced = time.perf_counter() - started - converted
    blocks = list(pipe)  # First, Repeated 0 .. n-1, Last
    first, last = blocks[0], blocks[-1]
    ours = our_model(cfg)
    k = 1 + 2 * half  # ours' stage 0: embedding + half the layers
    hp, tr = plain.transformer.h, plain.transformer

    with torch.no_grad():  # the block call HF makes (hidden, then position ids, flags ...), and the stage boundary's input
        (h0, *rest), kw = _until(plain, hp[0], input_ids=ids, labels=ids)
        (hk, *_), _ = _until(plain, hp[half], input_ids=ids, labels=ids)
        carry0 = _chain(blocks[: 1 + half], ids)  # what the traced stage 0 sends: (hidden, position ids)
        ours_k = ours[:k](ids)
    grad = torch.randn_like(hk)

    def hf_plain_whole():
        plain(input_ids=ids, labels=ids).loss.backward()

    def hf_traced_whole():
        pipe(input_ids=ids, labels=ids).loss.backward()

    def ours_whole():
        F.cross_entropy(ours(ids).flatten(0, 1), targets.flatten()).backward()

    def hf_plain_stage0():  # HF's forward up to block n/2 (what stage 0 sends), backward from the received gradient
        (h, *_), _ = _until(plain, hp[half], input_ids=ids, labels=ids)
        h.backward(grad)

    def hf_traced_stage0():
        out = _chain(blocks[: 1 + half], ids)
        out[0].backward(grad)

    def ours_stage0():
        ours[:k](ids).backward(grad)

    def hf_plain_stage1():
        h = hk.detach().requires_grad_()
        for i in range(half, n):
            h = _hidden(hp[i](h, *rest, **kw))
        logits = plain.lm_head(tr.ln_f(h))
        plain.loss_function(logits, ids, vocab_size=cfg["vocab"]).backward()

    def hf_traced_stage1():
        x: Any = (carry0[0].detach().requires_grad_(), *carry0[1:])
        for b in blocks[1 + half :]:
            x = b(x)
        x.loss.backward()

    def ours_stage1():
        h = ours_k.detach().requires_grad_()
        F.cross_entropy(ours[k:](h).flatten(0, 1), targets.flatten()).backward()

    # the adapters' forwards (autograd on, as in training; no backward) against the code they stand for
    x0 = _call(ids)
    h_in = h0.detach()

    def first_fwd():
        first(x0)

    def hf_prelude():  # HF's own forward up to block 0: what First runs, without the front end
        _until(plain, hp[0], input_ids=ids, labels=ids)

    def repeated_fwd():
        blocks[1]((h_in, *carry0[1:]))

    def block_fwd():
        hp[0](h_in, *rest, **kw)

    def last_fwd():
        last(carry0)

    def after_loop():  # the code after the loop, as HF runs it: final norm, head, loss
        plain.loss_function(plain.lm_head(tr.ln_f(carry0[0])), ids, vocab_size=cfg["vocab"])

    loop_block = next(blocks[1].children())  # block 0 as the model holds it: Last's prelude ends where the model calls it
    marks: list[float] = []

    def last_prelude():  # Last's run of the code before the loop (on meta) until the loop: timed to block 0's call
        handle = loop_block.register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))
        try:
            t = time.perf_counter()
            last(carry0)
            return marks.pop() - t
        finally:
            handle.remove()

    whole = {"ours": ours_whole, "hf plain": hf_plain_whole, "hf traced": hf_traced_whole}
    stage0 = {"ours": ours_stage0, "hf plain": hf_plain_stage0, "hf traced": hf_traced_stage0}
    stage1 = {"ours": ours_stage1, "hf plain": hf_plain_stage1, "hf traced": hf_traced_stage1}
    adapters = {
        "First": first_fwd,
        "HF before the loop": hf_prelude,
        "Repeated 0": repeated_fwd,
        "block 0": block_fwd,
        "Last": last_fwd,
        "HF after the loop": after_loop,
    }
    configs = [
        (part, name, fn)
        for part, fns in (("whole", whole), ("stage 0", stage0), ("stage 1", stage1), ("fwd", adapters))
        for name, fn in fns.items()
    ]

    def run(config, r: int) -> float:
        part, name, fn = config
        if part == "stage 1" and name == "hf traced":
            with torch.no_grad():
                first(x0)  # the last stage's rank gets the user's call with every micro-batch: here First's run sets it
        reps = args.reps * (4 if part == "fwd" else 1)
        return timer(fn, reps)

    def run_prelude(r: int) -> float:
        with torch.no_grad():
            first(x0)
        for _ in range(2):
            last_prelude()
        return statistics.median(last_prelude() for _ in range(args.reps * 4))

    configs.append(("fwd", "Last: before the loop (meta)", None))
    wrapped = lambda config, r: run_prelude(r) if config[2] is None else run(config, r)  # noqa: E731
    results: list[list[float]] = [[] for _ in configs]
    loads = []
    for r in range(args.rounds):  # A B C, A B C ...; each round after the machine went quiet, its foreign load measured
        quiet(bench, args)
        gc.collect()
        start = CpuClock.now()
        for i, times in enumerate(interleave(configs, 1, lambda config, _r: wrapped(config, r))):
            results[i] += times
        loads.append(foreign_load(start, CpuClock.now()))
        bench.log(f"  overhead round {r + 1}/{args.rounds}: other load {loads[-1]:.2f} CPUs")
    by = {(part, name): spread(times) for (part, name, _), times in zip(configs, results)}
    bench.keep("overhead", {f"{p}/{n}": s for (p, n), s in by.items()})
    bench.keep("overhead_rounds", {f"{p}/{n}": times for (p, n, _), times in zip(configs, results)})
    bench.keep("overhead_foreign", loads)
    bench.keep("overhead_setup", {"convert_s": converted, "trace_s": traced})
    mb = f"{mbs} x {cfg['seq']} tokens"
    t = Table(
        "one micro-batch, forward + backward",
        "ours (ms)",
        "HF as it is (ms)",
        "HF traced (ms)",
        "traced - as it is (ms)",
        "front end's share",
        "HF traced / ours",
    )
    for part, label in (("whole", "whole model, one process"), ("stage 0", f"stage 0: embedding + layers 0-{half - 1}"), ("stage 1", f"stage 1: layers {half}-{n - 1} + head, loss")):  # fmt: skip
        o, p, q = by[(part, "ours")], by[(part, "hf plain")], by[(part, "hf traced")]
        t.add(
            label,
            o.fmt(1e3, 2),
            p.fmt(1e3, 2),
            q.fmt(1e3, 2),
            f"{1e3 * (q.median - p.median):+.2f}",
            f"{(q.median / p.median - 1) * 100:+.1f}%",
            f"{q.median / o.median:.3f}",
        )
    bench.table(
        t,
        f"In one process, one thread, one micro-batch ({mb}); median of {args.rounds} interleaved rounds (min..max), each the median of {args.reps} runs:",
    )
    a = Table("forward only (autograd on)", "adapter (ms)", "what it stands for, without the front end (ms)", "front end's own cost (ms)")
    for adapter, native, what in (("First", "HF before the loop", "HF's forward up to block 0"), ("Repeated 0", "block 0", "block 0 called directly"), ("Last", "HF after the loop", "final norm, head, loss")):  # fmt: skip
        x, y = by[("fwd", adapter)], by[("fwd", native)]
        a.add(f"{adapter} vs {what}", x.fmt(1e3, 3), y.fmt(1e3, 3), f"{1e3 * (x.median - y.median):+.3f}")
    pre = by[("fwd", "Last: before the loop (meta)")]
    a.add("of which Last's rerun of the code before the loop (on meta)", pre.fmt(1e3, 3), by[("fwd", "HF before the loop")].fmt(1e3, 3), "")
    bench.table(a, f"The adapters' forwards ({mb}; each the median of {4 * args.reps} runs):")
    bench.say(f"Other processes' load during the rounds: {spread(loads).fmt(digits=2)} CPUs (median, min..max).")
    bench.say(f"convert {converted * 1e3:.1f} ms, trace {traced * 1e3:.1f} ms (this model, one micro-batch)\n")
    return by


def quiet(bench: Bench, args: Any) -> None:
    """Before an in-process measurement: wait (within the budget) for other benchmarks and tests to end and the CPUs to idle."""
    if bench.patient:
        wait_for_quiet(args.quiet_wait, args.max_foreign, patterns=OTHER_JOBS, log=bench.log)


def _call(ids: torch.Tensor):
    from lightning_pipe.runtime.call import as_input

    return as_input((), {"input_ids": ids, "labels": ids})


def _chain(blocks: list, ids: torch.Tensor) -> Any:
    x = _call(ids)
    for b in blocks:
        x = b(x)
    return x


# ---- planning: GPT-2 1.3B built on the meta device ----------------------------------------------------
def traced_costs(costs: Any, layers: int, seq: int) -> Any:
    """Sub-layer analytic costs (embedding, [attention, FFN] x layers, head) as the traced pipeline's
    blocks: First = the embedding, Repeated i = attention i + FFN i, Last = the head with the loss.
    What crosses a cut after First or a layer: the hidden state and GPT-2's position ids (1 x T int64)."""
    from lightning_pipe.simulation import CostModel

    def fold(values: tuple) -> list:
        return [values[0], *(values[1 + 2 * i] + values[2 + 2 * i] for i in range(layers)), values[-1]]

    acts = costs.activation_bytes
    activation = [acts[0] + 8 * seq, *(acts[2 + 2 * i] + 8 * seq for i in range(layers)), acts[-1]]
    return CostModel(
        tuple(fold(costs.forward)),
        tuple(fold(costs.backward)),
        activation_bytes=tuple(activation),
        param_bytes=tuple(fold(costs.param_bytes)),
        bandwidth=costs.bandwidth,
        latency=costs.latency,
    )


def planning(bench: Bench, args: Any) -> dict:
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.frontend import convert, trace
    from lightning_pipe.planning import transformer_costs
    from lightning_pipe.planning.entry import block_kinds, plan_run
    from lightning_pipe.planning.replay import cached_schedule, compiled

    quiet(bench, args)
    big = dict(layers=BIG["n_layer"], hidden=BIG["n_embd"], heads=BIG["n_head"], vocab=BIG["vocab_size"], seq=BIG["n_positions"], lr=1e-4)
    builds, converts = [], []
    for _ in range(args.plan_repeats):
        started = time.perf_counter()
        with torch.device("meta"):
            module = HFUser(big)
        built = time.perf_counter()
        path, pipe = convert(module)
        builds.append(built - started)
        converts.append(time.perf_counter() - built)
    meta = all(t.is_meta for t in module.parameters())
    traces: dict[int, list[float]] = {}
    errors: dict[int, str] = {}
    for tokens in args.trace_tokens:
        for _ in range(1 if tokens > 256 else args.plan_repeats):
            with torch.device("meta"):
                module = HFUser(big)
            path, pipe = convert(module)
            ids = torch.randint(0, big["vocab"], (1, tokens), generator=torch.Generator().manual_seed(0))
            gc.collect()
            started = time.perf_counter()
            try:
                trace(module, path, pipe, (ids, ids))
            except Exception as err:  # noqa: BLE001  (reported: whether a meta-built model traces is part of the result)
                errors[tokens] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                break
            traces.setdefault(tokens, []).append(time.perf_counter() - started)
            bench.log(f"  trace, 1 x {tokens} tokens: {traces[tokens][-1]:.2f} s")
    kinds = block_kinds([type(b).__name__ for b in pipe])  # as the strategy names a traced pipeline's blocks
    sub, sub_kinds = transformer_costs("gpt2-1.3b", args.plan_mbs)
    hf_costs = traced_costs(sub, big["layers"], big["seq"])
    plans: dict[tuple[str, int], dict] = {}
    for stages in args.plan_stages:
        config = PipelineConfig(schedule="1f1b", microbatches=2 * stages, partition="autopipe")
        for name, costs, k in (("HF traced", hf_costs, kinds), ("ours", sub, sub_kinds)):
            times, result = [], None
            for _ in range(args.plan_repeats):
                compiled.cache_clear()
                cached_schedule.cache_clear()
                started = time.perf_counter()
                result = plan_run(costs, stages, config, k)
                times.append(time.perf_counter() - started)
            assert result is not None and result.plan is not None
            plans[(name, stages)] = {
                "seconds": times,
                "blocks": costs.num_blocks,
                "sizes": [b - a for a, b in result.bounds],
                "iteration_ms": result.plan.iteration_time * 1e3,
            }
    bench.keep(
        "planning",
        {
            "build_s": builds,
            "convert_s": converts,
            "trace_s": {str(k): v for k, v in traces.items()},
            "trace_errors": errors,
            "plans": {f"{n}/{s}": v for (n, s), v in plans.items()},
        },
    )
    t = Table("GPT-2 1.3B on the meta device", "seconds, median (min..max)", "runs")
    t.add("build HFUser(GPT2LMHeadModel(config)) under torch.device('meta')", spread(builds).fmt(1, 3), len(builds))
    t.add("convert (find the blocks, swap in the TracedPipeline)", spread(converts).fmt(1e3, 2).replace(" (", " ms ("), len(converts))
    for tokens in args.trace_tokens:
        if tokens in traces:
            t.add(f"trace (the user's training_step once, 1 x {tokens} tokens)", spread(traces[tokens]).fmt(1, 2), len(traces[tokens]))
        else:
            t.add(f"trace, 1 x {tokens} tokens: failed ({errors.get(tokens, '?')})", "", 0)
    bench.table(t, f"Setup of the front end, one process, one thread (parameters on meta after convert: {meta}):")
    p = Table(
        "plan (AutoPipe, 1F1B, m = 2 x stages)",
        "stages",
        "blocks",
        "planning ms, median (min..max)",
        "blocks per stage",
        "simulated iteration (ms)",
    )
    for (name, stages), v in plans.items():
        p.add(name, stages, v["blocks"], spread(v["seconds"]).fmt(1e3, 1), " ".join(map(str, v["sizes"])), f"{v['iteration_ms']:.1f}")
    bench.table(
        p,
        f"Planning GPT-2 1.3B with plan_run, analytic costs (planning/flops.py: micro-batch {args.plan_mbs} x 1024 tokens, 100 TFLOP/s, "
        f"100 Gb/s links), caches cleared before each of {args.plan_repeats} runs; HF traced: First, 24 layers (attention + FFN), Last; "
        "ours: embedding, 48 sub-layer blocks, head:",
    )
    return {"plans": plans, "traces": traces}


def main() -> None:
    bench = Bench(
        __doc__,
        quick=dict(reps=3, plan_repeats=1, trace_tokens=[16]),
        threads=1,
        rounds=5,
        steps=20,
        warmup=5,
        retries=2,
        max_foreign=0.15,
        quiet_wait=30.0,
        budget=1800.0,
        timeout=600.0,
        pin=False,
    )
    bench.options(parts=(PARTS, f"of {PARTS}"), modes=(MODES, f"throughput: of {MODES}"))
    bench.options(layers=(4, "even: half per stage"), hidden=128, heads=4, vocab=260, seq=128, lr=1e-3)
    bench.options(batch=(32, "rows per step"), microbatches=4, reps=(10, "overhead: timed runs per configuration per round"))
    bench.options(plan_stages=([8, 16], "planning: pipeline stages"), plan_mbs=(16, "planning: micro-batch size (sequences of 1024)"))
    bench.options(trace_tokens=([128, 1024], "planning: the trace's sample, one sequence of this many tokens"))
    bench.options(plan_repeats=(5, "planning: runs of build, convert, short traces and plans"))
    args = bench.parse()
    if args.layers % 2 or args.batch % args.microbatches:
        bench.error("--layers must be even and --batch divisible by --microbatches")
    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "lr", "batch", "microbatches", "steps", "warmup")}
    bench.say(
        f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, {args.seq} positions, tied head, "
        f"dropout 0, exact GELU; batch {args.batch} = {args.microbatches} micro-batches of {args.batch // args.microbatches}; "
        f"HF partition {partition('hf', args.layers)} blocks, ours {partition('ours', args.layers)}\n"
    )
    if "throughput" in args.parts:
        throughput(bench, args, cfg)
    if "overhead" in args.parts:
        overhead(bench, args, cfg)
    if "planning" in args.parts:
        planning(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
