"""A live switch's stall, fine-grained vs stop: `python benchmarks/bench_switch.py [--emulated] --rounds 5 --json docs/switch_results.json`."""

from lightning_pipe.bench.switch_stall import main

if __name__ == "__main__":
    main(__doc__)
