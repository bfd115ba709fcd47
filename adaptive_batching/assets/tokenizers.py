"""Tiny tokenizers in the formats other model families' tokenizers read, trained offline on the tiny data.

* Qwen 2 / 2.5: a GPT-2 style byte-level BPE, ``vocab.json`` and ``merges.txt``, made from the tiny
  byte-level BPE (``tiny_tokenizer.train_bpe``): every merged token is written as the merge of the two
  earlier tokens it was made from.
* Gemma, Phi-3 and Mistral: a ``sentencepiece`` model (BPE with byte fallback, so any text encodes),
  trained deterministically on one thread.
* The special tokens of a family, at ids right after the trained vocabulary, in the HF ``tokenizer.json``
  ``added_tokens`` form that torchtune's ``special_tokens_path`` reads.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence

from torchtune.models.qwen2._tokenizer import bytes_to_unicode


def qwen2_files(tokens: Sequence[bytes]) -> tuple[bytes, bytes]:
    """``vocab.json`` and ``merges.txt`` for byte-level BPE ``tokens`` in rank order (the 256 single bytes
    first): each later token's merge is its split into two earlier tokens."""
    to_text = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    rank = {token: i for i, token in enumerate(tokens)}
    merges = []
    for i, token in enumerate(tokens):
        if len(token) == 1:
            continue
        split = next(
            (token[:k], token[k:])
            for k in range(1, len(token))
            if rank.get(token[:k], i) < i and rank.get(token[k:], i) < i
        )
        merges.append(f"{text(split[0])} {text(split[1])}")
    vocab = {text(token): i for i, token in enumerate(tokens)}
    return (
        (json.dumps(vocab, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"),
        ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8"),
    )


def sentencepiece_model(texts: Iterable[str], vocab_size: int) -> bytes:
    """A trained ``sentencepiece`` BPE model (the bytes of its ``tokenizer.model``): ids 0-2 are
    ``<unk>``, ``<s>`` and ``</s>``, and unseen characters fall back to bytes."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        split_digits=True,
        train_extremely_large_corpus=False,
        minloglevel=2,
    )
    return model.getvalue()


def special_tokens_file(names: Sequence[str], first_id: int) -> bytes:
    """An HF ``tokenizer.json``-like file whose ``added_tokens`` give ``names`` the ids from ``first_id`` on."""
    added = [
        {
            "content": name,
            "id": first_id + offset,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, name in enumerate(names)
    ]
    return (json.dumps({"added_tokens": added, "version": "1.0"}, indent=2, sort_keys=True) + "\n").encode("ascii")
