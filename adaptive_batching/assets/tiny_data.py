"""The tiny assets' synthetic alpaca-format dataset: its token lengths have a long tail, so that
length-aware batching has something to work with. Same seed, same records."""

from __future__ import annotations

import math
import random
import re

__all__ = ["generate_dataset", "generate_preferences"]

_BODY_MEDIAN_WORDS = 20.0
_BODY_SIGMA = 0.55
_TAIL_PROBABILITY = 0.05
_TAIL_MIN_WORDS = 200.0
_TAIL_PARETO_ALPHA = 1.2
_TAIL_MAX_WORDS = 800
_INPUT_PROBABILITY = 0.4
_VOWEL_ARTICLE = re.compile(r"\b([aA]) ([aeiou])")


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


def _prompt(record: dict[str, str]) -> str:
    """The user's turn of an alpaca record: its instruction, then its input when it has one."""
    return record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")


def generate_preferences(records: list[dict[str, str]], seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """Preference pairs in torchtune's ``preference_dataset`` JSON format (``chosen`` and ``rejected`` message
    lists), one per record: the record's answer is chosen, a fresh answer of its own length is rejected. Both
    answers' lengths have the long tail of :func:`generate_dataset`, so pairs of very different lengths occur.
    Its own generator: the records and their files stay as they are."""
    rng = random.Random(seed + 1_000_003)
    pairs = []
    for record in records:
        prompt = {"role": "user", "content": _prompt(record)}
        rejected = _text(rng, _output_words(rng), as_list=record["instruction"].startswith("List"))
        pairs.append(
            {
                "chosen": [prompt, {"role": "assistant", "content": record["output"]}],
                "rejected": [prompt, {"role": "assistant", "content": rejected}],
            }
        )
    return pairs
