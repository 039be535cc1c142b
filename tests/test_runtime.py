"""The runtime on real gloo processes reproduces single-process training (plain PyTorch, no Lightning)."""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_distributed
from models import masked_blocks, max_rel_diff, mlp_blocks
from torch import nn

from lightning_pipe.planning import partition_blocks
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule

UNEVEN = {2: [1, 5], 3: [1, 2, 3], 4: [3, 1, 1, 1]}


def batches(kind: str, dtype: torch.dtype):
    """Three steps; the masked kind changes sequence length and ends on a short batch (renegotiation)."""
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(10, 8, generator=g, dtype=dtype), torch.randint(0, 3, (10,), generator=g)) for _ in range(3)]
    shapes = [(10, 5), (10, 7), (7, 4)]
    return [(torch.randint(0, 17, s, generator=g), torch.randint(0, 3, (s[0],), generator=g)) for s in shapes]


def build(kind: str, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return (mlp_blocks() if kind == "mlp" else masked_blocks()).to(dtype)


def reference(kind: str, dtype: torch.dtype) -> dict:
    model = build(kind, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(kind, dtype):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train_stage(rank: int, world: int, configs: list) -> list[dict]:
    results = []
    for kind, dtype, schedule, partition, m in configs:
        model = build(kind, dtype)
        start, stop = partition_blocks(partition, len(model), world).bounds[rank]
        chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
        host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
        pipe = SequentialPipeline(build_schedule(schedule, world, m), rank, host, Transport(lambda r: r, torch.device("cpu")))
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
        for x, y in batches(kind, dtype):
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        results.append({k: v for k, v in model.state_dict().items() if start <= int(k.split(".")[0]) < stop})
    return results


def check(world: int, configs: list) -> None:
    per_rank = run_distributed(train_stage, world, configs, timeout=240)
    for i, (kind, dtype, schedule, partition, m) in enumerate(configs):
        got = {}
        for rank_results in per_rank:
            got.update(rank_results[i])
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        err = max_rel_diff(reference(kind, dtype), got)
        assert err <= tol, f"{schedule} world={world} partition={partition} m={m} {kind} {dtype}: rel err {err:.2e} > {tol}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gpipe_and_1f1b_equal_single_process(world):
    configs = [
        ("mlp", torch.float64, schedule, partition, m)
        for schedule, partition, m in itertools.product(["gpipe", "1f1b"], ["uniform", UNEVEN[world]], [1, 3, 4])
    ]
    configs += [("mlp", torch.float32, schedule, "uniform", 4) for schedule in ["gpipe", "1f1b"]]
    check(world, configs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_tuple_activation_with_integer_mask_and_changing_shapes(world):
    configs = [("masked", torch.float64, schedule, "uniform", 3) for schedule in ["gpipe", "1f1b"]]
    check(world, configs)


def traced_step(rank: int, world: int) -> list:

    model = build("mlp", torch.float64)
    start, stop = partition_blocks("uniform", len(model), world).bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
    host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
    pipe = SequentialPipeline(build_schedule("1f1b", world, 4), rank, host, Transport(lambda r: r, torch.device("cpu")))
    pipe.executor.trace = True
    x, y = batches("mlp", torch.float64)[0]
    pipe.step(x, y)
    return pipe.executor.records


@pytest.mark.multiprocess
def test_trace_records_every_compute_and_send():
    from lightning_pipe.simulation.timelines import traced_timeline

    schedule = build_schedule("1f1b", 2, 4)
    records = run_distributed(traced_step, 2, timeout=120)
    for rank, recs in enumerate(records):
        traced = [schedule.actions[rank][i] for i, _, _ in recs]
        expected = [a for a in schedule.actions[rank] if a.op.is_compute or a.op.is_send]
        assert sorted(map(str, traced)) == sorted(map(str, expected))
        computes = [(s, e) for i, s, e in recs if schedule.actions[rank][i].op.is_compute]
        assert all(s <= e for s, e in computes) and all(a[1] <= b[0] for a, b in zip(computes, computes[1:]))
    timeline = traced_timeline(schedule, records)
    assert timeline.iteration_time > 0 and len(timeline.computes()) == 2 * 2 * 4


# ---- the executor in one process, on a transport that logs --------------------------------------
class _Work:
    def __init__(self, log: list, label: str):
        self.log, self.label = log, label

    def wait(self) -> None:
        self.log.append(f"wait {self.label}")


class _LoggingTransport:
    """Stands in for `Transport`: labels every p2p op, logs issues, blocking header reads and waits.
    `batch_ops` returns one work per group as NCCL's batch_isend_irecv does, else one per op."""

    def __init__(self, log: list, batch_ops: bool):
        self.log, self.batch_ops, self.device = log, batch_ops, torch.device("cpu")
        self._specs: set = set()
        self._sent: set = set()
        self._n = itertools.count()

    def _ops(self, kind: str, peer: int, n: int) -> list[str]:
        return [f"{kind}{peer}#{next(self._n)}" for _ in range(n)]

    def send_activation(self, peer, chunk, key, value):
        header = 2 if (peer, chunk, key) not in self._sent else 0  # length and header first
        self._sent.add((peer, chunk, key))
        return self._ops("SF>", peer, header + 1)

    def needs_header(self, peer, chunk, key):
        return (peer, chunk, key) not in self._specs

    def recv_activation(self, peer, chunk, key):
        from lightning_pipe.runtime.p2p import ActivationSpec, PendingRecv, TensorSpec

        if (peer, chunk, key) not in self._specs:
            self.log.append(f"header<{peer}")
            self._specs.add((peer, chunk, key))
        spec = ActivationSpec(False, (TensorSpec((2, 3), torch.float64, True),))
        return PendingRecv([torch.full((2, 3), 0.5, dtype=torch.float64)], spec), self._ops("RF<", peer, 1)

    def send_gradients(self, peer, grads):
        return self._ops("SB>", peer, len(grads))

    def recv_gradients(self, peer, like):
        from lightning_pipe.runtime.p2p import PendingRecv

        return PendingRecv([torch.full(t.shape, 0.25, dtype=t.dtype) for t in like], None), self._ops("RB<", peer, len(like))

    def issue(self, ops):
        if not ops:
            return []
        self.log.append("issue " + " ".join(ops))
        return [_Work(self.log, "group")] if self.batch_ops else [_Work(self.log, op) for op in ops]

    def release_headers(self):
        self.log.append("release")


class _ScalingHost:
    """Chunk c multiplies by its weight; the last chunk's sum is the loss."""

    def __init__(self, log: list, chunks: int):
        self.log, self.last = log, chunks - 1
        self.weights = [torch.full((3,), 1.0 + c, dtype=torch.float64, requires_grad=True) for c in range(chunks)]

    def forward(self, chunk, mb, inputs):
        self.log.append(f"F{chunk}.{mb}")
        x = torch.full((2, 3), float(mb + 1), dtype=torch.float64) if inputs is None else inputs
        out = x * self.weights[chunk]
        return out.sum() if chunk == self.last else out

    def reduce_gradients(self, chunk):
        self.log.append(f"R{chunk} {self.weights[chunk].grad.tolist()}")


def _logged_steps(schedule, rank: int, prefetch: bool, batch_ops: bool, steps: int = 2) -> list[str]:
    from lightning_pipe.runtime.executor import Executor

    log: list[str] = []
    executor = Executor(schedule, rank, _LoggingTransport(log, batch_ops), prefetch)
    host = _ScalingHost(log, schedule.num_chunks)
    for _ in range(steps):  # the first step negotiates headers (blocking), the second does not
        executor.run(host, list(range(schedule.num_microbatches)))
    return log


# rank 1 of 1F1B on 3 ranks, 2 micro-batches: RF1.0<0 F1.0 SF1.0>2 RF1.1<0 F1.1 SF1.1>2 RB1.0<2 B1.0
# SB1.0>0 RB1.1<2 B1.1 SB1.1>0 R1. The weight gradient: 2 rows x 0.5 (input) x 0.25 (gradient) x 2 mbs per step.
_STEP_1 = "header<0 | issue RF<0#0 | wait {rf0} | F1.0 | issue SF>2#1 SF>2#2 SF>2#3 | header<0 | "
_NO_PREFETCH = {
    # without prefetch a send and the next receive go out as one group (the NCCL deadlock rule);
    # a receive whose header is still to be read first issues the sends before it
    True: _STEP_1.format(rf0="group") + "issue RF<0#4 | wait group | F1.1 | issue SF>2#5 SF>2#6 SF>2#7 RB<2#8 | wait group | "
    "issue SB>0#9 RB<2#10 | wait group | issue SB>0#11 | R1 [0.5, 0.5, 0.5] | wait group | wait group | wait group | "
    "wait group | release | issue RF<0#12 | wait group | F1.0 | issue SF>2#13 RF<0#14 | wait group | F1.1 | "
    "issue SF>2#15 RB<2#16 | wait group | issue SB>0#17 RB<2#18 | wait group | issue SB>0#19 | R1 [1.0, 1.0, 1.0] | "
    "wait group | wait group | wait group | wait group | release",
    # on gloo each receive waits for its own ops only, the sends are waited for at the end
    False: _STEP_1.format(rf0="RF<0#0") + "issue RF<0#4 | wait RF<0#4 | F1.1 | issue SF>2#5 SF>2#6 SF>2#7 RB<2#8 | "
    "wait RB<2#8 | issue SB>0#9 RB<2#10 | wait RB<2#10 | issue SB>0#11 | R1 [0.5, 0.5, 0.5] | wait SF>2#1 | "
    "wait SF>2#2 | wait SF>2#3 | wait SF>2#5 | wait SF>2#6 | wait SF>2#7 | wait SB>0#9 | wait SB>0#11 | release | "
    "issue RF<0#12 | wait RF<0#12 | F1.0 | issue SF>2#13 RF<0#14 | wait RF<0#14 | F1.1 | issue SF>2#15 RB<2#16 | "
    "wait RB<2#16 | issue SB>0#17 RB<2#18 | wait RB<2#18 | issue SB>0#19 | R1 [1.0, 1.0, 1.0] | wait SF>2#13 | "
    "wait SF>2#15 | wait SB>0#17 | wait SB>0#19 | release",
}
# with prefetch the next receive is posted before each compute, alone, unless its header is unread
_PREFETCH_NCCL = (
    _STEP_1.format(rf0="group") + "issue RF<0#4 | issue RB<2#5 | wait group | F1.1 | issue SF>2#6 SF>2#7 SF>2#8 | "
    "issue RB<2#9 | wait group | issue SB>0#10 | wait group | issue SB>0#11 | R1 [0.5, 0.5, 0.5] | wait group | "
    "wait group | wait group | wait group | release | issue RF<0#12 | issue RF<0#13 | wait group | F1.0 | "
    "issue SF>2#14 | issue RB<2#15 | wait group | F1.1 | issue SF>2#16 | issue RB<2#17 | wait group | issue SB>0#18 | "
    "wait group | issue SB>0#19 | R1 [1.0, 1.0, 1.0] | wait group | wait group | wait group | wait group | release"
)


@pytest.mark.parametrize("batch_ops", [True, False], ids=["nccl", "gloo"])
def test_executor_issues_consecutive_comm_actions_as_one_group(batch_ops):
    log = _logged_steps(build_schedule("1f1b", 3, 2), 1, prefetch=False, batch_ops=batch_ops)
    assert " | ".join(log) == _NO_PREFETCH[batch_ops]


def test_executor_prefetches_the_next_receive_before_each_compute():
    log = _logged_steps(build_schedule("1f1b", 3, 2), 1, prefetch=True, batch_ops=True)
    assert " | ".join(log) == _PREFETCH_NCCL


@pytest.mark.parametrize("name,options", [("gpipe", {}), ("1f1b", {}), ("interleaved", {"chunks": 2}), ("wave", {"waves": 2})])
@pytest.mark.parametrize("prefetch", [True, False])
def test_executor_runs_every_rank_in_process(name, options, prefetch):
    """Every action has a handler, every receive is posted and taken, every send is waited for."""
    from lightning_pipe.runtime.executor import Executor
    from lightning_pipe.schedules import Op

    schedule = build_schedule(name, 2, 4, **options)
    for rank in range(2):
        log = _logged_steps(schedule, rank, prefetch, batch_ops=False)
        step = log[: log.index("release") + 1]
        issued = [op for line in step if line.startswith("issue ") for op in line.split()[1:]]
        waited = [line.split()[1] for line in step if line.startswith("wait ")]
        assert sorted(issued) == sorted(waited)  # gloo: one wait per op, none forgotten
        assert [x for x in step if x[0] == "F"] == [f"F{a.chunk}.{a.microbatch}" for a in schedule.actions[rank] if a.op is Op.FORWARD]
        assert len([x for x in step if x[0] == "R"]) == len(schedule.chunks_of(rank))
    assert set(Executor(schedule, 0, None)._handlers) == set(Op)
