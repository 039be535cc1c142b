"""Byte-level tokenizer: every UTF-8 byte is a token, so nothing is ever downloaded or unknown."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


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
