"""Real tokenizers and token files: a byte-level BPE trained offline on the stdlib, corpora tokenized
once into memory-mapped files, and their checks against each other and the model. CPU, no network."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import START

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    CausalLMDataModule,
    HFTokenizer,
    MaskedLMDataModule,
    StreamWindows,
    TokenFile,
    TokenizerInfo,
    TokenSlice,
    check_model_vocab,
    iter_corpus,
    read_corpus,
    write_token_file,
)
from lightning_pipe.data import tokenize as tokenize_command
from lightning_pipe.data import train_tokenizer as train_command
from lightning_pipe.data.tokenize import tokenize_corpus
from lightning_pipe.data.train_tokenizer import SPECIAL_TOKENS, train_tokenizer
from lightning_pipe.errors import SettingError
from lightning_pipe.models import CausalLM, MaskedLM, ModelConfig

pytest.importorskip("tokenizers")  # the `test` extra installs it: CI runs every test here

ROOT = Path(__file__).resolve().parents[1]
SMALL = 256 * 1024  # bytes of stdlib text: trains a tokenizer in well under a second
VOCAB = 512
PROPERTY = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A trained tokenizer, another one (for mismatches), and the stdlib head tokenized with each."""
    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(d / "tok.json", VOCAB, max_bytes=SMALL)
    other = train_tokenizer(d / "other.json", 400, max_bytes=SMALL)
    tokenize_corpus(d / "tokens.bin", d / "tok.json", max_bytes=SMALL)
    tokenize_corpus(d / "bytes.bin", None, max_bytes=SMALL)
    return {"dir": d, "tok": tok, "other": other, "tokens": d / "tokens.bin", "bytes": d / "bytes.bin"}


def _windows(dataset) -> list[tuple]:
    return [tuple(t.clone() for t in dataset[i]) for i in range(len(dataset))]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for p, q in zip(a, b) for u, v in zip(p, q))


# ---- training a tokenizer ---------------------------------------------------------------------
def test_train_tokenizer_command_is_deterministic_and_checked(tmp_path, capsys, files):
    out = tmp_path / "sub" / "tok.json"
    argv = ["--out", str(out), "--vocab-size", str(VOCAB), "--max-bytes", str(SMALL)]
    assert train_command.main(argv) == 0
    line = capsys.readouterr().out
    assert f"wrote {out}: byte-level BPE, {VOCAB} ids" in line and f"trained on {SMALL:,} bytes of the standard library" in line
    # the same corpus and settings give the same file, byte for byte (the fixture's, trained the same way)
    assert out.read_bytes() == (files["dir"] / "tok.json").read_bytes()
    tok = HFTokenizer(out)
    assert tok.vocab_size == VOCAB and tok.sha256 == files["tok"].sha256
    assert [tok.info.special[r] for r in ("bos", "pad", "mask", "cls", "sep")] == [0, 1, 2, 3, 4]
    assert tok.info.special_ids == (0, 1, 2, 3, 4) and tok.info.special["eos"] == 0
    assert tok.info.ordinary_ids().tolist() == list(range(len(SPECIAL_TOKENS), VOCAB))
    # merges learned: the stdlib compresses well below a byte per token
    text = read_corpus(max_bytes=SMALL).decode()
    assert len(tok.encode(text)) < 0.5 * len(text.encode())

    assert train_command.main(["--out", str(tmp_path / "x.json"), "--vocab-size", "100"]) == 2
    assert capsys.readouterr().err.strip() == "error: --vocab-size=100: must be at least 261 (256 byte symbols + 5 special tokens)"
    assert train_command.main(["--out", str(tmp_path / "x.json"), "--vocab-size", "300", "--path", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: --path=")
    assert not (tmp_path / "x.json").exists() and not [p for p in out.parent.iterdir() if p.name != "tok.json"]


@PROPERTY
@given(text=st.text(max_size=200) | st.sampled_from(["<mask>", "a<|endoftext|>b", "[CLS] <pad><sep>", "\r\n\t  \x00 🙂 日本"]))
def test_round_trip_any_text_and_special_spellings_stay_text(files, text):
    tok = files["tok"]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < VOCAB for i in ids)
    # a special token's spelling in the corpus is text, never the special id (masked LM relies on it)
    assert not set(ids) & set(tok.info.special_ids)
    assert tok.encode_tensor(text).tolist() == ids


def test_tokenizer_pickles_with_its_settings(files):
    tok = files["tok"]
    back = pickle.loads(pickle.dumps(tok))
    text = "x = '<mask>'  # héllo\n"
    assert back.encode(text) == tok.encode(text) and back.info == tok.info and back.sha256 == tok.sha256


def test_missing_tokenizers_package_is_one_line(monkeypatch, files, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ImportError) as err:
        CausalLMDataModule(tokenizer=files["dir"] / "tok.json")
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.tokenizer=") and 'pip install "lightning-pipe[tokenizers]"' in message
    assert train_command.main(["--out", "t.json", "--vocab-size", "300"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and line.endswith('pip install "lightning-pipe[tokenizers]"')
    # the byte tokenizer and byte token files need no package
    assert CausalLMDataModule(tokens=files["bytes"]).vocab_size == 260


# ---- token files ------------------------------------------------------------------------------
def test_token_file_equals_in_memory_tokenisation(files):
    meta = json.loads(Path(str(files["tokens"]) + ".json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB and meta["tokenizer"]["sha256"] == files["tok"].sha256
    assert meta["corpus"] == {"path": meta["corpus"]["path"], "stdlib": True, "max_bytes": SMALL, "bytes": SMALL}
    assert files["tokens"].stat().st_size == 2 * meta["count"]
    # the file holds the corpus's ids, which decode to the corpus
    ids = np.fromfile(files["tokens"], dtype="<u2")
    assert files["tok"].decode(ids.tolist()) == read_corpus(max_bytes=SMALL).decode()

    for module, kw in ((CausalLMDataModule, {}), (MaskedLMDataModule, {"mask_prob": 0.2})):
        memory = module(tokenizer=files["dir"] / "tok.json", max_bytes=SMALL, seq_len=64, batch_size=8, val_fraction=0.1, **kw)
        mapped = module(tokens=files["tokens"], seq_len=64, batch_size=8, val_fraction=0.1, **kw)
        memory.setup("fit"), mapped.setup("fit")
        assert isinstance(mapped.train_dataset.windows.tokens, TokenSlice)  # read through the map, not loaded
        assert mapped.vocab_size == memory.vocab_size == VOCAB
        assert _equal(_windows(memory.train_dataset), _windows(mapped.train_dataset))
        assert _equal(_windows(memory.val_dataset), _windows(mapped.val_dataset))
        assert _equal(list(memory.train_dataloader()), list(mapped.train_dataloader()))

    # bytes: a byte token file gives the default data module's windows exactly
    default = CausalLMDataModule(max_bytes=SMALL, seq_len=64, batch_size=8)
    from_file = CausalLMDataModule(tokens=files["bytes"], seq_len=64, batch_size=8)
    default.setup(), from_file.setup()
    assert _equal(_windows(default.train_dataset), _windows(from_file.train_dataset))
    assert _equal(_windows(default.val_dataset), _windows(from_file.val_dataset))


def test_masked_lm_uses_the_tokenizers_special_ids(files):
    dm = MaskedLMDataModule(tokens=files["tokens"], seq_len=64, batch_size=8, mask_prob=0.25)
    dm.setup()
    mask_id, special = files["tok"].mask_id, set(files["tok"].info.special_ids)
    cls, sep = files["tok"].cls_id, files["tok"].sep_id
    windows = dm.train_dataset.windows  # consecutive slices of the stream: no token skipped by the framing
    assert torch.equal(torch.cat([windows[0], windows[1]]), windows.tokens[:124].long())
    masked = replaced = chosen_total = 0
    for i in range(len(dm.train_dataset)):
        inputs, attention, labels = dm.train_dataset[i]
        chosen = labels != IGNORE_INDEX
        # BERT's framing: [CLS] + 62 stream tokens + [SEP], 16 = round(0.25 x 62) predicted among the 62
        assert inputs.shape == (64,) and (int(inputs[0]), int(inputs[-1])) == (cls, sep) and not chosen[[0, -1]].any()
        assert int(chosen.sum()) == 16 and bool((attention == 1).all())
        assert torch.equal(inputs[1:-1][~chosen[1:-1]], dm.train_dataset.windows[i][~chosen[1:-1]])  # the rest untouched
        assert not set(labels[chosen].tolist()) & special  # the stream holds no special id
        others = inputs[chosen & (inputs != mask_id) & (inputs != labels)]
        assert not set(others.tolist()) & special and bool((others < VOCAB).all())  # random ids: ordinary ones
        masked, replaced, chosen_total = masked + int((inputs[chosen] == mask_id).sum()), replaced + others.numel(), chosen_total + 16
    assert 0.75 < masked / chosen_total < 0.85 and 0.07 < replaced / chosen_total < 0.11  # BERT's 80 / 10 / 10


def _gpt2_like(path: Path) -> Path:
    """GPT-2's layout: byte-level BPE with one special token, <|endoftext|>, as the last id; no mask."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([read_corpus(max_bytes=20_000).decode()], trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_a_tokenizer_json_with_its_specials_last(tmp_path):
    path = _gpt2_like(tmp_path / "gpt2_like.json")
    tok = HFTokenizer(path)
    assert tok.vocab_size == 301 and tok.info.special == {"bos": 300, "eos": 300} and tok.mask_id is None
    assert tok.info.ordinary_ids().tolist() == list(range(300))
    dm = CausalLMDataModule(path=_write(tmp_path), tokenizer=path, seq_len=16, batch_size=4, model_vocab_size=301)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 16) and int(x.max()) < 300 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match=r"data.tokenizer=.*gpt2_like.json': masked LM needs a mask token"):
        MaskedLMDataModule(tokenizer=path)


def _write(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text("def f(x):\n    return x * 2  # größer, 二倍\n" * 200)
    return p


@PROPERTY
@given(
    ids=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=300),
    big=st.booleans(),
    seq_len=st.integers(1, 40),
    val_fraction=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
    causal=st.booleans(),
)
def test_memmap_windows_equal_tensor_windows(ids, big, seq_len, val_fraction, causal):
    vocab = 70_000 if big else 2**16  # uint32 above 65536 ids, uint16 up to it
    info = TokenizerInfo("huggingface", vocab, {}, (), "0" * 64, "t.json")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "t.bin"
        chunks = [np.asarray(ids[i : i + 7], dtype=np.int64) for i in range(0, len(ids), 7)]
        meta = write_token_file(out, iter(chunks), info)
        assert meta["dtype"] == ("uint32" if big else "uint16") and out.stat().st_size == len(ids) * (4 if big else 2)
        assert sorted(os.listdir(d)) == ["t.bin", "t.bin.json"]
        file = TokenFile(out)
        tensor = torch.tensor(ids, dtype=torch.int64)
        cut = len(ids) - int(len(ids) * val_fraction)
        length = seq_len + 1 if causal else seq_len
        for a, b in ((0, cut), (cut, len(ids))):
            mapped = StreamWindows(TokenSlice(file, a, b), length, stride=seq_len)
            listed = StreamWindows(tensor[a:b], length, stride=seq_len)
            assert len(mapped) == len(listed)
            assert all(torch.equal(mapped[i], listed[i]) for i in range(len(mapped)))
        # a map is opened per process: pickling sends the file's name, not its ids
        assert pickle.loads(pickle.dumps(file))._map is None and len(pickle.dumps(file)) < 2000


def test_token_file_write_is_atomic(tmp_path, files):
    out = tmp_path / "t.bin"
    info = files["tok"].info

    def failing():
        yield np.arange(10)
        raise KeyboardInterrupt  # an interrupt half-way

    with pytest.raises(KeyboardInterrupt):
        write_token_file(out, failing(), info)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary file
    write_token_file(out, iter([np.arange(100)]), info)
    before = (out.read_bytes(), Path(str(out) + ".json").read_bytes())
    with pytest.raises(ValueError, match="token id 600 is outside"):
        write_token_file(out, iter([np.arange(50), np.array([600])]), info)
    with pytest.raises(KeyboardInterrupt):
        write_token_file(out, failing(), info)
    assert (out.read_bytes(), Path(str(out) + ".json").read_bytes()) == before  # the old pair, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]
    assert TokenSlice(TokenFile(out))[0:100].tolist() == list(range(100))


def test_token_file_refusals(tmp_path, files):
    import shutil

    bad = tmp_path / "bad.bin"
    shutil.copy(files["tokens"], bad)
    with pytest.raises(ValueError, match=r"data.tokens=.*bad.bin.*sidecar bad.bin.json is missing"):
        CausalLMDataModule(tokens=bad)
    side = Path(str(bad) + ".json")
    side.write_text("{not json")
    with pytest.raises(ValueError, match="not a token file's description"):
        TokenFile(bad)
    shutil.copy(str(files["tokens"]) + ".json", side)
    with open(bad, "r+b") as f:  # cut short
        f.truncate(bad.stat().st_size - 2)
    with pytest.raises(ValueError, match=r"bytes, but its sidecar says \d+ uint16 tokens .*cut or replaced"):
        CausalLMDataModule(tokens=bad)
    with pytest.raises(FileNotFoundError, match="data.tokens=.*no such file"):
        CausalLMDataModule(tokens=tmp_path / "none.bin")

    # made with another tokenizer than the one named
    with pytest.raises(ValueError, match=r"data.tokens=.*tokens.bin' was written with tokenizer tok.json.*data.tokenizer=.*other.json"):
        CausalLMDataModule(tokens=files["tokens"], tokenizer=files["dir"] / "other.json")
    with pytest.raises(ValueError, match=r"written with the byte tokenizer \(260 ids\), but data.tokenizer="):
        CausalLMDataModule(tokens=files["bytes"], tokenizer=files["dir"] / "tok.json")
    CausalLMDataModule(tokens=files["tokens"], tokenizer=files["dir"] / "tok.json")  # the same one: fine
    with pytest.raises(ValueError, match="give one of them"):
        CausalLMDataModule(tokens=files["tokens"], path=tmp_path)
    with pytest.raises(ValueError, match="data.synthetic=true"):
        CausalLMDataModule(synthetic=True, tokenizer=files["dir"] / "tok.json")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        CausalLMDataModule(tokenizer=side)


def test_model_vocab_must_hold_the_tokenizers_ids(files):
    tok_json = files["dir"] / "tok.json"
    with pytest.raises(
        ValueError, match=rf"data.tokenizer=.*tok.json': {VOCAB} token ids, .*model.model.vocab_size=260.*\+model.model.vocab_size={VOCAB}"
    ):
        CausalLMDataModule(tokenizer=tok_json, model_vocab_size=260)
    with pytest.raises(ValueError, match=rf"data.tokens=.*written with tokenizer tok.json.*: {VOCAB} token ids"):
        MaskedLMDataModule(tokens=files["tokens"], model_vocab_size=400)
    with pytest.raises(ValueError, match=r"data.tokenizer=null \(the byte tokenizer\): 260 token ids"):
        CausalLMDataModule(model_vocab_size=256)
    CausalLMDataModule(tokenizer=tok_json, model_vocab_size=VOCAB)
    CausalLMDataModule(tokens=files["tokens"], model_vocab_size=50257)  # a paper-size vocabulary: the upper ids go unused

    dm = CausalLMDataModule(tokens=files["tokens"])
    small = CausalLM(ModelConfig(vocab_size=260, n_layer=1, n_head=2, d_model=16, max_seq_len=128))
    with pytest.raises(ValueError, match=r"model.model.vocab_size=260"):
        check_model_vocab(small, dm)
    # from Python: fit refuses it in setup, before a step
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"data.tokens=.*model.model.vocab_size=260"):
        trainer.fit(small, datamodule=dm)
    assert trainer.global_step == 0
    # under the strategy: refused before any process starts (the launcher's checks)
    strategy = AutoPipeStrategy(partition="uniform", microbatches=2, start_method=START)
    pipe = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(SettingError, match=r"data.tokens=.*model.model.vocab_size=260"):
        pipe.fit(small, datamodule=dm)
    assert strategy.layers is None, "no process was started, nothing was set up"


def test_cli_refuses_a_small_vocab_before_any_process_starts(files):
    from hydra import compose, initialize_config_dir
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from lightning_pipe.cli import errors
    from lightning_pipe.cli.paths import CONFIG_DIR
    from lightning_pipe.cli.train import build

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"data.tokenizer={files['dir'] / 'tok.json'}"])
        ok = compose("config", overrides=[f"data.tokens={files['tokens']}", f"+model.model.vocab_size={VOCAB}", "data.max_bytes=1000"])
    with pytest.raises(InstantiationException) as err:
        build(cfg)  # builds the model and the data module in this process: nothing is launched yet
    assert errors.describe(err.value).startswith(f"data.tokenizer='{files['dir'] / 'tok.json'}': {VOCAB} token ids, more than")
    assert "model.model.vocab_size=260" in errors.describe(err.value)
    datamodule = instantiate(ok.data, model_vocab_size=instantiate(ok.model).config.vocab_size)
    assert datamodule.vocab_size == VOCAB and datamodule.token_file.path == files["tokens"]


# ---- training with them -----------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["causal", "masked"])
def test_trains_through_the_trainer_with_a_trained_tokenizer(files, objective):
    config = ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=64, max_seq_len=64)
    if objective == "causal":
        model, dm = CausalLM(config, lr=3e-3, warmup_steps=0), CausalLMDataModule(tokens=files["tokens"], seq_len=64, batch_size=8)
    else:
        model = MaskedLM(config, lr=3e-3, warmup_steps=0)
        dm = MaskedLMDataModule(tokenizer=files["dir"] / "tok.json", max_bytes=SMALL // 4, seq_len=64, batch_size=8)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    L.seed_everything(0)
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[Record()],
    ).fit(model, datamodule=dm)
    assert abs(losses[0] - math.log(VOCAB)) < 0.5, losses  # about uniform over the tokenizer's ids at first
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # and it learns


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_readme_commands(tmp_path):
    """The README's three commands, as typed there (a smaller corpus and 3 steps), on 2 processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    assert train_command.main(["--out", "tok.json", "--vocab-size", "1024", "--max-bytes", "1000000"]) == 0
    assert tokenize_command.main(["--out", "tokens.bin", "--tokenizer", "tok.json", "--max-bytes", "1000000"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json", "tokens.bin", "tokens.bin.json"]
    args = ["data.tokens=tokens.bin", "+model.model.vocab_size=1024", "trainer.max_steps=3", "trainer.val_check_interval=3"]
    args += ["trainer.limit_val_batches=2", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "lightning_pipe.train", *args], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[lightning-pipe] gpt-tiny-cpu: train_loss=" in proc.stdout
    resolved = (tmp_path / "run" / "config_resolved.yaml").read_text()
    assert "tokens: tokens.bin" in resolved and "vocab_size: 1024" in resolved


def test_iter_corpus_pieces_are_the_corpus(tmp_path):
    # pieces join to read_corpus exactly (capped or not), never span files, and end after a newline
    # unless a line is longer than a block (or the file or the cap ends there)
    (tmp_path / "a.txt").write_text("line one\nline two\n" * 40 + "no newline at the end")
    (tmp_path / "b.txt").write_text("x" * 300 + "\nshort\n")
    for cap in (None, 1000, 1001, 37):
        pieces = list(iter_corpus(tmp_path, cap, block_bytes=64))
        assert b"".join(pieces) == read_corpus(tmp_path, cap)
        a = [p for p in pieces if p.startswith((b"line", b"no newline"))]
        assert b"".join(a) == (tmp_path / "a.txt").read_bytes()[:cap]  # a's pieces hold a alone
        assert all(p.endswith(b"\n") and len(p) < 2 * 64 for p in a[:-1])
    b = [p for p in iter_corpus(tmp_path / "b.txt", None, block_bytes=64)]
    assert [len(p) for p in b] == [64] * 4 + [44 + 1 + 6]  # the long line in blocks; its end and the next line together
    assert ByteTokenizer().info.vocab_size == 260 and ByteTokenizer.info.ordinary_ids().tolist() == list(range(256))
