"""Where the Hydra configs live: LIGHTNING_PIPE_CONF if set; else a checkout's top-level conf/
(recipes/ is reached as conf/recipe); else the copy an installed wheel carries (lightning_pipe/conf)."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
_CHECKOUT = _PACKAGE.parent / "conf"


def _config_dir() -> Path:
    if os.environ.get("LIGHTNING_PIPE_CONF"):
        return Path(os.environ["LIGHTNING_PIPE_CONF"]).resolve()
    return _CHECKOUT if (_CHECKOUT / "config.yaml").is_file() else _PACKAGE / "conf"


CONFIG_DIR = _config_dir()
