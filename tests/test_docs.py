"""The documentation holds together: the README stays a short guide, every path a Markdown file
names exists (and every test it names is there), the docs speak about the product, not about how
it was made, and the README's Options table lists exactly the fields of `PipelineConfig`.
Reads files only: no processes."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from lightning_pipe.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])
MAX_README_LINES = 300

# `benchmarks/x.py` or `tests/x.py`, optionally followed by `::name` (the name may wrap to the next line)
CODE_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|tests)/[\w/]+\.py)(?:::\s*(\w+))?")
# a bare mention of a document or a result file under docs/, read from the repository's root
BARE_DOC = re.compile(r"(?<![\w/.-])(docs/[\w./-]*\.(?:md|json))(?![\w*{])")
# a Markdown link [text](target), read relative to the linking file
LINK = re.compile(r"\]\(([^)\s]+)\)")
# words about how the project was worked on, not about the product
PROCESS_WORDS = [
    r"\bsessions?\b",
    r"\bhelpers? (?:that|who)\b",
    r"\bagents?\b",
    r"\bissues? #?\d+",
    r"\btracker\b",
    r"\buncommitted\b",
    r"\bworking tree\b",
]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_readme_is_a_short_guide():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}: move detail into docs/guide/"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_code_paths_named_in_the_docs_exist(doc):
    missing = []
    for match in CODE_PATH.finditer(doc.read_text()):
        path, name = match.group(1), match.group(2)
        target = ROOT / path
        if not target.is_file():
            missing.append(path)
        elif name and not re.search(rf"\b{re.escape(name)}\b", target.read_text()):
            missing.append(f"{path}::{name}")
    assert not missing, f"{rel(doc)} names what does not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_doc_paths_and_links_resolve(doc):
    text = doc.read_text()
    missing = [path for path in BARE_DOC.findall(text) if not (ROOT / path).exists()]
    for target in LINK.findall(text):
        if re.match(r"^(?:[a-z][a-z0-9+.-]*:|#)", target):  # a web address or an anchor of the same page
            continue
        path = target.split("#", 1)[0]
        resolved = Path(os.path.normpath(doc.parent / path))
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{rel(doc)} points at paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_docs_speak_about_the_product(doc):
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        found += [f"line {number}: {m.group(0)!r}" for pattern in PROCESS_WORDS for m in re.finditer(pattern, line, re.I)]
    assert not found, f"{rel(doc)} talks about how the work was done, not about the product: {found}"


def options_table() -> list[str]:
    """The names in the first column of the README's Options table (a cell may hold several, comma-separated)."""
    text = README.read_text()
    section = re.search(r"^## Options\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Options' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    assert len(rows) > 2 and re.match(r"^\|\s*field\s*\|", rows[0]), "the Options section's table starts with '| field | default | what |'"
    names = []
    for row in rows[2:]:  # below the header and its |---| line
        names += [name.strip().strip("`") for name in row.split("|")[1].split(",")]
    return names


def test_readme_options_are_exactly_the_config_fields():
    fields = [field.name for field in dataclasses.fields(PipelineConfig)]
    names = options_table()
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    assert not set(fields) - set(names), f"README.md's Options table misses: {[f for f in fields if f not in names]}"
    assert not set(names) - set(fields), f"README.md's Options table lists what is not a field: {sorted(set(names) - set(fields))}"


def test_command_line_keys_are_the_config_fields():
    # `pipeline.<field>=` on the command line is checked against this schema (Hydra's --help lists
    # the config groups only): the README's table names every key a user can set there
    from lightning_pipe.cli.schema import PipelineSchema

    keys = {field.name for field in dataclasses.fields(PipelineSchema)} - {"_target_"}
    assert keys == set(options_table())


def test_readme_options_show_the_config_defaults():
    # the default column is what PipelineConfig() holds (Python literals: "1f1b", None, 32, ...), so
    # a changed default cannot leave the README behind
    text = README.read_text()
    section = re.search(r"^## Options\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    defaults = {field.name: field.default for field in dataclasses.fields(PipelineConfig)}
    for row in [line for line in section.splitlines() if line.startswith("|")][2:]:
        cells = row.split("|")
        names = [n.strip().strip("`") for n in cells[1].split(",")]
        shown = [v.strip() for v in re.split(r",\s*(?![^\[]*\])", cells[2].strip())]
        assert len(shown) == len(names), f"{row}: one default per field"
        for name, value in zip(names, shown):
            want = f'"{defaults[name]}"' if isinstance(defaults[name], str) else repr(defaults[name])
            assert value == want, f"README.md's Options table: {name} defaults to {want}, the table says {value}"
