"""`python -m lightning_pipe.data.train_tokenizer --out tok.json --vocab-size N [--path corpus]`:
train a byte-level BPE tokenizer (GPT-2's scheme) on a local corpus, offline.

The corpus is the data module's: the Python standard library's source by default, or a text file or
folder (`--path`), capped at `--max-bytes`. The tokenizer starts from the 256 byte symbols (any text
encodes, nothing is unknown), adds the special tokens ``<|endoftext|>``, ``<pad>``, ``<mask>``,
``<cls>``, ``<sep>`` (ids 0-4) and learns merges until it holds `--vocab-size` ids (fewer if the
corpus runs out of pairs seen `--min-frequency` times). Training is deterministic: the same corpus
and settings give the same file. It is written to a temporary file and renamed into place. Needs the
optional `tokenizers` package: ``pip install "lightning-pipe[tokenizers]"``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Optional

from . import _command
from .corpus import DEFAULT_MAX_BYTES, PathLike, iter_corpus
from .tokenizer import HFTokenizer, import_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<mask>", "<cls>", "<sep>")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(
    out: PathLike,
    vocab_size: int,
    path: Optional[PathLike] = None,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
    min_frequency: int = 2,
) -> HFTokenizer:
    """Train a byte-level BPE on the corpus at `path` (None: the stdlib), save it to `out`, return it loaded."""
    return _train(out, vocab_size, path, max_bytes, min_frequency)[0]


def _train(
    out: PathLike, vocab_size: int, path: Optional[PathLike], max_bytes: Optional[int], min_frequency: int
) -> tuple[HFTokenizer, int]:
    """(the tokenizer, the corpus bytes it was trained on)."""
    tokenizers = import_tokenizers("python -m lightning_pipe.data.train_tokenizer")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(
            f"--vocab-size={vocab_size}: must be at least {MIN_VOCAB} (256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
        )
    if min_frequency < 1:
        raise ValueError(f"--min-frequency={min_frequency}: must be >= 1")
    out = Path(out).expanduser()
    if out.is_dir():
        raise IsADirectoryError(f"--out={str(out)!r} is a folder; give a file name such as tok.json")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    read = 0

    def texts():
        nonlocal read
        for piece in iter_corpus(path, max_bytes):
            read += len(piece)
            yield piece.decode("utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tok.save(str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return HFTokenizer(out, setting="--out"), read


def _main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.data.train_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    parser.add_argument(
        "--vocab-size", type=int, required=True, help=f"ids in all (>= {MIN_VOCAB}); the model's vocab_size must be at least this"
    )
    parser.add_argument("--path", default=None, help="a text file or folder (default: the Python standard library's source)")
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help=f"read at most this many bytes (default {DEFAULT_MAX_BYTES})"
    )
    parser.add_argument("--min-frequency", type=int, default=2, help="a merge must be seen this often (default 2)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tok, read = _train(args.out, args.vocab_size, args.path, args.max_bytes, args.min_frequency)
    corpus = "the standard library" if args.path is None else args.path
    print(
        f"wrote {args.out}: byte-level BPE, {tok.vocab_size} ids (256 bytes, {tok.vocab_size - MIN_VOCAB} merges, "
        f"special {', '.join(f'{r}={i}' for r, i in sorted(tok.info.special.items()))}), sha256 {tok.sha256[:12]}, "
        f"trained on {read:,} bytes of {corpus} in {time.perf_counter() - start:.1f} s"
    )


def main(argv: Optional[list[str]] = None) -> int:
    return _command.run(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
