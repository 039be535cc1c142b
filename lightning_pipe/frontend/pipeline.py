"""A model that loops over its blocks, as an `nn.Sequential` the planners and the runtime take as is.

The model is not rewritten. Its forward is cut at the boundaries of its repeated blocks by running
it with the blocks' `forward` dispatched by a shared `Frontend` state:

- `First` (block 0 of the pipeline) runs the model's forward on the user's call until the first
  repeated block is called, and returns that block's call (its tensors, flat: `structure.py`).
- `Repeated` i runs block i on its call and returns block i+1's call, made as the model's own loop
  makes it (which argument is the previous block's output, which ones are passed along unchanged:
  recorded by the trace).
- `Last` runs the model's forward again with every repeated block answering the received output of
  the last one: the code after the loop (final norm, head, the loss from `labels`) runs for real.
  What runs before the loop is dead code there; every operation it makes on the model's own
  tensors is computed on the meta device and answered with zeros (`_PreludeOnMeta`), so the last
  stage needs none of the first stage's weights and spends nothing on them.

Each adapter registers the model's own modules it owns (a block, the embeddings, the head) under
their path in the model, dots written as '/'; the containers (`TracedPipeline` and the rank's
stage) translate state-dict keys back to the model's names, so checkpoints hold the user's names.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..runtime.call import Call, as_call, as_input
from .find import FIX, FrontendError
from .structure import Structure

HOLDER = "~"  # a part name ending so holds some tensors of the module at that path, not the module


class _Reached(BaseException):
    """Stops the model's forward at its first block (a BaseException: a user's `except Exception` must not catch it)."""

    def __init__(self, call: Call):
        super().__init__()
        self.call = call


class Holder(nn.Module):
    """Some parameters or buffers that a module higher up holds directly (e.g. a position table the
    model keeps as an attribute): registered here under their own names, as the same objects."""

    def __init__(self, tensors: dict[str, Tensor], persistent: dict[str, bool]):
        super().__init__()
        for name, t in tensors.items():
            if isinstance(t, nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t, persistent=persistent.get(name, True))


def encode(path: str, holder: bool = False) -> str:
    return path.replace(".", "/") + (HOLDER if holder else "")


def decode(part: str) -> str:
    return part[: -len(HOLDER)].replace("/", ".") if part.endswith(HOLDER) else part.replace("/", ".")


class _BlockForward:
    """The `forward` of a repeated block while it is part of a traced pipeline: asks the front end
    what to do. Holds the block's class function, not a bound method (a bound method would pickle as
    `getattr(block, 'forward')`, i.e. as itself)."""

    def __init__(self, frontend: "Frontend", index: int, block: nn.Module):
        self.frontend, self.index, self.block = frontend, index, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.frontend.block_called(self.index, self.block, args, kwargs)


def original_forward(block: nn.Module, args: tuple, kwargs: dict) -> Any:
    return type(block).forward(block, *args, **kwargs)


class _PreludeOnMeta(TorchFunctionMode):
    """While `active`: an operation on a tensor of the model (or on a meta tensor) runs on the meta
    device and answers zeros on `device`; others run as they are."""

    def __init__(self, owned: set[int], device: torch.device):
        super().__init__()
        self.owned, self.device, self.active = owned, device, True

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not self.active or not self._touches(args, kwargs):
            return func(*args, **kwargs)
        if func is Tensor.device.__get__:
            return self.device
        if getattr(func, "__name__", "") == "__get__":  # shape, dtype, requires_grad ...: as they are
            return func(*args, **kwargs)
        meta_args, meta_kwargs = pytree.tree_map_only(Tensor, lambda t: t.detach().to("meta"), (args, kwargs))
        meta_args, meta_kwargs = pytree.tree_map_only(torch.device, lambda _d: torch.device("meta"), (meta_args, meta_kwargs))
        if isinstance(meta_kwargs.get("device"), str):
            meta_kwargs["device"] = "meta"
        if func is Tensor.to:  # t.to("cuda"): a device named by a string
            meta_args = tuple(_meta_if_device(a) for a in meta_args)
        out = func(*meta_args, **meta_kwargs)
        return pytree.tree_map_only(Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device), out)

    def _touches(self, args: tuple, kwargs: dict) -> bool:
        """Whether an operation reads a tensor of the model's or a meta one (arguments and one level
        into lists and tuples: a cheap look, as every operation of the code before the loop asks)."""
        for value in (*args, *kwargs.values()):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, Tensor) and (id(t) in self.owned or t.is_meta):
                    return True
        return False


def _meta_if_device(value: Any) -> Any:
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return value
        return "meta"
    return value


class _PartForward:
    """The `forward` of a module of the code before the loop (an embedding, a rotary table) while the
    model is traced: in the last block's rerun, before the loop, it answers zeros of its output's
    shape (found once per input shape on a meta copy) without computing; otherwise it runs."""

    def __init__(self, frontend: "Frontend", module: nn.Module):
        self.frontend, self.module = frontend, module
        self._shapes: dict[Any, tuple[Structure, list[tuple[torch.Size, torch.dtype]]]] = {}
        self._meta: list[nn.Module] = []

    def __deepcopy__(self, memo: dict) -> "_PartForward":
        copy = _PartForward(self.frontend, memo.get(id(self.module), self.module))
        return copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fe = self.frontend
        if not (fe.mode == "last" and fe.before_loop):
            return original_forward(self.module, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        key = tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else repr(t) for t in leaves)
        if key not in self._shapes:
            if not self._meta:
                self._meta.append(_meta_copy(self.module))
            meta_args, meta_kwargs = pytree.tree_map_only(Tensor, lambda t: t.detach().to("meta"), (args, kwargs))
            out = original_forward(self._meta[0], meta_args, meta_kwargs)
            tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
            self._shapes[key] = (Structure.of(out, "a module before the loop"), [(t.shape, t.dtype) for t in tensors])
        structure, shapes = self._shapes[key]
        device = fe.device
        return structure.build(tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes))


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device (its structure, no storage), its own forward restored."""
    import copy

    # a DTensor (FSDP2's or a tensor plan's shards) stands in whole: the copy computes shapes as one process would
    memo: dict[int, Any] = {id(t): torch.empty(t.shape, dtype=t.dtype, device="meta") for t in [*module.parameters(), *module.buffers()]}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(memo[id(p)], requires_grad=p.requires_grad)
    made = copy.deepcopy(module, memo)
    for m in made.modules():
        m.__dict__.pop("forward", None)
    return made


class Frontend:
    """The state one converted model shares with its adapters and its blocks' forwards (one per
    process; copies of adapters, e.g. a live switch's skeletons, share it)."""

    def __init__(self, root: nn.Module, list_path: str, blocks: nn.ModuleList):
        self.root, self.list_path, self.count = root, list_path, len(blocks)
        self.mode = "run"
        self.call: Optional[Call] = None  # the user's call of this micro-batch (the last block reruns it)
        self.block_call: Optional[Structure] = None  # recorded by the trace
        self.output: Optional[Structure] = None
        self.links: tuple[Any, ...] = ()  # per leaf of a block call: ("out", k) or ("same",)
        self._last_output: Any = None
        self._meta: Optional[_PreludeOnMeta] = None
        self.before_loop = False  # in the last block's rerun: the loop is not reached yet
        self.loose: list[nn.Module] = []  # the first block's holders of tensors the model keeps itself
        self.device = torch.device("cpu")  # where the last block's rerun makes its zeros
        self.recorder: Optional[Any] = None  # the trace's
        self.use_cache = False  # the model's config had its key/value cache on (off while it is cut)
        self.halves: Optional[Any] = None  # the blocks' sub-layer cut (halves.py), when they have one

    def __deepcopy__(self, memo: dict) -> "Frontend":
        return self

    @property
    def traced(self) -> bool:
        return self.block_call is not None

    @contextlib.contextmanager
    def in_mode(self, mode: str) -> Iterator[None]:
        before, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = before

    @contextlib.contextmanager
    def calling(self, call: Optional[Call]) -> Iterator[None]:
        before, self.call = self.call, call
        try:
            yield
        finally:
            self.call = before

    def block_called(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.mode == "first":
            if index != 0:
                raise FrontendError(f"the model's forward called block {index} before block 0; {FIX}")
            raise _Reached(Call(args, kwargs))
        if self.mode == "last":
            self.before_loop = False  # the loop is reached: what follows is the real code after it
            if self._meta is not None:
                self._meta.active = False
            return self._last_output
        if self.mode == "trace" and self.recorder is not None:
            return self.recorder.block(index, block, args, kwargs)
        return original_forward(block, args, kwargs)

    # ---- the three kinds of adapters' work ----------------------------------------------------
    def run_first(self, x: Any) -> tuple[Tensor, ...]:
        call = self.call = as_call(x)
        with self.in_mode("first"):
            try:
                self.root(*call.args, **call.kwargs)
            except _Reached as reached:
                assert self.block_call is not None
                return self.block_call.flat((reached.call.args, reached.call.kwargs))
        raise FrontendError(f"{type(self.root).__name__}'s forward returned without calling its blocks; {FIX}")

    def run_block(self, index: int, block: nn.Module, carry: Any) -> tuple[Tensor, ...]:
        assert self.block_call is not None and self.output is not None
        call = self.block_call.build(carry)
        args, kwargs = call
        return self.next_from(index, call, block(*args, **kwargs))

    def next_from(self, index: int, call: Any, out: Any) -> tuple[Tensor, ...]:
        """After block `index` ran `call` giving `out`: block index+1's call as the model's loop makes
        it (flat), or after the last block its output."""
        assert self.block_call is not None and self.output is not None
        if index == self.count - 1:
            return self.output.flat(out)
        leaves = pytree.tree_leaves(call)
        outs = pytree.tree_leaves(out)
        made = [outs[link[1]] if link[0] == "out" else leaves[j] for j, link in enumerate(self.links)]
        return tuple(made[j] for j in self.block_call.tensor_slots)

    def run_last(self, carry: Any) -> Any:
        assert self.output is not None
        if self.call is None:
            raise RuntimeError("the last block of a traced model ran before the model was called")
        call = self.call
        self._last_output = self.output.build(carry)
        self.device = next((t.device for t in pytree.tree_leaves(carry) if isinstance(t, Tensor)), torch.device("cpu"))
        # the modules before the loop answer zeros (_PartForward); an operation there on a tensor the
        # model holds itself (a position table) or on one this rank released runs on the meta device
        owned = {id(t) for h in self.loose for t in [*h._parameters.values(), *h._buffers.values()] if t is not None}
        self._meta = _PreludeOnMeta(owned, self.device)
        self.before_loop = True
        try:
            with self.in_mode("last"), self._meta:
                return self.root(*call.args, **call.kwargs)
        finally:
            self._meta, self._last_output, self.before_loop = None, None, False


class FrontBlock(nn.Module):
    """A block of a traced pipeline: the model's modules it owns, under their paths in the model."""

    def __init__(self, frontend: Frontend, parts: Optional[dict[str, nn.Module]] = None):
        super().__init__()
        self.frontend = frontend  # not a module: plain attribute, shared by copies
        for name, module in (parts or {}).items():
            self.add_module(name, module)

    def own(self, parts: dict[str, nn.Module]) -> None:
        for name, module in parts.items():
            self.add_module(name, module)

    @contextlib.contextmanager
    def mounted(self) -> Iterator[None]:
        """The model's forward reaches this block's parts, not others at the same paths: a copy of the
        block (a profiling stand-in of a model created empty) puts its own parts in the model for the
        call. For the block itself this changes nothing."""
        root, undo = self.frontend.root, []
        for name, part in self._modules.items():
            path = decode(name)
            if name.endswith(HOLDER):
                owner = root.get_submodule(path) if path else root
                for table, mine in ((owner._parameters, part._parameters), (owner._buffers, part._buffers)):
                    for attr, t in mine.items():
                        if table.get(attr) is not t:
                            undo.append((table, attr, table.get(attr)))
                            table[attr] = t
                continue
            parent_path, _, attr = path.rpartition(".")
            parent = root.get_submodule(parent_path) if parent_path else root
            if parent._modules.get(attr) is not part:
                undo.append((parent._modules, attr, parent._modules.get(attr)))
                parent._modules[attr] = part
        try:
            yield
        finally:
            for table, attr, before in reversed(undo):
                table[attr] = before


class First(FrontBlock):
    def forward(self, x: Any) -> tuple[Tensor, ...]:
        with self.mounted():
            return self.frontend.run_first(x)


class Repeated(FrontBlock):
    def __init__(self, frontend: Frontend, index: int, path: str, block: nn.Module):
        super().__init__(frontend, {encode(path): block})
        self.index, self.path = index, path

    @property
    def block(self) -> nn.Module:
        return next(iter(self._modules.values()))

    def forward(self, carry: Any) -> tuple[Tensor, ...]:
        return self.frontend.run_block(self.index, self.block, carry)


class Last(FrontBlock):
    def forward(self, carry: Any) -> Any:
        with self.mounted():
            return self.frontend.run_last(carry)

    def replay_context(self) -> tuple[Any, Any]:
        """For recomputation: the replay in backward reruns the call of its own micro-batch, not the
        one the schedule has moved on to (GPipe runs every forward before the first backward)."""
        return contextlib.nullcontext(), self.frontend.calling(self.frontend.call)


# ---- names: the model's own state-dict keys --------------------------------------------------------
def _user_key(rest: str) -> str:
    """'transformer/h/0.attn.weight' -> 'transformer.h.0.attn.weight'; '~.pos' -> 'pos'."""
    part, _, tail = rest.partition(".")
    owner = decode(part)
    return f"{owner}.{tail}" if owner else tail


def _front_blocks(container: nn.Module) -> dict[str, FrontBlock]:
    return {name: m for name, m in container._modules.items() if isinstance(m, FrontBlock)}


def _to_user_keys(container: nn.Module, state: dict, prefix: str, _meta: Any) -> None:
    blocks = _front_blocks(container)
    if not blocks:
        return
    for key in [k for k in state if k.startswith(prefix)]:
        index, _, rest = key[len(prefix) :].partition(".")
        if index in blocks:
            value = state.pop(key)
            state.setdefault(prefix + _user_key(rest), value)


def _from_user_keys(container: nn.Module, state: dict, prefix: str, *_args: Any) -> None:
    blocks = _front_blocks(container)
    used = set()
    for index, block in blocks.items():
        for local in block.state_dict(keep_vars=True):
            user = prefix + _user_key(local)
            if user in state:
                state[f"{prefix}{index}.{local}"] = state[user]
                used.add(user)
    for user in used:
        del state[user]


def attach_user_names(container: nn.Module) -> None:
    """State dicts of `container` (a pipeline or a stage of one) in the model's own names."""
    container._register_state_dict_hook(_to_user_keys)
    container._register_load_state_dict_pre_hook(_from_user_keys, with_module=True)


class TracedPipeline(nn.Sequential):
    """A model cut at its blocks: [First, Repeated 0 .. n-1, Last]; called as the model is called."""

    def __init__(self, frontend: Frontend, paths: list[str]):
        blocks = [Repeated(frontend, i, p, b) for i, (p, b) in enumerate(zip(paths, frontend_blocks(frontend)))]
        super().__init__(First(frontend), *blocks, Last(frontend))
        self.frontend = frontend
        attach_user_names(self)

    @property
    def original(self) -> nn.Module:
        return self.frontend.root

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = as_input(args, kwargs)
        for block in self:
            x = block(x)
        return x

    def replace_blocks(self, blocks: list[nn.Module]) -> None:
        """Hold `blocks` (e.g. each repeated block as two halves), numbered anew."""
        for name in list(self._modules):
            del self._modules[name]
        for i, block in enumerate(blocks):
            self.add_module(str(i), block)


def frontend_blocks(frontend: Frontend) -> nn.ModuleList:
    return frontend.root.get_submodule(frontend.list_path)
