"""Hugging Face weights in and out of a pipelined run: a model read with from_pretrained, or created
empty from a local directory's config (each rank reading only its blocks' tensors), trains to one
process's weights, and leaves a directory `from_pretrained` loads in a plain process."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import safetensors
import torch
from hf_models import Tokens, UserLM, gpt2, loader
from lightning.pytorch.callbacks import ModelCheckpoint
from models import START, trainer_kwargs

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.frontend import convert, trace
from lightning_pipe.frontend import weights as weights_module
from lightning_pipe.frontend.hf import export_pretrained, main
from lightning_pipe.frontend.weights import SAFETENSORS_INDEX, init_traced_block, read_tensors
from lightning_pipe.models.init import is_meta, materialize, seeded

transformers = pytest.importorskip("transformers")
STEPS = 3


def loaded(directory) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)


def worst_diff(ref: dict, got: dict) -> float:
    """Largest |got - ref| over each tensor, scaled by max(|ref|, 1): AdamW turns rounding noise on a
    parameter whose gradient is mathematically zero into steps of size lr, so a relative measure on
    near-zero tensors would be noise over noise."""
    assert sorted(ref) == sorted(got), (sorted(set(ref) ^ set(got)))[:5]
    return max(((got[k].double() - ref[k].double()).abs().max() / ref[k].double().abs().max().clamp(min=1.0)).item() for k in ref)


class FromPretrained(UserLM):
    """The model read from a directory as is (every process holds all of it)."""

    def __init__(self, directory):
        L.LightningModule.__init__(self)
        self.kind, self.lr = "gpt2", 1e-2
        self.model = loaded(directory)


class FromConfig(UserLM):
    """The model created from the directory's config alone: in configure_model() on the meta device,
    or in __init__ (under `trainer.init_module(empty_init=True)`)."""

    def __init__(self, directory, in_configure_model: bool):
        L.LightningModule.__init__(self)
        self.kind, self.lr, self.directory = "gpt2", 1e-2, directory
        self.model = None if in_configure_model else self._build()

    def _build(self):
        config = transformers.AutoConfig.from_pretrained(self.directory)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    def configure_model(self):
        if self.model is None:
            with torch.device("meta"):
                self.model = self._build()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A small float64 GPT-2 saved with save_pretrained, and one process's weights after training from it."""
    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    gpt2().save_pretrained(directory)
    ref = FromPretrained(directory)
    L.Trainer(devices=1, **trainer_kwargs(max_steps=STEPS)).fit(ref, loader())
    return directory, ref.model.state_dict()


def two_ranks(**kw) -> L.Trainer:
    strategy = AutoPipeStrategy(schedule="1f1b", partition="uniform", microbatches=4, start_method=START)
    return L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=STEPS, **kw))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_from_pretrained_trains_to_one_process_and_saves_back(pretrained, tmp_path):
    directory, ref = pretrained
    assert worst_diff(loaded(directory).state_dict(), ref) > 1e-3, "training moved the weights"
    module = FromPretrained(directory)
    two_ranks().fit(module, loader())
    assert isinstance(module.model, transformers.GPT2LMHeadModel), "the user's own model object comes back"
    assert worst_diff(ref, module.model.state_dict()) <= 1e-9
    out = export_pretrained(module.model, tmp_path / "out")  # its own save_pretrained
    back = loaded(out)
    assert worst_diff(ref, back.state_dict()) <= 1e-9
    assert back.lm_head.weight is back.transformer.wte.weight


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_configure_model", [True, False], ids=["configure_model", "init_module"])
def test_empty_model_starts_from_the_directory_and_exports_its_checkpoint(pretrained, tmp_path, in_configure_model):
    """Weights after training equal one process's from from_pretrained(dir): every rank started from
    the directory's values (a fresh initialisation would land far away)."""
    directory, ref = pretrained
    trainer = two_ranks(enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)])
    if in_configure_model:
        module = FromConfig(directory, in_configure_model=True)
    else:
        with trainer.init_module(empty_init=True):
            module = FromConfig(directory, in_configure_model=False)
        assert is_meta(module)
    trainer.fit(module, loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert worst_diff({f"model.{k}": v for k, v in ref.items()}, saved) <= 1e-9
    # out through the function, and through the command line (a Hugging Face directory as the config)
    export_pretrained(tmp_path / "last.ckpt", tmp_path / "out", directory)
    main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "cli"), "--config", str(directory), "--prefix", "model."])
    for out in ("out", "cli"):
        back = loaded(tmp_path / out)
        assert worst_diff(ref, back.state_dict()) <= 1e-9
        assert back.lm_head.weight is back.transformer.wte.weight


def test_export_of_a_checkpoint_with_another_prefix_and_class(tmp_path):
    torch.manual_seed(1)
    model = gpt2()
    torch.save({"state_dict": {f"net.{k}": v for k, v in model.state_dict().items()}, "epoch": 0}, tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match="prefix"):
        export_pretrained(tmp_path / "m.ckpt", tmp_path / "out", model.config)
    export_pretrained(tmp_path / "m.ckpt", tmp_path / "out", model.config, model_class=transformers.AutoModelForCausalLM, prefix="net.")
    assert worst_diff(model.state_dict(), loaded(tmp_path / "out").state_dict()) == 0.0
    with torch.device("meta"):
        empty = gpt2()
    with pytest.raises(ValueError, match="created empty"):
        export_pretrained(empty, tmp_path / "empty")


def test_missing_transformers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ImportError, match=r'pip install "lightning-pipe\[hf\]"'):
        export_pretrained(tmp_path / "m.ckpt", tmp_path / "out", "config")


def _rows(n: int = 2) -> dict:
    data = Tokens()
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in data[0]}


# Pipeline blocks held -> the model's names asked for: [First: embeddings, h.0 .. h.3, Last: final norm
# and head]; the head's weight is the embedding's, so the blocks holding it ask for both its names
HELD = {
    "middle": ({2, 3}, lambda n: n.startswith(("transformer.h.1.", "transformer.h.2."))),
    "first": ({0}, lambda n: n.startswith(("transformer.wte.", "transformer.wpe.")) or n == "lm_head.weight"),
    "last": ({5}, lambda n: n.startswith("transformer.ln_f.") or n in ("lm_head.weight", "transformer.wte.weight")),
}


@pytest.mark.parametrize("case", sorted(HELD))
def test_a_rank_reads_only_its_blocks_tensors(pretrained, monkeypatch, case):
    directory, _ = pretrained
    held, expected = HELD[case]
    module = FromConfig(directory, in_configure_model=True)
    module.configure_model()
    path, pipeline = convert(module)
    trace(module, path, pipeline, _rows(), sublayers=False)  # whole layers: blocks 1-4 are layers 0-3
    assert len(pipeline) == 6
    asked: list[str] = []

    def recording(directory, names):
        names = list(names)
        asked.extend(names)
        return read_tensors(directory, names)

    monkeypatch.setattr(weights_module, "read_tensors", recording)
    init = init_traced_block(pipeline, lambda index: seeded(0, index))
    materialize({i: pipeline[i] for i in held}, init, within=pipeline.original)
    truth = loaded(directory).state_dict()
    assert sorted(set(asked)) == sorted(n for n in truth if expected(n))
    state = pipeline.original.state_dict()  # the model's own view of its tensors
    assert all(torch.equal(state[n], truth[n]) for n in truth if expected(n)), "the directory's values"
    for i in set(range(len(pipeline))) - held:
        assert is_meta(pipeline[i]), f"block {i} is not this rank's: never created"


def test_read_tensors_from_shards_opens_only_the_files_it_needs(tmp_path, monkeypatch):
    torch.manual_seed(2)
    model = gpt2()
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    with open(tmp_path / SAFETENSORS_INDEX) as f:
        where = json.load(f)["weight_map"]
    assert len(set(where.values())) > 2, "several shards"
    wanted = ["transformer.h.0.attn.c_attn.weight", "transformer.h.3.mlp.c_proj.bias", "no.such.tensor"]
    opened: list[str] = []
    real_open = safetensors.safe_open

    def recording(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    got = read_tensors(str(tmp_path), wanted)
    assert sorted(got) == sorted(wanted[:2]), "a name the directory lacks is left out"
    truth = model.state_dict()
    assert all(torch.equal(got[n], truth[n]) for n in got)
    assert sorted(opened) == sorted({where[n] for n in wanted[:2]})
