"""What a rank's host spends beyond its blocks' profiled times: three direct measurements.

The simulator under-predicts many-chunk schedules on 2 real processes (docs/predictions.md), and
bench_waves' fit over its traces puts 40-95 us on every compute action. Where would a fixed
per-action term come from? Each part below measures one candidate alone:

- ``dispatch``: the executor's own cost per compute action (the interpreter, boundary leaves,
  stash, autograd's entry, the input gradients): one process, a one-rank interleaved schedule of
  v null chunks (one scalar weight times a --rows x --hidden tensor), its median run less the null
  blocks' profiled times (lightning_pipe.profiling, chain mode), per compute action.
- ``chunks``: the same 8 residual-MLP blocks (bench_runtime's, hidden --hidden) and m micro-batches
  run on one rank as v = 1, 2, 4, 8 chunks (1F1B for v = 1, interleaved otherwise): the same block
  computes, no messages, only more compute actions and more micro-batches in flight; the simulator
  predicts the same time for every v. Besides, one chunk in GPipe's order (all m micro-batches in
  flight, the same actions as 1F1B's): does holding more activations cost? Rounds alternate.
- ``transport``: 2 gloo processes pinned to a core each; one issues `isend`, the other `irecv`,
  then both run the same fixed compute (matmuls, ~2 ms): how much longer it takes than without a
  message in flight is the compute time the transport's threads took, per message, by size.

    flock /tmp/bench.lock python benchmarks/bench_host_costs.py            # all three, ~3 min
    flock /tmp/bench.lock python benchmarks/bench_host_costs.py --parts chunks
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench.launch import machine_description, run_distributed  # noqa: E402
from lightning_pipe.bench.mlp import Block  # noqa: E402
from lightning_pipe.profiling import profile_blocks  # noqa: E402
from lightning_pipe.runtime.executor import Executor  # noqa: E402
from lightning_pipe.runtime.microbatch import signature  # noqa: E402
from lightning_pipe.runtime.p2p import Transport  # noqa: E402
from lightning_pipe.runtime.sequential import SequentialHost  # noqa: E402
from lightning_pipe.schedules import build_schedule  # noqa: E402

CPU = torch.device("cpu")


class Null(nn.Module):
    """A block with (almost) nothing to compute: what the executor adds shows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def one_rank(chunks: list[nn.Module], m: int, x: torch.Tensor, one_chunk: str = "1f1b") -> tuple[Executor, SequentialHost, list]:
    """A one-rank schedule over `chunks` (`one_chunk`'s order for one chunk, interleaved otherwise), ready to run."""
    v = len(chunks)
    schedule = build_schedule("interleaved", 1, m, chunks=v) if v > 1 else build_schedule(one_chunk, 1, m)
    host = SequentialHost(dict(enumerate(chunks)), v - 1, lambda out, _: out.pow(2).mean())
    host.inputs, host.targets, host.weights = [x.clone() for _ in range(m)], [None] * m, [1 / m] * m
    return Executor(schedule, 0, Transport(lambda r: r, CPU)), host, [signature(t) for t in host.inputs]


def run_once(executor: Executor, host: SequentialHost, keys: list, modules: list[nn.Module]) -> float:
    host.losses = []
    t0 = time.perf_counter()
    executor.run(host, keys)
    elapsed = time.perf_counter() - t0
    for mod in modules:
        mod.zero_grad(set_to_none=True)
    return elapsed


def dispatch(args) -> None:
    x, m = torch.randn(args.rows, args.hidden), args.microbatches
    print(f"\n## dispatch: the executor's cost per compute action, null blocks on {args.rows} x {args.hidden} tensors, m = {m}")
    print("| chunks | run ms | null blocks' profiled f + b per micro-batch, us | executor per compute action, us |")
    print("|---:|---:|---:|---:|")
    for v in (1, 2, 4, 8):
        blocks = [Null() for _ in range(v)]
        prof = profile_blocks(blocks, x, CPU, repeats=args.rounds, warmup=3, inflight=m, loss_fn=lambda o: o.pow(2).mean())
        blocks_time = sum(p["forward"] + p["backward"] for p in prof.values())
        ex, host, keys = one_rank(blocks, m, x)
        runs = [run_once(ex, host, keys, blocks) for _ in range(args.rounds + 3)][3:]
        run = statistics.median(runs)
        print(f"| {v} | {run * 1e3:.3f} | {blocks_time * 1e6:.1f} | {(run - m * blocks_time) / (2 * m * v) * 1e6:.1f} |")


def chunks(args) -> None:
    torch.manual_seed(0)
    blocks = [Block(args.hidden, args.hidden * args.mlp_ratio) for _ in range(8)]
    x, m = torch.randn(args.rows, args.hidden), args.microbatches
    variants = {
        "1 (1F1B order)": one_rank([nn.Sequential(*blocks)], m, x),
        "1 (GPipe order)": one_rank([nn.Sequential(*blocks)], m, x, "gpipe"),
    }
    for v in (2, 4, 8):
        per = len(blocks) // v
        variants[str(v)] = one_rank([nn.Sequential(*blocks[c * per : (c + 1) * per]) for c in range(v)], m, x)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds + 2):  # alternate, so drifts of the machine fall on every variant alike
        for v, (ex, host, keys) in variants.items():
            t = run_once(ex, host, keys, blocks)
            if r >= 2:
                times[v].append(t)
    base = statistics.median(times["1 (1F1B order)"])
    print(
        f"\n## chunks: 8 MLP blocks (hidden {args.hidden}, inner {args.hidden * args.mlp_ratio}), {args.rows}-row micro-batches, m = {m}, one rank"
    )
    print("| chunks | compute actions | median run ms | min..max ms | vs 1 chunk (1F1B) | per added compute action, us |")
    print("|---|---:|---:|---:|---:|---:|")
    for v, (ex, _, _) in variants.items():
        ts, med = times[v], statistics.median(times[v])
        actions = sum(a.op.is_compute for a in ex.actions)
        added = (med - base) / (actions - 2 * m) * 1e6 if actions > 2 * m else 0.0
        print(f"| {v} | {actions} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f} | {med / base:.3f}x | {added:.0f} |")


def _compute(a: torch.Tensor, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        a = torch.tanh(a @ a * 0.01)
    return time.perf_counter() - t


def transport_job(rank: int, world: int, sizes: list[int], rounds: int) -> dict:
    a = torch.randn(128, 128)
    _compute(a, 200)  # warm up, then size the work to ~2 ms
    n = max(1, round(2e-3 / (min(_compute(a, 200) for _ in range(5)) / 200)))
    box = [n]
    dist.broadcast_object_list(box, 0)  # the same work on both ranks
    n, out = box[0], {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        inbox = torch.empty_like(buf)
        quiet, send, recv = [], [], []
        for _ in range(rounds):
            for sender in (0, 1):
                dist.barrier()
                quiet.append(_compute(a, n))
                dist.barrier()
                if rank == sender:
                    work = dist.isend(buf, 1 - rank)
                    send.append(_compute(a, n))
                else:
                    work = dist.irecv(inbox, 1 - rank)
                    recv.append(_compute(a, n))
                work.wait()
        q = statistics.fmean(quiet)
        out[nbytes] = (q, statistics.fmean(send) - q, statistics.fmean(recv) - q)
    return out


def transport(args) -> None:
    sizes = [4096, args.rows * args.hidden * 4, 1 << 20, 4 << 20]
    results = run_distributed(transport_job, 2, sizes, args.rounds * 2, timeout=600, pin=True)
    print("\n## transport: compute time a message in flight takes from its sender's / receiver's compute (means; 2 pinned gloo processes)")
    print("| bytes | rank | compute alone ms | longer with an isend in flight, us | longer with an irecv in flight, us |")
    print("|---:|---:|---:|---:|---:|")
    for nbytes in sizes:
        for rank, res in enumerate(results):
            q, s, r = res[nbytes]
            print(f"| {nbytes} | {rank} | {q * 1e3:.2f} | {s * 1e6:.0f} | {r * 1e6:.0f} |")


PARTS = {"dispatch": dispatch, "chunks": chunks, "transport": transport}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    print(f"{machine_description()}; 1 thread per process; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    torch.set_num_threads(1)
    for part in args.parts:
        PARTS[part](args)


if __name__ == "__main__":
    main()
