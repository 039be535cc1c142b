"""Random pipelines for the property tests (tests/test_properties_pipeline.py), and the pool of
persistent gloo workers that runs them.

A `Case` is a picklable description of one training run: a block stack (kinds, activation formats,
shared weights, seed), a schedule with its options and micro-batch count, a partition of the blocks
into the schedule's chunks, the pipeline depth and number of replicas, the batches of each step,
the optimizer and the runtime switches. `build_model(case)` makes the same float64 `nn.Sequential`
in every process from it; `train_reference` trains it in this process, `train_stage` trains this
rank's chunks with the runtime (no Lightning) in a worker of the `Pool`.

Activations between blocks are described by a *format*: "" is a plain tensor ``h``; otherwise a
string of slot letters, each slot one tensor of a tuple, in that order:

    h  the hidden state, float64 (B, T, W), requires grad
    m  a mask, int64 (B, T): no gradient
    b  a mask, bool (B, T): no gradient
    p  position ids, int32 (B, T): no gradient, an index into a position embedding
    g  a second float64 (B, T, W) that requires grad (a two-gradient tuple)
    c  a float64 (B, T, W) constant that needs no grad (detached)

so "h" is a 1-tuple, "mhp" a (mask, hidden, positions) triple, and so on. Every block reads every
slot it is given (masks gate its update, positions index its embedding, g and c feed its linear
map), so every parameter gets a gradient and every integer tensor matters; the head may ignore g
(its input gradient is then the zeros the executor sends back).
"""

from __future__ import annotations

import multiprocessing.connection
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from itertools import combinations
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import assume
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from benchmarks.harness.launch import WorkerError
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.runtime.tied import allreduce_tied, find_tied_parameters
from lightning_pipe.schedules import REGISTRY, ScheduleSpec
from lightning_pipe.topology import Topology

POOL_WORLD = 4  # workers in the pool: a case uses depth x replicas <= 4 of them
MAX_T = 6  # longest sequence: the size of the position embeddings
SLOTS = "mbpgc"  # the optional slots of a tuple activation (h is always there)


# ---- schedules -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleCase:
    name: str
    stages: int
    microbatches: int
    options: tuple[tuple[str, int], ...]

    @property
    def spec(self) -> ScheduleSpec:
        return ScheduleSpec(self.name, self.options)

    def build(self):
        return self.spec.build(self.stages, self.microbatches)


def option_values(name: str) -> dict[str, list[int]]:
    """The values tried for each option of a registered schedule (a new option gets 1..3)."""
    known = {"chunks": [1, 2, 3], "waves": [1, 2], "advance_num": [0, 1, 2, 3, 5]}
    return {key: known.get(key, [1, 2, 3]) for key in REGISTRY[name].options}


def valid_microbatches(name: str, stages: int, options: tuple[tuple[str, int], ...], most: int) -> list[int]:
    """Every micro-batch count up to `most` that the schedule accepts on `stages` ranks (asking the
    generator itself, so a rule added to a schedule is followed here)."""
    out = []
    for m in range(1, most + 1):
        try:
            REGISTRY[name].generator(stages, m, **dict(options))
        except ValueError:
            continue
        out.append(m)
    return out


@st.composite
def schedule_cases(
    draw, stages: Optional[st.SearchStrategy[int]] = None, most_microbatches: int = 12, names: Optional[list[str]] = None
) -> ScheduleCase:
    """Any registered schedule (or one of `names`) on 1..6 ranks (or `stages`), any of its options,
    any valid micro-batch count."""
    name = draw(st.sampled_from(sorted(names or REGISTRY)))
    p = draw(stages if stages is not None else st.integers(1, 6))
    options = tuple(sorted((key, draw(st.sampled_from(values))) for key, values in option_values(name).items()))
    valid = valid_microbatches(name, p, options, most_microbatches)
    assume(valid)  # e.g. advance_num below the depth's K - 1: no micro-batch count takes it
    return ScheduleCase(name, p, draw(st.sampled_from(valid)), options)


def partitions(blocks: int, chunks: int) -> st.SearchStrategy[tuple[tuple[int, int], ...]]:
    """Contiguous, non-empty block ranges, one per chunk."""

    def bounds(order: list[int]) -> tuple[tuple[int, int], ...]:
        cuts = sorted(order[: chunks - 1])
        return tuple(zip([0, *cuts], [*cuts, blocks]))

    return st.permutations(list(range(1, blocks))).map(bounds)


# ---- the model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    kind: str  # "embed" (token ids in) | "linear" (float input in) | "mix" | "head"
    out: str = ""  # activation format produced (not for the head)
    share: Optional[int] = None  # mix blocks with the same number share one Linear (a tied weight)
    salt: int = 0  # varies the masks a block derives
    use_g: bool = True  # head: whether it reads the g slot


@dataclass(frozen=True)
class Case:
    seed: int
    vocab: int
    hidden: int
    blocks: tuple[Block, ...]
    tie_head: bool  # the head scores against the embedding matrix (GPT's tied LM head)
    schedule: ScheduleCase
    replicas: int
    bounds: tuple[tuple[int, int], ...]  # chunk -> block range
    steps: tuple[tuple[int, int], ...]  # (samples per replica, sequence length) of each step
    optimizer: str  # "sgd" (momentum) | "adam"
    prefetch: bool
    batch_ops: bool

    @property
    def world(self) -> int:
        return self.schedule.stages * self.replicas

    @property
    def exact(self) -> bool:
        """The pipeline does the single process's float operations in the same order: one
        micro-batch (loss weight exactly 1), one replica (no averaging), and no weight used by more
        than two blocks (two gradients add up alike in any order; three, summed on other ranks
        and then across them, need not)."""
        uses = Counter(b.share for b in self.blocks if b.share is not None)
        return self.schedule.microbatches == 1 and self.replicas == 1 and max(uses.values(), default=0) <= 2

    def describe(self) -> str:
        s = self.schedule
        blocks = " ".join(
            f"{b.kind}{'>' + repr(b.out) if b.kind != 'head' else ''}{'[s%d]' % b.share if b.share is not None else ''}"
            for b in self.blocks
        )
        return (
            f"{s.spec.label} p={s.stages} m={s.microbatches} x{self.replicas} replicas, bounds={list(self.bounds)}, "
            f"{self.optimizer}, prefetch={self.prefetch}, batch_ops={self.batch_ops}, tie_head={self.tie_head}, "
            f"steps={list(self.steps)}, seed={self.seed}; blocks: {blocks}"
        )


def _slots(value: Any, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "":
        assert isinstance(value, torch.Tensor), type(value)
        return {"h": value}
    assert isinstance(value, tuple) and len(value) == len(fmt), (fmt, type(value))
    return dict(zip(fmt, value))


def _keep(s: dict[str, torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """The product of the masks given, as float (B, T, 1), or None."""
    keep = None
    for key in "mb":
        if key in s:
            k = s[key].to(like.dtype).unsqueeze(-1)
            keep = k if keep is None else keep * k
    return keep


def _pack(fmt: str, h: torch.Tensor, given: dict[str, torch.Tensor], salt: int, ids: Optional[torch.Tensor] = None) -> Any:
    """The activation of format `fmt`: given integer slots pass on, missing ones are derived from
    the positions (or the token ids); g and c are made from h."""
    if fmt == "":
        return h
    n, t = h.shape[:2]
    pos = torch.arange(t).expand(n, t)
    out = []
    for key in fmt:
        if key == "h":
            out.append(h)
        elif key == "m":
            out.append(given["m"] if "m" in given else ((ids if ids is not None else pos + salt) % 3 != 0).long())
        elif key == "b":
            out.append(given["b"] if "b" in given else ((ids if ids is not None else pos + salt) % 4 != 1))
        elif key == "p":
            out.append(given["p"] if "p" in given else ((pos + salt) % MAX_T).to(torch.int32))
        elif key == "g":
            g = torch.sin(h)
            out.append(g + 0.5 * given["g"] if "g" in given else g)
        elif key == "c":
            out.append(h.detach() * 0.25 if "c" not in given else given["c"])
    return tuple(out)


class Embed(nn.Module):
    def __init__(self, case: Case, spec: Block):
        super().__init__()
        self.emb = nn.Embedding(case.vocab, case.hidden)
        self.spec = spec

    def forward(self, ids):
        return _pack(self.spec.out, self.emb(ids), {}, self.spec.salt, ids=ids)


class LinearIn(nn.Module):
    def __init__(self, case: Case, spec: Block):
        super().__init__()
        self.lin = nn.Linear(case.hidden, case.hidden)
        self.spec = spec

    def forward(self, x):
        return _pack(self.spec.out, torch.tanh(self.lin(x)), {}, self.spec.salt)


class Mix(nn.Module):
    """h + tanh(lin(h) + gate * g + c + pos_emb(p)) * masks, then the output format."""

    def __init__(self, case: Case, spec: Block, fmt_in: str):
        super().__init__()
        self.spec, self.fmt_in = spec, fmt_in
        self.lin = nn.Linear(case.hidden, case.hidden)
        if "g" in fmt_in:
            self.gate = nn.Parameter(torch.randn(case.hidden) * 0.5)
        if "p" in fmt_in:
            self.pos = nn.Embedding(MAX_T, case.hidden)

    def forward(self, x):
        s = _slots(x, self.fmt_in)
        h = s["h"]
        y = self.lin(h)
        if "g" in s:
            y = y + self.gate * s["g"]
        if "c" in s:
            y = y + s["c"]
        if "p" in s:
            y = y + self.pos(s["p"])
        update = torch.tanh(y)
        keep = _keep(s, h)
        h = h + (update if keep is None else update * keep)
        return _pack(self.spec.out, h, s, self.spec.salt)


class Head(nn.Module):
    """Masked mean over positions (plus g's mean where read), then logits over the vocabulary: against
    the embedding matrix when tied (the same nn.Parameter as the first block's), else its own Linear."""

    def __init__(self, case: Case, spec: Block, fmt_in: str, tied: Optional[nn.Parameter]):
        super().__init__()
        self.spec, self.fmt_in = spec, fmt_in
        if tied is not None:
            self.weight = tied
        else:
            self.out = nn.Linear(case.hidden, case.vocab)
        if "g" in fmt_in and spec.use_g:
            self.gate = nn.Parameter(torch.randn(case.hidden) * 0.5)

    def forward(self, x):
        s = _slots(x, self.fmt_in)
        h = s["h"]
        keep = _keep(s, h)
        pooled = h.mean(1) if keep is None else (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        if "g" in s and self.spec.use_g:
            pooled = pooled + self.gate * s["g"].mean(1)
        return pooled @ self.weight.t() if hasattr(self, "weight") else self.out(pooled)


def build_model(case: Case) -> nn.Sequential:
    """The case's block stack, float64, the same in every process (seeded)."""
    torch.manual_seed(case.seed)
    blocks: list[nn.Module] = []
    shared: dict[int, nn.Linear] = {}
    fmt = None
    for spec in case.blocks:
        if spec.kind == "embed":
            block = Embed(case, spec)
        elif spec.kind == "linear":
            block = LinearIn(case, spec)
        elif spec.kind == "mix":
            block = Mix(case, spec, fmt)
            if spec.share is not None:
                block.lin = shared.setdefault(spec.share, block.lin)
        else:
            block = Head(case, spec, fmt, blocks[0].emb.weight if case.tie_head else None)
        blocks.append(block)
        fmt = spec.out
    model = nn.Sequential(*blocks).to(torch.float64)
    if case.tie_head:
        assert model[-1].weight is model[0].emb.weight
    return model


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's whole batch (all replicas' samples, replica r's are the r-th slice)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    out = []
    for n, t in case.steps:
        total = n * case.replicas
        if case.blocks[0].kind == "embed":
            x = torch.randint(0, case.vocab, (total, t), generator=g)
        else:
            x = torch.randn(total, t, case.hidden, generator=g, dtype=torch.float64)
        out.append((x, torch.randint(0, case.vocab, (total,), generator=g)))
    return out


def optimizer(case: Case, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def train_reference(case: Case) -> dict[str, torch.Tensor]:
    """One process, whole batches: the full model's state dict after the steps (a tied weight
    appears under each of its keys)."""
    model = build_model(case)
    opt = optimizer(case, list(model.parameters()))
    for x, y in batches(case):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the case strategy ----------------------------------------------------------------------------
@st.composite
def formats(draw) -> str:
    """An activation format: "" (a plain tensor) or slot letters in any order, h among them."""
    if draw(st.integers(0, 3)) == 0:
        return ""
    extras = draw(st.lists(st.sampled_from(SLOTS), unique=True, max_size=3))
    letters = draw(st.permutations(["h", *extras]))
    return "".join(letters)


@st.composite
def cases(draw, names: Optional[list[str]] = None, most_microbatches: int = 6) -> Case:
    """A random block stack on a random valid pipeline layout of at most `POOL_WORLD` processes,
    with any registered schedule (or one of `names`)."""
    replicas = draw(st.sampled_from([1, 1, 1, 2]))
    stages = draw(st.integers(1 if replicas > 1 else 2, POOL_WORLD // replicas))
    sched = draw(schedule_cases(stages=st.just(stages), most_microbatches=most_microbatches, names=names))
    chunks = sched.spec.chunk_count(stages)
    if chunks > 12:  # wave with 2 waves on 4 ranks: 16 chunks, a big model for little more coverage
        sched = ScheduleCase(sched.name, stages, sched.microbatches, tuple((k, 1) for k, _ in sched.options))
        chunks = sched.spec.chunk_count(stages)
    n = draw(st.integers(max(chunks, 2), max(chunks, 2) + 3))
    first = draw(st.sampled_from(["embed", "embed", "linear"]))
    mids = n - 2
    share_ids = draw(st.lists(st.sampled_from([None, None, 0, 1]), min_size=mids, max_size=mids))
    blocks = [Block(first, draw(formats()), salt=draw(st.integers(0, 5)))]
    blocks += [Block("mix", draw(formats()), share, draw(st.integers(0, 5))) for share in share_ids]
    blocks.append(Block("head", use_g=draw(st.booleans())))
    bounds = draw(partitions(n, chunks))
    m = sched.microbatches
    steps = tuple(draw(st.tuples(st.integers(m, m + 3), st.integers(2, MAX_T))) for _ in range(draw(st.integers(2, 3))))
    return Case(
        seed=draw(st.integers(0, 2**16)),
        vocab=draw(st.integers(5, 11)),
        hidden=draw(st.integers(2, 5)),
        blocks=tuple(blocks),
        tie_head=first == "embed" and draw(st.booleans()),
        schedule=sched,
        replicas=replicas,
        bounds=bounds,
        steps=steps,
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        prefetch=draw(st.booleans()),
        batch_ops=draw(st.booleans()),
    )


# ---- one rank of a case, in a worker --------------------------------------------------------------
def train_stage(rank: int, case: Case, groups: dict[tuple[int, ...], Any]) -> Optional[dict]:
    """This rank's part of `case`: its chunks' weights after training (numpy, by state-dict key) and
    the executor's trace of the last step. None for a worker the case does not use."""
    topo = Topology(case.world, case.replicas)
    if rank >= case.world:
        return None
    stage, replica = topo.stage_of(rank), topo.replica_of(rank)
    schedule = case.schedule.build()
    model = build_model(case)
    mine = schedule.chunks_of(stage)
    chunks = {c: nn.Sequential(*[model[i] for i in range(*case.bounds[c])]) for c in mine}
    tied = find_tied_parameters(model, case.bounds, schedule.chunk_rank)
    tied_groups = {t.index: groups[tuple(topo.global_rank(replica, s) for s in t.stages)] for t in tied if stage in t.stages}
    replica_group = groups[tuple(topo.stage_ranks(stage))] if case.replicas > 1 else None
    host = SequentialHost(chunks, schedule.num_chunks - 1, F.cross_entropy, replica_group, case.replicas)
    transport = Transport(lambda s: topo.global_rank(replica, s), torch.device("cpu"), batch_ops=case.batch_ops)
    pipe = SequentialPipeline(schedule, stage, host, transport, prefetch=case.prefetch)
    pipe.executor.trace = True
    params = list({id(p): p for c in chunks.values() for p in c.parameters()}.values())
    opt = optimizer(case, params)
    for x, y in batches(case):
        n = len(x) // case.replicas
        rows = slice(replica * n, (replica + 1) * n)
        opt.zero_grad()
        pipe.step(x[rows], y[rows])
        allreduce_tied(tied, tied_groups, stage)
        opt.step()
    blocks = {i for c in mine for i in range(*case.bounds[c])}
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if int(k.split(".")[0]) in blocks}
    return {"weights": weights, "records": list(pipe.executor.records)}


# ---- the pool ------------------------------------------------------------------------------------
def _all_groups(world: int) -> dict[tuple[int, ...], Any]:
    """A process group for every set of two or more ranks (replica and tied-weight groups), made
    once, in one order on every rank (new_group is collective)."""
    groups: dict[tuple[int, ...], Any] = {}
    for size in range(2, world + 1):
        for ranks in combinations(range(world), size):
            groups[ranks] = dist.new_group(list(ranks)) if size < world else dist.group.WORLD
    return groups


FENCE = 10**12  # fence values: far from any header length or shape a stray message could hold


def _fence(rank: int, world: int, task: int) -> None:
    """Every rank sends every other rank one int64 and receives one from each, on the channel the
    pipeline's messages use (tag 0): a message the task sent but never received is taken here
    instead, so it fails *this* task (a wrong value here, or gloo aborting on the size) rather
    than corrupt or crash a later one."""
    mark = torch.tensor([FENCE + task], dtype=torch.int64)
    inbox = {peer: torch.zeros(1, dtype=torch.int64) for peer in range(world) if peer != rank}
    works = [dist.isend(mark, peer) for peer in inbox] + [dist.irecv(buf, peer) for peer, buf in inbox.items()]
    for work in works:
        work.wait()
    stray = [peer for peer, buf in inbox.items() if buf.item() != FENCE + task]
    if stray:
        raise RuntimeError(f"rank {rank}: rank(s) {stray} sent a message during the task that this rank never received")


def _serve(rank: int, world: int, port: int, conn: Any, group_timeout: float) -> None:
    """A worker: join the group, then run the tasks the parent sends until it sends None."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=group_timeout))
        groups = _all_groups(world)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    task = 0
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            break
        if message is None:
            break
        fn, args = message
        task += 1
        try:
            result = fn(rank, *args, groups)
            _fence(rank, world, task)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            break  # the group may be out of step now: the parent restarts the pool
    if dist.is_initialized():
        dist.destroy_process_group()


class PoolGaveUp(BaseException):
    """The pool failed `max_failures` times. A BaseException, so that Hypothesis does not take it
    for one more failing example and go on shrinking (each pool failure can cost a gloo timeout):
    pytest reports it with the first failure's case and traceback."""


class Pool:
    """`world` processes joined in one gloo group, reused for every task.

    ``run(fn, *args)`` calls ``fn(rank, *args, groups)`` on every worker (fn importable, args
    picklable) and returns the results in rank order; a fence after each task makes a message it
    left unreceived fail that task. Every wait is bounded: a worker's exception raises `WorkerError`
    with its traceback, a worker that dies raises RuntimeError (its last words, e.g. gloo's abort,
    are on the captured stderr), a task that does not finish within ``timeout`` s raises
    TimeoutError naming the ranks still running. After any failure the workers are killed and the
    next `run` starts new ones. p2p and collectives in a worker give up after ``group_timeout`` s,
    so most hangs come back as a worker's traceback. After ``max_failures`` such failures `run`
    raises `PoolGaveUp` at once, which bounds the time a broken runtime costs (Hypothesis would
    otherwise re-run every shrinking candidate into the same hang).

    Workers are forked from a fork server that has imported this module (torch, lightning_pipe)
    once: the first start costs one import, a restart after a failure well under a second, which
    keeps Hypothesis' shrinking of a failure that kills the pool affordable. (Plain spawn, as
    `benchmarks.harness.launch` uses, would import everything again in every worker at every start.)"""

    def __init__(
        self,
        world: int = POOL_WORLD,
        timeout: float = 30.0,
        group_timeout: float = 10.0,
        start_timeout: float = 120.0,
        max_failures: int = 3,
    ):
        self.world, self.timeout, self.group_timeout, self.start_timeout = world, timeout, group_timeout, start_timeout
        self.max_failures = max_failures
        self.failures: list[str] = []
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.store: Any = None
        self.starts = 0
        self.last = "nothing yet"  # the last task that finished, for a worker dying after it

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        self.conns, self.procs = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, name=f"pool rank {r}", args=(r, self.world, self.store.port, child, self.group_timeout))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.starts += 1
        self._collect(self.start_timeout, "starting the pool (process group and its subgroups)")

    def _died(self, r: int, what: str) -> RuntimeError:
        self.procs[r].join(timeout=5)
        code = self.procs[r].exitcode
        self.close(kill=True)
        return RuntimeError(
            f"pool rank {r} of {self.world} died (exit code {code}) without a result while {what}; the "
            f"previous task was {self.last}. Its last words (e.g. gloo's abort) are on the captured stderr."
        )

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        waiting = {r: self.conns[r] for r in range(self.world)}
        while waiting:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(
                list(waiting.values()) + [self.procs[r].sentinel for r in waiting], timeout=max(left, 0)
            )
            if not ready:
                late = sorted(waiting)
                self.close(kill=True)
                raise TimeoutError(f"pool ranks {late} of {self.world} did not finish within {timeout:g} s (hang?) while {what}")
            for r in list(waiting):
                conn = waiting[r]
                if conn in ready or conn.poll():
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        raise self._died(r, what) from None
                elif self.procs[r].sentinel in ready:
                    raise self._died(r, what)
                else:
                    continue
                if status == "error":
                    self.close(kill=True)
                    raise WorkerError(r, self.world, f"while {what}:\n{value}")
                results[r] = value
                del waiting[r]
        return [results[r] for r in range(self.world)]

    def run(self, fn: Any, *args: Any, what: str = "running a task") -> list[Any]:
        if len(self.failures) >= self.max_failures:
            raise PoolGaveUp(
                f"the pool failed {len(self.failures)} times (worker errors, deaths or hangs): no more cases run, "
                f"so that shrinking stops here. The first failure:\n{self.failures[0]}"
            )
        try:
            if not self.procs:
                self._start()
            for r, conn in enumerate(self.conns):
                try:
                    conn.send((fn, args))
                except OSError:  # it died after the last task
                    raise self._died(r, "waiting for a task") from None
            results = self._collect(self.timeout, what)
        except Exception as err:
            self.failures.append(f"{type(err).__name__}: {err}")
            raise
        self.last = what
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the workers (ours only, by handle): ask them to leave, kill what is still there."""
        if not kill:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 3
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.store = [], [], None


__all__ = [
    "Block",
    "Case",
    "POOL_WORLD",
    "Pool",
    "PoolGaveUp",
    "ScheduleCase",
    "batches",
    "build_model",
    "cases",
    "partitions",
    "schedule_cases",
    "train_reference",
    "train_stage",
    "valid_microbatches",
]
