"""Where the Hydra configs live: the checkout's top-level conf/ (recipes/ is reached as conf/recipe).
Set LIGHTNING_PIPE_CONF to use another config directory."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_DIR = Path(os.environ.get("LIGHTNING_PIPE_CONF", Path(__file__).resolve().parents[2] / "conf"))
