"""Tokenizers for `prepare`, under Megatron-LM's `--tokenizer-type` names.

    ByteLevel             ids 0-255 are UTF-8 bytes, 256 ends a document (vocab 257); no files
    GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt (GPT-2's own files,
                          or any byte-level BPE saved in that form); EOD is <|endoftext|>
    HuggingFaceTokenizer  --tokenizer-model tokenizer.json (or a folder holding one); EOD is
                          the eos_token of a tokenizer_config.json beside it, else the first
                          of END_OF_DOCUMENT in the vocabulary

`train_bpe` makes a byte-level BPE vocabulary from the corpus itself (`--train-tokenizer`);
it is saved as tokenizer.json and used as a HuggingFaceTokenizer. A `TokenizerSpec` (names
and paths) is what crosses into worker processes; each builds its own tokenizer from it.
"""

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

EOD = 256
"""End of document of the byte-level tokenizer."""
VOCAB_SIZE = 257
"""256 byte values + EOD."""

TOKENIZER_TYPES = ("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer")
END_OF_DOCUMENT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-document tokens of GPT-2, Llama 3, Llama 2 / Mistral, Gemma: looked up when no config names one."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from what was given; the message names the flag and the fix."""


def encode(data: bytes) -> np.ndarray:
    """Bytes of UTF-8 text (any bytes, in fact) -> byte-level token ids, ending in EOD."""
    return np.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16), np.uint16(EOD))


def decode(ids) -> str:
    """Byte-level token ids -> text; EOD becomes a newline, invalid UTF-8 a replacement character."""
    return bytes(10 if i == EOD else i for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_type: str = "ByteLevel"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None


def vocab_digest(vocab: dict[str, int]) -> str:
    """What a tokenizer's ids mean, as one hash of its (token, id) pairs: two tokenizers that agree on it give
    each id the same text (GPT-2's vocab.json + merges.txt and its tokenizer.json), whatever their files."""
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]


class ByteLevel:
    vocab_size, eod, id_bound = VOCAB_SIZE, EOD, VOCAB_SIZE
    digest = vocab_digest({f"byte {i}": i for i in range(EOD)} | {"end of document": EOD})

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return decode(ids)


class HuggingFace:
    """A `tokenizers.Tokenizer`; text is decoded from UTF-8 first, invalid bytes replaced.

    A special token's text inside a document ("<|endoftext|>" in a file about tokenizers)
    is encoded as the text it is, so documents end only where prepare ends them.
    """

    def __init__(self, tokenizer, eod: int | None):
        self.tokenizer, self.eod = tokenizer, eod
        tokenizer.encode_special_tokens = True
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.id_bound = max(vocab.values(), default=-1) + 1
        """One above the largest id it can give (its vocab_size counts entries; ids may skip some)."""
        self.digest = vocab_digest(vocab)

    def encode(self, data: bytes) -> list[int]:
        return self.tokenizer.encode(data.decode("utf-8", errors="replace")).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def build(spec: TokenizerSpec) -> ByteLevel | HuggingFace:
    if spec.tokenizer_type == "ByteLevel":
        return ByteLevel()
    if spec.tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(spec.vocab_file, spec.merge_file)
    if spec.tokenizer_type == "HuggingFaceTokenizer":
        return _hugging_face(spec.tokenizer_model)
    raise TokenizerError(f"--tokenizer-type {spec.tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def _missing(flag: str, path: str | None) -> str:
    return f"{flag} {path}: no such file" if path else f"no {flag} given"


def _gpt2_bpe(vocab_file: str | None, merge_file: str | None) -> HuggingFace:
    from tokenizers import ByteLevelBPETokenizer

    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not path or not os.path.isfile(path):
            raise TokenizerError(f"{_missing(flag, path)}; GPT2BPETokenizer needs --vocab-file vocab.json and "
                                 f"--merge-file merges.txt")
    try:
        tokenizer = ByteLevelBPETokenizer(vocab_file, merge_file)
    except Exception as e:  # tokenizers raises plain Exception on a malformed file
        raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE "
                             f"vocabulary ({e})") from None
    return HuggingFace(tokenizer, tokenizer.token_to_id("<|endoftext|>"))


def _hugging_face(path: str | None) -> HuggingFace:
    from tokenizers import Tokenizer

    if path and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not path or not os.path.isfile(path):
        raise TokenizerError(f"{_missing('--tokenizer-model', path)}; HuggingFaceTokenizer needs --tokenizer-model "
                             f"tokenizer.json (or the folder that holds it)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception on a malformed file
        raise TokenizerError(f"--tokenizer-model {path}: not a Hugging Face tokenizer.json ({e})") from None
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if (named := _eos_from_config(config)) is not None:
        if (eod := tokenizer.token_to_id(named)) is None:
            raise TokenizerError(f"{config}: eos_token {named!r} is not in {path}'s vocabulary; name one of its "
                                 f"tokens, or remove the key")
        return HuggingFace(tokenizer, eod)
    ids = [tokenizer.token_to_id(name) for name in END_OF_DOCUMENT]
    return HuggingFace(tokenizer, next((i for i in ids if i is not None), None))


def _eos_from_config(path: str) -> str | None:
    """transformers' eos_token from the tokenizer_config.json at `path` (a string, or a dict with "content");
    None where there is no file or it names none."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e}); fix it, or remove it (it names the end-of-document "
                             f"token)") from None
    if not isinstance(found, dict):
        raise TokenizerError(f"{path}: not a JSON object of tokenizer settings; fix it, or remove it")
    eos = found.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is not None and not isinstance(eos, str):
        raise TokenizerError(f"{path}: eos_token is {json.dumps(eos)[:40]}, not a token's text; name one, or remove "
                             f"the key")
    return eos


MAX_VOCAB_SIZE = 2 ** 31 - 1


def train_bpe(documents, vocab_size: int, path: str) -> int:
    """A byte-level BPE (GPT-2's kind) of up to vocab_size entries, <|endoftext|> included, saved to `path`;
    returns its size, smaller when the corpus runs out of pairs to merge.

    `documents` is an iterable of bytes; all 256 byte values are in the vocabulary
    whether the corpus has them or not, so any later text encodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < VOCAB_SIZE:
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {VOCAB_SIZE} "
                             "(256 bytes + <|endoftext|>)")
    if vocab_size > MAX_VOCAB_SIZE:
        raise TokenizerError(f"--vocab-size {vocab_size}: at most {MAX_VOCAB_SIZE:,} (token ids are int32)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  show_progress=sys.stderr.isatty(),  # minutes on a large corpus
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.decode("utf-8", errors="replace") for d in documents), trainer)
    tokenizer.save(path)
    return tokenizer.get_vocab_size()
