"""Simulated bubble ratios of GPipe, 1F1B, interleaved 1F1B and wave (Hanayo) schedules.

    python benchmarks/bench_bubbles.py [--pictures docs/img]

B = P micro-batches, T_B = 2 T_F, no communication, the model cut into equal chunks (each chunk's
time shrinks with the number of chunks). Bubble ratio = total idle / (ranks x iteration time), the
simulator's definition; Hanayo's closed form for wave is (2P - 2) / (3PW + P - 1).
"""

from __future__ import annotations

import argparse

from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate


def bubble(name: str, p: int, m: int, **options: int):
    s = build_schedule(name, p, m, **options)
    n = s.num_chunks
    scale = p / n  # the whole model takes p*(1 + 2) per micro-batch, whatever the number of chunks
    return simulate(s, CostModel.uniform(n, 1.0 * scale, 2.0 * scale), [(i, i + 1) for i in range(n)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pictures", default=None)
    args = parser.parse_args()
    print(f"{'P':>2} {'gpipe':>7} {'1f1b':>7} {'interl. v=2':>12} {'wave W=1':>9} {'W=2':>7} {'W=4':>7}   Hanayo closed form W=1/2/4")
    for p in (2, 4, 8):
        row = [bubble("gpipe", p, p), bubble("1f1b", p, p)]
        row.append(bubble("interleaved", p, p, chunks=2))
        row += [bubble("wave", p, p, waves=w) for w in (1, 2, 4)]
        closed = [(2 * p - 2) / (3 * p * w + p - 1) for w in (1, 2, 4)]
        print(
            f"{p:>2} "
            + " ".join(f"{t.bubble_ratio:>{w}.3f}" for t, w in zip(row, (7, 7, 12, 9, 7, 7)))
            + "   "
            + " / ".join(f"{c:.3f}" for c in closed)
        )
        if args.pictures and p == 4:
            from lightning_pipe.simulation.timelines import gantt

            for t, name in zip(row, ("gpipe", "1f1b", "interleaved2", "wave1", "wave2", "wave4")):
                gantt(t, f"{args.pictures}/bubbles_p4_{name}.png")


if __name__ == "__main__":
    main()
