"""benchmarks.harness.bench: interleaved rounds, median and spread, the markdown table, the outputs."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.bench import Bench, Table, interleave, spread


def test_interleave_runs_every_config_once_per_round_in_order():
    calls = []
    out = interleave(["A", "B", "C"], 3, lambda c, r: calls.append((c, r)) or f"{c}{r}")
    assert calls == [(c, r) for r in range(3) for c in "ABC"]  # A B C, A B C, not A A A
    assert out == [["A0", "A1", "A2"], ["B0", "B1", "B2"], ["C0", "C1", "C2"]]


def test_spread_median_range_and_quartiles():
    s = spread([5.0, 1.0, 3.0, 9.0, 7.0])
    assert (s.median, s.lo, s.hi, s.n) == (5.0, 1.0, 9.0, 5)
    q = spread([1.0, 2.0, 3.0, 4.0, 100.0], iqr=True)
    assert (q.median, q.lo, q.hi) == (3.0, 2.0, 4.0)  # the outlier is outside the IQR
    assert spread([0.010, 0.012, 0.020]).fmt(1e3) == "12.0 (10.0..20.0)"
    assert spread([]).n == 0


def test_table_markdown_alignment_and_row_width():
    t = Table("mode", "samples/s", "note", align="lrl")
    t.add("single", f"{123.456:.1f}", None)
    assert t.markdown().splitlines() == ["| mode | samples/s | note |", "|---|---:|---|", "| single | 123.5 |  |"]
    with pytest.raises(ValueError):
        t.add("too", "few")


def test_bench_quick_json_and_markdown(tmp_path, capsys):
    bench = Bench("demo.\n\nmore", quick={"sizes": [1]}, rounds=3, steps=20, warmup=5, retries=2, quiet_wait=10.0)
    bench.options(sizes=[1, 2, 3], rate=(0.5, "a float"), name=None, flag=False)
    assert bench.parse(["--sizes", "4,5", "--rate", "2", "--flag"], header=False).sizes == [4, 5]
    assert (bench.args.rate, bench.args.name, bench.args.flag) == (2.0, None, True)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    args = bench.parse(["--quick", "--json", str(out), "--markdown", str(md)])
    assert (args.rounds, args.steps, args.warmup, args.retries, args.quiet_wait, args.sizes) == (1, 2, 1, 0, 0.0, [1])
    assert bench.parse(["--repeats", "4"], header=False).rounds == 4  # --repeats: the older name of --rounds
    bench.parse(["--json", str(out), "--markdown", str(md)])
    t = Table("x", "y")
    t.add(1, 2)
    bench.table(t, "## part")
    with bench.recording():
        print("printed inside\nand a second line")
    print("printed outside")
    bench.keep("samples", [0.5, 0.25])
    bench.finish()
    record = json.loads(out.read_text())
    assert record["raw"] == {"samples": [0.5, 0.25]}
    assert record["tables"] == [{"title": "## part", "columns": ["x", "y"], "rows": [["1", "2"]]}]
    assert record["options"]["rounds"] == 3 and "commit" in record["provenance"]
    text = md.read_text()
    assert text.startswith("# ") and "| x | y |\n|---|---:|\n| 1 | 2 |" in text
    assert "printed inside\nand a second line\n" in text and "outside" not in text
    assert "| 1 | 2 |" in capsys.readouterr().out


def test_bench_experiment_defaults_fill_what_the_command_line_left():
    # rounds and sizes default to None in the parser: the chosen experiment's, unless given or set by --quick
    defaults = {"a": {"rounds": 3, "sizes": [1, 2]}, "b": {"rounds": 5, "sizes": [4]}}
    bench = Bench("demo.", quick={"sizes": [9]}, rounds=None, steps=20)
    bench.experiment(defaults, "which")
    bench.parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")])
    args = bench.parse(["b"], header=False)
    assert (args.which, args.rounds, args.sizes) == ("b", 5, [4])
    args = bench.parse(["a", "--rounds", "7"], header=False)
    assert (args.rounds, args.sizes) == (7, [1, 2])
    args = bench.parse(["a", "--quick"], header=False)
    assert (args.rounds, args.sizes) == (1, [9])
