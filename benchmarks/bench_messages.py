"""The message costs the strategy measures at setup (lightning_pipe.profiling.messages), repeated: their spread.

On 2 gloo processes x 1 thread (one host, so bounce + lockstep), messages of --nbytes (default: a
64-row x 512 float32 activation, bench_waves.py's boundary) and --think s of busy work per hop, the
measurement is repeated --repeats times in one process group and each result printed, then the
min / median / max of each term. With --bounce-only the ranks pretend to be on two hosts (the
clock-free bounce alone), for comparison.

    flock /tmp/bench.lock python benchmarks/bench_messages.py
    flock /tmp/bench.lock python benchmarks/bench_messages.py --bounce-only
"""

from __future__ import annotations

import argparse
import os
import statistics

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

from lightning_pipe.bench.launch import machine_description, run_distributed  # noqa: E402


def job(rank: int, world: int, nbytes: int, think: float, repeats: int, bounce_only: bool) -> list:
    import lightning_pipe.profiling.messages as messages

    torch.set_num_threads(1)
    if bounce_only:
        messages.socket.gethostname = lambda: f"host{rank}"
    return [messages.measure_messages(list(range(world)), nbytes, torch.device("cpu"), think=think) for _ in range(repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nbytes", type=int, default=64 * 512 * 4)
    p.add_argument("--think", type=float, default=3e-3)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--bounce-only", action="store_true")
    args = p.parse_args()
    print(f"{machine_description()}; 2 processes x 1 thread, gloo; {args.nbytes} B, think {args.think * 1e3:g} ms")
    results = run_distributed(job, 2, args.nbytes, args.think, args.repeats, args.bounce_only, timeout=300)[0]
    for r in results:
        print("  " + r.summary())
    for name in ("send_overhead", "recv_overhead", "handoff_mean"):
        xs = [getattr(r, name) * 1e6 for r in results]
        print(f"{name}: min {min(xs):.0f}, median {statistics.median(xs):.0f}, max {max(xs):.0f} us")
    print(f"seconds per measurement: max {max(r.seconds for r in results):.2f} s")


if __name__ == "__main__":
    main()
