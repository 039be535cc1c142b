"""The stall of a live switch: AutoPipe-RL's fine-grained switch vs stopping the pipeline (lightning_pipe.bench.switch_stall).

flock /tmp/bench.lock python benchmarks/bench_switch.py --rounds 5 --json docs/switch_results.json
"""

from lightning_pipe.bench.switch_stall import main

if __name__ == "__main__":
    main(__doc__)
