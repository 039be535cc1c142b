"""The package's import graph has no cycle, and the layering holds (no Lightning below the bridge).

Every import statement counts, at module level or inside a function (a lazy import that only dodges
a cycle is still a cycle of concerns); imports under `if TYPE_CHECKING:` do not run and are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(test)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (the module, or the submodule a `from` names)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
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


def test_below_the_bridge_nothing_imports_lightning():
    lower = ("schedules", "runtime", "layers", "simulation", "profiling", "planning", "adaptive", "tuning")
    offenders = []
    for name, path in modules().items():
        if name.split(".")[1:2] and name.split(".")[1] in lower:
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
