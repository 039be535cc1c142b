"""lightning_pipe.data: tokenizer, offline corpora, splits, LM data modules. CPU, no network."""

import builtins
import os

import pytest
import torch

from lightning_pipe.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    CausalLMDataModule,
    MaskedLMDataModule,
    check_seq_len,
    corpus_files,
    num_predicted,
    read_corpus,
    split_corpus,
    stdlib_files,
)
from lightning_pipe.data import datamodules as datamodules_module
from lightning_pipe.data.corpus import stdlib_root
from lightning_pipe.data.masking import mask_tokens

SMALL = 256 * 1024  # bytes of stdlib text: plenty of windows, fast to read


def _text(n: int) -> str:
    """Varied ASCII and multi-byte text of at least n bytes."""
    line = "def f(x): return x * 2  # größer als zwei, 二倍\n"
    return line * (n // len(line.encode()) + 1)


def _write_corpus(tmp_path, n=20_000):
    p = tmp_path / "corpus.txt"
    p.write_text(_text(n), encoding="utf-8")
    return p


def _all(loader):
    return [tuple(t.clone() for t in batch) for batch in loader]


# ---- tokenizer ----------------------------------------------------------------------------------
def test_tokenizer_round_trip_utf8():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text).dtype == torch.int64
    assert tok.encode_tensor(text).tolist() == ids
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.encode(text.encode("utf-8")) == ids


def test_tokenizer_specials():
    tok = ByteTokenizer()
    assert (tok.PAD, tok.MASK, tok.BOS, tok.EOS, tok.vocab_size) == (256, 257, 258, 259, 260)
    ids = tok.encode("ab", add_bos=True, add_eos=True)
    assert ids == [258, 97, 98, 259]
    assert tok.encode_tensor("ab", add_bos=True, add_eos=True).tolist() == ids
    assert tok.decode([258, 97, 257, 256, 98, 259]) == "ab"  # specials skipped
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character is replaced, not an error
    with pytest.raises(ValueError):
        tok.decode([260])


# ---- corpora ------------------------------------------------------------------------------------
def test_stdlib_corpus_nonempty_deterministic():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    skipped = {"site-packages", "test", "tests", "__pycache__"}
    assert not any(skipped & set(f.relative_to(stdlib_root()).parts[:-1]) for f in files)
    a, b = read_corpus(max_bytes=SMALL), read_corpus(max_bytes=SMALL)
    assert len(a) == SMALL and a == b
    assert corpus_files(None) == files
    # The capped corpus is the prefix of a longer read: the order does not depend on the cap.
    assert read_corpus(max_bytes=2 * SMALL)[:SMALL] == a


def test_split_disjoint_and_deterministic():
    data = read_corpus(max_bytes=SMALL)
    train, val = split_corpus(data, 0.1)
    assert (train, val) == split_corpus(data, 0.1)
    assert train + val == data  # disjoint and complete: val is the tail
    assert len(val) == int(len(data) * 0.1)
    assert split_corpus(data, 0.0) == (data, b"")
    with pytest.raises(ValueError, match="data.val_fraction"):
        split_corpus(data, 1.0)


def test_user_file_and_folder(tmp_path):
    f = _write_corpus(tmp_path)
    assert read_corpus(f) == f.read_bytes()
    assert read_corpus(str(f), max_bytes=10) == f.read_bytes()[:10]

    root = tmp_path / "folder"
    (root / "b" / "c").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "z.txt").write_text("zzz\n")
    (root / "a.md").write_text("aaa\n")
    (root / "b" / "c" / "d.py").write_text("ddd\n")
    (root / "b" / "blob.bin").write_bytes(b"\x00\x01binary")  # not text: skipped
    (root / ".git" / "HEAD").write_text("hidden\n")  # hidden: skipped
    assert [p.name for p in corpus_files(root)] == ["a.md", "d.py", "z.txt"]
    assert read_corpus(root) == b"aaa\nddd\nzzz\n"


def test_missing_path_and_empty_corpus(tmp_path):
    missing = tmp_path / "nope.txt"
    for call in (lambda: read_corpus(missing), lambda: CausalLMDataModule(path=missing)):
        with pytest.raises(FileNotFoundError, match="data.path") as err:
            call()
        assert str(missing) in str(err.value)

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="data.path.*empty"):
        read_corpus(empty)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="data.path.*empty"):
        read_corpus(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match="data.path.*empty"):
        MaskedLMDataModule(path=empty).setup()


def test_binary_file_refused_alike_alone_or_in_a_folder(tmp_path):
    # A binary file (a NUL byte in its first 8 KiB, as git and grep decide) is not read: given as
    # data.path it used to be read and trained on silently while a folder holding it was refused.
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / blob.name).write_bytes(blob.read_bytes())
    messages = []
    for path, inside in ((blob, blob), (folder, folder / blob.name)):
        assert corpus_files(path) == []
        for call in (lambda p=path: read_corpus(p), lambda p=path: CausalLMDataModule(path=p).setup()):
            with pytest.raises(ValueError) as err:
                call()
            assert str(err.value) == (
                f"data.path={str(path)!r}: the corpus is empty: {inside} is a binary file (a NUL byte in the first 8192 "
                "bytes, as git and grep decide), and binary files are not read; give a text file or a folder of text files"
            )
            messages.append(str(err.value).split(": ", 1)[1].replace(str(inside), "<file>"))
    assert len(set(messages)) == 1, messages  # the same message whichever way the file is given
    # a NUL after the first 8 KiB: text, both ways; text next to a binary file in a folder: read
    late = tmp_path / "late.txt"
    late.write_bytes(b"a" * 8192 + b"\0")
    assert read_corpus(late) == late.read_bytes()
    (folder / "notes.txt").write_text("text\n")
    assert corpus_files(folder) == [folder / "notes.txt"] and read_corpus(folder) == b"text\n"


def test_setting_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len=512.*max_seq_len=256"):
        CausalLMDataModule(seq_len=512, max_seq_len=256)
    with pytest.raises(ValueError, match="data.seq_len"):
        MaskedLMDataModule(seq_len=0)
    check_seq_len(256, max_seq_len=256)  # at the limit is fine
    with pytest.raises(ValueError, match="data.batch_size"):
        CausalLMDataModule(batch_size=0)
    with pytest.raises(ValueError, match="data.mask_prob"):
        MaskedLMDataModule(mask_prob=0.0)
    with pytest.raises(ValueError, match="data.max_bytes"):
        read_corpus(max_bytes=0)

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just a few bytes")
    with pytest.raises(ValueError, match="data.seq_len=64"):
        CausalLMDataModule(path=tiny, seq_len=64, val_fraction=0.0).setup()
    with pytest.raises(ValueError, match="data.batch_size=16"):
        CausalLMDataModule(path=_write_corpus(tmp_path, 1000), seq_len=128, val_fraction=0.0).setup()
    with pytest.raises(ValueError, match="data.val_fraction"):
        CausalLMDataModule(path=_write_corpus(tmp_path, 20_000), seq_len=128, val_fraction=0.001).setup()


# ---- causal LM ----------------------------------------------------------------------------------
def test_causal_windows_shifted_and_contiguous(tmp_path):
    path = _write_corpus(tmp_path)
    dm = CausalLMDataModule(path=path, seq_len=32, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    assert dm.vocab_size == 260
    train_bytes, val_bytes = split_corpus(path.read_bytes(), 0.1)
    assert len(dm.train_dataset) == (len(train_bytes) - 33) // 32 + 1
    for i in (0, 1, len(dm.train_dataset) - 1):
        x, y = dm.train_dataset[i]
        assert x.shape == y.shape == (32,) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
        assert bytes(x.tolist()) + bytes(y[-1:].tolist()) == train_bytes[32 * i : 32 * i + 33]
    x, y = dm.val_dataset[0]
    assert bytes(x.tolist()) == val_bytes[:32]


def test_train_loader_full_batches_deterministic(tmp_path):
    path = _write_corpus(tmp_path)
    make = lambda: CausalLMDataModule(path=path, seq_len=16, batch_size=7, val_fraction=0.1, seed=3)
    a, b = make(), make()
    batches_a, batches_b = _all(a.train_dataloader()), _all(b.train_dataloader())
    assert len(batches_a) == len(a.train_dataset) // 7 and len(a.train_dataset) % 7  # a short tail dropped
    assert all(x.shape == (7, 16) and y.shape == (7, 16) for x, y in batches_a)
    assert all(torch.equal(u, v) for ba, bb in zip(batches_a, batches_b) for u, v in zip(ba, bb))
    # One epoch is a permutation of the windows: each drawn exactly once (the loader drops the short last batch).
    order = list(a.train_dataloader().sampler)
    assert len(order) == len(set(order)) == len(a.train_dataset) and set(order) == set(range(len(a.train_dataset)))
    # Shuffled: not the dataset's order.
    first = torch.stack([a.train_dataset[i][0] for i in range(7)])
    assert not torch.equal(batches_a[0][0], first)
    # Another seed, another order.
    c = CausalLMDataModule(path=path, seq_len=16, batch_size=7, val_fraction=0.1, seed=4)
    assert not torch.equal(_all(c.train_dataloader())[0][0], batches_a[0][0])

    # Validation: in order and complete (drop_last=False).
    val = _all(a.val_dataloader())
    assert sum(x.shape[0] for x, _ in val) == len(a.val_dataset)
    assert torch.equal(val[0][0][0], a.val_dataset[0][0])


def test_no_validation_when_fraction_zero(tmp_path):
    dm = CausalLMDataModule(path=_write_corpus(tmp_path), seq_len=16, batch_size=4, val_fraction=0.0)
    assert dm.val_dataloader() == []


def test_default_corpus_datamodule():
    dm = CausalLMDataModule(seq_len=64, batch_size=8, max_bytes=SMALL)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (8, 64)
    # each row is the standard library's text at an offset that is a multiple of seq_len, in the
    # training split (the head of the capped corpus), with its target the next 64 bytes
    train, _ = split_corpus(read_corpus(max_bytes=SMALL), 0.05)
    windows = {train[64 * j : 64 * j + 65] for j in range((len(train) - 65) // 64 + 1)}
    assert len(windows) > 0.9 * (len(train) // 64)
    for row_x, row_y in zip(x, y):
        assert bytes(row_x.tolist()) + bytes(row_y[-1:].tolist()) in windows
        assert torch.equal(row_x[1:], row_y[:-1])


# ---- masked LM ----------------------------------------------------------------------------------
def test_masked_lm_exact_k_and_labels(tmp_path):
    path = _write_corpus(tmp_path)
    dm = MaskedLMDataModule(path=path, seq_len=40, batch_size=4, val_fraction=0.1, mask_prob=0.15)
    dm.setup("fit")
    k = num_predicted(40, 0.15)
    assert k == 6
    train_bytes, _ = split_corpus(path.read_bytes(), 0.1)
    n_mask = n_random_or_kept = 0
    for ds in (dm.train_dataset, dm.val_dataset):
        for i in range(len(ds)):
            inputs, attention, labels = ds[i]
            assert inputs.shape == attention.shape == labels.shape == (40,)
            assert all(t.dtype == torch.int64 for t in (inputs, attention, labels))
            assert bool((attention == 1).all())
            predicted = labels != IGNORE_INDEX
            assert int(predicted.sum()) == k
            if ds is dm.train_dataset:
                original = torch.tensor(list(train_bytes[40 * i : 40 * i + 40]))
                assert torch.equal(labels[predicted], original[predicted])
                assert torch.equal(inputs[~predicted], original[~predicted])  # the rest is untouched
            assert int(inputs[predicted].max()) <= ByteTokenizer.MASK
            assert bool((inputs[~predicted] < 256).all())
            n_mask += int((inputs[predicted] == ByteTokenizer.MASK).sum())
            n_random_or_kept += int((inputs[predicted] != ByteTokenizer.MASK).sum())
    share = n_mask / (n_mask + n_random_or_kept)
    assert abs(share - 0.8) < 0.03  # BERT's 80% MASK (~3000 predicted positions: sd 0.007)


def test_masking_rule_proportions_on_a_seeded_sample():
    """mask_tokens on 20000 random bytes, k = 6000: exactly k labels, each the original id; of the
    predicted positions 80% MASK, 10% a random byte, 10% kept (BERT), the random ids spread over
    all bytes; positions spread over the whole sample; the rest untouched."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (20_000,), generator=g)
    k = 6000
    inputs, labels = mask_tokens(ids, k, torch.Generator().manual_seed(1), ByteTokenizer.MASK, 256)
    predicted = labels != IGNORE_INDEX
    assert int(predicted.sum()) == k
    assert torch.equal(labels[predicted], ids[predicted]) and torch.equal(inputs[~predicted], ids[~predicted])
    got, orig = inputs[predicted], ids[predicted]
    masked = got == ByteTokenizer.MASK
    kept = got == orig
    replaced = ~masked & ~kept  # a random byte equal to the original counts as kept (1 in 256)
    # sd of a share over 6000 positions: 0.005 at 80%, 0.004 at 10%
    assert abs(masked.float().mean().item() - 0.8) < 0.02
    assert abs(replaced.float().mean().item() - 0.1 * 255 / 256) < 0.015
    assert abs(kept.float().mean().item() - (0.1 + 0.1 / 256)) < 0.015
    assert int(got[replaced].max()) < 256 and len(set(got[replaced].tolist())) > 200
    where = predicted.nonzero().flatten()
    quarters = torch.bincount(where // 5000, minlength=4) / k
    assert bool(((quarters - 0.25).abs() < 0.03).all()), quarters
    # another generator, other positions
    _, other = mask_tokens(ids, k, torch.Generator().manual_seed(2), ByteTokenizer.MASK, 256)
    assert not torch.equal(other != IGNORE_INDEX, predicted)


def test_masked_lm_deterministic_across_instances(tmp_path):
    path = _write_corpus(tmp_path)
    make = lambda: MaskedLMDataModule(path=path, seq_len=32, batch_size=4, val_fraction=0.1, seed=1)
    a, b = make(), make()
    a.setup(), b.setup()
    n = len(a.train_dataset)
    # The same sample is masked the same way however often or in whatever order it is drawn: `a`
    # in order, `b` backwards, then `b`'s sample 5 again after all the others.
    forward = [a.train_dataset[i] for i in range(n)]
    backward = [b.train_dataset[i] for i in reversed(range(n))][::-1]
    for i in range(n):
        assert all(torch.equal(u, v) for u, v in zip(forward[i], backward[i])), i
    assert all(torch.equal(u, v) for u, v in zip(b.train_dataset[5], forward[5]))
    # and samples are not all masked alike (the masking depends on the index)
    assert len({tuple((labels != IGNORE_INDEX).nonzero().flatten().tolist()) for _, _, labels in forward}) > n // 2
    ba, bb = _all(a.train_dataloader()), _all(b.train_dataloader())
    assert all(torch.equal(u, v) for x, y in zip(ba, bb) for u, v in zip(x, y))
    c = MaskedLMDataModule(path=path, seq_len=32, batch_size=4, val_fraction=0.1, seed=2)
    c.setup()
    assert not torch.equal(a.train_dataset[0][2], c.train_dataset[0][2])  # the seed matters


# ---- synthetic ----------------------------------------------------------------------------------
def test_synthetic_makes_no_file_access(monkeypatch):
    def no_files(*args, **kwargs):
        raise AssertionError("synthetic data must not read files")

    monkeypatch.setattr(builtins, "open", no_files)
    monkeypatch.setattr(os, "walk", no_files)
    monkeypatch.setattr(datamodules_module, "iter_corpus", no_files)

    causal = CausalLMDataModule(path=None, synthetic=True, synthetic_vocab=50, synthetic_samples=20, seq_len=12, batch_size=4)
    assert causal.vocab_size == 50
    batches = _all(causal.train_dataloader())
    assert len(batches) == 5
    x, y = batches[0]
    assert x.shape == y.shape == (4, 12) and x.dtype == torch.int64 and int(x.max()) < 50
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(causal.val_dataset) == 1  # max(1, round(20 * 0.05))
    assert not torch.equal(causal.val_dataset[0][0], causal.train_dataset[0][0])  # separate streams
    again = CausalLMDataModule(synthetic=True, synthetic_vocab=50, synthetic_samples=20, seq_len=12, batch_size=4)
    assert all(torch.equal(u, v) for p, q in zip(batches, _all(again.train_dataloader())) for u, v in zip(p, q))

    masked = MaskedLMDataModule(synthetic=True, synthetic_vocab=1000, synthetic_samples=8, seq_len=20, batch_size=4)
    inputs, attention, labels = next(iter(masked.train_dataloader()))
    assert inputs.shape == attention.shape == labels.shape == (4, 20)
    assert ((labels != IGNORE_INDEX).sum(dim=1) == num_predicted(20, 0.15)).all()
    with pytest.raises(ValueError, match="data.synthetic_vocab"):
        MaskedLMDataModule(synthetic=True, synthetic_vocab=100)
