"""Converting a user's model in place, and tracing one step to learn how its forward is cut.

`convert` swaps the LightningModule's child that holds the blocks (``self.model``) for a
`TracedPipeline` over the same modules. `trace` then runs the user's own training step once on a
sample micro-batch (no gradients) and records, with the blocks' forwards, a global module hook and
a torch function mode:

- the calls of the repeated blocks: each once, in order, with one structure (`Structure`); which
  argument of block i+1 is block i's output and which are passed along unchanged;
- which module and which tensor of the model runs before the loop (the first block's), inside
  block i (block i's only) and after it (the last block's); anything used between two blocks, or a
  block's weight used outside it, is refused, as is a step that calls the model twice.

It also turns off Hugging Face's key/value cache (`config.use_cache`): training does not read it
and a cache object cannot travel between stages.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..runtime.call import Call
from .find import FIX, FrontendError, find_blocks
from .halves import HalfA, HalfB, find_cut, split_blocks, unsplit_blocks
from .pipeline import HOLDER, Frontend, Holder, TracedPipeline, _BlockForward, _PartForward, encode, original_forward
from .structure import Structure
from .weights import ZerosForMeta


def convert(module: nn.Module, blocks: Optional[str] = None) -> tuple[str, TracedPipeline]:
    """Put a `TracedPipeline` in place of the model holding the blocks; (its path, it)."""
    found = find_blocks(module, blocks)
    root = found.root
    config = getattr(root, "config", None)
    frontend = Frontend(root, found.list_path, found.blocks)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache, frontend.use_cache = False, True  # back on when the model is handed back
    for i, block in enumerate(found.blocks):
        block.forward = _BlockForward(frontend, i, block)
    paths = [f"{found.list_path}.{i}" for i in range(len(found.blocks))]
    pipeline = TracedPipeline(frontend, paths)
    setattr(module, found.root_path, pipeline)
    return found.root_path, pipeline


def restore(pipeline: TracedPipeline) -> nn.Module:
    """The user's model as it was (its blocks' own forwards back), with the pipeline's weights."""
    fe = pipeline.frontend
    blocks = list(fe.root.get_submodule(fe.list_path))
    for block in blocks:
        block.__dict__.pop("forward", None)
    if fe.halves is not None:
        unsplit_blocks(blocks, fe.halves.cut)
    for m in fe.root.modules():  # the modules before the loop: their own forwards back
        if isinstance(m.__dict__.get("forward"), _PartForward):
            del m.__dict__["forward"]
    if fe.use_cache:
        fe.root.config.use_cache = True
    return fe.root


class _Recorder(TorchFunctionMode):
    """Records block calls, module calls and the model's tensors touched, by phase: "pre", ("block", i), ("after", i)."""

    def __init__(self, frontend: Frontend):
        super().__init__()
        self.frontend = frontend
        self.phase: Any = "pre"
        self.calls: list[tuple[int, Any, Any]] = []  # (index, (args, kwargs), output)
        self.names = {id(t): n for n, t in _named_tensors(frontend.root)}
        self.used: dict[int, set] = {}
        self.module_calls: list[tuple[nn.Module, Any]] = []
        self.children: list[tuple[str, Any, Any]] = []  # block 0's direct children: (name, (args, kwargs), output)
        first = frontend.root.get_submodule(frontend.list_path)[0]
        self._first_children = {id(m): n for n, m in first.named_children()}

    def block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.phase = ("block", index)
        out = original_forward(block, args, kwargs)
        self.calls.append((index, (args, kwargs), out))
        self.phase = ("after", index)
        return out

    def module_called(self, module: nn.Module, _args: Any) -> None:
        self.module_calls.append((module, self.phase))

    def module_returned(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.phase == ("block", 0) and id(module) in self._first_children:
            self.children.append((self._first_children[id(module)], (args, kwargs), output))

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, Tensor) and id(t) in self.names:
                self.used.setdefault(id(t), set()).add(self.phase)
        return func(*args, **kwargs)


def _named_tensors(root: nn.Module) -> list[tuple[str, Tensor]]:
    out = []
    for prefix, m in root.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def trace(module: Any, path: str, pipeline: TracedPipeline, batch: Any, step_name: str = "training_step", sublayers: bool = True) -> None:
    """Run the user's step (`step_name`) once on `batch` and record how the model is cut (see above);
    `sublayers`: each repeated block in two halves where it allows (halves.py)."""
    fe = pipeline.frontend
    recorder = _Recorder(fe)
    calls: list[Call] = []
    root = fe.root
    inside = {id(m) for m in root.modules()}
    empty = ZerosForMeta() if any(t.is_meta for t in [*root.parameters(), *root.buffers()]) else contextlib.nullcontext()

    def call_model(*args: Any, **kwargs: Any) -> Any:
        calls.append(Call(args, kwargs))
        if len(calls) > 1:  # run it, but the step is refused below
            return root(*args, **kwargs)
        recorder.phase = "pre"
        with fe.in_mode("trace"), empty, recorder:  # the recorder innermost: it sees the model's own tensors
            return root(*args, **kwargs)

    def hook(m: nn.Module, args: Any) -> None:
        if id(m) in inside and fe.mode == "trace":
            recorder.module_called(m, args)

    def after(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if id(m) in inside and fe.mode == "trace":
            recorder.module_returned(m, args, kwargs, output)

    fe.recorder = recorder
    pipeline.forward = call_model  # type: ignore[method-assign]
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    handle_after = torch.nn.modules.module.register_module_forward_hook(after, with_kwargs=True)
    had_log = "log" in module.__dict__
    module.log = lambda *a, **k: None  # no logging outside the loop
    modes = {m: m.training for m in module.modules()}
    module.eval()  # no dropout draws, no running statistics: the trace leaves no trace
    try:
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            getattr(module, step_name)(batch, 0)
    finally:
        for m, mode in modes.items():
            m.training = mode
        handle.remove()
        handle_after.remove()
        del pipeline.forward
        fe.recorder = None
        if not had_log:
            del module.log
    if not calls:
        raise FrontendError(f"{type(module).__name__}.{step_name} never called self.{path}(...); call the model once per step")
    if len(calls) > 1:
        raise FrontendError(
            f"{type(module).__name__}.{step_name} calls self.{path}(...) {len(calls)} times; a pipeline runs the model once per "
            "micro-batch: call it once per step (concatenate the inputs), or define configure_pipeline()"
        )
    _learn_calls(fe, recorder)
    _learn_owners(module, pipeline, recorder)
    if sublayers:
        _split(pipeline, recorder)


def _split(pipeline: TracedPipeline, rec: _Recorder) -> None:
    """Each repeated block as two pipeline blocks where block 0's recorded run verifies a cut (halves.py)."""
    fe = pipeline.frontend
    blocks = list(fe.root.get_submodule(fe.list_path))
    _, call, output = rec.calls[0]
    cut = find_cut(fe, blocks[0], call, output, rec.children)
    if cut is None:
        return
    split_blocks(fe, blocks, cut)
    names = [n for n, _ in blocks[0].named_children()]
    first_half = [n for n in names if n in cut.before]
    second_half = [n for n in names if n not in cut.before]
    made: list[nn.Module] = [pipeline[0]]
    for i, block in enumerate(blocks):
        path = f"{fe.list_path}.{i}"
        made += [HalfA(fe, i, path, block, first_half), HalfB(fe, i, path, block, second_half)]
    pipeline.replace_blocks([*made, pipeline[len(pipeline) - 1]])


def _learn_calls(fe: Frontend, rec: _Recorder) -> None:
    order = [i for i, _, _ in rec.calls]
    if order != list(range(fe.count)):
        shown = order if len(order) <= 12 else order[:12] + ["..."]
        raise FrontendError(
            f"{type(fe.root).__name__}'s forward called its {fe.count} blocks ({fe.list_path}) in the order {shown}; a pipeline "
            f"needs each block called once, in order, every step (no data-dependent control flow across blocks); {FIX}"
        )
    structures = [Structure.of(call, "block calls") for _, call, _ in rec.calls]
    for i, s in enumerate(structures[1:], start=1):
        if not s.same_as(structures[0]):
            raise FrontendError(f"block {i} of {fe.list_path} is called with other arguments than block 0; {FIX}")
    links: Optional[list[Any]] = None
    for i in range(1, fe.count):
        before, out = pytree.tree_leaves(rec.calls[i - 1][1]), pytree.tree_leaves(rec.calls[i - 1][2])
        now = pytree.tree_leaves(rec.calls[i][1])
        mine = []
        for j, leaf in enumerate(now):
            if not isinstance(leaf, Tensor):
                mine.append(("same",))
            elif any(leaf is o for o in out):
                mine.append(("out", next(k for k, o in enumerate(out) if leaf is o)))
            elif leaf is before[j]:
                mine.append(("same",))
            else:
                name = structures[0].names[j] or "its input"
                raise FrontendError(
                    f"{type(fe.root).__name__}'s forward computes {name} of block {i} ({fe.list_path}.{i}) between blocks; the code "
                    f"between two blocks may only pass the previous block's outputs along; {FIX}"
                )
        if links is not None and mine != links:
            raise FrontendError(f"the blocks of {fe.list_path} are not chained the same way at block {i}; {FIX}")
        links = mine
    fe.block_call = structures[0]
    fe.output = Structure.of(rec.calls[-1][2], "the last block's outputs")
    fe.links = tuple(links or [("same",)] * len(pytree.tree_leaves(rec.calls[0][1])))


def _outermost(paths: list[str]) -> list[str]:
    ordered = sorted(set(paths), key=lambda p: (p.count("."), p))
    kept: list[str] = []
    for p in ordered:
        if not any(p == k or p.startswith(k + ".") for k in kept):
            kept.append(p)
    return kept


def _learn_owners(module: Any, pipeline: TracedPipeline, rec: _Recorder) -> None:
    fe = pipeline.frontend
    root, list_path, last = fe.root, fe.list_path, ("after", fe.count - 1)
    module_path = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    ancestors = {list_path.rsplit(".", i)[0] for i in range(list_path.count(".") + 1)} | {""}

    def block_of(path: str) -> Optional[int]:
        if path.startswith(list_path + "."):
            return int(path[len(list_path) + 1 :].split(".", 1)[0])
        return None

    # the model's tensors by phase of use
    for tid, phases in rec.used.items():
        name = rec.names[tid]
        owner = block_of(name)
        for phase in sorted(phases, key=_order):  # the first misuse in execution order
            if owner is not None and phase != ("block", owner):
                raise FrontendError(
                    f"{name} belongs to block {owner} of {list_path} but is used {_where(phase, fe.count)}; a block's weights "
                    f"must be used only inside it; {FIX}"
                )
            if owner is None and isinstance(phase, tuple) and phase[0] == "block":
                raise FrontendError(
                    f"{name} is held outside the blocks of {list_path} but used inside block {phase[1]}; every parameter must "
                    f"belong to one block (move it into the blocks, or pass it as an argument); {FIX}"
                )
            if owner is None and isinstance(phase, tuple) and phase[0] == "after" and phase != last:
                raise FrontendError(f"{name} is used between blocks {phase[1]} and {phase[1] + 1} of {list_path}; {FIX}")

    def modules_in(phase_ok: Callable[[Any], bool]) -> list[str]:
        paths = [module_path[id(m)] for m, phase in rec.module_calls if phase_ok(phase) and id(m) in module_path]
        return _outermost([p for p in paths if p not in ancestors and block_of(p) is None and not p.startswith(list_path + ".")])

    first_mods = modules_in(lambda ph: ph == "pre")
    last_mods = modules_in(lambda ph: ph == last)
    named = _named_tensors(root)
    covered_first = {id(t) for p in first_mods for t in _tensors_of(root.get_submodule(p))}
    covered_last = {id(t) for p in last_mods for t in _tensors_of(root.get_submodule(p))}
    seen: set[int] = set()
    first_loose: dict[str, dict[str, Tensor]] = {}
    last_loose: dict[str, dict[str, Tensor]] = {}
    for name, t in named:
        if block_of(name) is not None or id(t) in seen:
            continue
        phases = rec.used.get(id(t), set())
        in_first, in_last = id(t) in covered_first, id(t) in covered_last
        if "pre" in phases and not in_first:
            _add_loose(first_loose, name, t)
            in_first = True
        if (last in phases or not (in_first or in_last)) and not in_last:  # unused tensors: kept by the last block
            _add_loose(last_loose, name, t)
        seen.add(id(t))
    first, lastb = pipeline[0], pipeline[len(pipeline) - 1]
    first.own({encode(p): root.get_submodule(p) for p in first_mods})
    for p in first_mods:  # in the last block's rerun they answer zeros without computing
        part = root.get_submodule(p)
        if p not in last_mods and "forward" not in part.__dict__:
            part.forward = _PartForward(fe, part)
    lastb.own({encode(p): root.get_submodule(p) for p in last_mods})
    first.own(_holders(root, first_loose))
    fe.loose = [m for m in first._modules.values() if isinstance(m, Holder)]
    lastb.own(_holders(root, last_loose))


def _order(phase: Any) -> int:
    return -1 if phase == "pre" else 2 * phase[1] + (0 if phase[0] == "block" else 1)


def _where(phase: Any, count: int) -> str:
    if phase == "pre":
        return "before the blocks"
    if phase[0] == "block":
        return f"inside block {phase[1]}"
    return "after the blocks" if phase[1] == count - 1 else f"between blocks {phase[1]} and {phase[1] + 1}"


def _tensors_of(m: nn.Module) -> list[Tensor]:
    return [*m.parameters(), *m.buffers()]


def _add_loose(table: dict[str, dict[str, Tensor]], name: str, t: Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    table.setdefault(owner, {})[attr] = t


def _holders(root: nn.Module, loose: dict[str, dict[str, Tensor]]) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    for owner, tensors in loose.items():
        module = root.get_submodule(owner) if owner else root
        persistent = {n: n not in module._non_persistent_buffers_set for n in tensors}
        out[encode(owner, holder=True) if owner else HOLDER] = Holder(tensors, persistent)
    return out
