"""The message costs the strategy measures at setup (lightning_pipe.profiling.messages), repeated: their spread.

2 gloo processes x 1 thread (one host: bounce + lockstep; --bounce-only: the ranks pretend to be on
two hosts), messages of --nbytes (a 64 x 512 float32 activation, bench_waves' boundary), --think s
of work per hop; --repeats measurements in one process group, then min / median / max of each
term. Feeds docs/messages.md.

    flock /tmp/bench.lock python benchmarks/bench_messages.py [--bounce-only]
"""

from __future__ import annotations

from lightning_pipe.bench.harness import Bench, Table, pin_threads, spread

pin_threads(1)

import torch  # noqa: E402

from lightning_pipe.bench.launch import run_distributed  # noqa: E402


def job(rank: int, world: int, nbytes: int, think: float, repeats: int, bounce_only: bool) -> list:
    import lightning_pipe.profiling.messages as messages

    if bounce_only:
        messages.socket.gethostname = lambda: f"host{rank}"
    return [messages.measure_messages(list(range(world)), nbytes, torch.device("cpu"), think=think) for _ in range(repeats)]


def main() -> None:
    bench = Bench(__doc__, rounds=8)
    bench.parser.add_argument("--nbytes", type=int, default=64 * 512 * 4)
    bench.parser.add_argument("--think", type=float, default=3e-3)
    bench.parser.add_argument("--bounce-only", action="store_true")
    args = bench.parse()
    bench.say(f"2 processes x 1 thread, gloo; {args.nbytes} B, think {args.think * 1e3:g} ms\n")
    results = run_distributed(job, 2, args.nbytes, args.think, args.rounds, args.bounce_only, timeout=300)[0]
    for r in results:
        bench.say("  " + r.summary())
    table = Table("term", "min us", "median us", "max us")
    for name in ("send_overhead", "recv_overhead", "handoff_mean"):
        s = spread(getattr(r, name) for r in results)
        table.add(name, *(f"{1e6 * v:.0f}" for v in (s.lo, s.median, s.hi)))
    bench.table(table)
    bench.say(f"seconds per measurement: max {max(r.seconds for r in results):.2f} s")
    bench.keep("measurements", [r.to_dict() for r in results])
    bench.finish()


if __name__ == "__main__":
    main()
