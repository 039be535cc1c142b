"""What every script under ``benchmarks/`` shares besides its experiment.

- `pin_threads`: one BLAS / OpenMP thread per process (set before workers spawn: they inherit it);
- `interleave`: rounds in the order A B C, A B C, ... so a drift of the machine falls on every
  configuration alike;
- `Spread` / `spread`: the median and the min..max (or the interquartile range) of repeated figures;
- `Table`: a markdown table, the form the docs quote (`column_table`: one from columns and records);
- `pyplot` / `save_figure`: matplotlib without a display, a figure written where asked;
- `Bench`: one run of a benchmark: the common options (rounds, steps, warm-up, ``--quick``,
  ``--json``, ``--markdown`` and, for scripts that launch jobs, the quiet-machine options), the
  script's own (`Bench.options`; `Bench.experiment`: several experiments with defaults of their
  own), threads pinned, the provenance header, `Bench.run` (`run_undisturbed` with those options),
  and at the end the JSON of raw results and the markdown of everything it printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

C = TypeVar("C")
R = TypeVar("R")


def pin_threads(n: int = 1) -> None:
    """``n`` threads for this process's torch and, through the environment, for every process it
    starts (a worker's BLAS reads the variables when it loads)."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)


def ints(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``; ``""`` -> ``[]`` (an option's value that turns a part off)."""
    return [int(v) for v in text.split(",") if v.strip()]


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def ms(seconds: float, digits: int = 1) -> str:
    return f"{1e3 * seconds:.{digits}f}"


# ---- rounds and statistics ------------------------------------------------------------------------
def interleave(configs: Sequence[C], rounds: int, run: Callable[[C, int], R]) -> list[list[R]]:
    """``run(config, round)`` for every config in every round, configs inner: A B C, A B C, ...
    Returns each config's results in round order (``out[i]`` belongs to ``configs[i]``)."""
    out: list[list[R]] = [[] for _ in configs]
    for r in range(rounds):
        for i, config in enumerate(configs):
            out[i].append(run(config, r))
    return out


@dataclass(frozen=True)
class Spread:
    """The median of repeated figures and their spread: min..max, or the quartiles (``iqr``)."""

    median: float
    lo: float
    hi: float
    n: int

    def fmt(self, scale: float = 1.0, digits: int = 1) -> str:
        """``median (lo..hi)``, each times ``scale``."""
        f = lambda v: f"{v * scale:.{digits}f}"  # noqa: E731
        return f"{f(self.median)} ({f(self.lo)}..{f(self.hi)})"

    def __str__(self) -> str:
        return self.fmt()


def spread(values: Iterable[float], iqr: bool = False) -> Spread:
    """The median and min..max (``iqr``: first..third quartile, inclusive method) of ``values``."""
    xs = sorted(values)
    if not xs:
        return Spread(math.nan, math.nan, math.nan, 0)
    if iqr and len(xs) > 1:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return Spread(statistics.median(xs), q1, q3, len(xs))
    return Spread(statistics.median(xs), xs[0], xs[-1], len(xs))


# ---- tables ---------------------------------------------------------------------------------------
class Table:
    """A markdown table. ``align``: one letter per column, ``l`` or ``r`` (default: the first column
    left, the others right, as figures are)."""

    def __init__(self, *columns: str, align: str | None = None):
        self.columns = list(columns)
        self.align = align or "l" + "r" * (len(columns) - 1)
        if len(self.align) != len(self.columns):
            raise ValueError(f"{len(self.columns)} columns, {len(self.align)} alignments")
        self.rows: list[list[str]] = []

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.columns)} columns")
        self.rows.append(["" if c is None else str(c) for c in cells])

    def markdown(self) -> str:
        rule = "|" + "|".join("---" if a == "l" else "---:" for a in self.align) + "|"
        lines = ["| " + " | ".join(self.columns) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"columns": self.columns, "rows": self.rows}


# ---- one run of a benchmark ----------------------------------------------------------------------
# The options a script may ask for, with their help; the script gives the defaults.
_OPTIONS: dict[str, tuple[type, str]] = {
    "rounds": (int, "rounds of every configuration, interleaved (A B C, A B C, ...)"),
    "steps": (int, "timed steps per run"),
    "warmup": (int, "untimed steps before the timed ones"),
    "retries": (int, "re-runs of a run other processes disturbed"),
    "max_foreign": (float, "a run during which other processes used more CPUs than this is disturbed"),
    "quiet_wait": (float, "seconds to wait at most, before a run, for other processes to go quiet"),
    "budget": (float, "seconds after which disturbed runs are kept and nobody is waited for any more"),
    "timeout": (float, "seconds per job before its processes are killed"),
}
# --quick: the fewest of everything that still runs the whole path, and no waiting for a quiet machine
QUICK = {"rounds": 1, "steps": 2, "warmup": 1, "retries": 0, "quiet_wait": 0.0, "budget": 0.0}


class Bench:
    """One run of a benchmark script.

    ``Bench(__doc__, rounds=3, steps=20, ...)`` offers the common options whose defaults it is
    given (``--rounds`` is also ``--repeats``); `options` (or ``bench.parser``) takes the script's
    own; ``threads``: `pin_threads` now, before any worker starts. `parse`
    applies ``--quick`` (the `QUICK` values of the common options, then the script's ``quick``
    overrides) and prints the provenance header. Everything printed with `say` / `table` is
    recorded (and what is printed inside `recording`); `keep` stores raw results; `finish` writes ``--json`` and ``--markdown``.
    """

    def __init__(self, doc: str | None, quick: dict[str, Any] | None = None, threads: int | None = None, **defaults: Any):
        if threads:
            pin_threads(threads)
        unknown = set(defaults) - set(_OPTIONS) - {"pin"}
        if unknown:
            raise ValueError(f"no common options {sorted(unknown)}; the script adds its own to bench.parser")
        doc = doc or ""
        self.parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
        g = self.parser.add_argument_group("common (benchmarks.harness.bench)")
        for key, (kind, text) in _OPTIONS.items():
            if key in defaults:
                flags = ["--" + key.replace("_", "-")] + (["--repeats"] if key == "rounds" else [])
                g.add_argument(*flags, dest=key, type=kind, default=defaults[key], help=f"{text} (default {defaults[key]})")
        if "pin" in defaults:
            g.add_argument("--pin", action="store_true", default=defaults["pin"], help="pin rank r's process to CPU r")
        g.add_argument("--quick", action="store_true", help="smoke mode: the fewest steps, rounds and configurations; no waiting")
        g.add_argument("--json", default=None, help="write the raw results (and the tables) here")
        g.add_argument("--markdown", default=None, help="write what is printed (the tables) here, as markdown")
        self.quick = dict(quick or {})
        self.experiments: tuple[str, dict[str, dict[str, Any]]] | None = None
        self.args: argparse.Namespace | None = None
        self.lines: list[str] = []
        self._pending = ""
        self.tables: list[dict] = []
        self.raw: dict[str, Any] = {}
        self.started = time.monotonic()
        self.name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "bench"

    # ---- options and header ----
    def options(self, **specs: Any) -> None:
        """The script's options, ``name=default`` or ``name=(default, help)``, typed by the default:
        a list is comma-separated (`ints`, `floats`, `names`), False a flag, None a string."""
        for name, spec in specs.items():
            default, text = spec if isinstance(spec, tuple) else (spec, None)
            flag = "--" + name.replace("_", "-")
            if default is False:
                self.parser.add_argument(flag, action="store_true", help=text)
                continue
            kind = type(default[0] if isinstance(default, list) and default else default)
            kind = {int: ints, float: floats}.get(kind, names) if isinstance(default, list) else str if default is None else kind
            self.parser.add_argument(flag, type=kind, default=default, help=text)

    def experiment(self, defaults: dict[str, dict[str, Any]], name: str = "experiment") -> None:
        """A positional choice of experiment (one script, several experiments), each with its own
        defaults of some options: those options default to None in the parser and `parse` fills in
        the chosen experiment's (after ``--quick``; a value given on the command line stays)."""
        self.parser.add_argument(name, choices=list(defaults))
        self.experiments = (name, defaults)

    def parse(self, argv: Sequence[str] | None = None, header: bool = True) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        if args.quick:
            for key, value in {**QUICK, **self.quick}.items():
                if hasattr(args, key) or key in self.quick:
                    setattr(args, key, value)
        if self.experiments:
            name, defaults = self.experiments
            for key, value in defaults[getattr(args, name)].items():
                setattr(args, key, value if getattr(args, key, None) is None else getattr(args, key))
        self.args = args
        self.started = time.monotonic()
        if header:
            self.say(f"# {self.name}: {self.provenance}")
            self.say(f"command: `{self.command}`")
        return args

    @property
    def command(self) -> str:
        """The command that runs this again: ``python -m benchmarks.<script> ...`` (a script run by its
        path is recorded by its path)."""
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        script = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0]) if sys.argv else self.name]
        return "python " + " ".join(shlex.quote(a) for a in [*script, *sys.argv[1:]])

    @property
    def provenance(self) -> str:
        from . import provenance

        return provenance()

    def error(self, message: str) -> None:
        self.parser.error(message)

    # ---- output ----
    def say(self, text: str = "") -> None:
        """Print (flushed) and record for ``--markdown``."""
        print(text, flush=True)
        self.lines.append(text)

    def log(self, text: str) -> None:
        """Progress: printed, not recorded."""
        print(text, flush=True)

    def table(self, table: Table, title: str | None = None) -> Table:
        if title:
            self.say(title)
            self.say()
        self.say(table.markdown())
        self.say()
        self.tables.append({"title": title, **table.as_dict()})
        return table

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside: what is printed is also recorded for ``--markdown`` (a report written with print)."""
        bench, out = self, sys.stdout

        class Tee(io.TextIOBase):
            def write(self, text: str) -> int:
                bench._pending += text
                *done, bench._pending = bench._pending.split("\n")
                bench.lines.extend(done)
                return out.write(text)

            def flush(self) -> None:
                out.flush()

        sys.stdout = Tee()
        try:
            yield
        finally:
            sys.stdout = out
            if self._pending:
                self.lines.append(self._pending)
                self._pending = ""

    def keep(self, key: str, value: Any) -> None:
        self.raw[key] = value

    def finish(self) -> None:
        elapsed = time.monotonic() - self.started
        self.log(f"\ntotal {elapsed:.0f} s")
        args = self.args
        if args is not None and args.json:
            record = {
                "provenance": self.provenance,
                "command": self.command,
                "seconds": elapsed,
                "options": vars(args),
                "tables": self.tables,
                "raw": self.raw,
            }
            write_json(args.json, record)
            self.log(f"raw results written to {args.json}")
        if args is not None and args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(self.lines) + "\n")
            self.log(f"markdown written to {args.markdown}")

    # ---- launching ----
    @property
    def patient(self) -> bool:
        """Within the budget: wait for a quiet machine, repeat disturbed runs."""
        return time.monotonic() - self.started < getattr(self.args, "budget", math.inf)

    def run(self, fn: Callable, world: int, *args: Any, label: str = "run", **launch: Any) -> tuple[list[Any], float]:
        """`run_undisturbed` with this run's options; the results and the foreign load (CPUs)."""
        from .launch import run_undisturbed

        a = self.args
        launch.setdefault("timeout", getattr(a, "timeout", 300.0))
        if hasattr(a, "pin"):
            launch.setdefault("pin", a.pin)
        if world == 1:
            launch.setdefault("backend", None)
        return run_undisturbed(
            fn,
            world,
            *args,
            retries=getattr(a, "retries", 0),
            max_foreign=getattr(a, "max_foreign", 0.1),
            quiet_wait=getattr(a, "quiet_wait", 0.0),
            patient=self.patient,
            label=label,
            log=self.log,
            **launch,
        )


def _plain(value: Any) -> Any:
    """JSON for what benchmarks keep: tensors as lists, dataclasses as dicts, the rest as text."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def write_json(path: str, record: Any) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=_plain)
        f.write("\n")


def column_table(columns: Sequence[tuple], rows: Iterable[Any], align: str | None = None) -> "Table":
    """A Table from columns, one row per record of `rows`: (header, value function) or (header, key,
    format spec), the record's figure (an empty cell where it has none)."""
    figure = lambda key, spec="": lambda r: "" if r.get(key) is None else format(r[key], spec)  # noqa: E731
    values = [column[1] if callable(column[1]) else figure(*column[1:]) for column in columns]
    table = Table(*(column[0] for column in columns), align=align)
    for row in rows:
        table.add(*(value(row) for value in values))
    return table


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: Any, dpi: int = 110) -> None:
    """Write ``fig`` to ``out`` (its folder made), close it, say where."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)
    print(f"wrote {out}", flush=True)


def pin_to_core(core: int) -> None:
    """Every thread of this process (gloo's background threads too) on `core`, one intra-op thread."""
    import torch

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # the thread ended between the listing and the call: nothing to pin
            pass
    torch.set_num_threads(1)
