"""The benchmarks and the GPU check: scripts of the checkout, not part of the wheel.

Run from the checkout's root, ``python -m benchmarks.<script> [--quick]`` (e.g.
``python -m benchmarks.bench_runtime --quick``, ``python -m benchmarks.gpu_check --smoke``); their
shared pieces are `benchmarks.harness`; their pictures need matplotlib (the ``plots`` extra). Results
and the commands that regenerate them: docs/results/.
"""
