"""Offline data for lightning-pipe: byte tokenizer, stdlib/user-text corpora, LM data modules."""

from .checks import check_seq_len
from .corpus import DEFAULT_MAX_BYTES, corpus_files, read_corpus, split_corpus, stdlib_files, stdlib_root
from .datamodules import CausalLMDataModule, MaskedLMDataModule
from .datasets import CausalLMDataset, MaskedLMDataset
from .masking import IGNORE_INDEX, mask_tokens, num_predicted
from .tokenizer import ByteTokenizer
from .windows import RandomWindows, StreamWindows

__all__ = [
    "DEFAULT_MAX_BYTES",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "CausalLMDataModule",
    "CausalLMDataset",
    "MaskedLMDataModule",
    "MaskedLMDataset",
    "RandomWindows",
    "StreamWindows",
    "check_seq_len",
    "corpus_files",
    "mask_tokens",
    "num_predicted",
    "read_corpus",
    "split_corpus",
    "stdlib_files",
    "stdlib_root",
]
