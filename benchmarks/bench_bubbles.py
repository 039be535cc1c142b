"""Simulated bubble ratios of GPipe, 1F1B, interleaved 1F1B and wave (Hanayo) schedules.

B = P micro-batches, T_B = 2 T_F, no communication, equal chunks; bubble ratio = total idle /
(ranks x iteration time); Hanayo's closed form for wave is (2P - 2) / (3PW + P - 1). Feeds
docs/schedules.md ("Bubble ratios").

    python benchmarks/bench_bubbles.py --pictures docs/img
"""

from __future__ import annotations

from lightning_pipe.bench.harness import Bench, Table
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate

VARIANTS = {"gpipe": ("gpipe", {}), "1f1b": ("1f1b", {}), "interleaved2": ("interleaved", {"chunks": 2})}
VARIANTS.update({f"wave{w}": ("wave", {"waves": w}) for w in (1, 2, 4)})


def bubble(name: str, p: int, m: int, **options: int):
    s = build_schedule(name, p, m, **options)
    n = s.num_chunks
    scale = p / n  # the whole model takes p*(1 + 2) per micro-batch, whatever the number of chunks
    return simulate(s, CostModel.uniform(n, 1.0 * scale, 2.0 * scale), [(i, i + 1) for i in range(n)])


def main() -> None:
    bench = Bench(__doc__)
    bench.parser.add_argument("--pictures", default=None, help="a folder for the P = 4 timelines")
    args = bench.parse()
    table = Table("P", "gpipe", "1f1b", "interleaved v=2", "wave W=1", "W=2", "W=4", "closed form W=1 / 2 / 4")
    for p in (2, 4) if args.quick else (2, 4, 8):
        row = {key: bubble(name, p, p, **options) for key, (name, options) in VARIANTS.items()}
        closed = " / ".join(f"{(2 * p - 2) / (3 * p * w + p - 1):.3f}" for w in (1, 2, 4))
        table.add(p, *(f"{t.bubble_ratio:.3f}" for t in row.values()), closed)
        if args.pictures and p == 4:
            from lightning_pipe.simulation.timelines import gantt

            for key, t in row.items():
                gantt(t, f"{args.pictures}/bubbles_p4_{key}.png")
    bench.table(table)
    bench.finish()


if __name__ == "__main__":
    main()
