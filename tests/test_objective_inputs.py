"""Every bad value of every node a recipe reads is one line before any model is built, for each objective
(fine-tuning, QAT, LoRA and full DPO, KD): a node switched off with ``key=null``, a path that is not there, a
checkpointer's unknown model type, a data set whose columns do not fit the builder or whose samples do not fit
the objective (issue 53.1). In-process: what a recipe runs before it builds anything (``validate_config``, its
objective's check, ``check_inputs``), with torchtune's own override parsing (``load_config``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from torchtune._recipe_registry import get_all_recipes

from adaptive_batching.config.inputs import check_inputs
from adaptive_batching.config.keys import RECIPE_KEYS
from adaptive_batching.config.loading import load_config, stock_configs
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import check_full_dpo, check_kd, check_lora_dpo, recipe_for_model
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.objectives import SupervisedFinetune
from adaptive_batching.training.recipe_table import method_and_objective

# Each recipe's check it runs after validate_config (its objective comes from the recipe table).
RECIPES: dict[str, Callable[[DictConfig], None]] = {
    "adaptive_full_finetune": lambda cfg: None,
    "adaptive_lora_finetune": lambda cfg: None,
    "adaptive_lora_dpo": check_lora_dpo,
    "adaptive_full_dpo": check_full_dpo,
    "adaptive_knowledge_distillation": check_kd,
}
# Our tiny config of each objective, and the recipe that runs it.
TINY = {
    "tiny_full": "adaptive_full_finetune",
    "tiny_lora": "adaptive_lora_finetune",
    "tiny_qat_lora": "adaptive_lora_finetune",
    "tiny_lora_dpo": "adaptive_lora_dpo",
    "tiny_full_dpo": "adaptive_full_dpo",
    "tiny_kd": "adaptive_knowledge_distillation",
}
# torchtune 0.6.1's stock configs of the objectives ours train: DPO, KD and QAT.
STOCK = {
    config.name: path
    for recipe in get_all_recipes()
    if recipe.name.startswith(("lora_dpo", "full_dpo", "knowledge_distillation", "qat_"))
    for config in recipe.configs
    if (path := stock_configs([recipe.name])[config.name]).is_file()
}
# Nodes that null switches off (the run goes without): the LR schedule, QAT's quantizer, the torch profiler, growth.
OFF_WHEN_NULL = {"lr_scheduler", "quantizer", "profiler", "batch_increase_function"}
# Node arguments that are written, not read (the run makes them).
WRITTEN = {"output_dir", "log_dir"}
NOT_THERE = "/nonexistent/adaptive-batching-53"


def before_any_model(cfg: DictConfig, recipe: str) -> None:
    """What ``recipe`` runs on ``cfg`` before it builds anything: the validation, its objective's check and the
    inputs' check (the trainer's first step of set-up)."""
    validate_config(cfg, recipe)
    RECIPES[recipe](cfg)
    check_inputs(cfg, method_and_objective(cfg, recipe, profiled=False)[1])


def refusal(cfg: DictConfig, recipe: str) -> str:
    with pytest.raises(ConfigError) as error:
        before_any_model(cfg, recipe)
    line = str(error.value)
    assert "\n" not in line and line.startswith("config key '"), line
    return line


def component_nodes(cfg: DictConfig) -> Iterator[str]:
    """The dotted key of every ``_component_`` node under the keys the recipes read, nested ones included."""
    stack: list[tuple[str, Any]] = [(str(k), cfg[k]) for k in cfg if str(k) in RECIPE_KEYS]
    while stack:
        where, node = stack.pop(0)
        if OmegaConf.is_dict(node):
            if "_component_" in node and node._component_ is not None:
                yield where
            stack.extend((f"{where}.{key}", node[key]) for key in node if key != "_component_")


def path_arguments(cfg: DictConfig) -> Iterator[tuple[str, Any]]:
    """``(dotted key, a value that is not there)`` of every argument of a node that names something the run reads
    (``path``, ``*_path``, ``*_file(s)``, ``*_dir``; the names torchtune's components give them)."""
    for node in component_nodes(cfg):
        for name, value in OmegaConf.select(cfg, node).items():
            if value is None or name in WRITTEN or not str(name).endswith(("path", "_file", "_files", "_dir")):
                continue
            missing = ["nothere.safetensors"] if name == "checkpoint_files" else f"{NOT_THERE}/{name}"
            yield f"{node}.{name}", missing


def with_override(name: str, assets: Path, tmp_path: Path, *overrides: str) -> DictConfig:
    return load_config(name, [f"assets_dir={assets}", f"output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("name", sorted(TINY))
def test_our_configs_pass_before_any_model(name: str, assets: Path, tmp_path: Path) -> None:
    before_any_model(with_override(name, assets, tmp_path), TINY[name])


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_node_of_our_configs_set_to_null_is_one_line_naming_it(name: str, assets: Path, tmp_path: Path) -> None:
    cfg = with_override(name, assets, tmp_path)
    nodes = list(component_nodes(cfg))
    assert {"model", "tokenizer", "dataset", "checkpointer", "optimizer", "loss", "metric_logger"} <= set(nodes)
    off = set()
    for node in nodes:
        nulled = with_override(name, assets, tmp_path, f"{node}=null")  # torchtune: node._component_ = null
        assert OmegaConf.select(nulled, f"{node}._component_", default="absent") is None
        if node in OFF_WHEN_NULL:
            before_any_model(nulled, TINY[name])
            off.add(node)
            continue
        line = refusal(nulled, TINY[name])
        assert line.startswith(f"config key '{node}' is null") or line.startswith(f"config key '{node}' is missing"), (
            node,
            line,
        )
    assert off == OFF_WHEN_NULL & set(nodes)


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_path_of_our_configs_that_is_not_there_is_one_line_naming_it(
    name: str, assets: Path, tmp_path: Path
) -> None:
    cfg = with_override(name, assets, tmp_path)
    paths = dict(path_arguments(cfg))
    checkpointers = [node for node in ("checkpointer", "ref_checkpointer", "teacher_checkpointer") if node in cfg]
    assert {"tokenizer.path", "dataset.data_files"} | {f"{c}.checkpoint_dir" for c in checkpointers} | {
        f"{c}.checkpoint_files" for c in checkpointers
    } <= set(paths)
    for key, missing in paths.items():
        line = refusal(modified_value(cfg, key, missing), TINY[name])
        assert line.startswith(f"config key '{key}'"), (key, line)
        assert "no such" in line or "which is not in" in line, line
    for checkpointer in checkpointers:
        line = refusal(modified_value(cfg, f"{checkpointer}.model_type", "LLAMA9"), TINY[name])
        assert line.startswith(
            f"config key '{checkpointer}.model_type' = 'LLAMA9' is invalid: expected one of torchtune's model types: "
        ), line


def modified_value(cfg: DictConfig, key: str, value: Any) -> DictConfig:
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.update(copy, key, value, merge=False)
    return copy


def test_the_issues_lines(assets: Path, tmp_path: Path) -> None:
    """Before: AttributeError: 'NoneType' object has no attribute 'split' (a null teacher), torchtune's
    ValueError: No file with name (a wrong teacher file), each a traceback after the student was built."""
    assert refusal(
        with_override("tiny_kd", assets, tmp_path, "teacher_checkpointer=null"), "adaptive_knowledge_distillation"
    ) == (
        "config key 'teacher_checkpointer' is null: adaptive_knowledge_distillation needs a checkpointer pointing at "
        "the teacher's weights"
    )
    assert refusal(
        with_override("tiny_kd", assets, tmp_path, "teacher_model=null"), "adaptive_knowledge_distillation"
    ).startswith("config key 'teacher_model' is null: ")
    wrong_file = "teacher_checkpointer.checkpoint_files=[nothere.safetensors]"
    line = refusal(with_override("tiny_kd", assets, tmp_path, wrong_file), "adaptive_knowledge_distillation")
    assert line == (
        f"config key 'teacher_checkpointer.checkpoint_files' names 'nothere.safetensors', which is not in "
        f"{assets}/model; it holds config.json, model.safetensors"
    )
    for name in ("tiny_lora_dpo", "tiny_full_dpo"):
        for key in ("checkpointer", "ref_checkpointer") if name == "tiny_full_dpo" else ("checkpointer",):
            line = refusal(
                with_override(name, assets, tmp_path, f"{key}.checkpoint_files=[nothere.safetensors]"), TINY[name]
            )
            assert line.startswith(f"config key '{key}.checkpoint_files' names 'nothere.safetensors'"), line


@pytest.mark.parametrize("name", sorted(STOCK))
def test_every_node_of_torchtunes_dpo_kd_and_qat_configs_set_to_null_is_one_line_naming_it(name: str) -> None:
    """Their files are not on this machine, so the inputs' check stops at the first (the tokenizer's) unless a
    null node was refused before it."""
    recipe = recipe_for_model(load_config(name))
    line = refusal(load_config(name), recipe)
    assert line.startswith("config key 'tokenizer.path' = ") and line.endswith(": no such file"), line
    for node in component_nodes(load_config(name)):
        nulled = load_config(name, [f"{node}=null"])
        line = refusal(nulled, recipe)
        if node in OFF_WHEN_NULL:
            assert line.startswith("config key 'tokenizer.path' = "), (node, line)
        else:
            assert line.startswith((f"config key '{node}' is null", f"config key '{node}' is missing")), (node, line)


DATA = "data/{}_tiny.json"


@pytest.mark.parametrize(
    "name, data, line",
    [
        (
            "tiny_full",
            "preference",
            "config key 'dataset': the first sample of {assets}/data/preference_tiny.json has no column 'instruction': "
            "torchtune.datasets.alpaca_dataset reads the columns 'instruction', 'input', 'output' and the data has "
            "'chosen', 'rejected'; give data with those columns, or map them with dataset.column_map",
        ),
        (
            "tiny_qat_lora",
            "preference",
            "config key 'dataset': the first sample of {assets}/data/preference_tiny.json has no column 'instruction'",
        ),
        (
            "tiny_kd",
            "preference",
            "config key 'dataset': the first sample of {assets}/data/preference_tiny.json has no column 'instruction'",
        ),
        (
            "tiny_lora_dpo",
            "alpaca",
            "config key 'dataset': the first sample of {assets}/data/alpaca_tiny.json has no column 'chosen': "
            "torchtune.datasets.preference_dataset reads the columns 'chosen', 'rejected' and the data has 'input', "
            "'instruction', 'output'; give data with those columns, or map them with dataset.column_map",
        ),
        (
            "tiny_full_dpo",
            "alpaca",
            "config key 'dataset': the first sample of {assets}/data/alpaca_tiny.json has no column 'chosen'",
        ),
    ],
)
def test_a_data_set_without_the_builders_columns_is_one_line_naming_both(
    name: str, data: str, line: str, assets: Path, tmp_path: Path
) -> None:
    """Before: KeyError: 'chosen' at DPO's first step (with the profiler on, while the tokens were counted);
    KeyError: 'instruction' for KD given the preference file."""
    cfg = with_override(name, assets, tmp_path, f"dataset.data_files={assets / DATA.format(data)}")
    assert refusal(cfg, TINY[name]).startswith(line.format(assets=assets))


def test_a_column_map_that_maps_the_columns_reads_them(assets: Path, tmp_path: Path) -> None:
    """The check reads through the builder's own column map: mapped columns pass, a wrong map names the column."""
    columns = "{chosen: chosen, rejected: rejected}"
    before_any_model(
        with_override("tiny_lora_dpo", assets, tmp_path, f"dataset.column_map={columns}"), "adaptive_lora_dpo"
    )
    line = refusal(
        with_override("tiny_lora_dpo", assets, tmp_path, "dataset.column_map={chosen: better}"), "adaptive_lora_dpo"
    )
    assert (
        line == "config key 'dataset': ValueError: Expected a key of 'rejected' in column_map but found "
        "dict_keys(['chosen'])."
    )  # torchtune's own check of the map: before, a traceback at its build
    line = refusal(
        with_override("tiny_lora_dpo", assets, tmp_path, "dataset.column_map={chosen: better, rejected: rejected}"),
        "adaptive_lora_dpo",
    )
    assert line.startswith(
        f"config key 'dataset': the first sample of {assets}/data/preference_tiny.json has no "
        "column 'better': torchtune.datasets.preference_dataset reads the columns 'better', "
        "'rejected' and the data has 'chosen', 'rejected'"
    ), line


@pytest.mark.parametrize("name", ["tiny_lora_dpo", "tiny_full_dpo"])
def test_a_data_set_of_single_answers_is_refused_by_dpo(name: str, assets: Path, tmp_path: Path) -> None:
    cfg = with_override(
        name,
        assets,
        tmp_path,
        "dataset._component_=torchtune.datasets.alpaca_dataset",
        f"dataset.data_files={assets / DATA.format('alpaca')}",
    )
    assert refusal(cfg, TINY[name]) == (
        "config key 'dataset._component_' = 'torchtune.datasets.alpaca_dataset' gives one answer per sample; "
        f"{TINY[name]} trains on pairs of chosen and rejected answers, as torchtune.datasets.preference_dataset gives"
    )


def test_a_packed_data_set_is_read_unpacked_and_a_resumed_runs_weights_are_the_resumes(
    assets: Path, tmp_path: Path
) -> None:
    """Packing would tokenize the whole set: the first sample is read as the builder reads it unpacked."""
    cfg = with_override(
        "tiny_full", assets, tmp_path, "dataset.packed=True", f"dataset.data_files={assets / DATA.format('preference')}"
    )
    assert "has no column 'instruction'" in refusal(cfg, "adaptive_full_finetune")
    cfg = with_override("tiny_full", assets, tmp_path, "checkpointer.checkpoint_files=[nothere.safetensors]")
    check_inputs(cfg, SupervisedFinetune(), resume=True)
    with pytest.raises(ConfigError, match=r"^config key 'checkpointer.checkpoint_files' names 'nothere.safetensors'"):
        check_inputs(cfg, SupervisedFinetune())


def test_what_streaming_cannot_read_is_read_as_the_run_builds_it(assets: Path, tmp_path: Path) -> None:
    """A split streaming does not take (a slice, a sum) is no error of the config's; one the build refuses is."""
    for split in ("train[:48]", "train[10%:]", "train+train"):
        cfg = with_override("tiny_full", assets, tmp_path, f"dataset.split={split}")
        before_any_model(cfg, "adaptive_full_finetune")
    assert refusal(with_override("tiny_full", assets, tmp_path, "dataset.split=nope"), "adaptive_full_finetune") == (
        "config key 'dataset': ValueError: Unknown split \"nope\". Should be one of ['train']."
    )


@pytest.mark.parametrize(
    "builder, missing, columns, mapped_by",
    [
        ("instruct_dataset", "input", "'input', 'output'", "column_map"),
        (
            "chat_dataset dataset.conversation_column=conversations dataset.conversation_style=sharegpt",
            "conversations",
            "'conversations'",
            "conversation_column",
        ),
        ("text_completion_dataset", "text", "'text'", "column"),
    ],
)
def test_each_fine_tuning_builder_names_its_columns_and_how_to_map_them(
    builder: str, missing: str, columns: str, mapped_by: str, assets: Path, tmp_path: Path
) -> None:
    component, *more = builder.split()
    cfg = with_override(
        "tiny_full",
        assets,
        tmp_path,
        f"dataset._component_=torchtune.datasets.{component}",
        *more,
        f"dataset.data_files={assets / DATA.format('preference')}",
    )
    assert refusal(cfg, "adaptive_full_finetune") == (
        f"config key 'dataset': the first sample of {assets}/data/preference_tiny.json has no column '{missing}': "
        f"torchtune.datasets.{component} reads the columns {columns} and the data has 'chosen', 'rejected'; give "
        f"data with those columns, or map them with dataset.{mapped_by}"
    )


@pytest.mark.parametrize("name", ["tiny_kd", "tiny_full_dpo"])
def test_a_checkpointers_output_inside_its_weights_folder_is_one_line(name: str, assets: Path, tmp_path: Path) -> None:
    """torchtune's checkpointers refuse it when built (a ValueError traceback, the teacher's and reference's
    after the model was built)."""
    key = "teacher_checkpointer" if name == "tiny_kd" else "ref_checkpointer"
    cfg = with_override(name, assets, tmp_path, f"{key}.output_dir={assets}/model/out")
    assert refusal(cfg, TINY[name]) == (
        f"config key '{key}.output_dir' = '{assets}/model/out' is its checkpoint_dir '{assets}/model' or inside it, "
        "which torchtune refuses (it copies the folder's files into the output); write the run's checkpoints "
        "elsewhere"
    )


def test_a_null_part_of_a_list_of_data_sets_is_one_line_naming_it(assets: Path, tmp_path: Path) -> None:
    cfg = with_override("tiny_full", assets, tmp_path)
    cfg = modified_value(cfg, "dataset", [OmegaConf.to_container(cfg.dataset), None])
    assert refusal(cfg, "adaptive_full_finetune") == (
        "config key 'dataset[1]' is null: it is inside a node the recipes build, which builds it too; give it a "
        "'_component_' or remove it"
    )
    cfg = modified_value(cfg, "dataset", [OmegaConf.to_container(cfg.dataset[0]), {"_component_": None}])
    assert refusal(cfg, "adaptive_full_finetune").startswith("config key 'dataset[1]' is null: ")
