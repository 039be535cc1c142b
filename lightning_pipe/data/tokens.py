"""Token streams of a corpus, and token files: a corpus tokenized once, read through a memory map.

A corpus is tokenized piece by piece (`corpus.iter_corpus`: about 1 MiB, cut after a newline), the
same way in memory (`data.path` + `data.tokenizer`) and into a file (`python -m
lightning_pipe.data.tokenize`), so both give the same ids, the same train/validation split (the last
`val_fraction` of the tokens) and the same windows.

A token file is the flat ids, little-endian ``uint16`` (vocabularies up to 65536 ids) or ``uint32``,
and a JSON sidecar ``<file>.json``: format, dtype, token count, the tokenizer's `TokenizerInfo`
(vocabulary size, special ids, sha256 of its tokenizer.json) and the corpus it was made from. Both
are written to temporary files and renamed into place, so an interrupted run leaves nothing
half-written behind (and an old pair stays as it was).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .corpus import PathLike
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerInfo

FORMAT = "lightning-pipe-tokens"
VERSION = 1
_ENCODE_BATCH = 8  # corpus pieces encoded together (the tokenizers library spreads them over threads)
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

Tokenizer = Union[ByteTokenizer, HFTokenizer]


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored type for ids below `vocab_size`: "uint16" up to 65536 ids, else "uint32"."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def token_chunks(tokenizer: Tokenizer, pieces: Iterable[bytes]) -> Iterator[np.ndarray]:
    """The ids of the corpus `pieces` (`corpus.iter_corpus`), one array per piece, in order.

    Bytes are their own ids (uint8); a Hugging Face tokenizer encodes each piece as UTF-8 text
    (invalid bytes become U+FFFD), several pieces at a time.
    """
    if isinstance(tokenizer, ByteTokenizer):
        for piece in pieces:
            yield np.frombuffer(piece, dtype=np.uint8)
        return
    batch: list[str] = []
    for piece in pieces:
        batch.append(piece.decode("utf-8", errors="replace"))
        if len(batch) == _ENCODE_BATCH:
            yield from (np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(batch))
            batch = []
    if batch:
        yield from (np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(batch))


def encode_corpus(tokenizer: Tokenizer, pieces: Iterable[bytes]) -> Tensor:
    """All ids of `pieces` in memory: uint8 for bytes (one byte per token), else int32."""
    arrays = list(token_chunks(tokenizer, pieces))
    dtype = np.uint8 if isinstance(tokenizer, ByteTokenizer) else np.int32
    joined = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(joined))


def sidecar_path(path: PathLike) -> Path:
    return Path(str(Path(path).expanduser()) + ".json")


def write_token_file(
    out: PathLike, chunks: Iterable[np.ndarray], info: TokenizerInfo, corpus: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Write the ids of `chunks` to `out` and the sidecar ``<out>.json``; returns the sidecar's content.

    `corpus` (a record of the source, into the sidecar) is read after the last chunk, so the chunks'
    producer may fill it in as it goes (the bytes it read).

    Both go to temporary files in the same folder first and are renamed into place only once all ids
    are written: an error or an interrupt leaves no file behind (and an existing pair as it was). The
    old sidecar is removed just before the renames, so even a crash between them leaves a token file
    without a sidecar, which is refused, never one paired with another file's sidecar.
    """
    out = Path(out).expanduser()
    if out.is_dir():
        raise IsADirectoryError(f"--out={str(out)!r} is a folder; give a file name such as tokens.bin")
    out.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(out)
    name = token_dtype(info.vocab_size)
    dtype = _DTYPES[name]
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp_side = out.with_name(f".{side.name}.{os.getpid()}.tmp")
    try:
        count = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                if chunk.size == 0:
                    continue
                low, high = int(chunk.min()), int(chunk.max())
                if low < 0 or high >= info.vocab_size:
                    raise ValueError(
                        f"token id {high if high >= info.vocab_size else low} is outside [0, {info.vocab_size}) of {info.describe()}"
                    )
                f.write(chunk.astype(dtype, copy=False).tobytes())
                count += chunk.size
            f.flush()
            os.fsync(f.fileno())
        if count == 0:
            raise ValueError(f"no tokens to write to {str(out)!r}: the corpus is empty")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": name,
            "byte_order": "little",
            "count": count,
            "vocab_size": info.vocab_size,
            "tokenizer": info.to_json(),
            "corpus": corpus or {},
        }
        tmp_side.write_text(json.dumps(meta, indent=2) + "\n")
        side.unlink(missing_ok=True)
        os.replace(tmp, out)
        os.replace(tmp_side, side)
        return meta
    finally:
        tmp.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)


class TokenFile:
    """A token file, checked against its sidecar and read through a read-only memory map.

    The map is opened on first use in each process (it is not pickled: spawned ranks and DataLoader
    workers open their own), so the ids are paged in as windows are read, never loaded whole.
    """

    def __init__(self, path: PathLike, setting: str = "data.tokens") -> None:
        self.path = Path(path).expanduser()
        where = self.where = f"{setting}={str(path)!r}"
        if not self.path.is_file():
            raise FileNotFoundError(f"{where}: no such file (python -m lightning_pipe.data.tokenize writes one)")
        side = sidecar_path(self.path)
        redo = "run python -m lightning_pipe.data.tokenize again"
        if not side.is_file():
            raise ValueError(
                f"{where}: its sidecar {side.name} is missing (not written by python -m lightning_pipe.data.tokenize, or cut off); {redo}"
            )
        try:
            meta = json.loads(side.read_text())
            ok = isinstance(meta, dict) and meta.get("format") == FORMAT
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ok = False
        if not ok:
            raise ValueError(f"{where}: its sidecar {side.name} is not a token file's description ({FORMAT}); {redo}")
        if meta.get("version") != VERSION or meta.get("dtype") not in _DTYPES:
            raise ValueError(
                f"{where}: version {meta.get('version')!r}, dtype {meta.get('dtype')!r}: this lightning-pipe reads version {VERSION}, uint16 or uint32; {redo}"
            )
        self.meta, self.dtype, self.count = meta, _DTYPES[meta["dtype"]], int(meta["count"])
        self.info = TokenizerInfo.from_json(meta["tokenizer"])
        size = self.path.stat().st_size
        if size != self.count * self.dtype.itemsize or self.count < 1:
            raise ValueError(
                f"{where}: {size} bytes, but its sidecar says {self.count} {meta['dtype']} tokens "
                f"({self.count * self.dtype.itemsize} bytes): the file was cut or replaced; {redo}"
            )
        self._map: Optional[np.memmap] = None

    def array(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))
        return self._map

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


class TokenSlice:
    """Tokens ``[start, stop)`` of a `TokenFile`: a 1-D token source for `StreamWindows` (`dim`,
    `numel`, slicing to an int64 tensor) that reads only the slices asked for."""

    def __init__(self, file: TokenFile, start: int = 0, stop: Optional[int] = None) -> None:
        stop = len(file) if stop is None else stop
        if not 0 <= start <= stop <= len(file):
            raise ValueError(f"slice [{start}, {stop}) outside the {len(file)} tokens of {file.path}")
        self.file, self.start, self.stop = file, start, stop

    def dim(self) -> int:
        return 1

    def numel(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, index: slice) -> Tensor:
        if not isinstance(index, slice):
            raise TypeError("a TokenSlice is read by slices")
        start, stop, step = index.indices(self.numel())
        if step != 1:
            raise ValueError("a TokenSlice is read by contiguous slices")
        ids = self.file.array()[self.start + start : self.start + max(start, stop)]
        return torch.from_numpy(ids.astype(np.int64))
