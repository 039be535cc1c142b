"""`PipelineConfig`: every pipeline setting, typed, documented and checked in one place.

Built once — from `AutoPipeStrategy(...)` keywords, from the Hydra group `conf/pipeline`
(`_target_: lightning_pipe.PipelineConfig`) or by hand — and handed to the launcher, the
strategy, the planner and the CLI. Checks come in the order their facts become known, all
before any process starts:

1. construction: each setting on its own (`__post_init__`);
2. `check_world(world_size)`: once the devices are known (the Trainer's launcher);
3. `check_model(world_size, num_blocks)`, `check_batch_size(n)`: once the model and the
   training DataLoader are known (`fit`, or the CLI's build).

Every failure is a `SettingError` naming the setting, so the CLI can say `pipeline.<setting>`.
No Lightning here: the CLI and the strategy are the only ones that map it onto Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from .config_values import check_partition, check_recompute, parse_bytes
from .errors import SettingError, check_choice, check_count
from .legality import ALGORITHM2_SCHEDULES, COMPILE_VALUES, LEGALITY
from .modes.advance import settings as advance
from .modes.avgpipe import settings as avgpipe
from .modes.partition import settings as partition_control
from .modes.two_bw import settings as two_bw
from .modes.width import settings as width_settings
from .planning.heuristic import MAX_EXPANSIONS_PER_STAGE, check_expansions
from .planning.partition import PartitionSpec, partition_blocks
from .profiling import Profile
from .schedules import AUTO, REGISTRY, ScheduleSpec
from .schedules.spec import ALIASES, canonical
from .topology import Topology

START_METHODS = ["popen", "spawn", "fork", "forkserver"]
CHECKPOINT_LAYOUTS = ["full", "sharded"]
SLICER_METHODS = (None, "algorithm2", "sweep")
MODE_SETTINGS = (width_settings, avgpipe, advance, two_bw, partition_control)  # each checks its own settings (check_config)


@dataclass
class PipelineConfig:
    """Settings of a pipeline-parallel run (see the fields' docstrings)."""

    # ---- schedule ----------------------------------------------------------------------------
    schedule: str = "1f1b"
    """gpipe | 1f1b (alias flush: PipeDream-Flush) | interleaved | wave (Hanayo's placement, our greedy order) |
    hanayo (Hanayo's placement and order) | advance (AvgPipe's 1F1B with advance forward, §4.2) |
    zb-h1 | zb-v (zero bubble: backward split into input and weight gradients) | zb-auto (zero
    bubble's automatic scheduler: its heuristic on the profiled F / BI / W times) |
    2bw (PipeDream-2BW: no flush, 1-stale updates), or auto (the simulator's fastest synchronous
    schedule within memory_limit)."""
    chunks: int = 2
    """interleaved: model chunks per rank (v)."""
    waves: int = 1
    """wave / hanayo: Hanayo waves (W); each rank holds 2W chunks."""
    advance_num: Optional[int] = None
    """advance: forwards the first stage runs before its first backward, in [K - 1, M] (K - 1: 1F1B,
    M: all forwards first); None: AvgPipe's Algorithm 1 (start at K - 1, raise by one after a step
    while steps get faster and the predicted peak memory stays under memory_limit)."""
    microbatches: int = 4
    """Micro-batches per optimizer step (m)."""
    width: int = 1
    """Pipeline replicas (data parallel); stages = devices x nodes / width."""
    shard: str = "none"
    """none: every replica holds its stage's whole optimizer state; optimizer: ZeRO-1, each parameter's
    optimizer state (Adam's moments) on one replica of its stage only, which steps it and broadcasts the new
    values; full: FSDP2's fully_shard on every block over the replicas (parameters, gradients and optimizer
    state 1/width each; every schedule you name, zero bubble's and 2bw included). Needs width >= 2; the
    update is the unsharded one."""
    reshard: str = "microbatch"
    """shard=full: when a block's gathered weights are freed. microbatch: after each micro-batch's forward and
    backward (FSDP2's default: least memory, two all-gathers per block and micro-batch); step: kept from a
    step's first forward to its last backward (one all-gather per block and step, as torchtitan runs FSDP
    under a pipeline; the stage's whole parameters held during the step)."""
    shard_mixed_precision: bool = True
    """shard=full under precision="bf16-mixed": FSDP2 gathers each block's weights in bf16 and reduce-scatters the
    gradients in fp32, the shards (the optimizer's master weights) and optimizer state fp32, as torchtitan runs FSDP2
    (FSDP2's MixedPrecisionPolicy); False: gathered in fp32, autocast casting per op, as in one process. Other
    precisions gather and reduce in the model's own dtype either way."""
    tensor: int = 1
    """Tensor-parallel ranks per stage (T): each block's weights split over T consecutive ranks (the mesh's
    innermost "tp" dimension) by the model's plan (`parallelize_block`, or our GPT / BERT / Hugging Face plans);
    stages = devices x nodes / (width x tensor)."""
    sequence_parallel: bool = False
    """tensor > 1, our GPT / BERT plan: sequence parallelism (Megatron-SP), the norms, dropout and residual adds
    between a stage's attention and MLP blocks run on each tensor rank's part of the sequence (activations there
    1/T; the sequence a multiple of T); what crosses a cut stays whole."""
    loss_parallel: bool = False
    """tensor > 1, our GPT / BERT plan: in training steps the head's logits stay split over the vocabulary and
    `F.cross_entropy` on them runs as a parallel cross-entropy (torch's loss_parallel: each tensor rank holds
    vocabulary / T of the logits, never all of them); the step's loss must be `F.cross_entropy` on the logits.
    Evaluation steps see whole logits."""
    pipelines: Optional[int] = None
    """AvgPipe: N parallel pipelines, each training its own model on its own data, joined by elastic
    averaging with reference processes (None: off); stages = devices x nodes / N."""
    alpha: Optional[float] = None
    """AvgPipe: the pull towards the reference, in [0, 1] (None: 1 / pipelines, as the paper)."""
    staleness: int = 0
    """AvgPipe: the pull at iteration t uses the reference after iterations up to t - 1 - staleness."""
    share_devices: bool = True
    """AvgPipe: the N pipelines share the Trainer's devices, N processes per device (the paper's layout:
    stages = devices x nodes); False: a device per process (stages = devices x nodes / N)."""

    # ---- the model ---------------------------------------------------------------------------
    blocks: Optional[str] = None
    """A model that loops over its blocks (no nn.Sequential child): the path of their nn.ModuleList from the
    LightningModule, e.g. "model.transformer.h" (None: the list of same-type modules holding the most parameters)."""
    sublayers: bool = True
    """A model that loops over its blocks: each block as two pipeline blocks (its attention half and its MLP half,
    AutoPipe's sub-layer partition) where the traced block verifies such a cut; False: whole blocks."""

    # ---- planning ----------------------------------------------------------------------------
    partition: Any = "autopipe"
    """A partitioner (autopipe, dp, parameters, exhaustive, uniform) or blocks per stage, e.g. [4, 6]."""
    autopipe_expansions: int = MAX_EXPANSIONS_PER_STAGE
    """partition=autopipe: splits AutoPipe's heuristic processes per stage before it stops (ours: the
    paper sets no bound; the default lets the paper's whole search finish on GPT-2 up to 8 stages and
    keeps 1.3B on 16 stages near 0.4 s); a search the bound stops says so under the plan's table."""
    slicer: Any = False
    """AutoPipe slicer: True (the count chosen by `slicer_method`), False, or a count of warm-up micro-batches to halve."""
    slicer_method: Optional[str] = None
    """"algorithm2": AutoPipe's Algorithm 2 picks the count and its sliced 1F1B runs (halves back to back, the
    blocked half's send merged into its twin's; the paper's, default for 1f1b); "sweep" (ours): every count
    simulated, the fastest kept, the halves run as micro-batches of the schedule (default for gpipe and auto)."""
    memory_limit: Any = None
    """Bytes per device, a number or a size such as "16GB" (KB, MB, GB, TB and KiB ... TiB all count in
    powers of 1024): what planner=2bw's configurations, schedule=auto's candidates, the advance rule's
    advance_num and the tuner's (M, N) may use (None: a GPU's memory; no limit on CPU)."""
    planner: Optional[str] = None
    """2bw: PipeDream-2BW's planner (§4, Algorithm 1) chooses width, depth, micro-batch size and count and
    recomputation per stage at setup, from a profile at several micro-batch sizes, the fastest predicted
    within memory_limit; schedule=auto also chooses among 2bw, 1f1b and gpipe. None: set by hand."""
    planner_2bw_cost: str = "simulated"
    """planner=2bw's cost functions: simulated (ours: each candidate's partition, schedule and optimizer state on
    the simulator) or paper (PipeDream-2BW's closed-form THROUGHPUT and MEMORY of §4.2: even split, no
    simulation, no optimizer state). The plan command prints the other's choice beside it."""
    plan_mesh: bool = False
    """planner=2bw, the plan command (ours, beside Algorithm 1): also search the tensor-parallel degree (divisors
    of the devices per node) and shard (none, optimizer, full) with their collectives' costs, and print the
    chosen mesh. A training run does not apply a planned tensor or shard: set them by hand."""
    global_batch: Optional[int] = None
    """planner=2bw: samples per optimizer step over all replicas, B = width x micro-batch size x
    microbatches (None: the training DataLoader's batch size)."""
    recompute: Any = False
    """Activation recomputation: true (every stage), false, or one true/false per stage: a recomputed
    stage keeps only each block's input for backward and runs the block's forward again there."""
    compile: Any = False
    """torch.compile each pipeline block once (as torchtitan compiles per transformer block), before the
    profile, so the planners see compiled costs; graph breaks are reported at the end of fit. Flush
    schedules and 2BW, shard='full' too; not with zero bubble's split backward. 'auto' (with
    schedule='auto'): the blocks are profiled eager and compiled, and the faster simulated step runs."""
    intra_bandwidth: Optional[float] = None
    """planner=2bw: bytes/s between devices of one node (None: a default for the device type)."""
    inter_bandwidth: Optional[float] = None
    """planner=2bw: bytes/s between nodes (None: a default for the device type)."""
    tune: bool = False
    """AvgPipe's tuner (§5.2): profile one setting (tune_microbatches' largest M, N = 1) for tune_batches
    steps, predict every (M, N) of the grid, train with the fastest within memory_limit (the CLI)."""
    tune_batches: int = 20
    """Tuner: training steps profiled (the paper: twenty)."""
    tune_microbatches: Optional[list[int]] = None
    """Tuner: the micro-batch counts M to consider (None: powers of two from 1 to the batch size, at most 64)."""
    tune_pipelines: Optional[list[int]] = None
    """Tuner: the parallel pipeline counts N to consider (None: 1, 2, 4)."""
    tune_model: str = "calibrated"
    """Tuner: how the grid is predicted: "calibrated" (ours, the default: a second profile at the grid's
    smallest M; lightning_pipe/tuning/calibrated.py; it picked right where Eq. 1-8 did not, docs/results/tuner.md)
    or "paper" (§5.2's Eq. 1-8 from one profile)."""
    profile: Optional[str] = None
    """A saved profile.json to plan from instead of profiling on the ranks."""
    bandwidth: Optional[float] = None
    """Link model for planning, bytes/s (None: a default for the device type)."""
    latency: Optional[float] = None
    """Link model for planning, seconds per message (None: a default for the device type)."""
    message_costs: bool = True
    """Measure what a message costs the ranks (thread time, hand-off delay) at setup, ~0.5 s, and plan with it."""
    stages: Optional[int] = None
    """The plan command only: stages to plan for (None: devices x nodes / width)."""

    # ---- adaptive re-partitioning (AutoPipe-RL) -------------------------------------------------
    adaptive: Any = False
    """AutoPipe-RL: monitor every rank each iteration and move blocks between two neighbouring workers while
    training. rule (or true): when the simulator on the measured speeds predicts at least adaptive_gain over
    the rest of the run; learned (ours, after the paper): our speed predictor, adapted online, and RL arbiter
    decide; paper: the paper's own networks (per-layer inputs, meta-learned predictor adapted online, arbiter
    updated by measured rewards, switch-cost meta-network; depths 2 and 4, at most 24 blocks, gpipe, 1f1b,
    advance or 2bw); false: off."""
    adaptive_gain: float = 0.05
    """Adaptive: the predicted fraction of the remaining run's time a switch must save, after its cost (x)."""
    adaptive_hysteresis: float = 0.0
    """Adaptive rule (ours): extra gain a switch back to the partition the last switch left must predict, e.g.
    0.05 to need 10% with adaptive_gain=0.05; keeps a threshold-close prediction from flipping back and forth."""
    adaptive_interval: int = 20
    """Adaptive: iterations at least between two switches."""
    adaptive_window: int = 5
    """Adaptive: iterations of measurements a decision reads (their median); candidates are scored once per window."""
    adaptive_switch: str = "fine-grained"
    """How a switch (adaptive, or repartition()) moves blocks. fine-grained: AutoPipe-RL §4.4, without stopping
    the pipeline: in the next iteration the first micro-batches run the moved blocks on their old worker, the
    rest on the new one as their weights arrive block by block, and the old worker's gradients join the new
    one's before the update (used where one block range moves between neighbouring workers, one chunk each,
    under a flush schedule; otherwise, and with stop: the pipeline stops at the iteration boundary while the
    blocks move)."""
    adaptive_weights: Optional[str] = None
    """adaptive=learned: a folder with predictor_d<depth>.pt, arbiter.pt and switch_cost.pt (None: the package's,
    made by python -m lightning_pipe.adaptive.offline); adaptive=paper: one with paper_predictor_d<depth>.pt,
    paper_switch_cost_d<depth>.pt and paper_arbiter_d<depth>.pt (python -m lightning_pipe.adaptive.paper_offline)."""

    # ---- runtime -----------------------------------------------------------------------------
    prefetch: bool = True
    """Post receives before the compute that needs them (Hanayo §4.2)."""
    trace: bool = False
    """Record each action's real start and end; writes trace.json and trace_timeline.png."""
    start_method: str = "popen"
    """How Lightning starts the processes: popen (re-run the command), spawn, fork or forkserver. The
    command line's default, auto, is popen, or spawn under Hydra's multirun (it picks before the config is built)."""
    checkpoint: str = "full"
    """full: one file in single-process layout, gathered on rank 0; sharded: a directory where every
    rank writes its own stage (torch.distributed.checkpoint). Either resumes at any depth."""
    timeout: float = 300.0
    """Seconds a peer may stay silent (dead, stopped, unreachable) before the job ends with an error
    naming the rank (a heartbeat); collectives and p2p give up after twice this."""

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str) or (canonical(self.schedule) not in REGISTRY and self.schedule.lower() != AUTO):
            raise SettingError(
                f"schedule={self.schedule!r} is not a known schedule; allowed values: {sorted(REGISTRY) + sorted(ALIASES) + [AUTO]}",
                "schedule",
            )
        self.schedule = canonical(self.schedule)
        if self.blocks is not None and (not isinstance(self.blocks, str) or not self.blocks):
            raise SettingError(
                f"blocks={self.blocks!r}: must be the path of an nn.ModuleList, e.g. 'model.transformer.h', or None", "blocks"
            )
        for name in ("microbatches", "width", "tensor", "chunks", "waves"):
            check_count(name, getattr(self, name))
        if self.stages is not None:
            check_count("stages", self.stages)
        self.partition = check_partition(self.partition)
        try:
            check_expansions(self.autopipe_expansions)
        except ValueError as err:
            raise SettingError(str(err), "autopipe_expansions") from None
        if not isinstance(self.slicer, (bool, int)) or (not isinstance(self.slicer, bool) and not 0 <= self.slicer <= self.microbatches):
            raise SettingError(
                f"slicer={self.slicer!r}: True (the simulator chooses), False, or a count 0..microbatches={self.microbatches}", "slicer"
            )
        if self.slicer_method not in SLICER_METHODS:
            raise SettingError(f"slicer_method={self.slicer_method!r}: 'algorithm2' (the paper's), 'sweep' (ours) or None", "slicer_method")
        self.memory_limit = parse_bytes(self.memory_limit)
        self.recompute = check_recompute(self.recompute)
        if not isinstance(self.compile, (bool, str)) or self.compile not in COMPILE_VALUES:
            raise SettingError(
                f"compile={self.compile!r}: True (torch.compile each block), False or 'auto' (with schedule='auto')", "compile"
            )
        for name in ("bandwidth", "latency", "intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise SettingError(f"{name}={value!r}: a number >= 0, or None for the device type's default", name)
        if not isinstance(self.message_costs, bool):
            raise SettingError(f"message_costs={self.message_costs!r}: true or false", "message_costs")
        self.start_method = check_choice("start_method", self.start_method, START_METHODS)
        self.checkpoint = check_choice("checkpoint", self.checkpoint, CHECKPOINT_LAYOUTS)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise SettingError(f"timeout={self.timeout!r}: seconds, a number > 0", "timeout")
        self.timeout = float(self.timeout)
        for mode in MODE_SETTINGS:  # each mode's own settings, checked by the mode (modes/<mode>/settings.py)
            mode.check_config(self)
        for f in fields(self):  # the other switches: True or False, not a truthy string from a config file
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise SettingError(f"{f.name}={getattr(self, f.name)!r}: allowed values are True or False", f.name)
        for rule in LEGALITY:  # then which settings combine
            if rule.illegal(self):
                raise SettingError(rule.message(self), rule.setting)

    def recompute_stages(self, depth: int) -> list[bool]:
        """Recomputation per stage of a pipeline `depth` deep."""
        if isinstance(self.recompute, list):
            if len(self.recompute) != depth:
                raise SettingError(
                    f"recompute={self.recompute}: {len(self.recompute)} entries for {depth} stages; give one per stage, or true / false",
                    "recompute",
                )
            return list(self.recompute)
        return [bool(self.recompute)] * depth

    # ---- what the settings mean ----------------------------------------------------------------
    @property
    def replicas(self) -> int:
        """Pipelines side by side: AvgPipe's N, else the width."""
        return self.pipelines if self.pipelines is not None else self.width

    @property
    def slicing(self) -> str:
        """The slicer's method: as set, else the paper's Algorithm 2 where it is defined (1F1B)."""
        if self.slicer_method is not None:
            return self.slicer_method
        return "algorithm2" if not self.auto and self.schedule_spec.name in ALGORITHM2_SCHEDULES else "sweep"

    @property
    def processes_per_device(self) -> int:
        """AvgPipe's shared devices: N processes on each device; else 1."""
        return self.pipelines if self.pipelines is not None and self.share_devices else 1

    def world(self, devices: int, nodes: int = 1) -> int:
        """Processes of a job on `devices` per node x `nodes`."""
        return devices * nodes * self.processes_per_device

    @property
    def elastic_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 1.0 / (self.pipelines or 1)

    @property
    def auto(self) -> bool:
        return self.schedule == AUTO

    @property
    def schedule_spec(self) -> ScheduleSpec:
        """The schedule to run; schedule="auto" runs 1F1B until the planner has chosen."""
        settings = {"chunks": self.chunks, "waves": self.waves, "advance_num": self.advance_num or 0}
        return ScheduleSpec.from_settings("1f1b" if self.auto else self.schedule, settings)

    @property
    def partitioner(self) -> Optional[str]:
        """The partitioner that needs a profile (None: a fixed partition or "uniform")."""
        return self.partition if isinstance(self.partition, str) and self.partition != "uniform" else None

    @property
    def fixed_partition(self) -> PartitionSpec:
        """What to cut with when nothing is planned: the listed sizes, else equal block counts."""
        return self.partition if not isinstance(self.partition, str) else "uniform"

    @property
    def needs_profile(self) -> bool:
        return self.auto or self.partitioner is not None or bool(self.slicer) or self.schedule_spec.kind.costed

    def replace(self, **changes: Any) -> "PipelineConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return PipelineConfig(**values)

    # ---- checks once more is known -------------------------------------------------------------
    def topology(self, world_size: int, node_devices: int = 0) -> Topology:
        """`node_devices`: devices per node, which hold consecutive stages when pipelines share them."""
        try:
            return Topology(world_size, self.replicas, node_devices if self.processes_per_device > 1 else 0, self.tensor)
        except ValueError as err:
            if str(err).startswith("tensor="):
                raise SettingError(str(err), "tensor") from None
            if self.pipelines is None:
                raise SettingError(str(err), "width") from None
            message = str(err).replace("width=", "pipelines=", 1).replace("allowed widths", "allowed values")
            raise SettingError(message, "pipelines") from None

    def check_world(self, world_size: int) -> Topology:
        """The devices are known: the width must divide them and the schedule must take the
        micro-batch count on that depth (e.g. interleaved needs a multiple of the stages)."""
        if self.planner is not None:  # width, depth, schedule and micro-batches are the planner's to choose
            return self.topology(world_size)
        topology = self.topology(world_size)
        self.recompute_stages(topology.depth)
        advance.check_world(self, topology.depth)
        partition_control.check_world(self, topology.depth)
        self.schedule_spec.placement(topology.depth, self.microbatches)
        return topology

    def check_model(self, world_size: int, num_blocks: int) -> None:
        """The model is known: every chunk needs a block, a listed partition must fit, a saved
        profile must describe this model."""
        topology = self.check_world(world_size)
        if self.planner is not None:
            self.check_plannable(world_size, num_blocks)
            return
        spec = self.schedule_spec
        spec.check(topology.depth, num_blocks)
        partition_control.check_model(self, num_blocks)
        try:
            partition_blocks(self.fixed_partition, num_blocks, spec.chunk_count(topology.depth))
        except ValueError as err:
            raise SettingError(str(err), "partition") from None
        if self.profile is not None:
            try:
                Profile.load(self.profile).check_blocks(num_blocks)
            except (OSError, ValueError, TypeError) as err:  # missing, unreadable, not a profile, another model's
                raise SettingError(f"profile={self.profile!r}: {str(err).splitlines()[0]}", "profile") from None

    def check_plannable(self, world_size: int, num_blocks: int, batch_size: Optional[int] = None) -> None:
        """planner=2bw: some (width, depth) exists for the devices and reaches the global batch."""
        two_bw.check_plannable(self, world_size, num_blocks, batch_size)

    def check_batch_size(self, batch_size: Optional[int], what: str = "the training DataLoader's batch_size") -> None:
        if self.planner is not None:  # planner=2bw sets the batch per replica itself (check_plannable)
            return
        if isinstance(batch_size, int) and batch_size < self.microbatches:
            raise SettingError(
                f"{what}={batch_size} is smaller than microbatches={self.microbatches}: "
                "use a batch size >= microbatches or fewer micro-batches",
                "microbatches",
            )
