"""The package's import graph runs one way: no cycle, at most one import back up the layers, no
Lightning below the bridge.

Every import statement counts, at module level, inside a function (a lazy import that only dodges a
cycle is still a cycle of concerns) or under `if TYPE_CHECKING:` (a reader still needs the other file).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (the module, or the submodule a `from` names)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle as a path (empty when there is none): depth-first search with colours."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_relative_imports_resolve_to_the_package_modules(tmp_path):
    edges = graph()
    assert "lightning_pipe.lightning.checkpoint.full" in edges["lightning_pipe.lightning.checkpoint.sharded"]
    assert "lightning_pipe.simulation.costs" in edges["lightning_pipe.simulation.simulator"]


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(graph())
    assert not cycle, " -> ".join(cycle)


# The layers, lowest first (docs/architecture.md draws them). A module imports its own layer or lower.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "faults", "topology"),
    ("schedules",),
    ("simulation",),
    ("runtime",),
    ("models",),
    ("planning",),
    ("profiling",),
    ("adaptive", "tuning"),
    ("modes", "modes.engine", "modes.*.engine", "modes.*.settings"),  # each mode's engine part and its settings' checks
    ("frontend",),
    ("config", "config_values", "legality"),
    (
        "lightning",
        "modes.lightning",
        "modes.*.lightning",
        "data",
        "models.lit",
        "models.hf",
    ),  # the bridge (each mode's Lightning part with it), the LightningModules and data modules
    ("cli",),
    ("plan", "train", ""),  # the package's __init__ and its commands
)


def layer_of(name: str) -> int:
    """The layer of module `name` (lightning_pipe.<...>): the most specific pattern that matches."""
    rest = name.split(".", 1)[1] if "." in name else ""
    best, depth = -1, -1
    for index, patterns in enumerate(LAYERS):
        for pattern in patterns:
            parts = pattern.split(".") if pattern else []
            mine = rest.split(".") if rest else []
            matches = (len(mine) >= len(parts) and all(p in ("*", m) for p, m in zip(parts, mine))) if parts else not mine
            if matches and len(parts) > depth:
                best, depth = index, len(parts)
    assert best >= 0, f"{name} is in no layer of LAYERS: add it"
    return best


def imports_back_up(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_layer_finder_finds_an_import_back_up():
    assert imports_back_up({"lightning_pipe.schedules.spec": {"lightning_pipe.config"}, "lightning_pipe.config": set()}) == [
        "lightning_pipe.schedules.spec -> lightning_pipe.config"
    ]
    assert (
        layer_of("lightning_pipe.modes.two_bw.engine")
        < layer_of("lightning_pipe.config")
        < layer_of("lightning_pipe.modes.two_bw.lightning")
    )
    assert layer_of("lightning_pipe") == len(LAYERS) - 1


def test_at_most_one_import_runs_back_up_the_layers():
    up = imports_back_up(graph())
    assert len(up) <= 1, up


def test_config_names_no_mode_outside_its_legality_table():
    """`config.py` holds the fields and their docs, `legality.py` the legality table: no comparison in
    config.py names a schedule or mode (a mode's own checks are in modes/<mode>/settings.py), and the
    table is made of its rows."""
    from lightning_pipe.legality import LEGALITY, Legality
    from lightning_pipe.schedules import REGISTRY

    names = set(REGISTRY) | {"auto", "learned", "rule", "2bw", "sync", "flush", "elastic", "avgpipe"}
    text = (PACKAGE / "config.py").read_text()
    tree = ast.parse(text)
    constants = {n.targets[0].id for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                literals = [c.value for c in ast.walk(side) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                if any(v.lower() in names for v in literals):
                    offenders.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
    assert "MODE_SETTINGS" in constants
    assert LEGALITY and all(isinstance(row, Legality) for row in LEGALITY)


def test_below_the_bridge_nothing_imports_lightning():
    bridge = layer_of("lightning_pipe.lightning")
    offenders = []
    for name, path in modules().items():
        if layer_of(name) < bridge:
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not offenders, offenders


def test_the_strategy_names_no_mode_and_stays_small():
    text = (PACKAGE / "lightning" / "strategy.py").read_text()
    assert len(text.splitlines()) < 300
    lowered = text.lower()
    for word in ('"sync"', "2bw", "two_bw", "avgpipe", "elastic", "flush"):
        assert word not in lowered, word
    assert not re.search(r"\.mode\b", text), "a mode attribute"


@pytest.mark.multiprocess
def test_the_strategy_alone_imports_neither_the_data_package_nor_the_cli():
    """`Trainer(strategy="autopipe")` needs torch and Lightning: not the data modules' torchdata or
    tokenizers, nor Hydra (a GPU machine with only those installed runs the strategy)."""
    import subprocess
    import sys

    def loaded(imports: str) -> set:
        probe = (
            f"import sys, {imports}; print(sorted({{m.split('.')[0] if not m.startswith('lightning_pipe') else m for m in sys.modules}}))"
        )
        return set(eval(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout))

    # what Lightning itself loads (it imports transformers and tokenizers when they are installed) is not ours
    ours = loaded("lightning_pipe") - loaded("torch, lightning")
    for name in ("lightning_pipe.data", "lightning_pipe.cli", "torchdata", "hydra", "tokenizers", "transformers"):
        assert name not in ours, name


def test_the_library_imports_nothing_of_the_benchmarks():
    """The benchmarks (benchmarks/, not in the wheel) use the library, never the other way round;
    what the library needs of theirs lives in the library (e.g. lightning_pipe.adaptive.stats)."""
    offenders = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] in ("benchmarks", "tests")]
    assert not offenders, offenders
    assert not list(PACKAGE.glob("bench/*.py")), "the benchmark harness is benchmarks/harness, outside the package"
