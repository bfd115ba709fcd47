"""Top-level keys: near misses of any known key (ours and torchtune's) and '+' keys are refused, keys that ask for
another kind of training are refused naming it, other unread keys are listed."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import pytest
from config_edits import CONFIGS, modified
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.config.inputs import check_inputs
from adaptive_batching.config.keys import check_top_level_keys, interpolated_keys, meant_key
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import DATASETS, TRAINING_KEYS, TRAINING_KINDS, recipe_for_model
from adaptive_batching.core.packages import NEEDS, PIP
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.recipe_table import method_and_objective


@pytest.mark.parametrize(
    "name", ["tiny_full", "tiny_lora", "llama3_2_1b", "llama3_2_1b_lora", "llama3_8b", "llama3_8b_lora"]
)
def test_shipped_configs_have_no_unread_keys(name: str) -> None:
    assert check_top_level_keys(OmegaConf.load(CONFIGS / f"{name}.yaml")) == []


def test_interpolation_only_keys_are_used() -> None:
    cfg = OmegaConf.load(CONFIGS / "tiny_full.yaml")
    assert "assets_dir" in interpolated_keys(cfg) and "output_dir" in interpolated_keys(cfg)


@pytest.mark.parametrize(
    "override, typo, meant",
    [
        ("use_max_batch_size=True", "use_max_batch_size", "use_maximum_batch_size"),
        ("batch_increase_fn=null", "batch_increase_fn", "batch_increase_function"),
        ("lr_scale=linear", "lr_scale", "lr_scaling"),
        ("adaptive_batch.memory_budget=1GiB", "adaptive_batch", "adaptive_batching"),
    ],
)
def test_a_near_miss_of_our_keys_is_refused_naming_the_key_meant(override: str, typo: str, meant: str) -> None:
    cfg = load_config("tiny_full", [override])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert f"'{typo}'" in str(info.value) and f"did you mean '{meant}'" in str(info.value)


@pytest.mark.parametrize(
    "override, typo, meant",
    [
        ("save_every_n_step=5", "save_every_n_step", "save_every_n_steps"),
        ("gradient_accumulation_step=2", "gradient_accumulation_step", "gradient_accumulation_steps"),
        ("enable_activation_checkpoint=True", "enable_activation_checkpoint", "enable_activation_checkpointing"),
        ("max_steps_per_epochs=3", "max_steps_per_epochs", "max_steps_per_epoch"),
        ("epoch=2", "epoch", "epochs"),
        ("optimiser.lr=0.1", "optimiser", "optimizer"),
        ("clip_grad=1.0", "clip_grad", "clip_grad_norm"),
        ("fsdp_cpu_offloading=True", "fsdp_cpu_offloading", "fsdp_cpu_offload"),
        ("kd_ration=0.5", "kd_ration", "kd_ratio"),
        ("quantiser._component_=x", "quantiser", "quantizer"),
    ],
)
def test_a_near_miss_of_a_torchtune_key_is_refused_naming_the_key_meant(override: str, typo: str, meant: str) -> None:
    """One rule for every key, so a misspelt torchtune key no longer runs without what it asked for (before,
    ``save_every_n_step=5`` was listed as ignored and no mid-epoch checkpoint was written)."""
    cfg = load_config("tiny_full", [override])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert str(info.value) == f"config key '{typo}' is not read by the recipes; did you mean '{meant}'?"


def test_a_plus_key_is_refused_naming_the_key_meant() -> None:
    """torchtune has no '+' syntax: the override made a top-level key literally named '+adaptive_batching'."""
    cfg = load_config("tiny_full", ["+adaptive_batching.keep_global_batch=True"])
    assert "+adaptive_batching" in cfg
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert "'+adaptive_batching'" in str(
        info.value
    ) and "write adaptive_batching.keep_global_batch=True (without the '+')" in str(info.value)


def test_other_unread_keys_get_one_warning_line(base_cfg: DictConfig, caplog: pytest.LogCaptureFixture) -> None:
    cfg = modified(base_cfg, {"log_peak_memory_stats": True, "dataloader_workers": 2, "my_note": "x"})
    with caplog.at_level(logging.WARNING):
        validate_config(cfg)
    lines = [r.getMessage() for r in caplog.records if "not read by the recipes" in r.getMessage()]
    assert lines == ["config keys not read by the recipes (ignored): dataloader_workers, my_note"]


def test_distant_keys_are_not_near_misses() -> None:
    assert meant_key("log_peak_memory_stats") is None and meant_key("output_dir") is None  # known keys
    assert meant_key("dataloader_workers") is None and meant_key("my_note") is None and meant_key("lr") is None
    assert meant_key("use_maximum_batch") == "use_maximum_batch_size"


def test_torchtunes_keys_that_change_nothing_trained_keep_the_warning(
    base_cfg: DictConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """``save_every_n_epochs`` is one letter from a near miss of ``save_every_n_steps``, but a key torchtune reads
    (these recipes save every epoch anyway); a training key set to null asks for nothing."""
    cfg = modified(base_cfg, {"save_every_n_epochs": 1, "ac_mode": "selective", "quantizer": None})
    with caplog.at_level(logging.WARNING):
        validate_config(cfg)
    lines = [r.getMessage() for r in caplog.records if "not read by the recipes" in r.getMessage()]
    assert lines == ["config keys not read by the recipes (ignored): ac_mode, save_every_n_epochs"]


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer",
            "config key 'quantizer' = 'torchtune.training.quantization.Int8DynActInt4WeightQuantizer' asks for "
            "quantizing a trained model (post-training quantization), which adaptive_full_finetune does not do yet; "
            "use torchtune's quantize",
        ),
        (
            "kd_ratio=0.5",
            "config key 'kd_ratio' = 0.5 asks for knowledge distillation from a teacher model, which "
            "adaptive_full_finetune does not do; use adaptive_knowledge_distillation",
        ),
        (
            "loss._component_=torchtune.modules.loss.ForwardKLWithChunkedOutputLoss",
            "config key 'loss._component_' = 'torchtune.modules.loss.ForwardKLWithChunkedOutputLoss' asks for "
            "knowledge distillation from a teacher model, which adaptive_full_finetune does not do; use "
            "adaptive_knowledge_distillation",
        ),
        (
            "loss._component_=torchtune.rlhf.loss.RSOLoss",
            "config key 'loss._component_' = 'torchtune.rlhf.loss.RSOLoss' asks for preference optimisation (DPO) on "
            "chosen and rejected answers, which adaptive_full_finetune does not do; use adaptive_full_dpo",
        ),
        (
            "dataset._component_=torchtune.datasets.hh_rlhf_helpful_dataset",
            "config key 'dataset._component_' = 'torchtune.datasets.hh_rlhf_helpful_dataset' asks for preference "
            "optimisation (DPO) on chosen and rejected answers, which adaptive_full_finetune does not do; use "
            "adaptive_full_dpo",
        ),
        (
            "layer_dropout.prob=0.1",
            "config key 'layer_dropout' asks for early-exit training (layer dropout, an early-exit loss), which "
            "adaptive_full_finetune does not do yet; use torchtune's dev/early_exit_finetune_distributed",
        ),
    ],
)
def test_a_key_that_asks_for_other_training_is_refused_before_any_model_loads(override: str, line: str) -> None:
    """Refused first, before the keys are checked for near misses (``teacher_checkpointer`` is one of
    ``checkpointer``); a DPO key names the DPO recipe for the model's kind (full here)."""
    with pytest.raises(ConfigError) as info:
        validate_config(load_config("tiny_full", [override]), "adaptive_full_finetune")
    assert str(info.value) == line


PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-keys.md"
# The override that makes each line the keys page quotes (wandb as not installed, whatever this machine has).
QUOTED = {
    "lr_scaling": "lr_scaling=cubic",
    "use_max_batch_size": "use_max_batch_size=True",
    "save_every_n_step": "save_every_n_step=5",
    "quantizer": "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer",
    "metric_logger._component_": "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
    "optimizer._component_": "optimizer._component_=torch.optim.AdamWW",
    "checkpointer.model_type": "checkpointer.model_type=LLAMA9",
}
# The lines the page quotes from an objective's config: its check and the run's inputs' (tiny assets where the
# page says /tmp/adaptive-batching/tiny, their default place).
RUN_QUOTED = {
    "teacher_checkpointer": ("tiny_kd", "teacher_checkpointer=null"),
    "teacher_checkpointer.checkpoint_files": ("tiny_kd", "teacher_checkpointer.checkpoint_files=[nothere.safetensors]"),
    "dataset": ("tiny_lora_dpo", "dataset.data_files=${assets_dir}/data/alpaca_tiny.json"),
}


def page_quotes() -> dict[str, str]:
    """Key -> the ``config error:`` line the keys page quotes for it."""
    text = PAGE.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.startswith("config error: config key '")]
    return {line.split("'")[1]: line for line in lines}


def test_the_keys_page_quotes_the_codes_own_lines(
    monkeypatch: pytest.MonkeyPatch, assets: Path, tmp_path: Path
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    quoted = page_quotes()
    assert set(quoted) == set(QUOTED) | set(RUN_QUOTED)
    for key, override in QUOTED.items():
        with pytest.raises(ConfigError) as error:
            validate_config(load_config("tiny_full", [override]))
        assert f"config error: {error.value}" == quoted[key]
    for key, (name, override) in RUN_QUOTED.items():
        cfg = load_config(name, [f"assets_dir={assets}", f"output_dir={tmp_path}", override])
        with pytest.raises(ConfigError) as error:
            validate_config(cfg, recipe_for_model(cfg))
            check_inputs(cfg, method_and_objective(cfg, profiled=False)[1])  # checked as its recipe checks it
        assert f"config error: {error.value}".replace(str(assets), "/tmp/adaptive-batching/tiny") == quoted[key]


def test_the_keys_page_tables_name_every_training_key_objective_and_package() -> None:
    text = PAGE.read_text(encoding="utf-8")
    training = text[text.index("| keys (any value but null) |") : text.index("### Components and optional packages")]
    spans = set(re.findall(r"`([^`]+)`", training))
    assert set(TRAINING_KEYS) <= spans
    assert {recipe for objective in TRAINING_KINDS.values() for recipe in objective.torchtune} <= spans
    assert all(objective.what in training for objective in TRAINING_KINDS.values())
    assert all(name in training for name in [*DATASETS, "DPOLoss", "RSOLoss", "PPOLoss", "ForwardKLLoss"])
    packages = text[text.index("| package | needed by |") : text.index("## The torchtune keys the recipes read")]
    assert set(re.findall(r"^\| `(\w+)` \|", packages, flags=re.M)) == set(PIP)
    assert all(f"`{component}`" in packages for component in NEEDS)
