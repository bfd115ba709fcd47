"""Full DPO's parity runs (test_full_dpo.py): a step built by hand from torchtune's parts, or ``adaptive_full_dpo``.

    python tests/full_dpo_parity_run.py by_hand --config CONFIG KEY=VALUE...
    python tests/full_dpo_parity_run.py adaptive_full_dpo --config CONFIG KEY=VALUE...

torchtune's ``full_dpo_distributed`` stops on CPU ("Distributed package doesn't have NCCL built in"), so ours is
held to its step built by hand on one process: the policy (the config's model, the checkpointer's weights, every
weight trainable), a frozen reference copy from ``ref_checkpointer``, ``padded_collate_dpo`` over the data in order
(``batch_size`` pairs a micro batch, ``gradient_accumulation_steps`` micro batches a step, as its loop takes them),
the concatenated forwards, ``DPOLoss`` averaged per micro batch and divided by the accumulation, the configured
optimizer and LR schedule. It logs, through the config's metric logger, the loss and LR of each step and the
rewards, log-probabilities and logits of its last micro batch (what ``adaptive_full_dpo`` and
``lora_dpo_single_device`` log; ``full_dpo_distributed`` averages those over the step's micro batches).
"""

from __future__ import annotations

import runpy
import sys
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, SequentialSampler
from torchtune import config, rlhf, training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo


def _model(cfg: DictConfig, checkpointer: DictConfig) -> torch.nn.Module:
    with training.set_default_dtype(training.get_dtype(cfg.dtype)):
        model = config.instantiate(cfg.model)
    weights = config.instantiate(checkpointer, should_load_recipe_state=False).load_checkpoint()
    model.load_state_dict(weights[training.MODEL_KEY], strict=True)
    return model


def _log_probs(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``full_dpo_distributed.concatenated_forward``: chosen and rejected log-probabilities, then their logits."""
    pairs = tokens.shape[0] // 2
    logits = model(tokens)
    return (
        rlhf.get_batch_log_probs(logits[:pairs], labels[:pairs], return_average_logprobs=False),
        rlhf.get_batch_log_probs(logits[pairs:], labels[pairs:], return_average_logprobs=False),
        logits[:pairs],
        logits[pairs:],
    )


def by_hand(cfg: DictConfig) -> None:
    training.set_seed(cfg.seed)
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset, tokenizer=tokenizer)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=SequentialSampler(dataset),
        drop_last=True,
        collate_fn=partial(padded_collate_dpo, padding_idx=tokenizer.pad_id, ignore_idx=CROSS_ENTROPY_IGNORE_IDX),
    )
    policy, reference = _model(cfg, cfg.checkpointer), _model(cfg, cfg.ref_checkpointer)
    for param in reference.parameters():
        param.requires_grad = False
    reference.eval()
    accumulation, steps = cfg.gradient_accumulation_steps, cfg.max_steps_per_epoch
    optimizer = config.instantiate(cfg.optimizer, policy.parameters())
    scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps, last_epoch=-1)
    loss_fn, logger = config.instantiate(cfg.loss), config.instantiate(cfg.metric_logger)
    policy.train()
    running: Any = 0
    for index, (tokens, labels) in enumerate(loader):
        if index // accumulation == steps:
            break
        chosen, rejected, chosen_logits, rejected_logits = _log_probs(policy, tokens, labels)
        chosen_logits_mean, rejected_logits_mean = chosen_logits.detach().mean(), rejected_logits.detach().mean()
        del chosen_logits, rejected_logits
        with torch.no_grad():
            reference_chosen, reference_rejected, _, _ = _log_probs(reference, tokens, labels)
        loss, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, reference_chosen, reference_rejected)
        loss = loss.mean() / accumulation
        running += loss
        loss.backward()
        if (index + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            logger.log_dict(
                {
                    "loss": running.item(),
                    "lr": training.get_lr(optimizer),
                    "rewards/chosen": chosen_rewards.mean(),
                    "rewards/rejected": rejected_rewards.mean(),
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                    "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                    "log_probs/chosen": chosen.detach().mean(),
                    "log_probs/rejected": rejected.detach().mean(),
                    "logits/chosen": chosen_logits_mean,
                    "logits/rejected": rejected_logits_mean,
                },
                step=(index + 1) // accumulation,
            )
            running = 0
    logger.close()


def main() -> None:
    recipe, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    if recipe == "by_hand":
        config.parse(by_hand)()
    else:
        runpy.run_module(recipe, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
