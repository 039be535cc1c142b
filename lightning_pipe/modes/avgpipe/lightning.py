"""AvgPipe's parallel pipelines in Lightning: elastic averaging against the reference processes.

N pipelines, each its own model and optimizer, one reference model.

- Layout: the world is N pipelines x K stages (the topology's replicas); pipeline n reads shard n of
  the data (Lightning's DistributedSampler over the replicas); gradients are *not* averaged across
  pipelines. Stage k of pipeline 0 starts stage k's reference process.
- The step: Lightning's optimizer step (closure, clipping, the user's optimizer) is wrapped by
  `before_update` / `after_update` (local update out, elastic pull in).
- Checkpoints: ``state_dict`` is the reference model (the model a user gets back; it loads into the
  plain LightningModule). Each parameter's name-keyed optimizer entry also carries every pipeline's
  weights and optimizer state ("pipelines") and the references the next pulls still need ("refs"),
  so a resume continues every parallel model exactly.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from ...lightning.checkpoint.full import load_named_state, parameter_names
from ...lightning.checkpoint.keys import ALIASES, decode_parameter, encode_parameter
from ...runtime.elastic import ReferenceLink
from ..lightning import ReplicasLayer
from .engine import ElasticAveraging

REF = "ref"  # a moved parameter's W_ref(j) slice travels as extra "ref<j>"
_links = itertools.count()  # every rank creates its links in the same order: a common store prefix per fit


class ElasticReplicas(ReplicasLayer):
    """AvgPipe: the N pipelines are the topology's replicas; each keeps its own gradients."""

    averages_gradients = False

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.elastic: Optional[ElasticAveraging] = None
        self._carried: Optional[tuple[int, dict[int, dict[int, torch.Tensor]]]] = None  # (t, W_ref slices) across a switch

    def on_runtime(self, runner: Any) -> None:
        if self.elastic is None:  # once per fit; its reference process starts on first use (after a resume loads)
            ctx, config = self.ctx, self.ctx.config
            self.elastic = ElasticAveraging(
                ctx.cut.stage, ctx.replica_index, config.elastic_alpha, config.staleness, self._link_factory(), rank=ctx.stage_index
            )

    def _link_factory(self) -> Callable[[int, torch.dtype], ReferenceLink]:
        ctx, config = self.ctx, self.ctx.config
        serial, stage = next(_links), ctx.stage_index

        def make(numel: int, dtype: torch.dtype) -> ReferenceLink:
            prefix = f"lightning_pipe/avgpipe/{serial}/{stage}/"
            return ReferenceLink(
                ctx.main_address, ctx.main_port, prefix, stage, ctx.replica_index, config.pipelines, numel, dtype, config.timeout
            )

        return make

    def optimizer_step(self, step: Callable[[], Any]) -> Any:
        """Lightning's optimizer step with the elastic update around it."""
        self.elastic.before_update()
        out = step()
        self.elastic.after_update()
        return out

    def showing_model(self) -> ContextManager[None]:
        """Evaluation, checkpoints and the end of fit see the reference model."""
        return self.elastic.showing_reference() if self.elastic is not None else contextlib.nullcontext()

    @property
    def shows_other_weights(self) -> bool:
        return True

    def drain(self) -> None:
        if self.elastic is not None:
            self.elastic.drain()

    def close(self, graceful: bool) -> None:
        """Stop the reference process: by message after a finished run, by SIGKILL after a failure."""
        if self.elastic is not None:
            self.elastic.close(graceful=graceful)

    # ---- a live switch: the reference re-partitions with the pipelines ---------------------------
    def switch_extras(self) -> Optional[Callable[[torch.nn.Parameter], dict[str, Any]]]:
        """Every W_ref(j) the coming pulls need (j = t - s .. t), cut per parameter: each slice moves
        with its parameter. The stage's reference process stops; a new one starts over the new stage."""
        elastic = self.elastic
        elastic.drain()
        refs = {j: v for j, v in elastic.refs.items() if j >= elastic.iteration - elastic.staleness}
        slices: dict[int, dict[int, torch.Tensor]] = {}
        offset = 0
        for p in elastic.params:
            slices[id(p)] = {j: ref[offset : offset + p.numel()].view_as(p).detach().clone() for j, ref in refs.items()}
            offset += p.numel()
        self._carried = (elastic.iteration, slices)
        elastic.close(graceful=True)
        return lambda p: {f"{REF}{j}": v for j, v in slices.get(id(p), {}).items()}

    def after_switch(self, received: dict[int, dict[str, Any]]) -> None:
        iteration, slices = self._carried
        self._carried = None
        for pid, extra in received.items():
            refs = {int(k[len(REF) :]): v for k, v in extra.items() if k.startswith(REF)}
            if refs:
                slices[pid] = refs
        self.elastic = None
        self.on_runtime(None)  # over the new stage, with a new reference process (started on first use)
        params = self.elastic.params
        whole = lambda j: torch.cat([slices[id(p)][j].reshape(-1) for p in params]) if params else torch.zeros(0)  # noqa: E731
        versions = sorted(slices[id(params[0])]) if params else [iteration]
        self.elastic.load_state(iteration, whole(iteration), {j: whole(j) for j in versions if j < iteration})

    # ---- checkpoints -----------------------------------------------------------------------------
    def run_state(self) -> dict[str, Any]:
        return {"iteration": self.elastic.iteration}

    def parameter_state(self, stored: dict[int, str], state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per stored name: every pipeline's weight and optimizer state, and the pending references.
        Collective over the stage's pipelines (each sends its own to pipeline 0)."""
        elastic, topo = self.elastic, self.ctx.topology
        versions = self.versions.parameter_state(stored, state)  # e.g. 2BW's stash: each pipeline has its own
        own = {
            stored[id(p)]: {
                "weight": p.detach().cpu().clone(),
                "state": _cpu(state.get(stored[id(p)], {})),
                "extras": encode_parameter(versions.get(stored[id(p)], {})),
            }
            for p in elastic.params
        }
        parts: list[Any] = [None] * topo.width
        if topo.width > 1:
            dist.all_gather_object(parts, own, group=self.ctx.groups.stage)
        else:
            parts = [own]
        pending = elastic.pending_references()
        out: dict[str, dict[str, Any]] = {}
        offset = 0
        for p in elastic.params:
            name, n = stored[id(p)], p.numel()
            out[name] = {
                "pipelines": [part[name] for part in parts],
                "refs": {j: ref[offset : offset + n].view_as(p).detach().cpu().clone() for j, ref in pending.items()},
            }
            offset += n
        return out

    def own_extras(self, extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """This pipeline's per-parameter extras (e.g. its 2BW stash) from its "pipelines" entry."""
        names, index = parameter_names(self.ctx.module), self.ctx.replica_index
        out = {pid: dict(e) for pid, e in extras.items()}
        for named in checkpoint.get("optimizer_states") or []:
            aliases, entries = named.get(ALIASES, {}), named.get("state", {})
            for p in self.ctx.module.parameters():
                if id(p) not in names:
                    continue
                entry = decode_parameter(entries.get(aliases.get(names[id(p)][0], names[id(p)][0]), {}))
                if "pipelines" in entry and len(entry["pipelines"]) > index:
                    out.setdefault(id(p), {}).update(decode_parameter(entry["pipelines"][index].get("extras", {})))
        return out

    def load(self, run: dict[str, Any], extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> None:
        """After the model (the reference) and pipeline 0's optimizer state are loaded: this pipeline's
        own weights and optimizer state, and the iteration and references. A checkpoint without
        AvgPipe state (a plain pipeline's) starts every parallel model from its weights."""
        ctx, elastic, index = self.ctx, self.elastic, self.ctx.replica_index
        states = checkpoint.get("optimizer_states") or [{}]
        reference = [p.detach().clone() for p in elastic.params]
        names = parameter_names(ctx.module)
        pending: dict[int, list[torch.Tensor]] = {}
        found = False
        for optimizer, named in zip(ctx.optimizers, states):
            aliases = named.get(ALIASES, {})
            entries = {name: decode_parameter(entry) for name, entry in named.get("state", {}).items()}
            own_state = {}
            for name, entry in entries.items():
                if "pipelines" in entry:
                    found = True
                    pipelines = entry["pipelines"]
                    if len(pipelines) != ctx.topology.width:
                        raise ValueError(f"the checkpoint holds {len(pipelines)} AvgPipe pipelines and this run has {ctx.topology.width}")
                    own_state[name] = pipelines[index]["state"]
            if found:
                load_named_state(optimizer, {**named, "state": own_state}, ctx.module)
            for p in elastic.params:
                name = aliases.get(names[id(p)][0], names[id(p)][0])
                entry = entries.get(name, {})
                if "pipelines" in entry:
                    with torch.no_grad():
                        p.copy_(entry["pipelines"][index]["weight"])
        if not found:
            return
        named0 = states[0]
        for p in elastic.params:
            name = names[id(p)][0]
            name = named0.get(ALIASES, {}).get(name, name)
            for j, value in decode_parameter(named0["state"][name]).get("refs", {}).items():
                pending.setdefault(int(j), []).append(value.reshape(-1))
        whole = lambda parts: torch.cat(parts) if parts else torch.zeros(0)  # noqa: E731  (a stage may hold no trained parameter)
        elastic.load_state(
            int(run.get("iteration", 0)), whole([r.reshape(-1) for r in reference]), {j: whole(v) for j, v in pending.items()}
        )


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj
