"""Models as users write them (Hugging Face GPT-2, Llama, BERT; a plain model looping over a
ModuleList) trained by Trainer(strategy="autopipe") with no rewrite, against one process.

float64, dropout 0, weights after 4 AdamW steps; every run is a real multi-process gloo job."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hf_models import (
    Tokens,
    UserLM,
    close,
    loader,
    pair,
    reference_2bw,
    reference_avgpipe,
    train_single,
    trainer_kwargs,
    two_replica_data,
)
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]
START = "forkserver"  # as tests/models.py START: no fork of pytest's threaded process
STEPS = 4


def pipelined(model, devices: int, steps: int = STEPS, data=None, callbacks=(), **settings):
    settings = {"microbatches": 4, "partition": "uniform", "start_method": START, **settings}
    trainer = L.Trainer(
        devices=devices, strategy=AutoPipeStrategy(**settings), callbacks=list(callbacks), **trainer_kwargs(max_steps=steps)
    )
    trainer.fit(model, data or loader())
    return trainer


# 6 layers = 8 pipeline blocks (first, 6 repeated, last): interleaved on 4 ranks runs 8 chunks of one block
SYNC = [(2, "1f1b"), (2, "gpipe"), (2, "interleaved"), (2, "zb-h1"), (4, "1f1b"), (4, "gpipe"), (4, "interleaved"), (4, "zb-h1")]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "looped"])
@pytest.mark.parametrize("devices,schedule", SYNC)
def test_synchronous_schedules_equal_one_process(kind, devices, schedule):
    ref, model = pair(kind)
    train_single(ref, STEPS)
    pipelined(model, devices, schedule=schedule)
    assert type(model.model) is type(ref.model), "fit hands the user's own model object back"
    if kind != "looped":  # ... with its key/value cache on again for generation
        assert model.model.config.use_cache
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize("kind,devices", [("gpt2", 2), ("llama", 4), ("looped", 2)])
def test_2bw_follows_its_rule(kind, devices):
    ref, model = pair(kind)
    reference_2bw(ref, STEPS)
    pipelined(model, devices, schedule="2bw", microbatches=devices)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_sharded_replicas_train_a_hugging_face_model_as_one_process(shard):
    # pp2 x dp2 (Llama, untied head). Lightning's DistributedSampler (shuffle, the run's seed) deals replica r
    # the rows perm[r::2] of each epoch; one process trains on the union of both replicas' k-th batches
    ref, model = pair("llama")
    train_single(ref, STEPS, data=two_replica_data(STEPS))
    pipelined(model, 4, width=2, shard=shard, microbatches=2)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


def test_avgpipe_follows_elastic_averaging():
    # 2 pipelines x 2 stages sharing 2 devices; fit hands back the reference model W_ref
    ref, model = pair("gpt2")
    want = reference_avgpipe(ref, STEPS, pipelines=2, alpha=0.5)
    pipelined(model, 2, pipelines=2, microbatches=2)
    got = dict(model.named_parameters())
    assert close(want, {k: got[k].detach() for k in want}) <= 1e-10


@pytest.mark.parametrize(
    "kind,devices,settings",
    [
        ("llama", 2, {"recompute": True}),
        ("gpt2", 2, {"recompute": True, "schedule": "gpipe"}),  # every forward first: the last block replays its own call
        ("bert", 2, {"schedule": "zb-v"}),
        ("looped", 2, {"schedule": "hanayo"}),
        ("gpt2", 2, {"partition": "autopipe"}),  # profiled on the real ranks, then planned
        ("llama", 2, {"schedule": "auto", "partition": "autopipe"}),
    ],
)
def test_every_mode_equals_one_process(kind, devices, settings):
    ref, model = pair(kind)
    train_single(ref, STEPS)
    pipelined(model, devices, **settings)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


def test_replicas_equal_one_process_on_the_global_batch():
    # 2 replicas of a 2-stage pipeline: replica r reads perm[r::2] of the epoch's shuffle, 4 rows a step,
    # together one process's batch of 8 (EpochPerm deals that permutation in one process)
    from models import EpochPerm

    ref, model = pair("gpt2")
    train_single(ref, STEPS, DataLoader(Tokens(), batch_size=8, sampler=EpochPerm(len(Tokens()))))
    pipelined(model, 4, width=2, microbatches=2, data=DataLoader(Tokens(), batch_size=4))
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


def test_dropout_trains():
    # Dropout draws from each stage's own random stream, so its masks are not the ones one process would
    # draw: the run is a valid training run, not a bit-for-bit copy of one process's. It must train.
    torch.manual_seed(0)
    model = UserLM("gpt2", 4)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1

    def mean_loss():
        model.eval()
        with torch.no_grad():
            losses = [float(model.training_step(b, 0)) for b in loader()]
        model.train()
        return sum(losses) / len(losses)

    start = mean_loss()
    pipelined(model, 2, steps=12)
    end = mean_loss()
    assert end < start - 0.1, (start, end)


def test_checkpoints_hold_the_models_own_names_and_resume_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # 2 batches an epoch, a checkpoint every 2 steps: Lightning resumes a plain DataLoader exactly there
    ref, model = pair("llama")
    train_single(ref, STEPS, loader(n=16))
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    settings = {"microbatches": 4, "partition": "uniform", "start_method": START}
    trainer = L.Trainer(
        devices=2, strategy=AutoPipeStrategy(**settings), callbacks=[saver], **trainer_kwargs(max_steps=STEPS, enable_checkpointing=True)
    )
    trainer.fit(model, loader(n=16))
    middle = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=False)
    assert set(middle["state_dict"]) == {f"model.{k}" for k in ref.model.state_dict()}, "the model's own names"
    plain = UserLM("llama", 6)  # a plain one-process module loads the last checkpoint as it is
    plain.load_state_dict(torch.load(tmp_path / "epoch=1-step=4.ckpt", weights_only=False)["state_dict"])
    assert close(ref.state_dict(), plain.state_dict()) <= 1e-10
    resumed = UserLM("llama", 6)  # other initial weights: all must come from the checkpoint
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(**settings), **trainer_kwargs(max_steps=STEPS))
    trainer.fit(resumed, loader(n=16), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert close(model.state_dict(), resumed.state_dict()) <= 1e-12


class SwitchAt(L.Callback):
    """strategy.repartition(bounds) at the start of an iteration, on every rank (a live switch)."""

    def __init__(self, at: int, bounds):
        self.at, self.bounds = at, bounds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at:
            trainer.strategy.repartition(self.bounds)


@pytest.mark.parametrize("switch", ["fine-grained", "stop"])
def test_live_repartition_moves_blocks_and_stays_exact(switch):
    # 14 blocks (first, 6 layers in halves, last) on 2 stages, 7 | 7, then 10 | 4 from iteration 2: three halves move,
    # one of them the attention half of a layer whose MLP half stays
    ref, model = pair("gpt2")
    train_single(ref, STEPS)
    pipelined(model, 2, callbacks=[SwitchAt(2, [[0, 10], [10, 14]])], adaptive=True, adaptive_switch=switch, adaptive_interval=1000)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


class RecordStage(L.Callback):
    """Each rank writes its stage's initial weights and which of the model's tensors it created."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        stage = pl_module.model
        root = next(b.frontend.root for b in stage.blocks().values())
        created = sorted(n for n, t in root.named_parameters(remove_duplicate=False) if not t.is_meta)
        state = {k: v.clone() for k, v in pl_module.state_dict().items()}
        torch.save({"state": state, "created": created}, self.folder / f"stage-{trainer.global_rank}.pt")


def test_empty_init_creates_only_each_stages_blocks_and_trains_as_one_process(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = AutoPipeStrategy(microbatches=4, partition="uniform", start_method=START)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS)
    trainer = L.Trainer(
        devices=2, strategy=strategy, callbacks=[RecordStage(tmp_path), saver], **trainer_kwargs(max_steps=STEPS, enable_checkpointing=True)
    )
    with trainer.init_module(empty_init=True):
        model = UserLM("gpt2", 6)
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, loader())
    stages = [torch.load(tmp_path / f"stage-{r}.pt") for r in range(2)]
    # blocks: first (embeddings), 6 layers, last (final norm + head tied to the embedding); 4 | 4
    # (the tied weight is created on both, under both its names)
    first = ("transformer.wte", "transformer.wpe", "transformer.h.0.", "transformer.h.1.", "transformer.h.2.", "lm_head.weight")
    last = ("transformer.h.3.", "transformer.h.4.", "transformer.h.5.", "transformer.ln_f", "lm_head", "transformer.wte.weight")
    assert all(n.startswith(first) for n in stages[0]["created"]) and "transformer.h.2.mlp.c_fc.weight" in stages[0]["created"]
    assert all(n.startswith(last) for n in stages[1]["created"]) and "transformer.h.3.mlp.c_fc.weight" in stages[1]["created"]
    init = {**stages[0]["state"], **stages[1]["state"]}
    assert torch.equal(init["model.lm_head.weight"], init["model.transformer.wte.weight"]), "tied copies start equal"
    ref = UserLM("gpt2", 6)
    ref.load_state_dict(init)
    train_single(ref, STEPS)
    (path,) = tmp_path.glob("*.ckpt")
    assert close(ref.state_dict(), torch.load(path, weights_only=False)["state_dict"]) <= 1e-10


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_validation_and_prediction_equal_one_process(kind, tmp_path):
    torch.manual_seed(0)
    model = UserLM(kind, 6)
    one = L.Trainer(devices=1, **trainer_kwargs())
    want_loss = one.validate(model, loader(), verbose=False)[0]["val_loss"]
    want_pred = torch.cat(one.predict(model, loader()))
    strategy = AutoPipeStrategy(microbatches=4, partition="uniform", start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs())
    got_loss = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    strategy = AutoPipeStrategy(microbatches=4, partition="uniform", start_method=START)
    L.Trainer(devices=2, strategy=strategy, callbacks=[RecordPredictions(tmp_path)], **trainer_kwargs()).predict(model, loader())
    assert got_loss == pytest.approx(want_loss, rel=1e-10)
    for rank in range(2):  # predictions come back on every rank
        assert torch.equal(torch.cat(torch.load(tmp_path / f"pred-{rank}.pt")), want_pred)


class RecordPredictions(L.Callback):
    def __init__(self, folder):
        self.folder, self.outputs = folder, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(self.outputs, self.folder / f"pred-{trainer.global_rank}.pt")


def test_the_2bw_planner_profiles_a_traced_model_and_trains_its_choice():
    # PipeDream-2BW's planner profiles the traced blocks at several micro-batch sizes and picks (w, d, b)
    torch.manual_seed(0)
    model = UserLM("gpt2", 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = AutoPipeStrategy(planner="2bw", global_batch=8, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=3))
    trainer.fit(model, loader())
    assert type(model.model).__name__ == "GPT2LMHeadModel"
    assert close(before, model.state_dict()) > 1e-4, "it trained"
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_a_model_created_empty_is_profiled_planned_and_trains_as_one_process(tmp_path):
    # partition=autopipe profiles the blocks of a meta-built model through stand-ins of one rank's share
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = AutoPipeStrategy(microbatches=4, partition="autopipe", start_method=START)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS)
    trainer = L.Trainer(
        devices=2, strategy=strategy, callbacks=[RecordStage(tmp_path), saver], **trainer_kwargs(max_steps=STEPS, enable_checkpointing=True)
    )
    with trainer.init_module(empty_init=True):
        model = UserLM("llama", 6)
    trainer.fit(model, loader())
    ref = UserLM("llama", 6)
    ref.load_state_dict({**torch.load(tmp_path / "stage-0.pt")["state"], **torch.load(tmp_path / "stage-1.pt")["state"]})
    train_single(ref, STEPS)
    (path,) = tmp_path.glob("*.ckpt")
    assert close(ref.state_dict(), torch.load(path, weights_only=False)["state_dict"]) <= 1e-10
