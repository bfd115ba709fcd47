"""The training objectives: supervised fine-tuning and direct preference optimisation (DPO) on LoRA adapters.

Each is a :class:`~adaptive_batching.core.objective.TrainingObjective` the trainer composes; the recipes pick one.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import rlhf
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.modules.peft import disable_adapter

from adaptive_batching.batching.data import build_collate, worst_case_batch
from adaptive_batching.config.objectives import check_lora_dpo, recipe_for_model
from adaptive_batching.core.loss import summed_token_loss


class SupervisedFinetune:
    """Next-token cross-entropy on each sample's labels, summed over the tokens that count."""

    name = "finetune"
    sequences_per_sample = 1

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        return build_collate(collate_path, packed, pad_id, loss_fn.ignore_index)

    def micro_loss(self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor],
                   activations: ContextManager) -> tuple[torch.Tensor, torch.Tensor]:
        return summed_token_loss(model, loss_fn, batch, activations)

    def worst_case_batch(self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int,
                         packed: bool) -> dict[str, torch.Tensor]:
        return worst_case_batch(collate, micro_batch=micro_batch, seq_len=seq_len, vocab_size=vocab_size,
                                packed=packed)

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        return {}


class PairCollate:
    """torchtune's ``padded_collate_dpo`` (chosen and rejected padded to the longest of the micro batch), with
    each pair kept in one row: ``tokens`` and ``labels`` are (pairs, 2, length), chosen first, so a micro batch
    is cut by pairs. An empty micro batch becomes one pair whose labels are all ignored: it counts for nothing."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.empty = {"chosen_input_ids": [pad_id], "chosen_labels": [CROSS_ENTROPY_IGNORE_IDX],
                      "rejected_input_ids": [pad_id], "rejected_labels": [CROSS_ENTROPY_IGNORE_IDX]}

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        tokens, labels = padded_collate_dpo(samples or [self.empty], padding_idx=self.pad_id,
                                            ignore_idx=CROSS_ENTROPY_IGNORE_IDX)
        pairs = tokens.size(0) // 2
        return {"tokens": tokens.view(2, pairs, -1).transpose(0, 1).contiguous(),
                "labels": labels.view(2, pairs, -1).transpose(0, 1).contiguous()}


def _concatenated(pairs: torch.Tensor) -> torch.Tensor:
    """(pairs, 2, length) -> (2 x pairs, length): every chosen sequence, then every rejected one, as
    ``padded_collate_dpo`` gives them."""
    return pairs.transpose(0, 1).reshape(-1, pairs.size(-1))


class LoRADPO:
    """DPO with LoRA: the policy is the model with its adapters, the reference the same model with them
    disabled, as torchtune's ``lora_dpo_single_device`` computes it. The loss is ``loss`` (``DPOLoss``,
    ``RSOLoss``) summed over a micro batch's pairs; the step divides by the pairs of the whole step."""

    name = "lora_dpo"
    sequences_per_sample = 2

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        return PairCollate(pad_id)

    def reference(self, model: nn.Module) -> ContextManager:
        """The reference model: the policy with its adapters off."""
        return disable_adapter(model)

    def _log_probs(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                   activations: ContextManager) -> tuple[torch.Tensor, torch.Tensor]:
        with activations:
            logits = model(tokens)
        return rlhf.get_batch_log_probs(logits, labels), logits

    def micro_loss(self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor],
                   activations: ContextManager) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = batch["tokens"].size(0)
        tokens, labels = _concatenated(batch.pop("tokens")), _concatenated(batch.pop("labels"))
        log_probs, logits = self._log_probs(model, tokens, labels, activations)
        logits_chosen, logits_rejected = logits[:pairs].detach().mean(), logits[pairs:].detach().mean()
        del logits
        with torch.no_grad(), self.reference(model):
            reference, _ = self._log_probs(model, tokens, labels, activations)
        chosen, rejected = log_probs[:pairs], log_probs[pairs:]
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, reference[:pairs], reference[pairs:])
        counts = (labels != CROSS_ENTROPY_IGNORE_IDX).any(dim=-1).view(2, pairs).any(dim=0)
        self.last = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
                     "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                     "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                     "log_probs/rejected": rejected.detach().mean(), "log_probs/chosen": chosen.detach().mean(),
                     "logits/rejected": logits_rejected, "logits/chosen": logits_chosen}
        return (losses * counts).sum(), counts.sum()

    def worst_case_batch(self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int,
                         packed: bool) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (micro_batch, 2, seq_len), generator=generator).tolist()
        return collate([{"chosen_input_ids": chosen, "chosen_labels": chosen, "rejected_input_ids": rejected,
                         "rejected_labels": rejected} for chosen, rejected in tokens])

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        """As ``lora_dpo_single_device`` logs them: the rewards and log-probabilities of the step's last micro
        batch, and the tokens per second of the policy's forwards (both sequences of each pair, padding
        included) in place of the pairs per second the step's count would give."""
        return {"tokens_per_second_per_gpu": padded_tokens / seconds,
                **{name: float(value) for name, value in self.last.items()}}


def objective_for(cfg: DictConfig) -> Any:
    """The objective of the recipe that runs ``cfg`` (``adaptive-batching profile`` and ``plan`` have no recipe):
    LoRA DPO for a LoRA config that asks for DPO (checked as its recipe checks it), else supervised fine-tuning."""
    if recipe_for_model(cfg) != "adaptive_lora_dpo":
        return SupervisedFinetune()
    check_lora_dpo(cfg)
    return LoRADPO()
