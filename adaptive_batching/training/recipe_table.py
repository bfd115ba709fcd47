"""Which fine-tuning method and training objective each recipe trains with: the one place that maps a recipe's name
to them, read from the config. The recipes ask it for their own name; the CLI (``profile``, ``plan``,
``estimate``) for the recipe that runs the config (``config.training_kinds.recipe_for_model``).

Each objective is built here from typed values the config gives (KD: its loss, its ratio, its teacher), and
checked first as its recipe checks it, in one line before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig
from torchtune import config

from adaptive_batching.config.trace_inputs import trace_inputs
from adaptive_batching.config.training_kinds import (
    builds_lora,
    check_full_dpo,
    check_kd,
    check_lora_dpo,
    kd_ratio,
    recipe_for_model,
)
from adaptive_batching.config.vision import image_geometry, is_vision
from adaptive_batching.core.defaults import DEFAULT_COMPILE
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building
from adaptive_batching.core.objective import FrozenModel, TrainingObjective
from adaptive_batching.errors import ConfigError
from adaptive_batching.estimate.fake_steps import TraceInputs
from adaptive_batching.training import compiling
from adaptive_batching.training.methods import FullFinetune, LoRAFinetune
from adaptive_batching.training.objectives import (
    FullDPO,
    KnowledgeDistillation,
    LoRADPO,
    SupervisedFinetune,
    VisionFinetune,
)
from adaptive_batching.training.quantization import quantization_aware

TEACHER = FrozenModel("teacher_model", "teacher_checkpointer")  # KD's teacher: its builder and weights, as torchtune's


def full(cfg: DictConfig) -> FinetuneMethod:
    """Every weight trains."""
    return FullFinetune()


def lora(cfg: DictConfig) -> FinetuneMethod:
    """The adapters of config key ``model`` train; ``save_adapter_weights_only`` saves them alone."""
    return LoRAFinetune(cfg.model, save_adapter_weights_only=cfg.get("save_adapter_weights_only", False))


def student(cfg: DictConfig) -> FinetuneMethod:
    """KD's student: LoRA when the model builder is a LoRA one (as torchtune's KD configs), else full."""
    return lora(cfg) if builds_lora(cfg) else full(cfg)


def supervised(cfg: DictConfig) -> TrainingObjective:
    """Fine-tuning; of a vision model, with its images cut into tiles as the config's transform cuts them."""
    return VisionFinetune(image_geometry(cfg)) if is_vision(cfg) else SupervisedFinetune()


def lora_dpo(cfg: DictConfig) -> TrainingObjective:
    check_lora_dpo(cfg)
    return LoRADPO()


def full_dpo(cfg: DictConfig) -> TrainingObjective:
    check_full_dpo(cfg)
    return FullDPO()


def distillation(cfg: DictConfig) -> TrainingObjective:
    """KD with the config's ``kd_loss`` (compiled with ``compile``), ``kd_ratio`` and teacher."""
    check_kd(cfg)
    with building("kd_loss"):
        kd_loss = config.instantiate(cfg.kd_loss)
    if cfg.get("compile", DEFAULT_COMPILE):
        kd_loss = compiling.compile_loss(kd_loss, verbose=False)
    return KnowledgeDistillation(kd_loss, kd_ratio(cfg), TEACHER)


@dataclass(frozen=True)
class Trains:
    """What a recipe trains: its method and its objective, each made from the config (checked as the recipe checks
    it), afresh for each run."""

    method: Callable[[DictConfig], FinetuneMethod]
    objective: Callable[[DictConfig], TrainingObjective]


RECIPE_TABLE: dict[str, Trains] = {
    "adaptive_full_finetune": Trains(full, supervised),
    "adaptive_lora_finetune": Trains(lora, supervised),
    "adaptive_lora_dpo": Trains(lora, lora_dpo),
    "adaptive_full_dpo": Trains(full, full_dpo),
    "adaptive_knowledge_distillation": Trains(student, distillation),
}


def method_and_objective(
    cfg: DictConfig, recipe: str | None = None, *, profiled: bool
) -> tuple[FinetuneMethod, TrainingObjective]:
    """The method and objective that ``recipe`` (default: the recipe of ours that runs ``cfg``) trains ``cfg``
    with; the method fake-quantized when the config has a ``quantizer`` (QAT, which only the fine-tuning recipes
    accept: the others refuse the key first). ``profiled``: whether the run profiles (QAT's set-up line says its
    trial steps run with fake quantization on)."""
    recipe = recipe or recipe_for_model(cfg)
    if recipe not in RECIPE_TABLE:
        raise ConfigError(f"recipe {recipe!r} is not one of ours: {', '.join(RECIPE_TABLE)}")
    trains = RECIPE_TABLE[recipe]
    objective = trains.objective(cfg)
    return quantization_aware(cfg, trains.method(cfg), profiled=profiled), objective


def traced_parts(cfg: DictConfig, recipe: str | None = None) -> tuple[TraceInputs, FinetuneMethod, TrainingObjective]:
    """What ``adaptive-batching estimate`` traces of ``cfg``: the inputs of the trace (see ``config.trace_inputs``),
    and the method and objective of ``recipe`` (default: the recipe that runs ``cfg``), as
    :func:`~adaptive_batching.estimate.prediction.trace_steps` takes them."""
    method, objective = method_and_objective(cfg, recipe, profiled=False)
    return trace_inputs(cfg, objective.frozen), method, objective
