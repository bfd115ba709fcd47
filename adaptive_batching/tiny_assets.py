"""Deterministic, offline tiny assets for a Llama-3-architecture model.

The project must train end-to-end on a CPU without any model or dataset hub, so
this module writes everything a torchtune recipe needs from a single seed:

* a randomly initialised tiny ``llama3`` checkpoint in Hugging Face layout
  (``config.json`` + ``model.safetensors``) loadable by
  ``torchtune.training.FullModelHFCheckpointer`` with ``model_type="LLAMA3"``;
* a tiny byte-level BPE tokenizer in tiktoken format plus a HF-style special
  tokens file, loadable by ``torchtune.models.llama3.llama3_tokenizer``;
* a synthetic alpaca-format JSON dataset whose token lengths have a long tail,
  so that length-aware batching has something to work with.

Same seed, same bytes: every file is written deterministically and atomically.
"""

from __future__ import annotations

import base64
import heapq
import io
import json
import math
import os
import random
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import regex
import torch
from safetensors.torch import save as safetensors_save
from torchtune.data import AlpacaToMessages
from torchtune.models.convert_weights import tune_to_hf
from torchtune.models.llama3 import Llama3Tokenizer, llama3, llama3_tokenizer
from torchtune.models.llama3._tokenizer import CL100K_PATTERN, LLAMA3_SPECIAL_TOKENS
from torchtune.modules import TransformerDecoder

__all__ = [
    "DEFAULT_TINY_DIR",
    "TINY_MODEL_ARGS",
    "TinyAssetPaths",
    "build_tiny_model",
    "describe",
    "generate_dataset",
    "hf_config",
    "hf_state_dict",
    "load_tiny_tokenizer",
    "special_tokens_json",
    "tiktoken_ranks_file",
    "token_lengths",
    "train_bpe",
    "write_tiny_assets",
]

DEFAULT_TINY_DIR = "/tmp/adaptive-batching/tiny"

TINY_MODEL_ARGS: dict[str, Any] = {
    "vocab_size": 1280,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "max_seq_len": 512,
    "intermediate_dim": 192,
    "norm_eps": 1e-5,
    "rope_base": 500000.0,
}

NUM_BYTE_TOKENS = 256
NUM_MERGEABLE_RANKS = 1024
NUM_SPECIAL_TOKENS = TINY_MODEL_ARGS["vocab_size"] - NUM_MERGEABLE_RANKS

_HEAD_DIM = TINY_MODEL_ARGS["embed_dim"] // TINY_MODEL_ARGS["num_heads"]
_BODY_MEDIAN_WORDS = 20.0
_BODY_SIGMA = 0.55
_TAIL_PROBABILITY = 0.05
_TAIL_MIN_WORDS = 200.0
_TAIL_PARETO_ALPHA = 1.2
_TAIL_MAX_WORDS = 800
_INPUT_PROBABILITY = 0.4
_VOWEL_ARTICLE = re.compile(r"\b([aA]) ([aeiou])")


@dataclass(frozen=True)
class TinyAssetPaths:
    """Where the tiny assets live below ``root``.

    Attributes:
        root: directory holding everything below.
        model_dir: ``root/model`` with ``config.json`` and ``model.safetensors`` (HF Llama layout).
        tokenizer_path: ``root/tokenizer/tokenizer.model`` (tiktoken BPE ranks file).
        special_tokens_path: ``root/tokenizer/special_tokens.json`` (HF ``added_tokens`` format).
        dataset_path: ``root/data/alpaca_tiny.json`` (alpaca-format JSON list).
    """

    root: Path
    model_dir: Path
    tokenizer_path: Path
    special_tokens_path: Path
    dataset_path: Path

    @classmethod
    def from_root(cls, root: str | Path) -> "TinyAssetPaths":
        """Compute the asset paths below ``root`` without touching the filesystem."""
        root = Path(root)
        return cls(
            root=root,
            model_dir=root / "model",
            tokenizer_path=root / "tokenizer" / "tokenizer.model",
            special_tokens_path=root / "tokenizer" / "special_tokens.json",
            dataset_path=root / "data" / "alpaca_tiny.json",
        )


# --------------------------------------------------------------------------- #
# Word lists for the synthetic dataset
# --------------------------------------------------------------------------- #

_NOUNS: tuple[str, ...] = tuple(
    """
    river garden window market teacher student engine forest mountain island
    bridge village kitchen letter picture planet signal server network system
    model dataset question answer problem method result report record story
    song book paper table chair door road street city country ocean valley
    farmer doctor painter writer player driver baker worker leader member
    animal bird horse rabbit tiger dragon insect flower tree seed leaf
    stone metal glass paint light shadow cloud storm winter summer morning
    evening moment minute hour season project budget plan team office
    meeting market price product customer order message channel program file
    folder window screen button keyboard camera robot machine sensor battery
    lamp candle blanket pillow basket bottle cup plate spoon fork knife
    map journey path trail camp tent fire lake shore wave harbor ship
    boat train plane ticket station airport museum library school lesson
    idea memory dream habit skill talent effort reason choice chance
    """.split()
)

_ADJECTIVES: tuple[str, ...] = tuple(
    """
    quiet bright dark small large ancient modern simple complex gentle
    rapid slow warm cold fresh clever careful curious honest brave
    calm noisy empty full heavy light strong weak rich poor
    narrow wide deep shallow sharp soft smooth rough clean dirty
    early late young old happy sad friendly useful strange common
    rare quick silent busy lazy golden silver green blue red
    """.split()
)

_VERBS: tuple[str, ...] = tuple(
    """
    build open move find help need keep start show hear play run
    turn learn read write paint explain describe collect follow visit
    improve protect connect measure compare repair design create
    change answer return remember forget support deliver observe gather
    share travel plant clean check count record order train test
    """.split()
)

_ADVERBS: tuple[str, ...] = tuple(
    """
    quickly slowly carefully quietly easily rarely often always never
    gently loudly clearly simply nearly finally suddenly happily barely
    """.split()
)

_PREPOSITIONS: tuple[str, ...] = tuple(
    "near under over behind beside across through into from with without around".split()
)

_CONNECTORS: tuple[str, ...] = (
    "However,",
    "Meanwhile,",
    "In addition,",
    "For example,",
    "As a result,",
    "Later,",
    "Then",
    "Because of this,",
    "In the end,",
    "At first,",
)

_SENTENCE_TEMPLATES: tuple[str, ...] = (
    "The {adj} {noun} {verbs} the {noun2}.",
    "A {adj} {noun} {verbs} {adv} {prep} the {noun2}.",
    "{Conn} the {noun} {verbs} a {adj} {noun2}.",
    "When the {noun} {verbs}, the {noun2} {verbs2} {adv}.",
    "It is {adj} to {verb} the {noun} {prep} the {adj2} {noun2}.",
    "Every {noun} should {verb} {num} {noun2}s before the {adj} {noun3}.",
    "The {noun} and the {noun2} {verb} {adv} together.",
    "Why does the {adj} {noun} {verb} the {noun2}?",
    "We {verb} {num} {adj} {noun}s {prep} the {noun2} every {noun3}.",
    "{Conn} a {adj} {noun} can {verb} any {noun2} {adv}.",
)

_PLAIN_INSTRUCTIONS: tuple[str, ...] = (
    "List three {adj} {noun}s and explain each one.",
    "Write a short story about a {adj} {noun}.",
    "Explain why the {noun} {verbs} {adv}.",
    "Describe a {adj} {noun} in detail.",
    "Give two reasons to {verb} the {noun}.",
    "What is the best way to {verb} a {adj} {noun}?",
    "Write a letter to a {noun} about the {adj} {noun2}.",
    "Compare the {noun} with the {noun2}.",
    "Suggest a plan to {verb} the {adj} {noun}.",
)

_INPUT_INSTRUCTIONS: tuple[str, ...] = (
    "Summarise the following text.",
    "Rewrite the following paragraph to make it more {adj}.",
    "Classify the following sentence as {adj} or {adj2}.",
    "Extract the main {noun} from the following text.",
    "Continue the following story.",
    "Translate the following text into plain English.",
)


# --------------------------------------------------------------------------- #
# Dataset
# --------------------------------------------------------------------------- #


def _fill(template: str, rng: random.Random) -> str:
    """Fill the named slots of ``template`` with random words, fixing "a" before vowels."""
    text = template.format(
        noun=rng.choice(_NOUNS),
        noun2=rng.choice(_NOUNS),
        noun3=rng.choice(_NOUNS),
        adj=rng.choice(_ADJECTIVES),
        adj2=rng.choice(_ADJECTIVES),
        verb=rng.choice(_VERBS),
        verbs=rng.choice(_VERBS) + "s",
        verbs2=rng.choice(_VERBS) + "s",
        adv=rng.choice(_ADVERBS),
        prep=rng.choice(_PREPOSITIONS),
        num=rng.randint(2, 999),
        Conn=rng.choice(_CONNECTORS),
    )
    return _VOWEL_ARTICLE.sub(r"\1n \2", text)


def _sentence(rng: random.Random) -> str:
    """One synthetic English-like sentence."""
    text = _fill(rng.choice(_SENTENCE_TEMPLATES), rng)
    return text[0].upper() + text[1:]


def _text(rng: random.Random, num_words: int, as_list: bool = False) -> str:
    """About ``num_words`` words of prose (paragraphs of 3-6 sentences) or a numbered list."""
    sentences: list[str] = []
    words = 0
    while words < num_words:
        sentence = _sentence(rng)
        sentences.append(sentence)
        words += len(sentence.split())
    if as_list:
        return "\n".join(f"{i + 1}. {sentence}" for i, sentence in enumerate(sentences))
    paragraphs: list[str] = []
    while sentences:
        size = rng.randint(3, 6)
        paragraphs.append(" ".join(sentences[:size]))
        sentences = sentences[size:]
    return "\n\n".join(paragraphs)


def _output_words(rng: random.Random) -> int:
    """Output length in words: log-normal body plus a Pareto long tail.

    The tail makes a few percent of samples exceed ``max_seq_len`` so that
    truncation and length-aware batching are exercised.
    """
    if rng.random() < _TAIL_PROBABILITY:
        return min(_TAIL_MAX_WORDS, int(_TAIL_MIN_WORDS * rng.paretovariate(_TAIL_PARETO_ALPHA)))
    words = rng.lognormvariate(math.log(_BODY_MEDIAN_WORDS), _BODY_SIGMA)
    return max(3, min(200, int(words)))


def _sample(rng: random.Random) -> dict[str, str]:
    """One alpaca-format record with ``instruction``, ``input`` and ``output``."""
    target_words = _output_words(rng)
    if rng.random() < _INPUT_PROBABILITY:
        instruction = _fill(rng.choice(_INPUT_INSTRUCTIONS), rng)
        input_words = max(4, min(120, int(rng.lognormvariate(math.log(18.0), 0.6))))
        sample_input = _text(rng, input_words)
    else:
        instruction = _fill(rng.choice(_PLAIN_INSTRUCTIONS), rng)
        sample_input = ""
    as_list = instruction.startswith("List")
    return {
        "instruction": instruction,
        "input": sample_input,
        "output": _text(rng, target_words, as_list=as_list),
    }


def generate_dataset(seed: int = 0, num_samples: int = 3000) -> list[dict[str, str]]:
    """Synthetic alpaca-format records, fully determined by ``seed``."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    rng = random.Random(seed)
    return [_sample(rng) for _ in range(num_samples)]


def _training_texts(records: Iterable[Mapping[str, str]]) -> Iterable[str]:
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
            symbols = words[index]
            freq = freqs[index]
            for old in zip(symbols, symbols[1:]):
                pair_counts[old] -= freq
                touched.add(old)
            new_symbols: list[bytes] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
                    new_symbols.append(merged)
                    i += 2
                else:
                    new_symbols.append(symbols[i])
                    i += 1
            words[index] = new_symbols
            for new in zip(new_symbols, new_symbols[1:]):
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


def load_tiny_tokenizer(paths: TinyAssetPaths, max_seq_len: int | None = None) -> Llama3Tokenizer:
    """Load the tiny tokenizer through torchtune's public ``llama3_tokenizer`` builder."""
    return llama3_tokenizer(
        path=str(paths.tokenizer_path),
        special_tokens_path=str(paths.special_tokens_path),
        max_seq_len=max_seq_len,
    )


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #


def build_tiny_model(seed: int = 0) -> TransformerDecoder:
    """Build ``llama3(**TINY_MODEL_ARGS)`` initialised from ``seed`` without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return llama3(**TINY_MODEL_ARGS)


def hf_config() -> dict[str, Any]:
    """HF ``config.json`` for the tiny model; FullModelHFCheckpointer reads its head/dim fields."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": NUM_MERGEABLE_RANKS + list(LLAMA3_SPECIAL_TOKENS).index("<|begin_of_text|>"),
        "eos_token_id": NUM_MERGEABLE_RANKS + list(LLAMA3_SPECIAL_TOKENS).index("<|end_of_text|>"),
        "head_dim": _HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": TINY_MODEL_ARGS["embed_dim"],
        "intermediate_size": TINY_MODEL_ARGS["intermediate_dim"],
        "max_position_embeddings": TINY_MODEL_ARGS["max_seq_len"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": TINY_MODEL_ARGS["num_heads"],
        "num_hidden_layers": TINY_MODEL_ARGS["num_layers"],
        "num_key_value_heads": TINY_MODEL_ARGS["num_kv_heads"],
        "rms_norm_eps": TINY_MODEL_ARGS["norm_eps"],
        "rope_scaling": None,
        "rope_theta": TINY_MODEL_ARGS["rope_base"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": TINY_MODEL_ARGS["vocab_size"],
    }


def hf_state_dict(model: TransformerDecoder) -> dict[str, torch.Tensor]:
    """The model's weights converted to HF Llama names and q/k layout, contiguous for safetensors."""
    converted = tune_to_hf(
        model.state_dict(),
        num_heads=TINY_MODEL_ARGS["num_heads"],
        num_kv_heads=TINY_MODEL_ARGS["num_kv_heads"],
        dim=TINY_MODEL_ARGS["embed_dim"],
    )
    return {name: tensor.detach().contiguous() for name, tensor in converted.items()}


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``.

    Readers never observe a half-written asset, even if writing is interrupted.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _json_bytes(obj: Any) -> bytes:
    """Canonical JSON encoding (sorted keys, ASCII, fixed indent) so equal data gives equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def write_tiny_assets(
    output_dir: str | Path = DEFAULT_TINY_DIR, seed: int = 0, num_samples: int = 3000
) -> TinyAssetPaths:
    """Write the tiny model, tokenizer and dataset under ``output_dir`` and return their paths.

    Deterministic in ``seed`` (byte-identical files), idempotent (rewrites overwrite),
    and every file is replaced atomically.
    """
    paths = TinyAssetPaths.from_root(output_dir)

    records = generate_dataset(seed=seed, num_samples=num_samples)
    _atomic_write(paths.dataset_path, _json_bytes(records))

    tokens = train_bpe(_training_texts(records))
    _atomic_write(paths.tokenizer_path, tiktoken_ranks_file(tokens))
    _atomic_write(paths.special_tokens_path, _json_bytes(special_tokens_json()))

    model = build_tiny_model(seed)
    _atomic_write(paths.model_dir / "model.safetensors", safetensors_save(hf_state_dict(model)))
    _atomic_write(paths.model_dir / "config.json", _json_bytes(hf_config()))
    return paths


# --------------------------------------------------------------------------- #
# Summary
# --------------------------------------------------------------------------- #


def token_lengths(paths: TinyAssetPaths) -> list[int]:
    """Untruncated token count of every dataset sample as torchtune's alpaca pipeline tokenizes it."""
    tokenizer = load_tiny_tokenizer(paths)
    to_messages = AlpacaToMessages()
    records = json.loads(paths.dataset_path.read_text())
    return [len(tokenizer.tokenize_messages(to_messages(r)["messages"])[0]) for r in records]


def _percentile(sorted_values: Sequence[int], fraction: float) -> int:
    """Nearest-rank percentile of already-sorted values."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def describe(paths: TinyAssetPaths) -> str:
    """Short human summary: files with sizes, sample count and token-length percentiles."""
    files = [
        paths.model_dir / "config.json",
        paths.model_dir / "model.safetensors",
        paths.tokenizer_path,
        paths.special_tokens_path,
        paths.dataset_path,
    ]
    lengths = sorted(token_lengths(paths))
    max_seq_len = TINY_MODEL_ARGS["max_seq_len"]
    over = sum(length > max_seq_len for length in lengths)
    out = io.StringIO()
    out.write(f"tiny assets in {paths.root}\n")
    for file in files:
        out.write(f"  {file.relative_to(paths.root)}: {file.stat().st_size:,} bytes\n")
    out.write(f"samples: {len(lengths)}\n")
    out.write(
        f"tokens per sample: p50={_percentile(lengths, 0.5)} p95={_percentile(lengths, 0.95)} "
        f"max={lengths[-1]}; >{max_seq_len}: {over} ({over / len(lengths):.1%})\n"
    )
    return out.getvalue()
