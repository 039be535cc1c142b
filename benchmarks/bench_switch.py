"""A live switch's stall, fine-grained vs stop: `python -m benchmarks.bench_switch [--emulated] --rounds 5 --json docs/results/switch_results.json`."""

from benchmarks.harness.switch_stall import main

if __name__ == "__main__":
    main(__doc__)
