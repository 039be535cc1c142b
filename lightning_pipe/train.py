"""`python -m lightning_pipe.train recipe=<name> [overrides]` (see lightning_pipe/cli/train.py)."""

from lightning_pipe.cli.train import main

if __name__ == "__main__":
    main()
