"""Checkpoint load and save through the configured torchtune checkpointer.

The recipe state (optimizer, epoch, seed, and the adaptive state under ``ADAPTIVE_KEY``) is
written at every save, the last one included, so any finished epoch can be resumed or extended.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from torchtune import config, training
from torchtune.training.checkpointing._utils import RECIPE_STATE_DIRNAME

ADAPTIVE_KEY = "adaptive_batching"
_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")


def latest_epoch_dir(output_dir: Path) -> Optional[Path]:
    """The ``epoch_N`` folder with the largest N, if any."""
    found = [(int(m.group(1)), p) for p in output_dir.glob("epoch_*") if (m := _EPOCH_DIR.match(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


def resume_config(cfg_checkpointer: DictConfig) -> DictConfig:
    """The checkpointer config that resumes from the newest saved epoch.

    torchtune 0.6.1 reloads a full fine-tune's weights only from files named in
    ``checkpoint_files`` relative to ``output_dir``; point those at the newest ``epoch_N``.
    A LoRA run (an ``adapter_model.pt`` there) keeps its base weights and finds the adapter itself.
    """
    output_dir = Path(cfg_checkpointer.output_dir)
    latest = latest_epoch_dir(output_dir)
    if latest is None or not (output_dir / RECIPE_STATE_DIRNAME / "recipe_state.pt").is_file():
        raise FileNotFoundError(
            f"resume_from_checkpoint=True but {output_dir} holds no saved epoch (epoch_N/ and "
            f"{RECIPE_STATE_DIRNAME}/recipe_state.pt); set resume_from_checkpoint=False or "
            f"point output_dir at the run to resume"
        )
    if (latest / "adapter_model.pt").is_file():
        return cfg_checkpointer
    weights = sorted(p.name for p in latest.glob("model-*") if p.suffix in (".safetensors", ".bin", ".pt"))
    resumed = OmegaConf.create(OmegaConf.to_container(cfg_checkpointer, resolve=True))
    resumed.checkpoint_files = [f"{latest.name}/{name}" for name in weights]
    return resumed


def load_checkpoint(cfg_checkpointer: DictConfig, resume: bool) -> tuple[Any, dict[str, Any]]:
    """Instantiate the checkpointer and load the weights, plus the recipe state on resume."""
    if resume:
        cfg_checkpointer = resume_config(cfg_checkpointer)
    checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=resume)
    return checkpointer, checkpointer.load_checkpoint()


def recipe_state(*, seed: int, epochs_run: int, total_epochs: int, max_steps_per_epoch: Any,
                 optimizer_state: dict[str, Any], adaptive_state: dict[str, Any]) -> dict[str, Any]:
    """The non-weight entries of a checkpoint, under torchtune's own key names."""
    return {
        training.SEED_KEY: seed,
        training.EPOCHS_KEY: epochs_run,
        training.TOTAL_EPOCHS_KEY: total_epochs,
        training.MAX_STEPS_KEY: max_steps_per_epoch,
        training.OPT_KEY: optimizer_state,
        ADAPTIVE_KEY: adaptive_state,
    }
