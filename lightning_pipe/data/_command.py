"""The data commands' shared ending: one ``error: ...`` line and exit code 2 for a bad argument or file."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

# corpus.py's messages name the Hydra keys; on these command lines the same settings are options
_OPTIONS = (("data.path=", "--path="), ("data.max_bytes=", "--max-bytes="))


def run(main: Callable[[Optional[list[str]]], None], argv: Optional[list[str]] = None) -> int:
    try:
        main(argv)
    except (ValueError, OSError, ImportError) as err:
        if os.environ.get("LIGHTNING_PIPE_DEBUG") == "1":
            raise
        message = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        for key, option in _OPTIONS:
            message = message.replace(key, option)
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0
