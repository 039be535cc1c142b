"""Zero bubble (issue 29): ZB-H1 and ZB-V vs our 1F1B and torch's ZBV on 2 real processes (MLP,
GPT-tiny), and EMULATED P = 4, 8 bubbles against the paper's formulas and our simulator.

    python -m benchmarks.bench_zero_bubble --rounds 3
"""

import argparse

from benchmarks.harness.bench import pin_threads
from benchmarks.harness.zero_bubble import main

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    pin_threads(1)
    main(a.rounds, a.steps)
