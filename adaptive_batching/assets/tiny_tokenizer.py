"""The tiny assets' tokenizer: a byte-level BPE trained on the tiny dataset, written in tiktoken format
with a HF-style special tokens file, loadable by ``torchtune.models.llama3.llama3_tokenizer``."""

from __future__ import annotations

import base64
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import regex
from torchtune.data import AlpacaToMessages
from torchtune.models.llama3._tokenizer import CL100K_PATTERN, LLAMA3_SPECIAL_TOKENS

__all__ = [
    "NUM_BYTE_TOKENS",
    "NUM_MERGEABLE_RANKS",
    "special_tokens_json",
    "tiktoken_ranks_file",
    "train_bpe",
    "training_texts",
]

NUM_BYTE_TOKENS = 256
NUM_MERGEABLE_RANKS = 1024


def training_texts(records: Iterable[Mapping[str, str]]) -> Iterable[str]:
    """The text the tokenizer will actually see: alpaca prompts, responses and role names."""
    to_messages = AlpacaToMessages()
    yield "user assistant system ipython"
    for record in records:
        for message in to_messages(record)["messages"]:
            yield message.text_content


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def train_bpe(texts: Iterable[str], num_merges: int = NUM_MERGEABLE_RANKS - NUM_BYTE_TOKENS) -> list[bytes]:
    """Train a byte-level BPE and return tiktoken mergeable tokens in rank order.

    Text is pre-split with the Llama-3 (cl100k) pattern, exactly as tiktoken does at
    encode time, so the learned merges are the ones the encoder can use. The most
    frequent adjacent pair is merged greedily, ties broken by the pair's bytes, so
    training is deterministic. The result always has ``256 + num_merges`` distinct
    tokens: the single bytes first, then the merges.
    """
    words, freqs = _split_words(texts)
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    pair_words: dict[tuple[bytes, bytes], set[int]] = {}
    for index, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += freqs[index]
            pair_words.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    vocab: list[bytes] = [bytes([b]) for b in range(NUM_BYTE_TOKENS)]
    known = set(vocab)
    target = NUM_BYTE_TOKENS + num_merges
    while len(vocab) < target and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue
        merged = pair[0] + pair[1]
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        touched: set[tuple[bytes, bytes]] = set()
        for index in pair_words.pop(pair):
            symbols, freq = words[index], freqs[index]
            for old in zip(symbols, symbols[1:]):
                pair_counts[old] -= freq
                touched.add(old)
            words[index] = symbols = _merge_pair(symbols, pair)
            for new in zip(symbols, symbols[1:]):
                pair_counts[new] += freq
                pair_words.setdefault(new, set()).add(index)
                touched.add(new)
        pair_counts.pop(pair, None)
        for other in touched:
            count = pair_counts.get(other, 0)
            if count > 0:
                heapq.heappush(heap, (-count, other))
            else:
                pair_counts.pop(other, None)

    return _pad_vocab(vocab, known, target)


def _split_words(texts: Iterable[str]) -> tuple[list[list[bytes]], list[int]]:
    """The distinct pre-split chunks of two or more bytes, as byte symbols, in sorted order, with their counts."""
    pattern = regex.compile(CL100K_PATTERN)
    chunk_counts: Counter[str] = Counter()
    for text in texts:
        chunk_counts.update(pattern.findall(text))
    words: list[list[bytes]] = []
    freqs: list[int] = []
    for chunk, count in sorted(chunk_counts.items()):
        symbols = [bytes([b]) for b in chunk.encode("utf-8")]
        if len(symbols) > 1:
            words.append(symbols)
            freqs.append(count)
    return words, freqs


def _merge_pair(symbols: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    """``symbols`` with every non-overlapping occurrence of ``pair``, left to right, replaced by its merge."""
    merged: list[bytes] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            merged.append(pair[0] + pair[1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def _pad_vocab(vocab: list[bytes], known: set[bytes], target: int) -> list[bytes]:
    """Fill up to ``target`` tokens with unused two-byte tokens when the corpus runs out of pairs.

    Only tiny corpora hit this; it keeps the rank count (and thus the vocab size) fixed.
    """
    for first in range(NUM_BYTE_TOKENS):
        for second in range(NUM_BYTE_TOKENS):
            if len(vocab) >= target:
                return vocab
            token = bytes([first, second])
            if token not in known:
                known.add(token)
                vocab.append(token)
    return vocab


def tiktoken_ranks_file(tokens: Sequence[bytes]) -> bytes:
    """Serialise tokens in tiktoken's ``base64(token) rank`` line format."""
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(tokens)]
    return "".join(lines).encode("ascii")


def special_tokens_json(first_id: int = NUM_MERGEABLE_RANKS) -> dict[str, Any]:
    """HF ``tokenizer.json``-like dict whose ``added_tokens`` hold the Llama-3 special tokens.

    Ids are contiguous from ``first_id`` in the order of torchtune's
    ``LLAMA3_SPECIAL_TOKENS`` so they sit right after the mergeable ranks.
    """
    added_tokens = [
        {
            "content": content,
            "id": first_id + offset,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, content in enumerate(LLAMA3_SPECIAL_TOKENS)
    ]
    return {"added_tokens": added_tokens, "version": "1.0"}
