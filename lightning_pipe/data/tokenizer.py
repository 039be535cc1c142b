"""Tokenizers: the byte-level default (every UTF-8 byte is a token, so nothing is ever downloaded
or unknown) and a Hugging Face ``tokenizer.json`` (`data.tokenizer=...`, the optional `tokenizers`
package: ``pip install "lightning-pipe[tokenizers]"``).

Both describe themselves by a `TokenizerInfo` (vocabulary size, special ids, identity), which token
files store beside their ids, so a file and the tokenizer or model it is used with can be checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

TOKENIZERS_EXTRA = 'pip install "lightning-pipe[tokenizers]"'

# Special tokens by role, in the spellings of common tokenizers (ours first: train_tokenizer adds them).
SPECIAL_SPELLINGS: dict[str, tuple[str, ...]] = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
    "mask": ("<mask>", "[MASK]", "<|mask|>"),
    "cls": ("<cls>", "[CLS]", "<s>"),
    "sep": ("<sep>", "[SEP]", "</s>"),
    "bos": ("<|endoftext|>", "<s>", "<bos>", "<|begin_of_text|>", "[CLS]"),
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"),
}


@dataclass(frozen=True)
class TokenizerInfo:
    """What the data needs to know of a tokenizer, and what a token file records of the one that made it.

    `vocab_size` is one more than the largest id (the rows the model's embedding needs); `special`
    maps roles (pad, mask, cls, sep, bos, eos) to ids; `special_ids` are all special ids, which masked
    LM never draws as random replacements. `sha256` (of the tokenizer.json's bytes) identifies a
    Hugging Face tokenizer; the byte tokenizer has none.
    """

    kind: str  # "bytes" | "huggingface"
    vocab_size: int
    special: dict[str, int] = field(default_factory=dict)
    special_ids: tuple[int, ...] = ()
    sha256: Optional[str] = None
    name: Optional[str] = None  # the file it was read from (informative only: the sha256 decides)

    def describe(self) -> str:
        if self.kind == "bytes":
            return f"the byte tokenizer ({self.vocab_size} ids)"
        return f"tokenizer {self.name or '?'}, sha256 {(self.sha256 or '?')[:12]}, {self.vocab_size} ids"

    def same_as(self, other: "TokenizerInfo") -> bool:
        return (self.kind, self.vocab_size, self.sha256) == (other.kind, other.vocab_size, other.sha256)

    def ordinary_ids(self) -> Tensor:
        """The ids that are not special, ascending (masked LM's random replacements)."""
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[list(self.special_ids)] = False
        return keep.nonzero().flatten()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "special": dict(self.special),
            "special_ids": list(self.special_ids),
            "sha256": self.sha256,
            "name": self.name,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TokenizerInfo":
        return cls(
            kind=str(d["kind"]),
            vocab_size=int(d["vocab_size"]),
            special={str(k): int(v) for k, v in d.get("special", {}).items()},
            special_ids=tuple(int(i) for i in d.get("special_ids", ())),
            sha256=d.get("sha256"),
            name=d.get("name"),
        )


class ByteTokenizer:
    """Ids 0..255 are bytes; the special ids follow them.

    Byte ids fit in ``uint8``, which lets corpora be stored at one byte per token.
    """

    PAD = 256
    MASK = 257
    BOS = 258
    EOS = 259
    NUM_BYTES = 256
    vocab_size = 260

    pad_id = PAD
    mask_id = MASK
    bos_id = BOS
    eos_id = EOS
    cls_id = None
    sep_id = None
    info = TokenizerInfo(
        kind="bytes", vocab_size=vocab_size, special={"pad": PAD, "mask": MASK, "bos": BOS, "eos": EOS}, special_ids=(PAD, MASK, BOS, EOS)
    )

    def encode(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([self.BOS] if add_bos else []) + list(data) + ([self.EOS] if add_eos else [])

    def encode_tensor(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> Tensor:
        """`encode` as an int64 tensor, built without a Python list (fast for megabytes of text)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        # bytearray: frombuffer warns on read-only buffers such as bytes.
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        parts = [torch.tensor([self.BOS])] if add_bos else []
        parts.append(ids.long())
        if add_eos:
            parts.append(torch.tensor([self.EOS]))
        return torch.cat(parts)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """Bytes back to text; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {self.vocab_size})")
            if i < self.NUM_BYTES:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def import_tokenizers(setting: str) -> Any:
    """The `tokenizers` package, or one line saying how to install it (`setting`: what asked for it)."""
    try:
        import tokenizers
    except ImportError:
        raise ModuleNotFoundError(
            f"{setting} needs the Hugging Face tokenizers package, which is not installed: {TOKENIZERS_EXTRA}", name="tokenizers"
        ) from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, read by the `tokenizers` library.

    Text is encoded without the tokenizer's post-processing (no [CLS]/[SEP] templates: corpora are one
    stream of ids) and with special tokens spelled in the text treated as text (``<mask>`` in a source
    file is never the mask id). Pickles as its JSON (spawned processes, DataLoader workers).
    """

    def __init__(self, path: str | Path, setting: str = "data.tokenizer") -> None:
        where = f"{setting}={str(path)!r}"
        tokenizers = import_tokenizers(where)
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"{where}: no such file (a tokenizer.json; python -m lightning_pipe.data.train_tokenizer makes one)")
        raw = p.read_bytes()
        try:
            tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # noqa: BLE001 - JSON errors, unknown models: all mean "not a tokenizer.json"
            first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            raise ValueError(f"{where}: not a tokenizer.json the tokenizers library can read ({first})") from None
        self.path, self.sha256 = str(path), hashlib.sha256(raw).hexdigest()
        self._json = raw.decode("utf-8")
        self._load(tok)

    def _load(self, tok: Any) -> None:
        tok.encode_special_tokens = True
        self._tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        by_text = {text: i for i, text in special.items()}
        roles = {}
        for role, spellings in SPECIAL_SPELLINGS.items():
            found = next((by_text[s] for s in spellings if s in by_text), None)
            if found is not None:
                roles[role] = found
        self.info = TokenizerInfo("huggingface", self.vocab_size, roles, tuple(sorted(special)), self.sha256, Path(self.path).name)
        self.pad_id, self.mask_id = roles.get("pad"), roles.get("mask")
        self.cls_id, self.sep_id = roles.get("cls"), roles.get("sep")
        self.bos_id, self.eos_id = roles.get("bos"), roles.get("eos")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "json": self._json}

    def __setstate__(self, state: dict[str, Any]) -> None:
        tokenizers = import_tokenizers(f"data.tokenizer={state['path']!r}")
        self.path, self.sha256, self._json = state["path"], state["sha256"], state["json"]
        self._load(tokenizers.Tokenizer.from_str(self._json))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in parallel (the library's threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_tensor(self, text: str) -> Tensor:
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """Ids back to text; special ids are skipped."""
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: Optional[str | Path], setting: str = "data.tokenizer") -> ByteTokenizer | HFTokenizer:
    """``None``: the byte tokenizer; a path: that tokenizer.json."""
    return ByteTokenizer() if path is None else HFTokenizer(path, setting)
