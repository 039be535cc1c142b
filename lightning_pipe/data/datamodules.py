"""LightningDataModules for causal and masked language modelling on byte-level text.

The corpus is read in `setup` (on every rank, deterministically) rather than in `__init__`, so
the module stays small when Lightning pickles it to spawned processes; cheap checks (settings,
that the path exists) run in `__init__` to fail before anything is launched.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from . import seeding
from .checks import check_fraction, check_positive, check_seq_len
from .corpus import DEFAULT_MAX_BYTES, PathLike, read_corpus, split_corpus
from .datasets import CausalLMDataset, MaskedLMDataset
from .sampling import ResumableSampler
from .tokenizer import ByteTokenizer
from .windows import RandomWindows, StreamWindows

DEFAULT_SYNTHETIC_SAMPLES = 1024

# torchdata 0.11 calls a deprecated torch function on every StatefulDataLoader: not the user's business.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class _TokenDataModule(L.LightningDataModule):
    """Shared plumbing: settings, corpus or synthetic windows, splits and loaders."""

    def __init__(
        self,
        path: Optional[PathLike] = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
        num_workers: int = 0,
        synthetic: bool = False,
        synthetic_vocab: int = ByteTokenizer.vocab_size,
        synthetic_samples: int = DEFAULT_SYNTHETIC_SAMPLES,
        seed: int = 0,
        max_seq_len: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_seq_len(seq_len, max_seq_len)
        check_positive("batch_size", batch_size)
        check_fraction("val_fraction", val_fraction, low_open=False)
        if max_bytes is not None:
            check_positive("max_bytes", max_bytes)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers!r}: must be an integer >= 0")
        if synthetic:
            check_positive("synthetic_vocab", synthetic_vocab)
            check_positive("synthetic_samples", synthetic_samples)
            if synthetic_samples < batch_size:
                raise ValueError(
                    f"data.synthetic_samples={synthetic_samples} is less than data.batch_size={batch_size}: "
                    "the training loader (drop_last=True) would yield no batch"
                )
        elif path is not None and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"data.path={str(path)!r}: no such file or directory")

        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.synthetic = synthetic
        self.synthetic_vocab = synthetic_vocab
        self.synthetic_samples = synthetic_samples
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.tokenizer = ByteTokenizer()
        self.vocab_size = synthetic_vocab if synthetic else ByteTokenizer.vocab_size
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None

    # ---- what the subclasses decide -------------------------------------------------------------
    @property
    def window_len(self) -> int:
        """Tokens per raw window (seq_len + 1 for next-token targets)."""
        raise NotImplementedError

    def _samples(self, windows: Dataset, stream: int) -> Dataset:
        raise NotImplementedError

    # ---- setup ----------------------------------------------------------------------------------
    def _windows(self) -> tuple[Dataset, Dataset]:
        if self.synthetic:
            n_val = max(1, round(self.synthetic_samples * self.val_fraction)) if self.val_fraction > 0 else 0
            make = lambda n, stream: RandomWindows(n, self.window_len, self.synthetic_vocab, self.seed, stream)
            return make(self.synthetic_samples, seeding.TRAIN), make(n_val, seeding.VAL)
        train, val = split_corpus(read_corpus(self.path, self.max_bytes), self.val_fraction)
        # One byte per token: keep the stream as uint8 (8x smaller than int64).
        as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
        # Stride seq_len: inputs never overlap; a causal window's extra token is the next one's first.
        make = lambda b: StreamWindows(as_tensor(b), self.window_len, stride=self.seq_len)
        return make(train), make(val)

    def _check_windows(self, train: Dataset, val: Dataset) -> None:
        source = "the standard library" if self.path is None else repr(str(self.path))
        if len(train) == 0:
            raise ValueError(
                f"data.seq_len={self.seq_len}: the training split of data.path={source} is too short for "
                f"one window of {self.window_len} tokens; lower data.seq_len or give more text "
                f"(data.path, data.max_bytes)"
            )
        if len(train) < self.batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size}: the training split of data.path={source} holds only "
                f"{len(train)} windows of data.seq_len={self.seq_len}, so no full batch (drop_last=True); "
                f"lower data.batch_size or data.seq_len, or give more text"
            )
        if self.val_fraction > 0 and len(val) == 0:
            raise ValueError(
                f"data.val_fraction={self.val_fraction}: the validation split of data.path={source} is too "
                f"short for one window of {self.window_len} tokens; raise data.val_fraction, lower "
                f"data.seq_len, or set data.val_fraction=0 for no validation"
            )

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return  # idempotent: Lightning calls setup once per stage
        train, val = self._windows()
        self._check_windows(train, val)
        self.train_dataset = self._samples(train, seeding.TRAIN)
        self.val_dataset = self._samples(val, seeding.VAL) if len(val) else None

    # ---- loaders --------------------------------------------------------------------------------
    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        if not train:
            return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
        # Resumable bit for bit: torchdata's StatefulDataLoader puts the epoch and the position within
        # it into Lightning's checkpoints. Every stage of a pipeline draws the same batches; replicas
        # (width > 1) draw their own shard.
        strategy = self.trainer.strategy if self.trainer is not None else None
        shard = strategy.distributed_sampler_kwargs if strategy is not None and strategy.is_distributed else {}
        return StatefulDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=ResumableSampler(dataset, self.seed, **shard),
            # Pipelines split each batch into micro-batches; a short last batch could hold too few.
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> Union[DataLoader, list]:
        self.setup("validate")
        # An empty list tells Lightning there is no validation (data.val_fraction=0).
        return [] if self.val_dataset is None else self._loader(self.val_dataset, train=False)


class CausalLMDataModule(_TokenDataModule):
    """Next-token prediction. Batches: ``(input_ids (B, T) int64, targets (B, T) int64)``.

    Samples are windows of ``seq_len + 1`` tokens; ``targets[t] == input_ids[t + 1]`` within a window.
    """

    @property
    def window_len(self) -> int:
        return self.seq_len + 1

    def _samples(self, windows: Dataset, stream: int) -> Dataset:
        return CausalLMDataset(windows)


class MaskedLMDataModule(_TokenDataModule):
    """Masked-token prediction (BERT). Batches: ``(input_ids, attention_mask, labels)``, each (B, T) int64.

    Every sample predicts exactly ``k = max(1, round(mask_prob * seq_len))`` positions (labels are
    -100 elsewhere), so a token-mean loss equals the mean of per-sample means.
    """

    def __init__(
        self,
        path: Optional[PathLike] = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
        num_workers: int = 0,
        synthetic: bool = False,
        synthetic_vocab: int = ByteTokenizer.vocab_size,
        synthetic_samples: int = DEFAULT_SYNTHETIC_SAMPLES,
        seed: int = 0,
        max_seq_len: Optional[int] = None,
        mask_prob: float = 0.15,
    ) -> None:
        check_fraction("mask_prob", mask_prob, low_open=True)
        # The MASK id must be a valid input id for the model's embedding.
        if synthetic and synthetic_vocab <= ByteTokenizer.MASK:
            raise ValueError(
                f"data.synthetic_vocab={synthetic_vocab}: masked LM needs > {ByteTokenizer.MASK} ids "
                f"so the MASK id {ByteTokenizer.MASK} is a valid token"
            )
        super().__init__(
            path,
            seq_len,
            batch_size,
            val_fraction,
            max_bytes,
            num_workers,
            synthetic,
            synthetic_vocab,
            synthetic_samples,
            seed,
            max_seq_len,
        )
        self.mask_prob = mask_prob

    @property
    def window_len(self) -> int:
        return self.seq_len

    def _samples(self, windows: Dataset, stream: int) -> Dataset:
        # Random replacements are ordinary tokens: bytes for text, the whole vocabulary when synthetic.
        num_random = self.synthetic_vocab if self.synthetic else ByteTokenizer.NUM_BYTES
        return MaskedLMDataset(windows, self.mask_prob, self.seed, stream, ByteTokenizer.MASK, num_random)
