"""The front end's cost: Hugging Face GPT-2 trained as it is (a model that loops over its blocks, traced
and cut by lightning_pipe.frontend) against the same-size model written as our nn.Sequential GPT and
against the same HF modules cut by hand, and the front end's setup (convert, trace, plan) for GPT-2
1.3B built on the meta device. Results: docs/results/benchmarks_frontend.md (raw: docs/results/benchmarks_frontend*.json).

Parts (``--parts``, all by default):

- ``throughput``: samples/s through ``Trainer(strategy=AutoPipeStrategy(schedule="1f1b"))`` on 2 gloo
  processes x 1 thread, half the layers on each stage on every side, the same micro-batches
  (``--modes``): hf-1f1b (the front end's default cut: each block in two halves where the trace
  verifies it), hf-whole-1f1b (``sublayers=False``: [First, layers 0..n/2-1] | [layers n/2..n-1,
  Last]), hf-hand-1f1b (the control: the same HF modules in an nn.Sequential by hand, no front end),
  ours-1f1b ([embedding, n/2 x (attention, FFN)] | [n/2 x (attention, FFN), head]); hf-single and
  ours-single through the Trainer in one process. Interleaved rounds; medians and min..max of rounds.
- ``overhead``: one process, one thread, one micro-batch: forward and backward of the whole model and
  of each stage's share, HF as it is against its traced pipelines (each cut) on the same weights, and
  ours; the adapters' forwards against the code they stand for (what the front end itself costs, and
  where). Each round waits for a quiet machine and records other processes' load.
- ``planning``: GPT-2 1.3B (24 layers, hidden 2048, 16 heads, vocabulary 50257, 1024 positions) as a
  user's HF model built on the meta device: the time to build it, `convert`, `trace` (on the meta-built
  model, one sequence of --trace-tokens tokens) and plan the partition on --plan-stages stages with
  the strategy's `plan_run` (AutoPipe, 1F1B, m = 2 x stages) on analytic costs (planning/flops.py
  mapped onto the traced blocks; the plan command profiles a materialised HF model and refuses a
  meta-built one).

    flock /tmp/bench.lock python -m benchmarks.bench_frontend --rounds 5 --reps 20 --json docs/results/benchmarks_frontend.json
    flock /tmp/bench.lock python -m benchmarks.bench_frontend --parts throughput --modes hf-1f1b,hf-whole-1f1b,hf-hand-1f1b,ours-1f1b --rounds 9 --steps 30
    flock /tmp/bench.lock python -m benchmarks.bench_frontend --parts overhead --rounds 7 --reps 20
    python -m benchmarks.bench_frontend --quick
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import os
import statistics
import time
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness.bench import Bench, Table, interleave, spread
from benchmarks.harness.launch import OTHER_JOBS, CpuClock, foreign_load, wait_for_quiet
from benchmarks.harness.trainer_runs import quiet_lightning

MODES = ["hf-1f1b", "hf-whole-1f1b", "hf-hand-1f1b", "ours-1f1b", "hf-single", "ours-single"]
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


class _Embed(nn.Module):
    """GPT-2's code before the loop, by hand: token + position embeddings (no mask: causal attention without padding)."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)))


class _Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _hidden(self.block(h))


class _Head(nn.Module):
    def __init__(self, transformer: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


class HFHand(L.LightningModule):
    """The control: the same HF modules (same weights as HFUser's, same seed) cut by hand into an
    nn.Sequential [embeddings, GPT2Block x n, final norm + head], HF's own loss function in the step:
    GPT-2's code without the front end (no trace, no rerun)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.lr, self.vocab = cfg["lr"], cfg["vocab"]
        hf = hf_model(cfg)
        self.hf_loss = hf.loss_function  # ForCausalLMLoss: shifts the labels as the model does
        tr = hf.transformer
        self.model = nn.Sequential(_Embed(tr), *(_Block(b) for b in tr.h), _Head(tr, hf.lm_head))  # the head tied to wte

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        loss = self.hf_loss(self.model(ids), ids, vocab_size=self.vocab)
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


def cuts() -> list[str]:
    """The front end's cuts of a block this library offers: "halves" (each block as its attention
    half and its MLP half where the traced block verifies it: the strategy's default since
    PipelineConfig.sublayers) and "whole" (a block per layer), or only "whole" before sub-layer cuts."""
    from lightning_pipe.config import PipelineConfig

    return ["halves", "whole"] if "sublayers" in {f.name for f in dataclasses.fields(PipelineConfig)} else ["whole"]


def traced(cfg: dict, cut: str, model: Any = None) -> Any:
    """An HFUser over `model` (default a fresh HF model) converted and traced on one micro-batch as
    the strategy does it, with `cut` ("halves": the default; "whole": sublayers=False)."""
    from lightning_pipe.frontend import convert, trace

    user = HFUser(cfg, model)
    rows = TokenRows(cfg, cfg["batch"] // cfg["microbatches"])
    path, pipe = convert(user)
    extra = {"sublayers": cut == "halves"} if "sublayers" in inspect.signature(trace).parameters else {}
    trace(user, path, pipe, (rows.ids[:, :-1], rows.ids[:, 1:]), **extra)
    return pipe


def per_layer(pipe: Any, layers: int) -> int:
    """Pipeline blocks per layer of a traced pipeline [First, ..., Last]."""
    return (len(pipe) - 2) // layers


def partition(kind: str, cfg: dict) -> list[int]:
    """Blocks per stage, half the layers on each: HF [First + n/2 layers' blocks, the other layers'
    blocks + Last] (a layer is 1 block whole, 2 in halves), ours [embedding + n/2 (attention, FFN),
    n/2 (attention, FFN) + head]."""
    n, half = cfg["layers"], cfg["layers"] // 2
    default = next(iter(cfg.get("per_layer", {"whole": 1})))  # the strategy's default cut ("hf")
    k = 2 if kind == "ours" else 1 if kind == "hf-hand" else cfg["per_layer"][kind.split("-", 1)[1] if "-" in kind else default]
    return [1 + k * half, k * (n - half) + 1]


# ---- throughput: the Trainer on 2 processes and on 1 -------------------------------------------------
def fit_job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """One ``Trainer.fit`` in the launched processes (as under torchrun: the environment says they
    exist); warm-up steps, then timed steps between two barriers."""
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    from lightning.pytorch.callbacks import Callback

    quiet_lightning()
    kind = mode.rsplit("-", 1)[0]  # hf, hf-whole, ours
    torch.manual_seed(0)
    module = HFHand(cfg) if kind == "hf-hand" else HFUser(cfg) if kind.startswith("hf") else OursLM(cfg)
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

        settings = dict(schedule="1f1b", microbatches=cfg["microbatches"], partition=partition(kind, cfg))
        if kind == "hf-whole" and "halves" in cfg["per_layer"]:
            settings["sublayers"] = False
        kwargs["strategy"] = AutoPipeStrategy(**settings)
    data = DataLoader(TokenRows(cfg, (last + 1) * cfg["batch"]), batch_size=cfg["batch"])
    L.Trainer(**kwargs).fit(module, data)
    return {"total": clock.total, "times": clock.times}


def throughput(bench: Bench, args: Any, cfg: dict) -> dict:
    modes = [m for m in MODES if m in args.modes and (m != "hf-whole-1f1b" or "halves" in cfg["per_layer"])]

    def run(mode: str, r: int) -> dict:
        world = 1 if mode.endswith("single") else 2
        label = f"round {r + 1}/{args.rounds} {mode}"
        results, foreign = bench.run(fit_job, world, mode, cfg, label=label)
        total = max(res["total"] for res in results)
        step = max(statistics.median(res["times"]) for res in results)
        out = {"samples_s": cfg["steps"] * cfg["batch"] / total, "step_ms": 1e3 * step, "foreign": foreign}
        bench.log(
            f"  {label:32s} {out['samples_s']:7.1f} samples/s ({1e3 * total / cfg['steps']:.1f} ms/step, other load {foreign:.2f} CPUs)"
        )
        return out

    rounds = dict(zip(modes, interleave(modes, args.rounds, run)))
    bench.keep("throughput", rounds)
    rate = {m: spread(x["samples_s"] for x in rounds[m]) for m in modes}
    table = Table("mode", "partition (blocks)", "samples/s, median (min..max)", "ms/step (median step)", "vs one process of the same model", "other load (CPUs, max)")  # fmt: skip
    for m in modes:
        single = f"{m.split('-')[0]}-single"
        vs = f"{rate[m].median / rate[single].median:.3f}x" if single in rate and m != single else ""
        steps = spread(x["step_ms"] for x in rounds[m])
        part = "" if m.endswith("single") else str(partition(m.rsplit("-", 1)[0], cfg))
        table.add(m, part, rate[m].fmt(), f"{steps.median:.1f}", vs, f"{max(x['foreign'] for x in rounds[m]):.2f}")
    bench.table(table, f"Throughput ({args.rounds} interleaved rounds, {cfg['steps']} timed steps after {cfg['warmup']} each):")
    ratios = {}
    pairs = [
        ("hf-1f1b", "ours-1f1b", "HF through the front end (its default cut) / ours"),
        ("hf-whole-1f1b", "ours-1f1b", "HF through the front end, whole blocks / ours"),
        ("hf-whole-1f1b", "hf-hand-1f1b", "the traced cut's own cost: the same model code and partition, traced / cut by hand"),
        ("hf-1f1b", "hf-hand-1f1b", "the default cut / HF cut by hand"),
        ("hf-hand-1f1b", "ours-1f1b", "GPT-2's own code / ours, both cut by hand"),
        ("hf-single", "ours-single", "GPT-2's own code / ours, one process"),
    ]
    for a, b, what in pairs:
        if a in rounds and b in rounds:
            paired = spread(x["samples_s"] / y["samples_s"] for x, y in zip(rounds[a], rounds[b]))
            ratio = ratios[f"{a}/{b}"] = rate[a].median / rate[b].median
            target = a in ("hf-1f1b", "hf-whole-1f1b")
            verdict = f" (target >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})" if target else ""
            bench.say(f"- {a} / {b}: {ratio:.3f} (medians of rounds; per round {paired.fmt(digits=3)}){verdict}: {what}")
    bench.say()
    return {"rate": rate, "ratios": ratios}


# ---- overhead: one process, one micro-batch -----------------------------------------------------------
class _Stop(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args_, self.kwargs_ = args, kwargs


def _until(model: torch.nn.Module, block: torch.nn.Module, **call: Any) -> tuple[tuple, dict]:
    """The model's forward (HF's own code) up to `block`'s call; that call (args, kwargs)."""

    def stop(_m, args, kwargs):
        raise _Stop(args, kwargs)

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(**call)
    except _Stop as stopped:
        return stopped.args_, stopped.kwargs_
    finally:
        handle.remove()
    raise RuntimeError(f"{type(model).__name__} never called {type(block).__name__}")


def quiet(bench: Bench, args: Any) -> None:
    """Before an in-process measurement: wait (within the budget) for other benchmarks and tests to end and the CPUs to idle."""
    if bench.patient:
        wait_for_quiet(args.quiet_wait, args.max_foreign, patterns=OTHER_JOBS, log=bench.log)


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


def split(fn: Callable[[], tuple[torch.Tensor, Any]], reps: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of the forward (`fn()`, giving what backward starts from and its gradient) and
    of the backward, over `reps` runs after `warmup`."""
    for _ in range(warmup):
        out, g = fn()
        out.backward(g)
    fwd, bwd = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out, g = fn()
        t1 = time.perf_counter()
        out.backward(g)
        fwd.append(t1 - t)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _chain(blocks: list, x: Any) -> Any:
    for b in blocks:
        x = b(x)
    return x


def _user_call(ids: torch.Tensor) -> Any:
    from lightning_pipe.runtime.call import as_input

    return as_input((), {"input_ids": ids, "labels": ids})


def traced_runs(pipe: Any, cfg: dict, ids: torch.Tensor, grad: torch.Tensor) -> dict[tuple[str, str], Callable[[], Any]]:
    """The timed runs of one traced pipeline: forward + backward of the whole model and of each
    stage's blocks (stage 1 from a received activation, stage 0 back from a received gradient), and
    its adapters' forwards (First; layer 0's blocks; Last, and Last until the model calls block 0)."""
    blocks, n, half = list(pipe), cfg["layers"], cfg["layers"] // 2
    k = per_layer(pipe, n)
    first, last, x0 = blocks[0], blocks[-1], _user_call(ids)
    with torch.no_grad():
        sent = _chain(blocks[: 1 + k * half], x0)  # what stage 0 sends: the hidden state (and GPT-2's position ids)
        first_out = first(x0)

    # forward + backward runs return (what backward starts from, its gradient): `split` times the two apart
    def whole():
        return pipe(input_ids=ids, labels=ids).loss, None

    def stage0():
        return _chain(blocks[: 1 + k * half], x0)[0], grad

    def stage1():  # (First ran before: the last stage's rank gets the user's call with every micro-batch, here First's run set it)
        x = (sent[0].detach().requires_grad_(), *sent[1:])
        return _chain(blocks[1 + k * half :], x).loss, None

    loop_block = pipe.original.transformer.h[0]  # block 0 as the model holds it: its call ends the code before the loop
    marks: list[float] = []

    with torch.no_grad():
        carry_last = _chain(blocks[1 + k * half : -1], sent)  # what Last receives

    def last_prelude() -> float:  # Last's rerun of the code before the loop (on meta), until the model calls block 0
        handle = loop_block.register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))
        try:
            t = time.perf_counter()
            last(carry_last)
            return marks[0] - t
        finally:
            marks.clear()
            handle.remove()

    return {
        ("whole", "fwd+bwd"): whole,
        ("stage 0", "fwd+bwd"): stage0,
        ("stage 1", "fwd+bwd"): stage1,
        ("First", "fwd"): lambda: first(x0),
        ("layer 0", "fwd"): lambda: _chain(blocks[1 : 1 + k], first_out),
        ("Last", "fwd"): lambda: last(carry_last),
        ("Last before the loop", "prelude"): last_prelude,
    }


def overhead(bench: Bench, args: Any, cfg: dict) -> dict:
    """One process: the HF model as it is, its traced pipelines (each cut), ours; see the module doc."""
    torch.manual_seed(0)
    plain = hf_model(cfg)
    pipes = {cut: traced(cfg, cut, copy.deepcopy(plain)) for cut in cuts()}  # the same weights, converted
    ours = our_model(cfg)
    mbs, n, half = cfg["batch"] // cfg["microbatches"], cfg["layers"], cfg["layers"] // 2
    rows = TokenRows(cfg, mbs)
    ids, targets = rows.ids[:, :-1], rows.ids[:, 1:]
    k = 1 + 2 * half  # ours' stage 0: embedding + half the layers
    hp, tr = plain.transformer.h, plain.transformer
    with torch.no_grad():  # the block call HF makes (hidden, then position ids, flags ...), and the stage boundary's input
        (h0, *rest), kw = _until(plain, hp[0], input_ids=ids, labels=ids)
        (hk, *_), _ = _until(plain, hp[half], input_ids=ids, labels=ids)
        h_last = hk
        for i in range(half, n):
            h_last = _hidden(hp[i](h_last, *rest, **kw))
        ours_k = ours[:k](ids)
    grad = torch.randn_like(hk)

    def hf_stage0():  # HF's forward up to block n/2 (what stage 0 sends), backward from the received gradient
        (h, *_), _ = _until(plain, hp[half], input_ids=ids, labels=ids)
        return h, grad

    def hf_stage1():
        h = hk.detach().requires_grad_()
        for i in range(half, n):
            h = _hidden(hp[i](h, *rest, **kw))
        return plain.loss_function(plain.lm_head(tr.ln_f(h)), ids, vocab_size=cfg["vocab"]), None

    def ours_stage1():
        h = ours_k.detach().requires_grad_()
        return F.cross_entropy(ours[k:](h).flatten(0, 1), targets.flatten()), None

    runs: dict[tuple[str, str, str], Callable[[], Any]] = {
        ("ours", "whole", "fwd+bwd"): lambda: (F.cross_entropy(ours(ids).flatten(0, 1), targets.flatten()), None),
        ("ours", "stage 0", "fwd+bwd"): lambda: (ours[:k](ids), grad),
        ("ours", "stage 1", "fwd+bwd"): ours_stage1,
        ("plain", "whole", "fwd+bwd"): lambda: (plain(input_ids=ids, labels=ids).loss, None),
        ("plain", "stage 0", "fwd+bwd"): hf_stage0,
        ("plain", "stage 1", "fwd+bwd"): hf_stage1,
        # what the adapters stand for, without the front end: HF's forward up to block 0; block 0; the code after the loop
        ("plain", "First", "fwd"): lambda: _until(plain, hp[0], input_ids=ids, labels=ids),
        ("plain", "layer 0", "fwd"): lambda: hp[0](h0, *rest, **kw),
        ("plain", "Last", "fwd"): lambda: plain.loss_function(plain.lm_head(tr.ln_f(h_last)), ids, vocab_size=cfg["vocab"]),
    }
    with torch.no_grad():  # the traced pipelines compute the model's own loss
        want = plain(input_ids=ids, labels=ids).loss
        diffs = {cut: abs(pipe(input_ids=ids, labels=ids).loss - want).item() for cut, pipe in pipes.items()}
    bench.say("loss of each traced pipeline minus the model's own: " + ", ".join(f"{c} {d:.1e}" for c, d in diffs.items()))
    for cut, pipe in pipes.items():
        runs.update({(cut, *key): fn for key, fn in traced_runs(pipe, cfg, ids, grad).items()})
    configs = list(runs)

    def run(config: tuple[str, str, str], r: int) -> Any:
        fn, kind = runs[config], config[2]
        if config[0] in pipes:
            with torch.no_grad():
                pipes[config[0]][0](_user_call(ids))  # First's run gives Last the user's call (as the stage does on the last rank)
        if kind == "prelude":
            for _ in range(2):
                fn()
            return statistics.median(fn() for _ in range(4 * args.reps))
        if kind == "fwd+bwd":
            return split(fn, args.reps)
        return timer(fn, 4 * args.reps)

    results: list[list[Any]] = [[] for _ in configs]
    loads = []
    for r in range(args.rounds):  # A B C, A B C ...; each round after the machine went quiet, its foreign load measured
        quiet(bench, args)
        gc.collect()
        start = CpuClock.now()
        for i, times in enumerate(interleave(configs, 1, lambda config, _r: run(config, r))):
            results[i] += times
        loads.append(foreign_load(start, CpuClock.now()))
        bench.log(f"  overhead round {r + 1}/{args.rounds}: other load {loads[-1]:.2f} CPUs")
    by = {}
    for (who, part, kind), times in zip(configs, results):
        if kind == "fwd+bwd":  # per round: the forward's and the backward's medians, and their sum
            by[(who, part, "f")], by[(who, part, "b")] = spread(t[0] for t in times), spread(t[1] for t in times)
            by[(who, part, kind)] = spread(t[0] + t[1] for t in times)
        else:
            by[(who, part, kind)] = spread(times)
    bench.keep("overhead", {"/".join(c): s for c, s in by.items()})
    bench.keep("overhead_rounds", {"/".join(c): times for c, times in zip(configs, results)})
    bench.keep("overhead_foreign", loads)
    mb = f"{mbs} x {cfg['seq']} tokens"
    got = lambda *key: by[key].median  # noqa: E731
    t = Table("one micro-batch: forward + backward (ms)", "ours", "HF as it is", *(f"HF traced, {c}" for c in pipes), *(f"{c}: front end's share (forward, backward)" for c in pipes), "HF as it is / ours")  # fmt: skip
    labels = {"whole": "whole model", "stage 0": f"stage 0: embedding + layers 0-{half - 1}", "stage 1": f"stage 1: layers {half}-{n - 1} + head, loss"}  # fmt: skip
    for part, label in labels.items():
        cell = lambda who: f"{1e3 * got(who, part, 'f'):.2f} + {1e3 * got(who, part, 'b'):.2f} = {by[(who, part, 'fwd+bwd')].fmt(1e3, 2)}"  # noqa: E731
        delta = lambda c, x: 1e3 * (got(c, part, x) - got("plain", part, x))  # noqa: E731
        shares = [f"{(got(c, part, 'fwd+bwd') / got('plain', part, 'fwd+bwd') - 1) * 100:+.1f}% ({delta(c, 'f'):+.2f}, {delta(c, 'b'):+.2f} ms)" for c in pipes]  # fmt: skip
        t.add(label, *(cell(who) for who in ("ours", "plain", *pipes)), *shares, f"{got('plain', part, 'fwd+bwd') / got('ours', part, 'fwd+bwd'):.3f}")  # fmt: skip
    bench.table(t, f"In one process, one thread, one micro-batch ({mb}); forward + backward = total, medians of {args.rounds} interleaved rounds (the total's min..max), each round the median of {args.reps} runs:")  # fmt: skip
    a = Table("forward only (autograd on)", "without the front end (ms)", *(f"{c}: adapter (ms)" for c in pipes), *(f"{c}: front end's own (ms)" for c in pipes))  # fmt: skip
    what = {"First": "First vs HF's forward up to block 0", "layer 0": "layer 0's blocks vs block 0 called directly", "Last": "Last vs final norm, head, loss"}  # fmt: skip
    for part, label in what.items():
        a.add(label, by[("plain", part, "fwd")].fmt(1e3, 3), *(by[(c, part, "fwd")].fmt(1e3, 3) for c in pipes), *(f"{1e3 * (got(c, part, 'fwd') - got('plain', part, 'fwd')):+.3f}" for c in pipes))  # fmt: skip
    pre = [by[(c, "Last before the loop", "prelude")] for c in pipes]
    a.add("of which Last until the loop (HF's code before it, on meta)", by[("plain", "First", "fwd")].fmt(1e3, 3), *(p.fmt(1e3, 3) for p in pre), *("" for _ in pipes))  # fmt: skip
    bench.table(a, f"The adapters' forwards ({mb}; each the median of {4 * args.reps} runs; layer 0 is {', '.join(f'{per_layer(p, n)} block(s) {c}' for c, p in pipes.items())}):")  # fmt: skip
    bench.say(f"Other processes' load during the rounds: {spread(loads).fmt(digits=2)} CPUs (median, min..max).\n")
    return by


# ---- planning: GPT-2 1.3B built on the meta device ----------------------------------------------------
def traced_costs(costs: Any, layers: int, seq: int, per: int) -> Any:
    """Sub-layer analytic costs (embedding, [attention, FFN] x layers, head) as a traced pipeline's
    blocks: First = the embedding, Last = the head with the loss, and a layer = its attention half and
    its FFN half (``per`` 2) or the two summed (``per`` 1). What crosses a cut before the head: the
    hidden state and GPT-2's position ids (1 x T int64)."""
    from lightning_pipe.simulation import CostModel

    def fold(values: tuple) -> list:
        if per == 2:
            return list(values)
        return [values[0], *(values[1 + 2 * i] + values[2 + 2 * i] for i in range(layers)), values[-1]]

    acts = list(costs.activation_bytes) if per == 2 else [costs.activation_bytes[0], *(costs.activation_bytes[2 + 2 * i] for i in range(layers)), costs.activation_bytes[-1]]  # fmt: skip
    activation = [a + 8 * seq for a in acts[:-1]] + acts[-1:]
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
    from lightning_pipe.frontend import convert
    from lightning_pipe.planning import transformer_costs
    from lightning_pipe.planning.entry import block_kinds, plan_run
    from lightning_pipe.planning.replay import cached_schedule, compiled

    quiet(bench, args)
    big = dict(layers=BIG["n_layer"], hidden=BIG["n_embd"], heads=BIG["n_head"], vocab=BIG["vocab_size"], seq=BIG["n_positions"], lr=1e-4)
    big.update(batch=1, microbatches=1)

    def on_meta() -> HFUser:
        with torch.device("meta"):
            return HFUser(big, hf_model(big, **BIG))

    builds, converts = [], []
    for _ in range(args.plan_repeats):
        started = time.perf_counter()
        module = on_meta()
        built = time.perf_counter()
        convert(module)
        builds.append(built - started)
        converts.append(time.perf_counter() - built)
    meta = all(t.is_meta for t in module.parameters())
    traces: dict[tuple[str, int], list[float]] = {}
    errors: dict[tuple[str, int], str] = {}
    shapes: dict[str, tuple[int, list[str]]] = {}  # per cut: pipeline blocks, their kinds as the strategy names them
    for tokens in args.trace_tokens:
        for cut in cuts():
            for _ in range(1 if tokens > 256 else args.plan_repeats):
                module = on_meta()
                gc.collect()
                started = time.perf_counter()
                try:
                    pipe = traced(dict(big, seq=tokens), cut, module.model)
                except Exception as err:  # noqa: BLE001  (reported: whether a meta-built model traces is part of the result)
                    errors[(cut, tokens)] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    break
                traces.setdefault((cut, tokens), []).append(time.perf_counter() - started)
                shapes[cut] = (len(pipe), block_kinds([type(b).__name__ for b in pipe]))
                bench.log(f"  trace ({cut}), 1 x {tokens} tokens: {traces[(cut, tokens)][-1]:.2f} s, {len(pipe)} blocks")
    sub, sub_kinds = transformer_costs("gpt2-1.3b", args.plan_mbs)
    candidates = [(f"HF traced, {cut}", traced_costs(sub, big["layers"], big["seq"], (n - 2) // big["layers"]), kinds) for cut, (n, kinds) in shapes.items()]  # fmt: skip
    candidates.append(("ours", sub, sub_kinds))
    plans: dict[tuple[str, int], dict] = {}
    for stages in args.plan_stages:
        config = PipelineConfig(schedule="1f1b", microbatches=2 * stages, partition="autopipe")
        for name, costs, kinds in candidates:
            times, result = [], None
            for _ in range(args.plan_repeats):
                compiled.cache_clear()
                cached_schedule.cache_clear()
                started = time.perf_counter()
                result = plan_run(costs, stages, config, kinds)
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
            "trace_s": {f"{c}/{t}": v for (c, t), v in traces.items()},
            "trace_errors": {f"{c}/{t}": v for (c, t), v in errors.items()},
            "plans": {f"{n}/{s}": v for (n, s), v in plans.items()},
        },
    )
    t = Table("GPT-2 1.3B on the meta device", "seconds, median (min..max)", "runs")
    t.add("build HFUser(GPT2LMHeadModel(config)) under torch.device('meta')", spread(builds).fmt(1, 3), len(builds))
    t.add("convert (find the blocks, swap in the TracedPipeline)", spread(converts).fmt(1, 4), len(converts))
    for tokens in args.trace_tokens:
        for cut in cuts():
            if (cut, tokens) in traces:
                what = f"trace, {cut} ({shapes[cut][0]} blocks): the user's training_step once on 1 x {tokens} tokens"
                t.add(what, spread(traces[(cut, tokens)]).fmt(1, 2), len(traces[(cut, tokens)]))
            else:
                t.add(f"trace, {cut}, 1 x {tokens} tokens: failed ({errors.get((cut, tokens), '?')})", "", 0)
    bench.table(t, f"Setup of the front end, one process, one thread (parameters still on meta after convert: {meta}):")
    p = Table("plan_run (AutoPipe, 1F1B, m = 2 x stages)", "stages", "blocks", "planning ms, median (min..max)", "blocks per stage", "simulated iteration (ms)")  # fmt: skip
    for (name, stages), v in plans.items():
        p.add(name, stages, v["blocks"], spread(v["seconds"]).fmt(1e3, 1), " ".join(map(str, v["sizes"])), f"{v['iteration_ms']:.1f}")
    bench.table(
        p,
        f"Planning GPT-2 1.3B with plan_run on analytic costs (planning/flops.py: micro-batch {args.plan_mbs} x 1024 tokens, 100 TFLOP/s, "
        f"100 Gb/s links), caches cleared before each of {args.plan_repeats} runs; HF traced: First, the layers' blocks as the trace "
        "cut them, Last (kinds as the strategy names them); ours: embedding, 48 sub-layer blocks, head:",
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
    cfg["per_layer"] = {cut: per_layer(traced(cfg, cut), args.layers) for cut in cuts()}  # as the strategy's trace cuts it
    bench.say(
        f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, {args.seq} positions, tied head, "
        f"dropout 0, exact GELU; batch {args.batch} = {args.microbatches} micro-batches of {args.batch // args.microbatches}; "
        f"partitions (blocks per stage): "
        + ", ".join(f"HF {cut} {partition(f'hf-{cut}', cfg)} ({k} per layer)" for cut, k in cfg["per_layer"].items())
        + f", ours {partition('ours', cfg)}\n"
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
