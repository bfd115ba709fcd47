"""Knowledge distillation (issue 38): ``adaptive_knowledge_distillation``'s config checks, its frozen teacher, the
profile counting the teacher's weights, parity with torchtune's ``knowledge_distillation_single_device``, what the
fine-tuning recipes promise (growth, OOM recovery, preemption, exact resume) and two ranks with the teacher sharded.

Six recipe runs, shared by module fixtures: torchtune's recipe as it is and with its gradient normalised as ours
(tests/kd_parity_run.py), ours stopped by SIGTERM after step 2 and resumed (the parity, an exact resume and the
clean exit of a preemption at once), ours with growth and an injected OOM, and two ranks on a copy of a stock
config.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from config_edits import CONFIGS, DELETE, modified
from doc_figures import agrees, overrides, profiled, quoted
from omegaconf import OmegaConf
from recipe_runs import check, read_metrics, run_command
from safetensors.torch import load_file
from test_first_hour import warning_lines
from test_oom_recovery import faulty_run, ok
from test_preemption import logged_steps, stopped
from torchtune.models.llama3 import llama3, lora_llama3
from torchtune.modules.loss import CEWithChunkedOutputLoss, ForwardKLWithChunkedOutputLoss

from adaptive_batching.config.loading import load_config
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import check_kd, recipe_for_model
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults.checkpoints import MARKER
from adaptive_batching.training.objectives import KnowledgeDistillation
from adaptive_batching.training.recipe_table import TEACHER, distillation, method_and_objective

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HERE = Path(__file__).parent
CONFIG = CONFIGS / "tiny_kd.yaml"
STOCK_KD = (
    "qwen2/1.5_to_0.5B_KD_lora_single_device",
    "qwen2/1.5_to_0.5B_KD_lora_distributed",
    "llama3_2/8B_to_1B_KD_lora_single_device",
    "llama3_2/8B_to_1B_KD_lora_distributed",
)


@pytest.mark.parametrize("name", STOCK_KD)
def test_the_stock_kd_configs_validate_by_name_for_adaptive_knowledge_distillation(name: str) -> None:
    cfg = load_config(name, ["use_maximum_batch_size=True"])
    assert recipe_for_model(cfg) == "adaptive_knowledge_distillation"
    assert validate_config(cfg, "adaptive_knowledge_distillation").use_maximum_batch_size
    check_kd(cfg)
    assert isinstance(method_and_objective(cfg, profiled=True)[1], KnowledgeDistillation)


def test_tune_cp_copies_a_stock_kd_config_and_ours_names_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptive_batching.cli import main

    result = run_command("tune", ["cp", "llama3_2/8B_to_1B_KD_lora_single_device", "mine.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert recipe_for_model(OmegaConf.load(tmp_path / "mine.yaml")) == "adaptive_knowledge_distillation"
    monkeypatch.chdir(tmp_path)
    assert main(["cp", "qwen2/1.5_to_0.5B_KD_lora_distributed", "ours.yaml"]) == 0
    assert "Run it with: tune run adaptive_knowledge_distillation --config ours.yaml" in capsys.readouterr().out


@pytest.mark.parametrize(
    "updates, message",
    [
        (
            {"teacher_model": DELETE},
            "config key 'teacher_model' is missing: adaptive_knowledge_distillation needs the "
            "teacher's model builder, e.g. torchtune.models.qwen2.qwen2_1_5b",
        ),
        (
            {"teacher_checkpointer": DELETE},
            "config key 'teacher_checkpointer' is missing: adaptive_knowledge_distillation needs a "
            "checkpointer pointing at the teacher's weights",
        ),
        (
            {"kd_loss._component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
            "config key 'kd_loss._component_' = 'torchtune.modules.loss.CEWithChunkedOutputLoss': "
            "adaptive_knowledge_distillation distils with one of torchtune.modules.loss.ForwardKLLoss, "
            "ForwardKLWithChunkedOutputLoss, ReverseKLLoss, ReverseKLWithChunkedOutputLoss, SymmetricKLLoss, "
            "SymmetricKLWithChunkedOutputLoss",
        ),
        (
            {"kd_ratio": 1.5},
            "config key 'kd_ratio' = 1.5: the weight of the KD loss against the cross-entropy must be a "
            "number in [0, 1]",
        ),
        (
            {"kd_loss._component_": "torchtune.modules.loss.ForwardKLLoss"},
            "config key 'kd_loss._component_' = 'torchtune.modules.loss.ForwardKLLoss' with 'loss._component_' = "
            "'CEWithChunkedOutputLoss': both take chunked logits or neither does (torchtune.modules.loss."
            "CEWithChunkedOutputLoss with a ...WithChunkedOutputLoss KD loss)",
        ),
        (
            {"kd_loss.num_output_chunks": 4},
            "config key 'kd_loss.num_output_chunks' = 4: it must equal "
            "'loss.num_output_chunks' = 8 (the student's and teacher's logits are chunked "
            "alike)",
        ),
    ],
)
def test_what_adaptive_knowledge_distillation_cannot_train_is_refused_in_one_line(updates: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_kd(modified(load_config("tiny_kd"), updates))
    assert str(error.value) == message


@pytest.mark.parametrize("recipe", ["adaptive_lora_finetune", "adaptive_lora_dpo", "adaptive_full_dpo"])
def test_the_other_recipes_given_kd_keys_name_adaptive_knowledge_distillation(recipe: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"^config key 'teacher_model' = 'torchtune.models.llama3.llama3' \(with "
        rf"'teacher_checkpointer', 'kd_loss', 'kd_ratio'\) asks for knowledge "
        rf"distillation from a teacher model, which {recipe} does not do; use "
        rf"adaptive_knowledge_distillation$",
    ):
        validate_config(load_config("tiny_kd"), recipe)


def test_the_teacher_is_frozen_from_its_own_checkpoint_and_the_trials_count_its_weights(assets: Path) -> None:
    """build_components gives the objective its teacher: teacher_model (another architecture than the student)
    with teacher_checkpointer's weights, frozen, eval mode, not in the optimizer. A profiler's trial step counts its
    weights among the step's long-lived tensors."""
    from torchtune import config, training

    from adaptive_batching.faults.guard import StepGuard
    from adaptive_batching.runtime import memory
    from adaptive_batching.runtime.distributed import ParallelInfo
    from adaptive_batching.training.components import build_components, build_data
    from adaptive_batching.training.methods import LoRAFinetune
    from adaptive_batching.training.stepping import StepRunner

    cfg = load_config("tiny_kd", [f"assets_dir={assets}"])
    one_rank, cpu = ParallelInfo(world_size=1, rank=0, local_rank=0), torch.device("cpu")
    objective = distillation(cfg)
    checkpoint = config.instantiate(cfg.checkpointer, should_load_recipe_state=False).load_checkpoint()
    parts = build_components(
        cfg,
        LoRAFinetune(cfg.model, False),
        objective,
        checkpoint,
        build_data(cfg),
        device=cpu,
        dtype=torch.float32,
        parallel=one_rank,
        is_rank_zero=True,
    )
    teacher = objective.teacher
    assert teacher is not None and objective.resident == (teacher,) and not teacher.training
    assert not any(param.requires_grad for param in teacher.parameters())
    assert len(teacher.layers) == 2 and len(parts.model.layers) == 1  # the teacher is the larger tiny model
    teacher_weights = config.instantiate(cfg.teacher_checkpointer).load_checkpoint()[training.MODEL_KEY]
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in teacher_weights.items())
    optimized = {id(param) for group in parts.optimizer.param_groups for param in group["params"]}
    assert not optimized & {id(param) for param in teacher.parameters()}

    runner = StepRunner(
        parts.model,
        parts.optimizer,
        parts.loss_fn,
        StepGuard(one_rank, cpu),
        one_rank,
        cpu,
        clip_grad_norm=None,
        oom_recovery=True,
        where=lambda: (1, None, "."),
        objective=objective,
    )
    seen: list[tuple[str, tuple[int, ...], bool]] = []
    for name, model in (("student", parts.model), ("teacher", teacher)):
        model.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: seen.append(
                (name, tuple(kwargs["tokens"].shape), torch.is_grad_enabled())
            ),
            with_kwargs=True,
        )
    measured = runner.trial_step(2, seq_len=16, accumulation=1, collate=parts.collate, vocab_size=1280, packed=False)
    assert seen == [("teacher", (2, 16), False), ("student", (2, 16), True)]  # the worst case, both forwards
    student_bytes, teacher_bytes = (
        memory.current_bytes(cpu, parts.model, parts.optimizer),
        memory.current_bytes(cpu, teacher),
    )  # as the trial's meters count: the same path on every machine
    assert teacher_bytes > 0 and measured.steady_bytes == student_bytes + teacher_bytes
    assert all(torch.equal(teacher_weights[k], v) for k, v in teacher.state_dict().items())  # left alone
    objective.start_step()  # as StepRunner.train_step begins: a trial's losses are no training step's
    assert objective.step_metrics(1.0, 0) == {}


def test_a_student_without_adapters_trains_every_weight_against_the_frozen_teacher(assets: Path) -> None:
    """torchtune's KD recipes are LoRA only; ours takes a full student too (the recipe picks FullFinetune)."""
    from torchtune import config

    from adaptive_batching.runtime.distributed import ParallelInfo
    from adaptive_batching.training.components import build_components, build_data
    from adaptive_batching.training.methods import FullFinetune

    lora = {
        f"model.{key}": DELETE
        for key in (
            "lora_attn_modules",
            "apply_lora_to_mlp",
            "apply_lora_to_output",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
        )
    }
    cfg = modified(
        load_config("tiny_kd", [f"assets_dir={assets}"]),
        {"model._component_": "torchtune.models.llama3.llama3", **lora},
    )
    check_kd(cfg)
    assert recipe_for_model(cfg) == "adaptive_knowledge_distillation"
    objective = distillation(cfg)
    checkpoint = config.instantiate(cfg.checkpointer, should_load_recipe_state=False).load_checkpoint()
    parts = build_components(
        cfg,
        FullFinetune(),
        objective,
        checkpoint,
        build_data(cfg),
        device=torch.device("cpu"),
        dtype=torch.float32,
        parallel=ParallelInfo(world_size=1, rank=0, local_rank=0),
        is_rank_zero=True,
    )
    optimized = {id(param) for group in parts.optimizer.param_groups for param in group["params"]}
    assert optimized == {id(param) for param in parts.model.parameters()}
    assert objective.teacher is not None and not optimized & {id(p) for p in objective.teacher.parameters()}


def test_a_micro_batch_runs_the_teacher_without_autograd_and_mixes_the_losses_as_torchtune() -> None:
    """The teacher's forward (a larger model, same vocabulary) without autograd, then the student's with it, on the
    same tokens; the loss is (1 - kd_ratio) x CE + kd_ratio x forward KL on the shifted labels, x the tokens that
    count."""
    torch.manual_seed(0)
    student = lora_llama3(
        lora_attn_modules=["q_proj", "v_proj"],
        vocab_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        max_seq_len=16,
        intermediate_dim=32,
        lora_rank=4,
        lora_alpha=8,
    )
    teacher = (
        llama3(
            vocab_size=32, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, max_seq_len=16, intermediate_dim=64
        )
        .eval()
        .requires_grad_(False)
    )
    ce, kd = CEWithChunkedOutputLoss(num_output_chunks=2), ForwardKLWithChunkedOutputLoss(num_output_chunks=2)
    student.set_num_output_chunks(2)
    teacher.set_num_output_chunks(2)
    objective = KnowledgeDistillation(kd, 0.25, TEACHER)
    objective.hold(teacher)
    seen: list[tuple[str, bool]] = []
    for name, model in (("student", student), ("teacher", teacher)):
        model.register_forward_pre_hook(lambda module, args, name=name: seen.append((name, torch.is_grad_enabled())))
    tokens = torch.randint(0, 32, (2, 8))
    labels = tokens.clone()
    labels[1, 5:] = -100
    loss, counted = objective.micro_loss(student, ce, {"tokens": tokens, "labels": labels.clone()}, torch.enable_grad())
    assert seen == [("teacher", False), ("student", True)] and counted == 7 + 4
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    logits, taught = student(tokens), teacher(tokens)
    expected = (0.75 * ce(logits, shifted) + 0.25 * kd(logits, taught, shifted)) * 11
    assert torch.equal(loss.detach(), expected.detach()) and loss.requires_grad
    metrics = objective.step_metrics(1.0, 16)
    assert metrics == pytest.approx(
        {"class_loss": float(ce(logits, shifted)), "kd_loss": float(kd(logits, taught, shifted))}, rel=1e-6
    )


# ---------------------------------------------------------------- parity, preemption and an exact resume
STEPS, STOP_AT = 4, 2
# 8 samples (of at most 96 tokens, all still distinct) x accumulation 2 a step, the data in order, every metric
# written in full.
PARITY = (
    "dataset.split=train[:64]",
    "tokenizer.max_seq_len=96",
    "epochs=1",
    f"max_steps_per_epoch={STEPS}",
    "batch_size=8",
    "gradient_accumulation_steps=2",
    "shuffle=False",
    "metric_logger._component_=dpo_parity_run.ExactDiskLogger",
)
LOSSES = ("loss", "class_loss", "kd_loss")


@pytest.fixture(scope="module")
def parity(assets: Path, runs: Path) -> dict:
    """torchtune's knowledge_distillation_single_device as it is (``stock``) and with its gradient normalised as
    ours (``fixed``); ours stopped by SIGTERM after step 2 (inside the epoch) then resumed to step 4."""
    common = ["--config", str(CONFIG), f"assets_dir={assets}", *PARITY]
    for name in ("stock", "stock_fixed"):
        check(
            run_command(
                "script",
                [
                    str(HERE / "kd_parity_run.py"),
                    name if name == "stock_fixed" else "knowledge_distillation_single_device",
                    *common,
                    f"output_dir={runs / name}",
                ],
                cwd=runs,
            )
        )
    overrides = (f"assets_dir={assets}", *PARITY, "use_maximum_batch_size=False", "batch_increase_function=null")
    first = faulty_run(
        runs,
        "ours",
        {"signal": "SIGTERM", "signal_at": STOP_AT},
        assets,
        *overrides,
        recipe="kd_parity_run",
        config=str(CONFIG),
    )
    marker = json.loads((runs / "ours" / "epoch_0" / MARKER).read_text())
    resumed = ok(
        faulty_run(
            runs,
            "ours_resumed",
            {},
            assets,
            *overrides,
            f"output_dir={runs / 'ours'}",
            "resume_from_checkpoint=True",
            recipe="kd_parity_run",
            config=str(CONFIG),
        )
    )
    adapters = {
        name: load_file(runs / name / "epoch_0" / "adapter_model.safetensors")
        for name in ("stock", "stock_fixed", "ours")
    }
    return {
        "first": first,
        "marker": marker,
        "resumed": resumed,
        "adapters": adapters,
        **{name: read_metrics(runs / name / "logs") for name in ("stock", "stock_fixed", "ours")},
    }


@pytest.mark.e2e
def test_a_stop_signal_saves_one_complete_checkpoint_inside_the_epoch_and_exits_75(parity: dict, runs: Path) -> None:
    assert stopped(parity["first"], "SIGTERM") == STOP_AT
    assert parity["marker"]["complete"] is True and parity["marker"]["global_step"] == STOP_AT
    assert f"Resuming at step {STOP_AT} of epoch 1 (optimizer step {STOP_AT})" in parity["resumed"]
    assert logged_steps(runs / "ours" / "logs") == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_ours_trains_as_stock_with_its_gradient_normalised_bit_for_bit_across_a_resume(parity: dict) -> None:
    """The adapters after 4 steps (2 before the stop, 2 after the resume) equal bit for bit those of torchtune's
    recipe whose micro batches' losses are summed over their tokens and divided once by the step's; the logged
    losses within float32 (stock logs float32 tensors, and weights its micro batches by their tokens before the label
    shift)."""
    ours, fixed = parity["adapters"]["ours"], parity["adapters"]["stock_fixed"]
    assert ours.keys() == fixed.keys() and all(torch.equal(ours[k], fixed[k]) for k in ours)
    assert any(bool(v.abs().sum()) for k, v in ours.items() if "lora_b" in k.lower())  # the adapters trained
    for row_ours, row_fixed in zip(parity["ours"], parity["stock_fixed"], strict=True):
        assert row_ours["lr"] == row_fixed["lr"]
        assert {key: row_ours[key] for key in LOSSES} == pytest.approx(
            {key: row_fixed[key] for key in LOSSES}, rel=1e-6, abs=0
        )


@pytest.mark.e2e
def test_ours_logs_stocks_losses_within_the_stated_tolerance(parity: dict) -> None:
    """Against torchtune's recipe as it is: its first step (before any update) within float32; then within 1e-4
    relative: stock backpropagates each micro batch's mean loss, so the step's gradient weighs micro batches by one
    over their tokens (ours by the tokens), which moves the adapters apart from the first update on."""
    ours, stock = parity["ours"], parity["stock"]
    assert len(ours) == len(stock) == STEPS
    assert {key: ours[0][key] for key in LOSSES} == pytest.approx({key: stock[0][key] for key in LOSSES}, rel=1e-6)
    for row_ours, row_stock in zip(ours, stock):
        assert row_ours["lr"] == row_stock["lr"]
        assert {key: row_ours[key] for key in LOSSES} == pytest.approx(
            {key: row_stock[key] for key in LOSSES}, rel=1e-4
        )
    differ = max(
        float((parity["adapters"]["stock"][k] - parity["adapters"]["ours"][k]).abs().max())
        for k in parity["adapters"]["ours"]
    )
    assert differ > 0  # the cause stated above is real: without it the two would be equal, as with stock_fixed


@pytest.mark.e2e
def test_the_pages_parity_figures_are_the_runs(parity: dict) -> None:
    """docs/distillation.md's figures of the parity runs, which are deterministic on CPU (each within 10%, as the
    page rounds them): the largest relative difference of a logged loss from stock's and its step, the largest
    difference of an adapter weight; and the teacher's line as ours prints it."""
    (quote,) = quoted(
        "distillation.md",
        r"afterwards the losses differ by up to (\S+) relative at step (\d+) and the "
        r"adapters by up to (\S+), the cause above",
    )
    by_step = [
        max(abs(ours[key] - stock[key]) / abs(stock[key]) for key in LOSSES)
        for ours, stock in zip(parity["ours"], parity["stock"])
    ]
    adapters = max(
        float((parity["adapters"]["stock"][k] - parity["adapters"]["ours"][k]).abs().max())
        for k in parity["adapters"]["ours"]
    )
    measured = (max(by_step), by_step.index(max(by_step)) + 1, adapters)
    assert int(quote[2]) == measured[1], measured
    assert float(quote[1]) == pytest.approx(measured[0], rel=0.1) and float(quote[3]) == pytest.approx(
        adapters, rel=0.1
    ), measured
    (line,) = quoted(
        "distillation.md",
        r"Teacher model \(teacher_model, weights from teacher_checkpointer\): frozen, "
        r"[\d.]+ MiB of weights; no gradients",
    )
    assert line[0] in parity["first"].stderr


@pytest.fixture(scope="module")
def kd_figure(assets: Path, runs: Path) -> tuple[re.Match, str]:
    """docs/distillation.md's profile command, as written there, on its ``tune cp`` copy pointed at the tiny assets."""
    (quote,) = quoted(
        "distillation.md",
        r"`adaptive-batching profile --config my_kd\.yaml ([^`]*)` fits about ([\d.]+) "
        r"MiB per sample of (\d+) tokens and chooses micro batch (\d+)",
    )
    folder = runs / "kd_figure"
    folder.mkdir()
    copy = stock_kd_on_tiny("qwen2/1.5_to_0.5B_KD_lora_single_device", assets, folder / "out", folder / "my_kd.yaml")
    result = check(
        run_command(
            "cli",
            ["profile", "--config", str(copy), *overrides(quote[1]), f"adaptive_batching.cache_dir={folder / 'cache'}"],
            cwd=folder,
        )
    )
    return quote, result.stdout + result.stderr


@pytest.mark.e2e
def test_the_pages_profile_figures_are_what_its_command_prints(kd_figure: tuple[re.Match, str]) -> None:
    """Per sample and the micro batch chosen, within tests/doc_figures.py's CPU tolerance; trials of whole KD steps."""
    quote, output = kd_figure
    run = profiled(output)
    assert f"samples of {quote[3]} tokens" in output and "Teacher model (teacher_model" in output
    assert agrees(float(quote[2]), run.per_sample_mib), (quote[0], run)
    assert agrees(int(quote[4]), run.chosen, samples=True), (quote[0], run)


# ---------------------------------------------------------------- growth and an out-of-memory error
BASE_LR, REFERENCE_BATCH = 1e-3, 2
GROWING = (
    "dataset.split=train[:48]",
    "tokenizer.max_seq_len=96",
    "batch_size=2",
    "gradient_accumulation_steps=1",
    "lr_scheduler=null",
    f"optimizer.lr={BASE_LR}",
    "epochs=1",
    "max_steps_per_epoch=null",
    "use_maximum_batch_size=False",
    "adaptive_batching.growth_interval=2 steps",
    "batch_increase_function._component_=adaptive_batching.growth.geometric",
    "batch_increase_function.factor=2",
)
OOM_AT_5 = {"phase": "forward", "from_step": 5, "to_step": 5, "above": 4}  # step 5 runs at micro batch 8


@pytest.fixture(scope="module")
def growing(assets: Path, runs: Path) -> str:
    return ok(
        faulty_run(
            runs,
            "growing",
            OOM_AT_5,
            assets,
            *GROWING,
            f"adaptive_batching.cache_dir={runs}/g-cache",
            recipe="adaptive_knowledge_distillation",
            config=str(CONFIG),
        )
    )


@pytest.mark.e2e
def test_the_batch_grows_and_an_oom_retries_the_same_samples_in_halves_with_kd(growing: str, runs: Path) -> None:
    assert "Growth period 1 (every 2 steps) after optimizer step 2: micro batch 2 -> 4" in growing
    assert (
        "Out of memory at micro batch 8 in step 5 of epoch 1 (optimizer step 5) (injected: forward out of "
        "memory (rank 0)): running the same 8 samples again as micro batch 4 x accumulation 2 x 1 rank(s); global "
        "batch 8 and LR unchanged; micro batch capped at 4 for the rest of the run" in growing
    )
    rows = read_metrics(runs / "growing" / "logs")
    assert [row["global_batch_size"] for row in rows[:5]] == [2, 2, 4, 4, 8]
    assert [row["micro_batch_size"] for row in rows[:5]] == [2, 2, 4, 4, 4]
    assert all(row["micro_batch_size"] <= 4 for row in rows[4:])
    for row in rows:
        planned = row["micro_batch_size"] * row["gradient_accumulation_steps"]
        assert row["lr"] == pytest.approx(BASE_LR * math.sqrt(planned / REFERENCE_BATCH), rel=1e-12), row["step"]
        assert row["loss"] == pytest.approx(0.5 * row["class_loss"] + 0.5 * row["kd_loss"], rel=1e-6)
    assert "Rank 0: finished at optimizer step" in growing


# ---------------------------------------------------------------- two ranks, a copy of a stock config
def stock_kd_on_tiny(stock: str, assets: Path, output_dir: Path, destination: Path) -> Path:
    """``tune cp`` of a stock KD config, pointed at the tiny student, teacher, tokenizer and data (every other key
    as torchtune ships it)."""
    copied = run_command("tune", ["cp", stock, str(destination)], cwd=destination.parent)
    assert copied.returncode == 0, copied.stderr[-3000:]
    cfg, ours = OmegaConf.load(destination), OmegaConf.load(CONFIG)
    for node in ("model", "teacher_model", "tokenizer", "dataset"):
        cfg[node] = ours[node]
    for key in ("checkpointer", "teacher_checkpointer"):
        for field in ("checkpoint_dir", "checkpoint_files", "model_type"):
            cfg[key][field] = OmegaConf.to_container(ours[key], resolve=False)[field]
    cfg.assets_dir, cfg.output_dir, cfg.device = str(assets), str(output_dir), "cpu"
    OmegaConf.save(cfg, destination)
    return destination


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_ranks_profile_a_stock_kd_copy_with_the_teacher_sharded_and_exit_cleanly(assets: Path, runs: Path) -> None:
    """torchrun, 2 ranks (gloo on CPU), a tiny copy of llama3_2/8B_to_1B_KD_lora_distributed: the teacher is
    sharded as the student (half its bytes on rank 0), the profiler's trials run with it resident, the run trains at
    the micro batch it chose and both ranks finish. A 24 MiB budget: a few samples a micro batch (the trials and
    the two steps short)."""
    out = runs / "two_ranks"
    copy = stock_kd_on_tiny("llama3_2/8B_to_1B_KD_lora_distributed", assets, out, runs / "kd_copy.yaml")
    result = check(
        run_command(
            "tune",
            [
                "run",
                "--nproc_per_node",
                "2",
                "adaptive_knowledge_distillation",
                "--config",
                str(copy),
                "use_maximum_batch_size=True",
                "adaptive_batching.memory_budget=24MiB",
                "tokenizer.max_seq_len=128",
                "dataset.split=train[:64]",
                "optimizer.fused=False",
                "max_steps_per_epoch=2",
                "gradient_accumulation_steps=1",
                f"adaptive_batching.cache_dir={runs / 'two-cache'}",
            ],
            cwd=runs,
        )
    )
    line = re.search(
        r"Teacher model \(teacher_model, weights from teacher_checkpointer\): frozen, ([\d.]+) MiB of "
        r"weights, ([\d.]+) MiB on this rank \(sharded over 2 ranks as the student\)",
        result.stderr,
    )
    assert line and 0.45 < float(line[2]) / float(line[1]) < 0.55, result.stderr[-3000:]
    chosen = re.search(r"largest micro batch that ran (\d+); chosen micro batch (\d+)", result.stderr)
    assert chosen and 1 <= int(chosen[2]) <= int(chosen[1]), result.stderr[-3000:]
    rows = read_metrics(out / "logs")
    assert [row["micro_batch_size"] for row in rows] == [int(chosen[2])] * 2 and "kd_loss" in rows[0]
    finals = [
        line.split("last loss ")[1] for line in result.stderr.splitlines() if "finished at optimizer step 2" in line
    ]
    assert len(finals) == 2 and finals[0] == finals[1], result.stderr[-3000:]
    assert warning_lines(result) == []  # the student's adapters drawn on a CPU mesh warned once per rank (issue 53)
