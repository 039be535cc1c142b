"""Every private name of Lightning, torchmetrics and torch the library uses exists in the installed
versions, so an upgrade that drops or renames one fails here, naming it, instead of in a training run.

Two sources: the imports, found in the package's source (`from lightning... import _x`, a private
module such as ``torch.utils._pytree``, a dotted path such as ``torch.autograd.profiler._is_profiler_enabled``);
and `ATTRIBUTES`, the private attributes the code reaches on their objects (``trainer._logger_connector``,
a launcher's ``_strategy``, a metric's ``_update_count``): written out here, since the object's class
is not in the source. Code that reaches a new one adds it to `ATTRIBUTES`; the last test checks
that every entry is still used where it says.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
OWNERS = ("lightning", "torchmetrics", "torch")
DISTRIBUTIONS = {"lightning": "lightning", "torchmetrics": "torchmetrics", "torch": "torch"}

# (class, attribute, files under lightning_pipe/ that use it): a method or class attribute, or an
# instance attribute the class (or a base of its own package) assigns in its source
ATTRIBUTES = [
    ("lightning.pytorch.Trainer", "_logger_connector", ["lightning/metrics.py"]),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_data_source", ["lightning/autoplan.py", "lightning/plan_2bw.py"]),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_should_accumulate", ["lightning/metrics.py"]),
    ("lightning.pytorch.loops.evaluation_loop._EvaluationLoop", "_data_source", ["lightning/autoplan.py", "lightning/front.py"]),
    ("lightning.pytorch.loops.prediction_loop._PredictionLoop", "_data_source", ["lightning/front.py"]),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_batches_that_stepped", ["lightning/metrics.py"]),
    ("lightning.pytorch.LightningModule", "_trainer", ["lightning/strategy.py"]),
    ("lightning.pytorch.core.optimizer.LightningOptimizer", "_optimizer", ["adaptive/switch.py", "lightning/checkpoint/full.py"]),
    ("lightning.pytorch.strategies.ParallelStrategy", "_launcher", ["lightning/strategy.py"]),
    ("lightning.pytorch.strategies.ParallelStrategy", "_precision_plugin", ["lightning/strategy.py"]),
    ("lightning.pytorch.strategies.launchers._SubprocessScriptLauncher", "_call_children_scripts", ["lightning/launchers.py"]),
    ("lightning.pytorch.strategies.launchers._MultiProcessingLauncher", "_strategy", ["lightning/launchers.py"]),
    ("lightning.pytorch.strategies.launchers._MultiProcessingLauncher", "_wrapping_function", ["lightning/launchers.py"]),
    ("lightning.pytorch.strategies.launchers._MultiProcessingLauncher", "_recover_results_in_main_process", ["lightning/launchers.py"]),
    ("lightning.pytorch.Trainer", "_signal_connector", ["lightning/signals.py"]),
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "_sigterm_notifier_fn", ["lightning/signals.py"]),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_broadcast_sigterm_tensor", ["lightning/signals.py"]),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_last_global_step_saved", ["cli/callbacks.py"]),
    *[
        ("lightning.pytorch.callbacks.ThroughputMonitor", name, ["lightning/metrics.py"])
        for name in ("_batches", "_lengths", "_samples", "_t0s", "_throughputs")
    ],
    *[
        ("torchmetrics.Metric", name, ["lightning/metric_state.py"])
        for name in (
            "_update_count",
            "_computed",
            "_to_sync",
            "_defaults",
            "_reductions",
            "_forward_cache",
            "_copy_state_dict",
            "_reduce_states",
        )
    ],
    *[
        ("torch.nn.Module", name, ["frontend/pipeline.py"])
        for name in ("_parameters", "_buffers", "_modules", "_register_state_dict_hook", "_register_load_state_dict_pre_hook")
    ],
    ("torch.nn.Module", "_non_persistent_buffers_set", ["frontend/trace.py"]),
    # FSDP2's state (shard="full"): zero bubble's reduction by hand, 2BW's versions of the shards
    (
        "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState",
        "_fsdp_param_groups",
        ["modes/width/lightning.py", "runtime/sharded_versions.py"],
    ),
    ("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "_state_ctx", ["modes/width/lightning.py"]),
    ("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "_root_post_backward_final_callback", ["modes/width/lightning.py"]),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState",
        "_lazy_init",
        ["runtime/sharded_versions.py", "modes/width/lightning.py"],
    ),
    ("torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam", "_sharded_param_data", ["runtime/sharded_versions.py"]),
    ("torch.distributed.tensor.DTensor", "_local_tensor", ["runtime/sharded_versions.py"]),
]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def private_uses() -> dict[str, list[str]]:
    """Dotted private names of the owners the package imports or reaches from an imported module
    (``torch.autograd.profiler._is_profiler_enabled``), each with the files that use it."""
    found: dict[str, set[str]] = {}
    for path in _files():
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a local name -> the owners' module (or name) it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in OWNERS:
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                        if any(_private(p) for p in a.name.split(".")):
                            found.setdefault(a.name, set()).add(where)
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in OWNERS:
                for a in node.names:
                    dotted = f"{node.module}.{a.name}"
                    aliases[a.asname or a.name] = dotted
                    if any(_private(p) for p in dotted.split(".")):
                        found.setdefault(dotted, set()).add(where)
        for node in ast.walk(tree):  # module.path._name reached through an imported module
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in aliases and _is_module(aliases[inner.id]):
                    found.setdefault(".".join([aliases[inner.id], *reversed(chain)]), set()).add(where)
    return {name: sorted(files) for name, files in sorted(found.items())}


def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        return False


def resolve(dotted: str):
    """The object a dotted name stands for: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, part in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, part):
                try:  # a submodule not imported by its package
                    obj = importlib.import_module(".".join(parts[: i + 1]))
                    continue
                except ImportError:
                    raise AttributeError(f"{'.'.join(parts[:i])} has no {part!r}") from None
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"no module of {dotted} imports")


def owns(cls: type, name: str) -> bool:
    """`name` is a method or class attribute of `cls`, or an instance attribute that `cls` or a base
    of the same package assigns (``self.name = ...``, ``self.name: T = ...`` or ``__setattr__("name", ...)``
    in its source)."""
    if hasattr(cls, name):
        return True
    assigned = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]+)?=(?!=)|setattr(__)?\((self, *)?[\"']{re.escape(name)}[\"']")
    root = cls.__module__.split(".")[0]
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == root:
            try:
                if assigned.search(inspect.getsource(klass)):
                    return True
            except (OSError, TypeError):
                continue
    return False


def installed(dotted: str) -> str:
    dist = DISTRIBUTIONS[dotted.split(".")[0]]
    return f"{dist} {importlib.metadata.version(dist)}"


USES = private_uses()


def test_the_scan_finds_the_private_imports_it_must():
    """The scan itself works: names the library is known to import privately are found."""
    assert "lightning.pytorch.strategies.launchers._MultiProcessingLauncher" in USES, sorted(USES)
    assert "torch.utils._pytree" in USES, sorted(USES)


@pytest.mark.parametrize("dotted", list(USES))
def test_every_private_name_the_library_imports_exists(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{dotted} (used by lightning_pipe/{', lightning_pipe/'.join(USES[dotted])}) is not in {installed(dotted)}: {err}")


@pytest.mark.parametrize(("owner", "name", "where"), ATTRIBUTES, ids=[f"{o.rsplit('.', 1)[-1]}.{n}" for o, n, _ in ATTRIBUTES])
def test_every_private_attribute_the_library_reaches_exists(owner, name, where):
    cls = resolve(owner)
    assert owns(cls, name), f"{owner}.{name} (used by lightning_pipe/{', lightning_pipe/'.join(where)}) is not in {installed(owner)}"


def test_the_checks_fail_on_a_name_that_is_not_there():
    trainer = resolve("lightning.pytorch.Trainer")
    assert owns(trainer, "_logger_connector") and not owns(trainer, "_no_such_connector")
    with pytest.raises(AttributeError, match="_no_such_helper"):
        resolve("lightning.fabric.utilities.distributed._no_such_helper")
    with pytest.raises(AttributeError, match="_no_such_module"):
        resolve("torch.utils._no_such_module.thing")


@pytest.mark.parametrize(("owner", "name", "where"), ATTRIBUTES, ids=[f"{o.rsplit('.', 1)[-1]}.{n}" for o, n, _ in ATTRIBUTES])
def test_every_listed_attribute_is_still_used_where_it_says(owner, name, where):
    unused = [f for f in where if not re.search(rf"\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']", (PACKAGE / f).read_text())]
    assert not unused, f"{owner}.{name}: no longer used in {unused}; update ATTRIBUTES"
