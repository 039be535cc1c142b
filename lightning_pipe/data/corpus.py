"""Raw text corpora as bytes: the interpreter's standard library by default, or a user path.

The default corpus exists offline on every machine that runs Python, so examples and tests need
no download. Everything is read in a fixed (sorted) order, so a corpus is a deterministic function
of its path, `max_bytes` and the interpreter.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

DEFAULT_MAX_BYTES = 8 * 2**20

PathLike = Union[str, "os.PathLike[str]"]

# Third-party code, caches and the (huge, repetitive) test suites are not the library's prose.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
# Folders of a user's corpus: skip VCS metadata and caches, not content.
_USER_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
_SNIFF_BYTES = 8192


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sorted_files(root: Path, skip_dirs: frozenset[str], suffix: Optional[str] = None) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            found.append(Path(dirpath, name))
    # Sort by path components, not by walk order: the order must not depend on the file system.
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files (no site-packages, no test suites), sorted."""
    return _sorted_files(stdlib_root(), _STDLIB_SKIP_DIRS, suffix=".py")


def _is_text(path: Path) -> bool:
    """The same heuristic as git and grep: a binary file holds a NUL byte in its first 8 KiB."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(_SNIFF_BYTES)


def _listing(path: Optional[PathLike]) -> tuple[list[Path], list[Path]]:
    """(text files, binary files) of the corpus at `path`, in order. A file given alone is judged as
    a folder's files are: a binary one is not read either way."""
    if path is None:
        return stdlib_files(), []
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.path={str(path)!r}: no such file or directory")
    texts, binaries = [], []
    for f in _sorted_files(p, _USER_SKIP_DIRS) if p.is_dir() else [p]:
        try:
            (texts if _is_text(f) else binaries).append(f)
        except OSError:
            if not p.is_dir():
                raise  # the file asked for: its own error (permission, ...)
            # in a folder: an unreadable file is skipped, as it always was
    return texts, binaries


def corpus_files(path: Optional[PathLike] = None) -> list[Path]:
    """The files a corpus reads, in order: the stdlib for ``None``, a text file, or a folder's
    text files (binary files, found as git and grep find them, are not read)."""
    return _listing(path)[0]


BLOCK_BYTES = 2**20


def iter_corpus(
    path: Optional[PathLike] = None, max_bytes: Optional[int] = DEFAULT_MAX_BYTES, block_bytes: int = BLOCK_BYTES
) -> Iterator[bytes]:
    """The bytes of `read_corpus(path, max_bytes)` as pieces of about `block_bytes` (under twice that),
    read as they are consumed (a corpus larger than memory streams through).

    A piece never spans two files and ends after a newline where it holds one, so it splits no line
    (nor a UTF-8 character) unless a line is longer than a block or the cap cuts it. The pieces depend
    only on the corpus, `max_bytes` and `block_bytes`: what tokenizes them piece by piece
    (`lightning_pipe.data.tokens`) gives the same ids in memory and into a token file.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"data.max_bytes={max_bytes}: must be >= 1 (or None for no cap)")
    files, binaries = _listing(path)
    left, total = max_bytes, 0
    for f in files:
        if left is not None and left <= 0:
            break
        with open(f, "rb") as fh:
            carry = b""
            while True:
                want = block_bytes if left is None else min(block_bytes, left)
                data = fh.read(want) if want > 0 else b""
                if left is not None:
                    left -= len(data)
                total += len(data)
                buf = carry + data
                if len(data) < block_bytes:  # end of the file, or of the cap
                    if buf:
                        yield buf
                    break
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    yield buf  # one line longer than a block
                    carry = b""
                else:
                    yield buf[:cut]
                    carry = buf[cut:]
    if total == 0:
        _refuse_empty(path, binaries)


def read_corpus(path: Optional[PathLike] = None, max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> bytes:
    """All bytes of the corpus at `path` (``None``: the standard library), concatenated in order.

    Reading stops after `max_bytes` (``None``: no cap); the last file may be cut. A corpus with no
    text is refused; when binary files are all there is (a binary file given alone, or a folder of
    them), the message names them, the same either way.
    """
    return b"".join(iter_corpus(path, max_bytes))


def _refuse_empty(path: Optional[PathLike], binaries: list[Path]) -> None:
    where = f"the standard library at {stdlib_root()}" if path is None else repr(str(path))
    if binaries:
        shown = ", ".join(str(b) for b in binaries[:3]) + (f" and {len(binaries) - 3} more" if len(binaries) > 3 else "")
        raise ValueError(
            f"data.path={where}: the corpus is empty: {shown} {'is a binary file' if len(binaries) == 1 else 'are binary files'} "
            f"(a NUL byte in the first {_SNIFF_BYTES} bytes, as git and grep decide), and binary files are not read; "
            "give a text file or a folder of text files"
        )
    raise ValueError(f"data.path={where}: the corpus is empty (no text files or no bytes to train on)")


def split_corpus(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """(train, validation): the validation split is the last `val_fraction` of the bytes.

    A contiguous tail rather than a random sample: windows never straddle the two splits, so they
    are disjoint, and the split needs no seed.
    """
    cut = split_point(len(data), val_fraction)
    return data[:cut], data[cut:]


def split_point(n: int, val_fraction: float) -> int:
    """Where the validation split starts in a stream of `n` bytes or tokens: its last
    `int(n * val_fraction)` are validation (token streams split by the same rule)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction}: must be in [0, 1)")
    return n - int(n * val_fraction)
