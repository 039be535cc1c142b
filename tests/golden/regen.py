"""Regenerate the golden schedule texts in this folder: ``python tests/golden/regen.py``.

Each ``<case>.txt`` is ``lightning_pipe.schedules.text.dump`` of one small schedule, built as
`CASES` says; tests/test_schedule_text.py checks that the builders still produce exactly these
lists. When a schedule changes on purpose, run this script and review the diff (``git diff
tests/golden``) as the change of behaviour it is. ``--check`` only reports stale files (exit 1).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from lightning_pipe.schedules import PipelineSchedule, build_schedule, forward_only, wave_placement
from lightning_pipe.schedules.text import dump

HERE = Path(__file__).resolve().parent

CASES: dict[str, Callable[[], PipelineSchedule]] = {
    "gpipe-p2-m3": lambda: build_schedule("gpipe", 2, 3),
    "1f1b-p3-m4": lambda: build_schedule("1f1b", 3, 4),
    "interleaved-p2-m4-chunks2": lambda: build_schedule("interleaved", 2, 4, chunks=2),
    "wave-p2-m4-waves1": lambda: build_schedule("wave", 2, 4, waves=1),
    "wave-p2-m4-waves2": lambda: build_schedule("wave", 2, 4, waves=2),
    "forward-p3-m2": lambda: forward_only(3, 2),
    # evaluation of a wave run: forward-only over the multi-chunk placement (local hand-overs)
    "forward-p2-m2-wave1": lambda: forward_only(2, 2, wave_placement(2, 1)),
    # zero bubble: backwards split in BI (input gradient) and W (weight gradients)
    "zb-h1-p3-m4": lambda: build_schedule("zb-h1", 3, 4),
    "zb-v-p2-m4": lambda: build_schedule("zb-v", 2, 4),
}


def path(case: str) -> Path:
    return HERE / f"{case}.txt"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for case, build in CASES.items():
        text = dump(build())
        target = path(case)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not check:
            target.write_text(text)
    verb = "stale" if check else "written"
    print(f"{verb}: {', '.join(stale)}" if stale else "all golden schedules up to date")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
