"""Elastic global batch sizes: one global batch that stays exact when the world size changes.

As DeepSpeed elasticity does, pick the global batch ``G <= max_global_batch`` that splits as
micro batch x accumulation x ranks for as many world sizes as possible (a highly composite
number). A job resized between those world sizes keeps ``G``, so its LR and its trajectory stay.
Config, under ``adaptive_batching.elastic:``::

    max_global_batch: 64      # required, >= 1
    micro_batches: [2, 4, 8]  # required, the micro batches allowed on one rank
    min_ranks: 1              # default 1
    max_ranks: 8              # required, >= min_ranks
    prefer_larger: true       # default: ties go to the larger global batch
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.errors import ConfigError

PREFIX = "adaptive_batching.elastic"
KNOWN_KEYS = ("max_global_batch", "micro_batches", "min_ranks", "max_ranks", "prefer_larger")
_REQUIRED = ("max_global_batch", "micro_batches", "max_ranks")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{PREFIX}.{key}' = {value!r} is invalid: expected {allowed}")


def _joined(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True, kw_only=True)
class ElasticSpec:
    """The user's elastic bounds; ``micro_batches`` is kept sorted and without duplicates."""

    max_global_batch: int
    micro_batches: tuple[int, ...]
    min_ranks: int = 1
    max_ranks: int
    prefer_larger: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.max_global_batch) or self.max_global_batch < 1:
            raise _invalid("max_global_batch", self.max_global_batch, "an integer >= 1")
        micro = self.micro_batches
        allowed = "a non-empty list of integers >= 1, e.g. [2, 4, 8]"
        if isinstance(micro, (str, bytes)) or not isinstance(micro, Sequence):
            raise _invalid("micro_batches", micro, allowed)
        if not micro or not all(_is_int(m) and m >= 1 for m in micro):
            raise _invalid("micro_batches", list(micro), allowed)
        object.__setattr__(self, "micro_batches", tuple(sorted(set(micro))))
        if not _is_int(self.min_ranks) or self.min_ranks < 1:
            raise _invalid("min_ranks", self.min_ranks, "an integer >= 1")
        if not _is_int(self.max_ranks) or self.max_ranks < self.min_ranks:
            raise _invalid("max_ranks", self.max_ranks, f"an integer >= {PREFIX}.min_ranks ({self.min_ranks})")
        if not isinstance(self.prefer_larger, bool):
            raise _invalid("prefer_larger", self.prefer_larger, "true or false")

    @classmethod
    def from_config(cls, node: Mapping) -> ElasticSpec:
        """The spec from the ``adaptive_batching.elastic`` config node (a dict or a DictConfig)."""
        if not isinstance(node, Mapping):
            raise ConfigError(
                f"config key '{PREFIX}' = {node!r} is invalid: expected a mapping with keys {', '.join(KNOWN_KEYS)}"
            )
        unknown = sorted(str(k) for k in node if k not in KNOWN_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(f'{PREFIX}.{k}' for k in unknown)}; "
                f"known keys under '{PREFIX}': {', '.join(KNOWN_KEYS)}"
            )
        for key in _REQUIRED:
            if node.get(key) is None:
                raise ConfigError(f"config key '{PREFIX}.{key}' is missing")
        micro = node["micro_batches"]
        if isinstance(micro, Sequence) and not isinstance(micro, (str, bytes)):
            micro = tuple(micro)
        return cls(
            max_global_batch=node["max_global_batch"],
            micro_batches=micro,
            max_ranks=node["max_ranks"],
            min_ranks=node.get("min_ranks", 1),
            prefer_larger=node.get("prefer_larger", True),
        )

    def usable_micro_batches(self, memory_cap: int | None = None) -> tuple[int, ...]:
        """The allowed micro batches that fit under the memory cap ``memory_cap`` (all when None)."""
        if memory_cap is None:
            return self.micro_batches
        if not _is_int(memory_cap) or memory_cap < 1:
            raise ValueError(f"memory_cap must be an integer >= 1, got {memory_cap!r}")
        usable = tuple(m for m in self.micro_batches if m <= memory_cap)
        if not usable:
            raise ConfigError(
                f"no micro batch in '{PREFIX}.micro_batches' = [{_joined(self.micro_batches)}] fits the "
                f"memory cap of {memory_cap} samples per forward; allow a micro batch <= {memory_cap}"
            )
        return usable


def _largest_micro(global_batch: int, world_size: int, micro_batches: Sequence[int]) -> int | None:
    fitting = [m for m in micro_batches if global_batch % (m * world_size) == 0]
    return max(fitting) if fitting else None


def _world_sizes(global_batch: int, spec: ElasticSpec, micro_batches: Sequence[int]) -> list[int]:
    highest = min(spec.max_ranks, global_batch // min(micro_batches))
    return [w for w in range(spec.min_ranks, highest + 1) if _largest_micro(global_batch, w, micro_batches) is not None]


def valid_world_sizes(global_batch: int, spec: ElasticSpec, *, memory_cap: int | None = None) -> list[int]:
    """The world sizes in ``[min_ranks, max_ranks]`` that ``global_batch`` splits into exactly:
    some allowed micro batch ``m`` (``<= memory_cap`` when given) has ``global_batch % (m * w) == 0``."""
    if not _is_int(global_batch) or global_batch < 1:
        raise ValueError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    return _world_sizes(global_batch, spec, spec.usable_micro_batches(memory_cap))


@dataclass(frozen=True)
class ElasticChoice:
    """The chosen global batch, the world sizes it is valid at and the micro batches it may use."""

    global_batch: int
    world_sizes: list[int]
    micro_batches: tuple[int, ...]

    def shape_for(self, world_size: int) -> BatchShape:
        """The shape at ``world_size`` ranks: the largest micro batch that divides the per-rank share,
        accumulation making up the rest, so the global batch is the same at every valid world size."""
        if world_size not in self.world_sizes:
            raise ValueError(
                f"global batch {self.global_batch} does not split evenly over {world_size} rank(s); "
                f"valid world sizes: {_joined(self.world_sizes)}"
            )
        micro = _largest_micro(self.global_batch, world_size, self.micro_batches)
        assert micro is not None
        return BatchShape(micro, self.global_batch // (micro * world_size), world_size)

    def describe(self) -> str:
        return (
            f"elastic: global batch {self.global_batch} valid at {_joined(self.world_sizes)} ranks "
            f"(micro batches {_joined(self.micro_batches)})"
        )


def _minimal_by_divisibility(values: Sequence[int]) -> list[int]:
    """Drop every value that a smaller one divides: its multiples are already covered."""
    kept: list[int] = []
    for v in sorted(set(values)):
        if all(v % k for k in kept):
            kept.append(v)
    return kept


def choose_global_batch(spec: ElasticSpec, *, memory_cap: int | None = None) -> ElasticChoice:
    """The global batch ``<= max_global_batch`` valid at the most world sizes; ties go to the larger
    one (the smaller with ``prefer_larger: false``). Only micro batches ``<= memory_cap``, the
    profiler's memory cap, count when it is given."""
    micro = spec.usable_micro_batches(memory_cap)
    limit = spec.max_global_batch
    if micro[0] * spec.min_ranks > limit:
        raise ConfigError(
            f"no global batch <= '{PREFIX}.max_global_batch' ({limit}) is valid at any of "
            f"{spec.min_ranks}..{spec.max_ranks} ranks: the smallest is micro batch {micro[0]} x "
            f"{spec.min_ranks} rank(s) = {micro[0] * spec.min_ranks}; raise max_global_batch, lower "
            f"min_ranks or allow a smaller micro batch"
        )
    base = _minimal_by_divisibility(micro)
    tally: Counter[int] = Counter()
    for w in range(spec.min_ranks, spec.max_ranks + 1):
        steps = [w * m for m in base if w * m <= limit]
        if not steps:
            break
        if len(steps) == 1:
            tally.update(range(steps[0], limit + 1, steps[0]))
        else:
            tally.update(set().union(*(range(s, limit + 1, s) for s in steps)))
    sign = 1 if spec.prefer_larger else -1
    best = max(tally, key=lambda g: (tally[g], sign * g))
    return ElasticChoice(best, _world_sizes(best, spec, micro), micro)


def shape_at(spec: ElasticSpec, world_size: int, *, memory_cap: int | None = None) -> tuple[ElasticChoice, BatchShape]:
    """The run's global batch (chosen without the memory cap, so it is the same at every world size and
    with every profile) and this world size's shape under the cap.

    Raises ValueError naming the valid world sizes when ``world_size`` cannot hold the global batch.
    """
    chosen = choose_global_batch(spec)
    choice = ElasticChoice(
        global_batch=chosen.global_batch,
        world_sizes=valid_world_sizes(chosen.global_batch, spec, memory_cap=memory_cap),
        micro_batches=spec.usable_micro_batches(memory_cap),
    )
    return choice, choice.shape_for(world_size)
