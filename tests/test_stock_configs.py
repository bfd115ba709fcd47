"""torchtune's own configs, as users bring them: names resolved as ``tune run`` resolves them, every stock key
accepted (refused only where the recipes cannot do what it asks, by name), our shipped real-model configs; every
stock config of torchtune's other recipes (DPO, KD, QAT, ...) refused in one line naming the recipe that trains it."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torchtune._recipe_registry import get_all_recipes

from adaptive_batching.cli import main
from adaptive_batching.config.keys import TORCHTUNE_OTHER_KEYS, check_top_level_keys
from adaptive_batching.config.loading import FINETUNE_RECIPES, load_config, resolve_config, stock_configs
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import OURS, TRAINING_KEYS, TRAINING_KINDS
from adaptive_batching.errors import ConfigError, ConfigNotFound
from adaptive_batching.training import stepping
from adaptive_batching.training.stepping import StepStats, step_metrics

STOCK = stock_configs(FINETUNE_RECIPES)
# torchtune 0.6.1's single-device full fine-tunes update weights inside the backward (no gradients kept).
OPTIMIZER_IN_BACKWARD = {
    "code_llama2/7B_full_low_memory",
    "llama2/7B_full_low_memory",
    "llama3/8B_full_single_device",
    "llama3_1/8B_full_single_device",
    "llama3_2/1B_full_single_device",
    "llama3_2/3B_full_single_device",
    "mistral/7B_full_low_memory",
    "phi3/mini_full_low_memory",
    "phi4/14B_full_low_memory",
    "qwen2/1.5B_full_single_device",
    "qwen2/7B_full_single_device",
    "qwen2_5/1.5B_full_single_device",
    "qwen2_5/3B_full_single_device",
    "qwen2_5/7B_full_single_device",
}
# Every stock config of torchtune 0.6.1 whose file its wheel ships (the registry also names
# llama2/7B_full_early_exit, whose file it lacks), with the recipe it names.
EVERY_STOCK = {
    config.name: (recipe.name, stock_configs([recipe.name])[config.name])
    for recipe in get_all_recipes()
    for config in recipe.configs
    if stock_configs([recipe.name])[config.name].is_file()
}
# The other recipes that train: each of their configs is refused, naming the recipe.
OTHER_TRAINING = {
    "qat_distributed",
    "qat_lora_finetune_distributed",
    "knowledge_distillation_single_device",
    "knowledge_distillation_distributed",
    "lora_dpo_single_device",
    "lora_dpo_distributed",
    "full_dpo_distributed",
    "ppo_full_finetune_single_device",
    "dev/lora_finetune_distributed_multi_dataset",
    "quantize",
}
VISION = {name for name in STOCK if name.startswith("llama3_2_vision/")}
SHIPPED_REAL = (
    "llama3_8b",
    "llama3_8b_lora",
    "llama3_2_1b",
    "llama3_2_1b_lora",
    "qwen2_5_7b_lora",
    "llama3_1_8b_qlora",
)
# A shipped config that is torchtune's but for keys no trace reads (the batching's, logging's, where output goes):
# its steps are the stock config's, traced once for both tests that estimate it.
SAME_STEPS = {
    "llama3_1_8b_qlora": (
        "llama3_1/8B_qlora_single_device",
        {"adaptive_batching", "use_maximum_batch_size", "output_dir", "profiler", "enable_activation_offloading"},
    )
}


def test_the_registry_has_torchtunes_121_full_lora_and_qlora_configs() -> None:
    assert len(STOCK) == 121 and "llama3_1/8B_full" in STOCK and "llama3_1/8B_qlora_single_device" in STOCK
    assert all(path.is_file() for path in STOCK.values())


def test_every_top_level_key_of_every_stock_config_is_read_or_accepted_silently() -> None:
    unread = {name: check_top_level_keys(OmegaConf.load(path)) for name, path in STOCK.items()}
    assert {name: keys for name, keys in unread.items() if keys} == {}


def test_no_key_of_any_stock_config_is_taken_for_a_misspelling() -> None:
    """All 155 stock configs, of every recipe: each key is read, refused by name or known to change nothing these
    recipes train; none is a near miss refused with a did-you-mean."""
    assert len(EVERY_STOCK) == 155
    unread = {key for _, path in EVERY_STOCK.values() for key in check_top_level_keys(OmegaConf.load(path))}
    assert unread and unread <= set(TRAINING_KEYS) | TORCHTUNE_OTHER_KEYS, unread - set(TRAINING_KEYS)


def test_every_stock_config_validates_and_the_optimizer_in_backward_ones_say_so() -> None:
    """The vision configs too, where torchvision, which their models import, is installed; else they stop with
    its pip install."""
    in_backward = set()
    for name, path in STOCK.items():
        if name in VISION and importlib.util.find_spec("torchvision") is None:
            with pytest.raises(
                ConfigError,
                match=r"^config key 'model._component_' = 'torchtune.models.llama3_2_vision"
                r"\.[a-z0-9_]+' needs torchvision, which is not installed: "
                r"pip install torchvision$",
            ):
                validate_config(OmegaConf.load(path))
        elif validate_config(OmegaConf.load(path)).optimizer_in_bwd:
            in_backward.add(name)
    assert in_backward == OPTIMIZER_IN_BACKWARD


@pytest.mark.parametrize("recipe", sorted(OURS))
def test_every_stock_config_of_another_training_recipe_is_refused_naming_that_recipe(recipe: str) -> None:
    """DPO, KD, QAT, PPO, post-training quantization and multi-data-set configs, given to a recipe of ours that
    does not train so: one line naming the key, what it asks for and the recipe that does it (ours if one does, else
    torchtune's)."""
    pattern = re.compile(
        rf"config key '[\w.\[\]]+'( = [^ ]+)?( \(with [^)]+\))? asks for (?P<what>.+), which "
        rf"{recipe} does not do(?: yet; use torchtune's (?P<recipes>[\w/, ]+)|; use (?P<ours>\w+))"
    )
    trained = {stock for objective in OURS[recipe] for stock in TRAINING_KINDS[objective].torchtune}
    refused = {}
    for name, (stock_recipe, path) in EVERY_STOCK.items():
        if stock_recipe not in OTHER_TRAINING or stock_recipe in trained:
            continue
        with pytest.raises(ConfigError) as error:
            validate_config(OmegaConf.load(path), recipe)
        line = str(error.value)
        match = pattern.fullmatch(line)
        assert match and "\n" not in line, line
        if match["ours"]:
            assert any(stock_recipe in TRAINING_KINDS[o].torchtune for o in OURS[match["ours"]]), line
        else:
            assert stock_recipe in re.split(r", | or ", match["recipes"]), line
        refused[name] = match["what"]
    # 5 DPO, 4 KD, 6 QAT, 1 PPO, 1 quantize, 1 multi-data-set
    assert len(refused) == 18 - 5 * ("dpo" in OURS[recipe]) - 6 * ("qat" in OURS[recipe]) - 4 * ("kd" in OURS[recipe])
    assert "dpo" in OURS[recipe] or refused["llama3_1/8B_lora_dpo_single_device"] == TRAINING_KINDS["dpo"].what
    assert "kd" in OURS[recipe] or refused["llama3_2/8B_to_1B_KD_lora_single_device"] == TRAINING_KINDS["kd"].what
    assert "qat" in OURS[recipe] or refused["llama3_2/1B_qat_lora"] == TRAINING_KINDS["qat"].what


@pytest.mark.parametrize(
    "name, line",
    [
        (
            "mistral/7B_full_ppo_low_memory",
            "config key 'policy_model' = 'torchtune.models.mistral.mistral_7b' (with 'reward_and_value_model', "
            "'ref_policy_checkpointer', 'value_checkpointer' and 14 more) asks for reinforcement learning from a "
            "reward model (PPO), which adaptive_full_finetune does not do yet; use torchtune's "
            "ppo_full_finetune_single_device",
        ),
    ],
)
def test_the_refusal_names_the_keys_and_the_recipe(name: str, line: str) -> None:
    """The recipe named is the one of ours that runs the config (LoRA for a LoRA model), as ``cp`` says."""
    with pytest.raises(ConfigError) as error:
        validate_config(load_config(name))
    assert str(error.value) == line


def test_the_configs_of_recipes_that_do_not_train_are_refused_for_what_they_lack() -> None:
    """Generation and evaluation configs have no data set to train on."""
    for _name, (stock_recipe, path) in EVERY_STOCK.items():
        if "generate" in stock_recipe or stock_recipe == "eleuther_eval":
            with pytest.raises(ConfigError, match=r"^config key '\w+' is missing$"):
                validate_config(OmegaConf.load(path))


def test_estimate_traces_a_stock_dpo_config(capsys: pytest.CaptureFixture) -> None:
    """The issue's command (issue 37.5). Before: a one-line refusal ('estimate does not model a DPO step yet'), and
    before that AttributeError: 'DPOLoss' object has no attribute 'ignore_index'. The DPO step itself is tested on
    tiny models in test_estimate_dpo.py."""
    assert (
        main(
            [
                "estimate",
                "--config",
                "llama3_1/8B_lora_dpo_single_device",
                "--device-memory",
                "80GiB",
                "--seq-len",
                "2048",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    pairs = int(out.split("predicted largest micro batch: ", 1)[1].split(" ", 1)[0])
    assert pairs >= 1 and out.startswith(
        f"predicted largest micro batch: {pairs} (pairs of 2048-token sequences, 1 rank(s))"
    )
    assert "DPO (lora_dpo): a sample is a pair" in out and "(the policy with its adapters off)" in out


@pytest.mark.parametrize(
    "name",
    [
        "qwen2/1.5_to_0.5B_KD_lora_single_device",
        "qwen2/1.5_to_0.5B_KD_lora_distributed",
        "llama3_2/8B_to_1B_KD_lora_single_device",
        "llama3_2/8B_to_1B_KD_lora_distributed",
    ],
)
def test_a_recipe_of_ours_that_trains_so_is_named_and_runs_the_config(name: str) -> None:
    """The 4 stock KD configs validate by name for adaptive_knowledge_distillation (the recipe that runs them, as
    ``cp`` says); a fine-tuning recipe refuses them naming it (issue 38.1)."""
    from adaptive_batching.config.training_kinds import check_kd, recipe_for_model

    cfg = load_config(name)
    assert recipe_for_model(cfg) == "adaptive_knowledge_distillation"
    validate_config(cfg, "adaptive_knowledge_distillation")
    check_kd(cfg)
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, "adaptive_lora_finetune")
    teacher = OmegaConf.select(cfg, "teacher_model._component_")
    assert str(error.value) == (
        f"config key 'teacher_model' = '{teacher}' (with 'teacher_checkpointer', 'kd_loss', 'kd_ratio') asks for "
        "knowledge distillation from a teacher model, which adaptive_lora_finetune does not do; use "
        "adaptive_knowledge_distillation"
    )


def test_stock_names_resolve_as_tune_run_resolves_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_config("llama3_1/8B_full") == STOCK["llama3_1/8B_full"]
    assert resolve_config("tiny_full").name == "tiny_full.yaml"  # ours by name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama3_1").mkdir()
    (tmp_path / "llama3_1" / "8B_full").write_text("model: {}\n")
    assert resolve_config("llama3_1/8B_full") == Path("llama3_1/8B_full")  # a file first
    with pytest.raises(ConfigNotFound, match=r"did you mean llama3_1/8B_full"):
        resolve_config("llama3_1/8B_ful")


def test_cp_copies_a_stock_config_and_names_the_recipe_that_runs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["cp", "llama3_1/8B_lora_single_device", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_text() == STOCK["llama3_1/8B_lora_single_device"].read_text()
    assert f"Run it with: tune run adaptive_lora_finetune --config {tmp_path / 'mine.yaml'}" in capsys.readouterr().out
    assert main(["cp", "qwen2_5/7B_full", str(tmp_path / "q.yaml")]) == 0
    assert "tune run adaptive_full_finetune" in capsys.readouterr().out
    assert main(["cp", "qwen2_5/7B_ful", str(tmp_path / "x.yaml")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "did you mean qwen2_5/7B_full" in error


def test_estimate_takes_a_stock_name_and_asks_for_the_length_its_data_cannot_give(
    capsys: pytest.CaptureFixture,
) -> None:
    """The stock configs' tokenizer files are not here, so the worst case cannot come from the data."""
    assert main(["estimate", "--config", "llama3_2/1B_lora_single_device", "--device-memory", "24GiB"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("config error: the worst-case sample length comes from the data")
    assert "--seq-len N" in error and error.count("\n") == 1


def test_log_peak_memory_stats_adds_torchtunes_memory_statistics_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepping.memory, "peak_memory_gb", lambda device: None if device.type == "cpu" else 1.5)
    monkeypatch.setattr(
        stepping.training,
        "get_memory_stats",
        lambda device: {"peak_memory_active": 1.0, "peak_memory_alloc": 1.5, "peak_memory_reserved": 2.0},
    )
    stats = StepStats(loss=1.0, tokens=10, seconds=1.0, samples=4)

    def metrics(device: str, on: bool) -> dict[str, float]:
        return step_metrics(
            stats, lr=1e-3, accumulation=1, ranks=1, device=torch.device(device), batching={}, peak_memory_stats=on
        )

    assert "peak_memory_reserved" not in metrics("cpu", True) and "peak_memory_gb" not in metrics("cpu", True)
    assert "peak_memory_reserved" not in metrics("cuda", False)
    assert metrics("cuda", True)["peak_memory_reserved"] == 2.0 and metrics("cuda", True)["peak_memory_gb"] == 1.5


@pytest.mark.parametrize("name", SHIPPED_REAL)
def test_the_shipped_real_model_configs_profile_and_say_how_their_batch_adapts(name: str) -> None:
    settings = validate_config(load_config(name))
    assert settings.needs_profile
    assert settings.growth.keep_global_batch != (settings.batch_increase_function is not None)
    text = resolve_config(name).read_text()
    why = "keeps the global batch" if settings.growth.keep_global_batch else "Growth" if "noise" in text else "warmup"
    assert why in text


@functools.cache
def _trace_2048(name: str) -> Any:
    """The config's fine-tuning steps traced on fake tensors at 2048-token samples, once a module: predictions for
    several devices share one trace (``StepTrace``)."""
    from adaptive_batching.estimate.prediction import trace_steps
    from adaptive_batching.training.recipe_table import traced_parts

    cfg = load_config(name)
    return trace_steps(*traced_parts(cfg), seq_len=2048, seq_len_source="--seq-len")


@pytest.mark.e2e
@pytest.mark.parametrize("name", SHIPPED_REAL)
def test_estimate_gives_each_shipped_real_model_config_a_micro_batch_on_80_gib(name: str) -> None:
    """On fake tensors (no weights, no memory), at 2048-token samples: what the 80 GiB GPU the configs are
    written for holds, by the fit of the traced steps (the fake steps that verify a fit, half the time here, are
    tested in test_estimate.py)."""
    from adaptive_batching.estimate.prediction import predict

    traced = name
    if name in SAME_STEPS:  # its steps are the stock config's: the keys that differ are none a trace reads
        traced, differ = SAME_STEPS[name]
        ours, stock = (OmegaConf.to_container(load_config(n)) for n in (name, traced))
        assert {key for key in {*ours, *stock} if ours.get(key) != stock.get(key)} == differ
        assert not stock["enable_activation_offloading"] and "enable_activation_offloading" not in ours
    estimate = predict(_trace_2048(traced), device_memory_bytes=80 * 2**30, verify=False)
    assert estimate.max_micro_batch >= 1 and estimate.budget_bytes == int(80 * 2**30 * 0.9)


@pytest.mark.e2e
def test_estimate_fits_qlora_8b_on_24_gib_with_nf4_weights_at_their_real_bytes() -> None:
    """torchtune's llama3_1/8B_qlora_single_device: NF4 base weights (4.1 bits a weight), bf16 embeddings,
    norms and adapters, AdamW's two states per adapter weight; within 1% of those bytes."""
    from torchao.dtypes.nf4tensor import NF4Tensor
    from torchtune import config as tune_config

    from adaptive_batching.estimate.prediction import predict
    from adaptive_batching.training.recipe_table import method_and_objective

    cfg = load_config("llama3_1/8B_qlora_single_device")
    estimate = predict(_trace_2048("llama3_1/8B_qlora_single_device"), device_memory_bytes=24 * 2**30, verify=False)
    assert estimate.max_micro_batch >= 1
    with torch.device("meta"):
        model = tune_config.instantiate(cfg.model)
    method_and_objective(cfg, profiled=False)[0].configure(model)
    nf4 = [p.numel() for p in model.parameters() if isinstance(p, NF4Tensor)]
    layout = sum(n // 2 + n // 64 + 4 * (n // (64 * 256)) + 68 for n in nf4)
    dense = sum(2 * p.numel() for p in model.parameters() if not isinstance(p, NF4Tensor))
    adam = sum(2 * 2 * p.numel() for p in model.parameters() if p.requires_grad)
    rope = model.layers[0].attn.pos_embeddings.to_empty(device="cpu")  # on meta its cache is not built
    rope.rope_init()
    rope = sum(b.numel() * b.element_size() for b in rope.buffers())
    assert len(nf4) == 32 * 7 and estimate.model_state_bytes == pytest.approx(layout + dense + adam + rope, rel=0.01)
