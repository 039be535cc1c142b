"""LightningDataModules for causal and masked language modelling on text.

Text is tokenized by the byte tokenizer (the default) or a Hugging Face tokenizer.json
(`data.tokenizer`), or comes pre-tokenized from a memory-mapped token file (`data.tokens`, written
by `python -m lightning_pipe.data.tokenize`). The corpus is read in `setup` (on every rank,
deterministically) rather than in `__init__`, so the module stays small when Lightning pickles it to
spawned processes; cheap checks (settings, that the files exist, the tokenizer against the token
file and the model's vocabulary) run in `__init__` to fail before anything is launched.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Union

import lightning as L
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from . import seeding
from .checks import check_fraction, check_model_vocab, check_positive, check_seq_len, check_vocab
from .corpus import DEFAULT_MAX_BYTES, PathLike, iter_corpus, split_point
from .datasets import CausalLMDataset, MaskedLMDataset
from .sampling import ResumableSampler
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerInfo, load_tokenizer
from .tokens import TokenFile, TokenSlice, encode_corpus
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
        tokenizer: Optional[PathLike] = None,
        tokens: Optional[PathLike] = None,
        model_vocab_size: Optional[int] = None,
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
            if tokenizer is not None or tokens is not None:
                raise ValueError(
                    "data.synthetic=true draws random ids: data.tokenizer and data.tokens do not apply (set them to null, or data.synthetic=false)"
                )
        elif tokens is not None and path is not None:
            raise ValueError(
                f"data.tokens={str(tokens)!r} and data.path={str(path)!r}: a token file is a tokenized corpus already; give one of them"
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
        # A missing tokenizers package, tokenizer.json or token file, or a file made with another
        # tokenizer: an error now, in the launching process.
        self.tokenizer: Optional[Union[ByteTokenizer, HFTokenizer]] = load_tokenizer(tokenizer)
        self.token_file = TokenFile(tokens) if tokens is not None else None
        self.tokenizer_setting = "data.tokenizer=null (the byte tokenizer)" if tokenizer is None else f"data.tokenizer={str(tokenizer)!r}"
        self.token_info: TokenizerInfo = self.tokenizer.info
        if self.token_file is not None:
            made_with = self.token_file.info
            if tokenizer is not None and not made_with.same_as(self.tokenizer.info):
                raise ValueError(
                    f"data.tokens={str(tokens)!r} was written with {made_with.describe()}, but {self.tokenizer_setting} is "
                    f"{self.tokenizer.info.describe()}: tokenize again with --tokenizer {tokenizer}, or set data.tokenizer to the "
                    "file it was made with (or to null: the token file's sidecar describes its tokenizer)"
                )
            self.token_info = made_with
            if tokenizer is None and made_with.kind != "bytes":
                self.tokenizer = None  # the ids need no tokenizer; set data.tokenizer to decode them
        self.vocab_size = synthetic_vocab if synthetic else self.token_info.vocab_size
        check_vocab(self.vocab_size, model_vocab_size, self.vocab_source)
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None

    @property
    def vocab_source(self) -> str:
        """Where the ids come from, as the setting to change (for the vocabulary check's message)."""
        if self.synthetic:
            return f"data.synthetic_vocab={self.synthetic_vocab}"
        if self.token_file is not None:
            return f"{self.token_file.where} (written with {self.token_info.describe()})"
        return self.tokenizer_setting

    @property
    def corpus_source(self) -> str:
        if self.token_file is not None:
            return self.token_file.where
        return "data.path=" + ("the standard library" if self.path is None else repr(str(self.path)))

    # ---- what the subclasses decide -------------------------------------------------------------
    @property
    def window_len(self) -> int:
        """Tokens per raw window (seq_len + 1 for next-token targets)."""
        raise NotImplementedError

    @property
    def stride(self) -> int:
        """Tokens between window starts: inputs never overlap; a causal window's extra token is the next one's first."""
        return self.seq_len

    def _samples(self, windows: Dataset, stream: int) -> Dataset:
        raise NotImplementedError

    # ---- setup ----------------------------------------------------------------------------------
    def _windows(self) -> tuple[Dataset, Dataset]:
        if self.synthetic:
            n_val = max(1, round(self.synthetic_samples * self.val_fraction)) if self.val_fraction > 0 else 0
            make = lambda n, stream: RandomWindows(n, self.window_len, self.synthetic_vocab, self.seed, stream)
            return make(self.synthetic_samples, seeding.TRAIN), make(n_val, seeding.VAL)
        # The validation split is the stream's last val_fraction of tokens (bytes: of bytes).
        if self.token_file is not None:  # memory-mapped: windows read their slices only
            n = len(self.token_file)
            cut = split_point(n, self.val_fraction)
            train, val = TokenSlice(self.token_file, 0, cut), TokenSlice(self.token_file, cut, n)
        else:  # in memory, compact: one byte per token for bytes (uint8), int32 otherwise
            stream = encode_corpus(self.tokenizer, iter_corpus(self.path, self.max_bytes))
            cut = split_point(stream.numel(), self.val_fraction)
            train, val = stream[:cut], stream[cut:]
        return StreamWindows(train, self.window_len, self.stride), StreamWindows(val, self.window_len, self.stride)

    def _check_windows(self, train: Dataset, val: Dataset) -> None:
        source = self.corpus_source
        if len(train) == 0:
            raise ValueError(
                f"data.seq_len={self.seq_len}: the training split of {source} is too short for "
                f"one window of {self.window_len} tokens; lower data.seq_len or give more text "
                f"(data.path, data.max_bytes)"
            )
        if len(train) < self.batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size}: the training split of {source} holds only "
                f"{len(train)} windows of data.seq_len={self.seq_len}, so no full batch (drop_last=True); "
                f"lower data.batch_size or data.seq_len, or give more text"
            )
        if self.val_fraction > 0 and len(val) == 0:
            raise ValueError(
                f"data.val_fraction={self.val_fraction}: the validation split of {source} is too "
                f"short for one window of {self.window_len} tokens; raise data.val_fraction, lower "
                f"data.seq_len, or set data.val_fraction=0 for no validation"
            )

    def setup(self, stage: Optional[str] = None) -> None:
        if self.trainer is not None:  # fit(model, datamodule=...) from Python: the model's vocabulary against the data's
            check_model_vocab(self.trainer.lightning_module, self)
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
        # (a single-device strategy has no is_distributed)
        shard = strategy.distributed_sampler_kwargs if getattr(strategy, "is_distributed", False) else {}
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
    -100 elsewhere), so a token-mean loss equals the mean of per-sample means. With a tokenizer.json
    (or a token file made with one) it must have a mask token (``<mask>`` or ``[MASK]``); random
    replacements are its ordinary (not special) ids. Windows are full slices of the token stream, so
    nothing is padding. A tokenizer with [CLS] and [SEP] (``<cls>``/``<sep>``, as
    ``lightning_pipe.data.train_tokenizer`` writes) frames each sample as BERT's input is framed:
    ``[CLS] + seq_len - 2 stream tokens + [SEP]``, predicted positions drawn from the inner ones
    (k counted on them). The byte vocabulary has no such tokens, so its windows stay unframed.
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
        tokenizer: Optional[PathLike] = None,
        tokens: Optional[PathLike] = None,
        model_vocab_size: Optional[int] = None,
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
            tokenizer=tokenizer,
            tokens=tokens,
            model_vocab_size=model_vocab_size,
        )
        self.mask_prob = mask_prob
        special = self.token_info.special
        self.frame = (special["cls"], special["sep"]) if not synthetic and "cls" in special and "sep" in special else None
        if self.frame is not None and seq_len < 3:
            raise ValueError(f"data.seq_len={seq_len}: a framed sample ([CLS] ... [SEP]) needs at least 3 tokens")
        if not synthetic and self.token_info.kind != "bytes" and "mask" not in self.token_info.special:
            raise ValueError(
                f"{self.vocab_source}: masked LM needs a mask token (<mask> or [MASK]) among the tokenizer's special tokens; "
                "python -m lightning_pipe.data.train_tokenizer adds one"
            )

    @property
    def window_len(self) -> int:
        return self.seq_len - 2 if self.frame is not None else self.seq_len

    @property
    def stride(self) -> int:
        return self.window_len

    def _samples(self, windows: Dataset, stream: int) -> Dataset:
        # Random replacements are ordinary tokens: bytes for text, the whole vocabulary when synthetic,
        # a tokenizer's ids that are not special (looked up in a table of them).
        if self.synthetic or self.token_info.kind == "bytes":
            num_random = self.synthetic_vocab if self.synthetic else ByteTokenizer.NUM_BYTES
            return MaskedLMDataset(windows, self.mask_prob, self.seed, stream, ByteTokenizer.MASK, num_random)
        ordinary = self.token_info.ordinary_ids()
        mask_id = self.token_info.special["mask"]
        return MaskedLMDataset(windows, self.mask_prob, self.seed, stream, mask_id, len(ordinary), ordinary, self.frame)
