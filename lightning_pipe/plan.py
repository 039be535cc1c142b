"""`python -m lightning_pipe.plan recipe=<name> pipeline.stages=8` (see lightning_pipe/cli/plan.py)."""

from lightning_pipe.cli.plan import main

if __name__ == "__main__":
    main()
