"""Offline data for lightning-pipe: byte and Hugging Face tokenizers, stdlib/user-text corpora, token
files, LM data modules."""

from .checks import check_model_vocab, check_seq_len, check_vocab
from .corpus import DEFAULT_MAX_BYTES, corpus_files, iter_corpus, read_corpus, split_corpus, stdlib_files, stdlib_root
from .datamodules import CausalLMDataModule, MaskedLMDataModule
from .datasets import CausalLMDataset, MaskedLMDataset
from .masking import IGNORE_INDEX, mask_tokens, num_predicted
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerInfo, load_tokenizer
from .tokens import TokenFile, TokenSlice, encode_corpus, token_chunks, write_token_file
from .windows import RandomWindows, StreamWindows

__all__ = [
    "DEFAULT_MAX_BYTES",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "HFTokenizer",
    "CausalLMDataModule",
    "CausalLMDataset",
    "MaskedLMDataModule",
    "MaskedLMDataset",
    "RandomWindows",
    "StreamWindows",
    "TokenFile",
    "TokenSlice",
    "TokenizerInfo",
    "check_model_vocab",
    "check_seq_len",
    "check_vocab",
    "corpus_files",
    "encode_corpus",
    "iter_corpus",
    "load_tokenizer",
    "mask_tokens",
    "num_predicted",
    "read_corpus",
    "split_corpus",
    "stdlib_files",
    "stdlib_root",
    "token_chunks",
    "write_token_file",
]
