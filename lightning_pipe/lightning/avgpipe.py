"""AvgPipe inside Lightning: N pipelines, each its own model and optimizer, one reference model.

- Layout: the world is N pipelines x K stages (the topology's replicas); pipeline n reads shard n of
  the data (Lightning's DistributedSampler over the replicas); gradients are *not* averaged across
  pipelines. Stage k of pipeline 0 starts stage k's reference process.
- The step: Lightning's optimizer step (closure, clipping, the user's optimizer) is wrapped by the
  mode's `before_update` / `after_update` (local update out, elastic pull in).
- Checkpoints: ``state_dict`` is the reference model (the model a user gets back; it loads into the
  plain LightningModule). Each parameter's name-keyed optimizer entry also carries every pipeline's
  weights and optimizer state (``autopipe_avg_pipelines``) and the references the next pulls still
  need (``autopipe_avg_refs``), so a resume continues every parallel model exactly.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..runtime.elastic import ReferenceLink

PIPELINES_KEY = "autopipe_avg_pipelines"  # per parameter: [{"weight": W_n, "state": optimizer state}] by pipeline
REFS_KEY = "autopipe_avg_refs"  # per parameter: {j: W_ref(j)} for the pending pulls
ITERATION_KEY = "autopipe_avg_iteration"

_links = itertools.count()  # every rank creates its links in the same order: a common store prefix per fit


def link_factory(strategy: Any) -> Callable[[int, torch.dtype], ReferenceLink]:
    env, config = strategy.cluster_environment, strategy.config
    serial, stage = next(_links), strategy.stage_index

    def make(numel: int, dtype: torch.dtype) -> ReferenceLink:
        prefix = f"lightning_pipe/avgpipe/{serial}/{stage}/"
        return ReferenceLink(
            env.main_address, env.main_port, prefix, stage, strategy.replica_index, config.pipelines, numel, dtype, config.timeout
        )

    return make


def mode_extras(strategy: Any) -> dict[str, Any]:
    config = strategy.config
    return dict(
        module=strategy.cut.stage,
        pipeline=strategy.replica_index,
        alpha=config.elastic_alpha,
        staleness=config.staleness,
        link=link_factory(strategy),
    )


def optimizer_step(strategy: Any, step: Callable[[], Any]) -> Any:
    """Lightning's optimizer step with the elastic update around it."""
    strategy.mode.before_update()
    out = step()
    strategy.mode.after_update()
    return out


# ---- checkpoints ------------------------------------------------------------------------------------
def stash_state(strategy: Any, stored: dict[int, str], state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per stored name: every pipeline's weight and optimizer state, and the pending references.
    Collective over the stage's pipelines (each sends its own to pipeline 0)."""
    mode = strategy.mode
    own = {stored[id(p)]: {"weight": p.detach().cpu().clone(), "state": _cpu(state.get(stored[id(p)], {}))} for p in mode.params}
    parts: list[Any] = [None] * strategy.topology.width
    if strategy.topology.width > 1:
        dist.all_gather_object(parts, own, group=strategy.process_groups.stage)
    else:
        parts = [own]
    pending = mode.pending_references()
    out: dict[str, dict[str, Any]] = {}
    offset = 0
    for p in mode.params:
        name, n = stored[id(p)], p.numel()
        out[name] = {
            PIPELINES_KEY: [part[name] for part in parts],
            REFS_KEY: {j: ref[offset : offset + n].view_as(p).detach().cpu().clone() for j, ref in pending.items()},
        }
        offset += n
    return out


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def load_mode_state(strategy: Any, checkpoint: dict[str, Any]) -> None:
    """After the model (the reference) and pipeline 0's optimizer state are loaded: this pipeline's
    own weights and optimizer state, and the mode's iteration and references. A checkpoint without
    AvgPipe state (a plain pipeline's) starts every parallel model from its weights."""
    from .checkpoints import ALIASES, load_named_state, parameter_names

    states = checkpoint.get("optimizer_states") or [{}]
    mode, index = strategy.mode, strategy.replica_index
    reference = [p.detach().clone() for p in mode.params]
    names = parameter_names(strategy.lightning_module)
    iteration = int(states[0].get(ITERATION_KEY, 0))
    pending: dict[int, list[torch.Tensor]] = {}
    found = False
    for optimizer, named in zip(strategy.optimizers, states):
        aliases = named.get(ALIASES, {})
        entries = named.get("state", {})
        own_state = {}
        for name, entry in entries.items():
            if PIPELINES_KEY in entry:
                found = True
                pipelines = entry[PIPELINES_KEY]
                if len(pipelines) != strategy.topology.width:
                    raise ValueError(f"the checkpoint holds {len(pipelines)} AvgPipe pipelines and this run has {strategy.topology.width}")
                own_state[name] = pipelines[index]["state"]
        if found:
            load_named_state(optimizer, {**named, "state": own_state}, strategy.lightning_module)
        for p in mode.params:
            name = aliases.get(names[id(p)][0], names[id(p)][0])
            entry = entries.get(name, {})
            if PIPELINES_KEY in entry:
                with torch.no_grad():
                    p.copy_(entry[PIPELINES_KEY][index]["weight"])
    if not found:
        return
    for p in mode.params:
        name = names[id(p)][0]
        named0 = states[0]
        name = named0.get(ALIASES, {}).get(name, name)
        for j, value in named0["state"][name].get(REFS_KEY, {}).items():
            pending.setdefault(int(j), []).append(value.reshape(-1))
    whole = lambda parts: torch.cat(parts) if parts else torch.zeros(0)  # noqa: E731  (a stage may hold no trained parameter)
    mode.load_state(iteration, whole([r.reshape(-1) for r in reference]), {j: whole(v) for j, v in pending.items()})
