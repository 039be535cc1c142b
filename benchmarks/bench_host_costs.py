"""What a rank's host spends beyond its blocks' profiled times: direct measurements.

``dispatch``: the executor's own cost per compute action (null blocks on one rank); ``chunks``: the
same 8 residual-MLP blocks on one rank as v = 1, 2, 4, 8 chunks; ``transport``: the compute time an
isend / irecv in flight takes (2 pinned gloo processes); ``messages`` (asked for by --parts): the
spread of the setup's message costs measured again and again. Feeds docs/results/predictions.md ("What the
host costs beyond the blocks") and docs/guide/messages.md.

    flock /tmp/bench.lock python -m benchmarks.bench_host_costs --rounds 40
    flock /tmp/bench.lock python -m benchmarks.bench_host_costs --parts chunks --mlp-ratio 1 --rounds 60
    flock /tmp/bench.lock python -m benchmarks.bench_host_costs --parts messages [--bounce-only]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.bench import Bench, Table, interleave, spread
from benchmarks.harness.launch import run_distributed
from benchmarks.harness.mlp import Block
from benchmarks.harness.pipes import broadcast
from lightning_pipe.profiling import profile_blocks
from lightning_pipe.runtime.executor import Executor
from lightning_pipe.runtime.microbatch import signature
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import build_schedule

CPU = torch.device("cpu")


class Null(nn.Module):
    """A block with (almost) nothing to compute: what the executor adds shows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def one_rank(chunks: list[nn.Module], m: int, x: torch.Tensor, one_chunk: str = "1f1b"):
    """A callable running a one-rank schedule over `chunks` (`one_chunk`'s order for one chunk,
    interleaved otherwise) once, returning its seconds; and its executor."""
    v = len(chunks)
    schedule = build_schedule("interleaved", 1, m, chunks=v) if v > 1 else build_schedule(one_chunk, 1, m)
    host = SequentialHost(dict(enumerate(chunks)), v - 1, lambda out, _: out.pow(2).mean())
    host.inputs, host.targets, host.weights = [x.clone() for _ in range(m)], [None] * m, [1 / m] * m
    executor, keys = Executor(schedule, 0, Transport(lambda r: r, CPU)), [signature(t) for t in host.inputs]

    def run() -> float:
        host.losses = []
        t0 = time.perf_counter()
        executor.run(host, keys)
        elapsed = time.perf_counter() - t0
        [chunk.zero_grad(set_to_none=True) for chunk in chunks]
        return elapsed

    return run, executor


def dispatch(bench: Bench, args) -> None:
    x, m = torch.randn(args.rows, args.hidden), args.microbatches
    table = Table("chunks", "run ms", "null blocks' profiled f + b per micro-batch, us", "executor per compute action, us")
    for v in (1, 2, 4, 8):
        blocks = [Null() for _ in range(v)]
        prof = profile_blocks(blocks, x, CPU, repeats=args.rounds, warmup=3, inflight=m, loss_fn=lambda o: o.pow(2).mean())
        blocks_time = sum(p["forward"] + p["backward"] for p in prof.values())
        run, _ = one_rank(blocks, m, x)
        t = statistics.median([run() for _ in range(args.rounds + 3)][3:])
        table.add(v, f"{t * 1e3:.3f}", f"{blocks_time * 1e6:.1f}", f"{(t - m * blocks_time) / (2 * m * v) * 1e6:.1f}")
    bench.table(table, f"## dispatch: the executor's cost per compute action, null blocks on {args.rows} x {args.hidden} tensors, m = {m}")


def chunks(bench: Bench, args) -> None:
    torch.manual_seed(0)
    blocks = [Block(args.hidden, args.hidden * args.mlp_ratio) for _ in range(8)]
    x, m = torch.randn(args.rows, args.hidden), args.microbatches
    variants = {
        f"1 ({'1F1B' if order == '1f1b' else 'GPipe'} order)": one_rank([nn.Sequential(*blocks)], m, x, order)
        for order in ("1f1b", "gpipe")
    }
    for v in (2, 4, 8):
        variants[str(v)] = one_rank([nn.Sequential(*blocks[c * 8 // v : (c + 1) * 8 // v]) for c in range(v)], m, x)
    times = dict(zip(variants, (ts[2:] for ts in interleave(list(variants.values()), args.rounds + 2, lambda v, _: v[0]()))))
    base = statistics.median(times["1 (1F1B order)"])
    table = Table("chunks", "compute actions", "median run ms", "min..max ms", "vs 1 chunk (1F1B)", "per added compute action, us")
    for v, (_, ex) in variants.items():
        ts, med = times[v], statistics.median(times[v])
        actions = sum(a.op.is_compute for a in ex.actions)
        added = (med - base) / (actions - 2 * m) * 1e6 if actions > 2 * m else 0.0
        table.add(v, actions, f"{med * 1e3:.2f}", f"{min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f}", f"{med / base:.3f}x", f"{added:.0f}")
    inner = args.hidden * args.mlp_ratio
    bench.table(table, f"## chunks: 8 MLP blocks (hidden {args.hidden}, inner {inner}), {args.rows}-row micro-batches, m = {m}, one rank")


def _compute(a: torch.Tensor, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        a = torch.tanh(a @ a * 0.01)
    return time.perf_counter() - t


def transport_job(rank: int, world: int, sizes: list[int], rounds: int) -> dict:
    a = torch.randn(128, 128)
    _compute(a, 200)  # warm up, then size the work to ~2 ms, the same on both ranks
    n, out = broadcast(max(1, round(2e-3 / (min(_compute(a, 200) for _ in range(5)) / 200)))), {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        inbox = torch.empty_like(buf)
        quiet, send, recv = [], [], []
        for _ in range(rounds):
            for sender in (0, 1):
                dist.barrier()
                quiet.append(_compute(a, n))
                dist.barrier()
                work = dist.isend(buf, 1 - rank) if rank == sender else dist.irecv(inbox, 1 - rank)
                (send if rank == sender else recv).append(_compute(a, n))
                work.wait()
        q = statistics.fmean(quiet)
        out[nbytes] = (q, statistics.fmean(send) - q, statistics.fmean(recv) - q)
    return out


def transport(bench: Bench, args) -> None:
    sizes = [4096, args.rows * args.hidden * 4, 1 << 20, 4 << 20]
    results = run_distributed(transport_job, 2, sizes, args.rounds * 2, timeout=600, pin=True)
    table = Table("bytes", "rank", "compute alone ms", "longer with an isend in flight, us", "longer with an irecv in flight, us")
    for nbytes, (rank, res) in [(n, r) for n in sizes for r in enumerate(results)]:
        table.add(nbytes, rank, f"{res[nbytes][0] * 1e3:.2f}", *(f"{t * 1e6:.0f}" for t in res[nbytes][1:]))
    title = "## transport: compute time a message in flight takes from its sender's / receiver's compute (means; 2 pinned gloo processes)"
    bench.table(table, title)


def messages_job(rank: int, world: int, nbytes: int, think: float, repeats: int, bounce_only: bool) -> list:
    import lightning_pipe.profiling.messages as messages

    if bounce_only:  # the ranks pretend to be on two hosts: the bounce alone, no lockstep
        messages.socket.gethostname = lambda: f"host{rank}"
    return [messages.measure_messages(list(range(world)), nbytes, CPU, think=think) for _ in range(repeats)]


def messages(bench: Bench, args) -> None:
    nbytes = args.rows * args.hidden * 4
    bench.say(f"## messages: the setup's costs, {args.message_repeats} times, 2 processes; {nbytes} B, {args.think * 1e3:g} ms per hop\n")
    results = run_distributed(messages_job, 2, nbytes, args.think, args.message_repeats, args.bounce_only, timeout=300)[0]
    for r in results:
        bench.say("  " + r.summary())
    table = Table("term", "min us", "median us", "max us")
    for name in ("send_overhead", "recv_overhead", "handoff_mean"):
        s = spread(getattr(r, name) for r in results)
        table.add(name, *(f"{1e6 * v:.0f}" for v in (s.lo, s.median, s.hi)))
    bench.table(table)
    bench.say(f"seconds per measurement: max {max(r.seconds for r in results):.2f} s")
    bench.keep("measurements", [r.to_dict() for r in results])


PARTS = {"dispatch": dispatch, "chunks": chunks, "transport": transport, "messages": messages}


def main() -> None:
    bench = Bench(__doc__, threads=1, rounds=30, quick={"rounds": 2, "message_repeats": 2})
    bench.parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=["dispatch", "chunks", "transport"])
    bench.options(hidden=512, mlp_ratio=4, rows=64, microbatches=4, think=(3e-3, "messages: seconds of work per hop"))
    bench.options(message_repeats=(8, "messages: measurements in one process group"), bounce_only=(False, "messages: two hosts, pretended"))
    args = bench.parse()
    for part in args.parts:
        PARTS[part](bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
