"""The one place that maps a recipe to its method and objective (training/recipe_table.py): every recipe of ours is in
it, each recipe asks it for its own name, and the CLI's choice for a config is its recipe's."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_batching.config.loading import RECIPES, load_config
from adaptive_batching.config.training_kinds import builds_lora, recipe_for_model
from adaptive_batching.core.objective import FrozenModel
from adaptive_batching.training.methods import FullFinetune, LoRAFinetune
from adaptive_batching.training.objectives import FullDPO, KnowledgeDistillation, LoRADPO, SupervisedFinetune
from adaptive_batching.training.quantization import QuantizationAware
from adaptive_batching.training.recipe_table import RECIPE_TABLE, method_and_objective

RECIPE_DIR = Path(__file__).parent.parent / "recipes"

# Each tiny config: the recipe that runs it, and the method and objective it trains with.
TINY = {
    "tiny_full": ("adaptive_full_finetune", FullFinetune, SupervisedFinetune),
    "tiny_lora": ("adaptive_lora_finetune", LoRAFinetune, SupervisedFinetune),
    "tiny_lora_dpo": ("adaptive_lora_dpo", LoRAFinetune, LoRADPO),
    "tiny_full_dpo": ("adaptive_full_dpo", FullFinetune, FullDPO),
    "tiny_kd": ("adaptive_knowledge_distillation", LoRAFinetune, KnowledgeDistillation),
    "tiny_qat_lora": ("adaptive_lora_finetune", QuantizationAware, SupervisedFinetune),
}


def test_every_recipe_is_in_the_table_and_asks_it_for_its_own_name() -> None:
    assert set(RECIPE_TABLE) == set(RECIPES)
    for recipe in RECIPES:
        source = (RECIPE_DIR / f"{recipe}.py").read_text(encoding="utf-8")
        assert f'method_and_objective(cfg, "{recipe}", profiled=settings.needs_profile)' in source, recipe


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_configs_method_and_objective_are_its_recipes(name: str) -> None:
    recipe, method_type, objective_type = TINY[name]
    cfg = load_config(name)
    assert recipe_for_model(cfg) == recipe
    method, objective = method_and_objective(cfg, profiled=True)
    assert type(method) is method_type and type(objective) is objective_type
    assert builds_lora(cfg) == isinstance(getattr(method, "method", method), LoRAFinetune)
    expected = {
        FullDPO: FrozenModel("model", "ref_checkpointer"),
        KnowledgeDistillation: FrozenModel("teacher_model", "teacher_checkpointer"),
    }
    assert objective.frozen == expected.get(objective_type)
    assert objective.sequences_per_sample == (2 if objective_type in (LoRADPO, FullDPO) else 1)
    if isinstance(objective, KnowledgeDistillation):
        assert objective.kd_ratio == cfg.get("kd_ratio", 0.5)


def test_a_full_student_distils_with_every_weight_training() -> None:
    cfg = load_config("tiny_kd", ["model._component_=torchtune.models.llama3.llama3", "~model.lora_attn_modules"])
    assert not builds_lora(cfg)
    method, _ = method_and_objective(cfg, "adaptive_knowledge_distillation", profiled=False)
    assert type(method) is FullFinetune
