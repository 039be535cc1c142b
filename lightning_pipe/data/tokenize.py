"""`python -m lightning_pipe.data.tokenize --out tokens.bin [--tokenizer tok.json] [--path corpus]`:
tokenize a corpus once into a token file that training reads through a memory map (`data.tokens=`).

The corpus is the data module's (the Python standard library's source by default, or a text file or
folder), read and encoded piece by piece, so it may be larger than memory; `--max-bytes` caps it as
`data.max_bytes` does (default: no cap). The ids are those `data.path=... data.tokenizer=...` would
train on in memory: the same windows and train/validation split. Writes `tokens.bin` (uint16 ids for
vocabularies up to 65536, else uint32) and its sidecar `tokens.bin.json` (dtype, count, vocabulary
size, the tokenizer's identity, the corpus), through temporary files renamed into place: an
interrupted run leaves nothing behind. Without `--tokenizer` the ids are bytes (the default tokenizer).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from . import _command
from .corpus import PathLike, iter_corpus, stdlib_root
from .tokenizer import load_tokenizer
from .tokens import token_chunks, write_token_file


def tokenize_corpus(
    out: PathLike, tokenizer: Optional[PathLike] = None, path: Optional[PathLike] = None, max_bytes: Optional[int] = None
) -> dict[str, Any]:
    """Write the token file `out` (and its sidecar) for the corpus at `path` (None: the stdlib),
    tokenized by the tokenizer.json `tokenizer` (None: bytes); returns the sidecar's content."""
    tok = load_tokenizer(tokenizer, setting="--tokenizer")
    corpus = {"path": str(stdlib_root()) if path is None else str(path), "stdlib": path is None, "max_bytes": max_bytes, "bytes": 0}

    def pieces():
        for piece in iter_corpus(path, max_bytes):
            corpus["bytes"] += len(piece)  # the sidecar's record is written after the last piece
            yield piece

    return write_token_file(out, token_chunks(tok, pieces()), tok.info, corpus)


def _main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.data.tokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the token file to write (its sidecar: <out>.json)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the byte tokenizer)")
    parser.add_argument("--path", default=None, help="a text file or folder (default: the Python standard library's source)")
    parser.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes (default: all)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    meta = tokenize_corpus(args.out, args.tokenizer, args.path, args.max_bytes)
    n, size = meta["count"], meta["count"] * (2 if meta["dtype"] == "uint16" else 4)
    made_with = "bytes" if args.tokenizer is None else f"{args.tokenizer} (sha256 {meta['tokenizer']['sha256'][:12]})"
    corpus = "the standard library" if args.path is None else args.path
    print(
        f"wrote {args.out}: {n:,} tokens ({meta['dtype']}, {size / 2**20:.1f} MiB) of {made_with}, vocab {meta['vocab_size']}, "
        f"from {meta['corpus']['bytes']:,} bytes of {corpus} ({meta['corpus']['bytes'] / n:.2f} bytes/token) "
        f"in {time.perf_counter() - start:.1f} s; sidecar {args.out}.json"
    )


def main(argv: Optional[list[str]] = None) -> int:
    return _command.run(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
