"""The training objectives: supervised fine-tuning, direct preference optimisation (DPO) of LoRA adapters or of
the whole model, and knowledge distillation (KD) from a frozen teacher.

Each is a :class:`~adaptive_batching.core.objective.TrainingObjective` the trainer composes, built from typed
values; ``training.recipe_table`` picks the one of each recipe and reads those values from the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn
from torchtune import rlhf
from torchtune.config._utils import _get_component_from_path
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import disable_adapter

from adaptive_batching.batching.data import build_collate, worst_case_batch
from adaptive_batching.batching.sampler import EmptyTolerantCollate
from adaptive_batching.config.vision import TILED_COLLATE, ImageGeometry
from adaptive_batching.core.loss import flat, shifted_labels, summed_token_loss
from adaptive_batching.core.objective import FrozenModel

_GIB = 2**30


class SupervisedFinetune:
    """Next-token cross-entropy on each sample's labels, summed over the tokens that count."""

    name = "finetune"
    trained_by = "fine-tuning"
    sequences_per_sample = 1
    frozen: FrozenModel | None = None
    resident: tuple[nn.Module, ...] = ()

    def hold(self, model: nn.Module) -> None:
        raise TypeError(f"{type(self).__name__} holds no frozen model")

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        return ""

    def start_step(self) -> None:
        pass

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        return build_collate(collate_path, packed, pad_id, loss_fn.ignore_index)

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: AbstractContextManager
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return summed_token_loss(model, loss_fn, batch, activations)

    def worst_case_batch(
        self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int, packed: bool, images: int = 0
    ) -> dict[str, torch.Tensor]:
        return worst_case_batch(collate, micro_batch=micro_batch, seq_len=seq_len, vocab_size=vocab_size, packed=packed)

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        return {}


class VisionFinetune(SupervisedFinetune):
    """Supervised fine-tuning of a Llama 3.2 Vision model (torchtune's ``DeepFusionModel``): the loss is
    :class:`SupervisedFinetune`'s, on a text whose images the encoder reads as tiles and the decoder's
    cross-attention layers attend to. Samples are collated by ``padded_collate_tiled_images_and_mask``, as torchtune's
    recipes collate them; the worst case gives every sample the most images a sample of the data holds (at least
    one), each cut into the most tiles the transform makes (``geometry``)."""

    name = "vision_finetune"

    def __init__(self, geometry: ImageGeometry) -> None:
        self.geometry = geometry

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        return (
            f"vision: each sample an image of {self.geometry.max_num_tiles} tiles ({self.geometry.describe()}) "
            f"through the encoder, and its {seq_len}-token text through the decoder, whose cross-attention layers "
            f"attend to the image's tokens"
        )

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        assert collate_path == TILED_COLLATE and not packed, "checked with the config (config.vision)"
        collate = partial(_get_component_from_path(TILED_COLLATE), padding_idx=pad_id, ignore_idx=loss_fn.ignore_index)
        return EmptyTolerantCollate(
            collate, pad_id=pad_id, ignore_index=loss_fn.ignore_index, packed=False, empty=self._empty_sample(pad_id)
        )

    def _empty_sample(self, pad_id: int) -> Callable[[], dict[str, Any]]:
        """A rank's empty micro batch: one ignored token and one blank tile that it does not attend to, so that
        every rank runs the encoder (its sharded weights are gathered by all ranks together)."""
        tile = self.geometry.tile_size

        def sample() -> dict[str, Any]:
            return {
                "tokens": [pad_id],
                "labels": [CROSS_ENTROPY_IGNORE_IDX],
                "encoder_input": {
                    "images": [torch.zeros(1, 3, tile, tile, dtype=torch.bfloat16)],
                    "aspect_ratio": [torch.tensor([1, 1])],
                },
                "encoder_mask": [torch.zeros(1, self.geometry.tokens_per_tile, dtype=torch.bool)],
            }

        return sample

    def worst_case_batch(
        self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int, packed: bool, images: int = 0
    ) -> dict[str, torch.Tensor]:
        """``micro_batch`` samples of ``seq_len`` tokens, each with ``images`` images (at least one) of the most
        tiles, every token attending to every image (bf16 tiles, as torchtune's image transform makes them)."""
        generator = torch.Generator().manual_seed(0)
        geometry, count = self.geometry, max(images, 1)
        tiles, tile = geometry.max_num_tiles, geometry.tile_size
        samples = []
        for row in torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator).tolist():
            pixels = torch.rand(count, tiles, 3, tile, tile, generator=generator).to(torch.bfloat16)
            samples.append(
                {
                    "tokens": row,
                    "labels": row,
                    "encoder_input": {
                        "images": list(pixels),
                        "aspect_ratio": [torch.tensor([1, tiles])] * count,
                    },
                    "encoder_mask": [torch.ones(seq_len, tiles * geometry.tokens_per_tile, dtype=torch.bool)] * count,
                }
            )
        return collate(samples)


class PairCollate:
    """torchtune's ``padded_collate_dpo`` (chosen and rejected padded to the longest of the micro batch), with
    each pair kept in one row: ``tokens`` and ``labels`` are (pairs, 2, length), chosen first, so a micro batch
    is cut by pairs. An empty micro batch becomes one pair whose labels are all ignored: it counts for nothing."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.empty = {
            "chosen_input_ids": [pad_id],
            "chosen_labels": [CROSS_ENTROPY_IGNORE_IDX],
            "rejected_input_ids": [pad_id],
            "rejected_labels": [CROSS_ENTROPY_IGNORE_IDX],
        }

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        tokens, labels = padded_collate_dpo(
            samples or [self.empty], padding_idx=self.pad_id, ignore_idx=CROSS_ENTROPY_IGNORE_IDX
        )
        pairs = tokens.size(0) // 2
        return {
            "tokens": tokens.view(2, pairs, -1).transpose(0, 1).contiguous(),
            "labels": labels.view(2, pairs, -1).transpose(0, 1).contiguous(),
        }


def _concatenated(pairs: torch.Tensor) -> torch.Tensor:
    """(pairs, 2, length) -> (2 x pairs, length): every chosen sequence, then every rejected one, as
    ``padded_collate_dpo`` gives them."""
    return pairs.transpose(0, 1).reshape(-1, pairs.size(-1))


class LoRADPO(SupervisedFinetune):
    """DPO with LoRA: the policy is the model with its adapters, the reference the same model with them
    disabled, as torchtune's ``lora_dpo_single_device`` computes it. The loss is ``loss`` (``DPOLoss``,
    ``RSOLoss``) summed over a micro batch's pairs; the step divides by the pairs of the whole step. (No frozen
    model, and nothing to forget at a step's start: :class:`SupervisedFinetune`'s.)"""

    name = "lora_dpo"
    trained_by = "adaptive_lora_dpo"
    sequences_per_sample = 2

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        return self._describe_pairs(seq_len, "the policy with its adapters off")

    def _describe_pairs(self, seq_len: int, reference: str) -> str:
        return (
            f"DPO ({self.name}): a sample is a pair, chosen and rejected each {seq_len} "
            f"tokens: the policy's forward and backward on 2 x micro batch sequences, then the "
            f"reference's forward without autograd ({reference}), which saves nothing for the "
            f"backward"
        )

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        return PairCollate(pad_id)

    def reference(self, model: nn.Module) -> AbstractContextManager:
        """The reference model: the policy with its adapters off."""
        return disable_adapter(model)

    def _reference_log_probs(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, activations: AbstractContextManager
    ) -> torch.Tensor:
        with torch.no_grad(), self.reference(model):
            return self._log_probs(model, tokens, labels, activations)[0]

    def _log_probs(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, activations: AbstractContextManager
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with activations:
            logits = model(tokens)
        return rlhf.get_batch_log_probs(logits, labels), logits

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: AbstractContextManager
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = batch["tokens"].size(0)
        tokens, labels = _concatenated(batch.pop("tokens")), _concatenated(batch.pop("labels"))
        reference = self._reference_log_probs(model, tokens, labels, activations)
        log_probs, logits = self._log_probs(model, tokens, labels, activations)
        logits_chosen, logits_rejected = logits[:pairs].detach().mean(), logits[pairs:].detach().mean()
        del logits
        chosen, rejected = log_probs[:pairs], log_probs[pairs:]
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, reference[:pairs], reference[pairs:])
        counts = (labels != CROSS_ENTROPY_IGNORE_IDX).any(dim=-1).view(2, pairs).any(dim=0)
        self.last = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "log_probs/rejected": rejected.detach().mean(),
            "log_probs/chosen": chosen.detach().mean(),
            "logits/rejected": logits_rejected,
            "logits/chosen": logits_chosen,
        }
        return (losses * counts).sum(), counts.sum()

    def worst_case_batch(
        self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int, packed: bool, images: int = 0
    ) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (micro_batch, 2, seq_len), generator=generator).tolist()
        return collate(
            [
                {
                    "chosen_input_ids": chosen,
                    "chosen_labels": chosen,
                    "rejected_input_ids": rejected,
                    "rejected_labels": rejected,
                }
                for chosen, rejected in tokens
            ]
        )

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        """As ``lora_dpo_single_device`` logs them: the rewards and log-probabilities of the step's last micro
        batch, and the tokens per second of the policy's forwards (both sequences of each pair, padding
        included) in place of the pairs per second the step's count would give."""
        return {
            "tokens_per_second_per_gpu": padded_tokens / seconds,
            **{name: float(value) for name, value in self.last.items()},
        }


class FullDPO(LoRADPO):
    """DPO of the whole model, as torchtune's ``full_dpo_distributed`` trains it: the policy is the model, every
    weight trainable; the reference a second, frozen copy loaded from ``ref_checkpointer`` (built with the other
    parts, sharded as the policy is, in eval mode, in no optimizer and no checkpoint). Its weights stay resident,
    so the profiler's trials count them (:attr:`resident`); its log-probabilities are computed again at every
    micro batch, never kept. The step, loss and metrics are :class:`LoRADPO`'s."""

    name = "full_dpo"
    trained_by = "adaptive_full_dpo"
    frozen = FrozenModel("model", "ref_checkpointer")

    def __init__(self) -> None:
        super().__init__()
        self.reference_model: nn.Module | None = None

    def hold(self, model: nn.Module) -> None:
        self.reference_model = model

    @property
    def resident(self) -> tuple[nn.Module, ...]:  # type: ignore[override]  # the base class attribute, read-only here
        return () if self.reference_model is None else (self.reference_model,)

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        return self._describe_pairs(
            seq_len, f"a frozen copy of the model, {frozen_bytes / _GIB:.2f} GiB per rank, counted with the weights"
        )

    def _reference_log_probs(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, activations: AbstractContextManager
    ) -> torch.Tensor:
        """The frozen reference's forward, without autograd or activation offloading (nothing is saved for a
        backward), as ``full_dpo_distributed`` runs it."""
        assert self.reference_model is not None, "the reference model is built with the other parts"
        with torch.no_grad():
            return self._log_probs(self.reference_model, tokens, labels, contextlib.nullcontext())[0]


class KnowledgeDistillation(SupervisedFinetune):
    """Knowledge distillation, as torchtune's ``knowledge_distillation_single_device`` trains it: the student (the
    model, LoRA or full) is trained on ``(1 - kd_ratio) x`` the cross-entropy on its labels ``+ kd_ratio x`` the
    ``kd_loss`` (a KL divergence) between its logits and those of a frozen teacher, built from ``teacher_model``
    with the weights of ``teacher_checkpointer`` (another architecture with the same vocabulary, sharded as the
    student is, in eval mode, in no optimizer and no checkpoint). The teacher's forward runs without autograd on
    the same micro batch; its weights stay resident and its logits live until both losses are done, so the
    profiler's trials count them (:attr:`resident`).

    Both losses are summed over the micro batch's tokens (their means x its tokens) and the step divides by the
    tokens of all its micro batches and ranks, as the fine-tuning recipes do: the step's gradient does not depend on
    how it is cut into micro batches. (Stock's backward takes each micro batch's mean and then divides by the step's
    tokens again; see docs/distillation.md.) A step logs its ``class_loss`` and ``kd_loss`` besides ``loss``."""

    name = "kd"
    trained_by = "adaptive_knowledge_distillation"

    def __init__(self, kd_loss: Any, kd_ratio: float, teacher: FrozenModel) -> None:
        """``kd_loss``: the KL loss (a torchtune ``...KLLoss`` module, compiled or not); ``kd_ratio``: its weight
        against the cross-entropy; ``teacher``: the teacher's builder and weights."""
        self.kd_loss_fn, self.kd_ratio = kd_loss, kd_ratio
        self.frozen: FrozenModel = teacher
        self.teacher: nn.Module | None = None
        self._sums: list[torch.Tensor] = []  # the step's (cross-entropy, KD, tokens) so far, on the device

    def hold(self, model: TransformerDecoder) -> None:
        self.teacher = model
        if hasattr(self.kd_loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(self.kd_loss_fn.num_output_chunks)

    @property
    def resident(self) -> tuple[nn.Module, ...]:  # type: ignore[override]  # the base class attribute, read-only here
        return () if self.teacher is None else (self.teacher,)

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        traced, total = frozen_layers
        layers = f"{traced} of its {total} layers traced" if traced < total else f"all its {total} layers traced"
        return (
            f"KD: the student's forward and backward on the micro batch, and the teacher's forward "
            f"on it without autograd ({self.frozen.model}, {frozen_bytes / _GIB:.2f} GiB of weights "
            f"per rank, sharded as the student's and counted with them; {layers}), which saves "
            f"nothing for the backward; both models' logits live until the cross-entropy and KD "
            f"losses are done"
        )

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: AbstractContextManager
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's forward without autograd, then the student's (under ``activations``), both losses on the
        labels shifted by one token (as :func:`~adaptive_batching.core.loss.summed_token_loss`); returns the mixed
        loss summed over the tokens that count, and their number. (Stock runs the student first: the same
        arithmetic, but the teacher's forward then runs on top of the student's saved activations, and on CPU glibc
        hands its freed pages back to be faulted in again.)"""
        assert self.teacher is not None, "the teacher is built with the other parts"
        labels, tokens = shifted_labels(batch.pop("labels"), loss_fn.ignore_index)
        with torch.no_grad():  # first: its transients are gone before the student's activations are saved
            teacher_logits = self.teacher(**batch)
        with activations:
            logits = model(**batch)
        logits, labels = flat(logits, labels)
        teacher_logits, _ = flat(teacher_logits, labels)
        kd_loss = self.kd_loss_fn(logits, teacher_logits, labels)
        class_loss = loss_fn(logits, labels)
        del logits, teacher_logits
        self._sums.append(torch.stack([class_loss.detach() * tokens, kd_loss.detach() * tokens, tokens.float()]))
        return ((1 - self.kd_ratio) * class_loss + self.kd_ratio * kd_loss) * tokens, tokens

    def start_step(self) -> None:
        """Forget the micro batches of a step that did not finish (an out-of-memory retry, a profiler trial)."""
        self._sums.clear()

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        """The step's cross-entropy and KD loss (token-weighted over its micro batches on this rank), as
        ``knowledge_distillation_single_device`` logs them beside ``loss``."""
        if not self._sums:
            return {}
        class_sum, kd_sum, tokens = torch.stack(self._sums).sum(dim=0).tolist()
        self._sums.clear()
        return {"class_loss": class_sum / max(tokens, 1), "kd_loss": kd_sum / max(tokens, 1)}
