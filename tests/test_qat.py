"""Quantization-aware training in ``adaptive_full_finetune`` and ``adaptive_lora_finetune`` (issue 38.3, 38.4, 38.7).

Four recipe runs, shared by module fixtures:
- ``full``: ``adaptive_full_finetune`` on ``tiny_full`` with torchao's 8da4w QAT quantizer, profiler off and the batch
  fixed, against the same two steps built by hand (the quantizer's ``prepare`` applied by hand, AdamW); then
  ``tune run quantize`` on its checkpoint;
- ``chain``: ``tiny_qat_lora`` with ``fake_quant_after_n_steps=4``, the batch growing every 3 steps, an injected
  out-of-memory error at step 7 (benchmarks/faulty_run.py): uninterrupted, and stopped by SIGTERM after step 3 then
  resumed;
- a ``tune cp`` copy of the stock ``llama3_2/1B_qat_lora`` pointed at the tiny model, profiled by name.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from doc_figures import agrees, overrides, profiled, quoted
from omegaconf import OmegaConf
from progress_lines import lines_inside_a_bar, screen_lines
from recipe_runs import FIXED_BATCH_SIZE, check, read_metrics, run_command, tune_run
from test_oom_recovery import faulty_run, ok
from test_preemption import logged_steps, stopped

from adaptive_batching.config.loading import load_config, stock_configs
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import recipe_for_model
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.methods import FullFinetune, LoRAFinetune
from adaptive_batching.training.quantization import (
    FakeQuantizedLoRALinear,
    QuantizationAware,
    fake_quantizers,
    quantization_aware,
    set_fake_quant,
)
from adaptive_batching.training.recipe_table import method_and_objective
from adaptive_batching.training.stepping import StepRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HERE = Path(__file__).parent
CONFIGS = HERE.parent / "configs"
QAT_QUANTIZER = "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"
STOCK_QAT = {
    "llama2/7B_qat_full": "adaptive_full_finetune",
    "llama3/8B_qat_full": "adaptive_full_finetune",
    "llama3/8B_qat_lora": "adaptive_lora_finetune",
    "llama3_1/8B_qat_lora": "adaptive_lora_finetune",
    "llama3_2/1B_qat_lora": "adaptive_lora_finetune",
    "llama3_2/3B_qat_lora": "adaptive_lora_finetune",
}


# ---------------------------------------------------------------- config: accepted by name, refused in one line
@pytest.mark.parametrize("name, recipe", sorted(STOCK_QAT.items()))
def test_the_stock_qat_configs_validate_by_name_for_our_recipe_with_their_quantizer(name: str, recipe: str) -> None:
    cfg = load_config(name)
    assert recipe_for_model(cfg) == recipe
    validate_config(cfg, recipe)
    method, _ = method_and_objective(cfg, recipe, profiled=True)
    assert isinstance(method, QuantizationAware) and method.mode == "8da4w-qat"
    assert method.quantizer.groupsize == 256 and method.quantizer.precision == torch.bfloat16
    assert isinstance(method.method, LoRAFinetune if "lora" in recipe else FullFinetune) and method.lora == (
        "lora" in recipe
    )


def test_the_dpo_recipes_refuse_a_quantizer_naming_the_fine_tuning_recipes() -> None:
    cfg = load_config("tiny_lora_dpo", [f"quantizer._component_={QAT_QUANTIZER}"])
    with pytest.raises(
        ConfigError,
        match=r"^config key 'quantizer' = '.+QATQuantizer' asks for quantization-aware "
        r"training, which adaptive_lora_dpo does not do; use adaptive_full_finetune "
        r"or adaptive_lora_finetune$",
    ):
        validate_config(cfg, "adaptive_lora_dpo")


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["fake_quant_after_n_steps=3"],
            "config key 'fake_quant_after_n_steps' = 3 needs config key 'quantizer' (a QAT quantizer: "
            "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer or Int4WeightOnlyQATQuantizer); without "
            "one nothing is fake-quantized",
        ),
        (
            [f"quantizer._component_={QAT_QUANTIZER}", "fake_quant_after_n_steps=-1"],
            "config key 'fake_quant_after_n_steps' = -1: a whole number of optimizer steps >= 0, or null (fake "
            "quantization on from the first step)",
        ),
        (
            [f"quantizer._component_={QAT_QUANTIZER}", "quantizer.group_size=32"],
            "config key 'quantizer': TypeError: Int8DynActInt4WeightQATQuantizer.__init__() got an unexpected keyword "
            "argument 'group_size'",
        ),
    ],
)
def test_bad_qat_keys_are_one_line_before_any_model_loads(overrides: list[str], line: str) -> None:
    cfg = load_config("tiny_full", overrides)
    validate_config(cfg, "adaptive_full_finetune")
    with pytest.raises(ConfigError) as error:
        quantization_aware(cfg, FullFinetune(), profiled=True)
    assert str(error.value) == line


def test_a_post_training_quantizer_is_refused_naming_torchtunes_quantize() -> None:
    ptq = "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer"
    cfg = load_config("tiny_lora", [ptq])
    with pytest.raises(
        ConfigError,
        match=r"asks for quantizing a trained model \(post-training quantization\), "
        r"which adaptive_lora_finetune does not do yet; use torchtune's quantize$",
    ):
        validate_config(cfg, "adaptive_lora_finetune")


def _meta_model(name: str, overrides: list[str] = (), profiled: bool = True) -> tuple[Any, torch.nn.Module]:
    from torchtune import config

    cfg = load_config(name, list(overrides))
    method, _ = method_and_objective(cfg, profiled=profiled)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    method.configure(model)
    return method, model


def test_lora_qat_fake_quantizes_each_lora_layers_base_path_and_a_groupsize_that_does_not_divide_is_one_line() -> None:
    method, model = _meta_model("tiny_qat_lora")
    swapped = [m for m in model.modules() if isinstance(m, FakeQuantizedLoRALinear)]
    assert len(swapped) == method.swapped == 12  # q, v, output_proj, w1, w2, w3 of 2 layers, as the config asks
    assert all(m.weight_fake_quantizer.config.group_size == 32 for m in swapped)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n
        for n, m in model.named_modules()
        if isinstance(m, FakeQuantizedLoRALinear)
        for n in (f"{n}.lora_a.weight", f"{n}.lora_b.weight")
    }
    with pytest.raises(
        ConfigError,
        match=r"^config key 'quantizer.groupsize' = 128: it must divide every adapted "
        r"layer's input size, and 64 is not a multiple of it$",
    ):
        _meta_model("tiny_qat_lora", ["quantizer.groupsize=128"])


def test_the_lora_layer_is_torchtunes_qat_lora_step_on_torchaos_fake_quantizers() -> None:
    """``fq(W) @ fq(x) + (alpha / rank) B A x``: the base path through torchao's own ``FakeQuantizedLinear`` with the
    quantizer's configs, the adapters' path unquantized; with fake quantization off, plain LoRA."""
    from torchao.quantization.qat import FakeQuantizedLinear
    from torchtune.modules.peft import LoRALinear
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    torch.manual_seed(0)
    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=32)
    lora = LoRALinear(64, 48, rank=4, alpha=8.0)
    torch.nn.init.normal_(lora.lora_b.weight)
    qat = FakeQuantizedLoRALinear(
        64,
        48,
        4,
        8.0,
        0.0,
        quantizer.get_activation_fake_quantize_config(),
        quantizer.get_weight_fake_quantize_config(),
    )
    qat.load_state_dict(lora.state_dict())
    base = FakeQuantizedLinear(
        64, 48, False, quantizer.get_activation_fake_quantize_config(), quantizer.get_weight_fake_quantize_config()
    )
    base.weight = lora.weight
    x = torch.randn(3, 5, 64)
    adapters = 2.0 * lora.lora_b(lora.lora_a(x))
    assert torch.equal(qat(x), base(x) + adapters)
    assert not torch.equal(qat(x), lora(x))
    set_fake_quant(qat, False)
    assert torch.equal(qat(x), lora(x))


def _runner(method: Any, model: torch.nn.Module) -> StepRunner:
    one_rank = ParallelInfo(world_size=1, rank=0, local_rank=0)
    cpu = torch.device("cpu")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return StepRunner(
        model,
        optimizer,
        None,
        StepGuard(one_rank, cpu),
        one_rank,
        cpu,
        None,
        True,
        lambda: (1, None, "."),
        method=method,
    )


def test_fake_quantization_is_on_for_every_trial_and_follows_the_step_in_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The step runner asks the method before each step: trials (the profile, growth's checks) always measure the
    fake-quantized step; each training step then runs as ``fake_quant_after_n_steps=2`` says, whatever came before it
    (a resume, a trial). It says the state at the run's first step and where it turns on."""
    method, model = _meta_model("tiny_qat_lora", ["fake_quant_after_n_steps=2"])
    runner = _runner(method, model)
    states = []
    with caplog.at_level("INFO"):
        for event, step in (
            ("trial", 4),
            ("step", 0),
            ("step", 1),
            ("trial", 8),
            ("step", 1),
            ("step", 2),
            ("step", 3),
        ):
            runner._fake_quantize(None if event == "trial" else step)
            states.append({q.enabled for q in fake_quantizers(model)})
    assert states == [{True}, {False}, {False}, {True}, {False}, {True}, {True}]
    said = [r.getMessage() for r in caplog.records if "fake quantization" in r.getMessage()]
    assert said == ["Step 0: fake quantization off, on from step 2", "Step 2: fake quantization on"]
    plain, plain_model = _meta_model("tiny_lora")
    assert plain.fake_quantization is None
    _runner(plain, plain_model)._fake_quantize(0)  # a method without fake quantization: nothing to switch


def test_the_qat_line_is_said_when_the_weights_load_and_names_the_trials_only_when_the_run_profiles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``estimate`` builds the model through ``configure`` and runs no trial: configure says nothing. A run's set-up
    says the line once the weights are loaded, with the trials only when the run profiles (``adaptive-batching
    estimate`` prints its own QAT line)."""
    said = []
    for profiles in (True, False):
        caplog.clear()
        with caplog.at_level("INFO"):
            method, model = _meta_model("tiny_qat_lora", ["fake_quant_after_n_steps=2"], profiled=profiles)
        assert not [r for r in caplog.records if "Quantization-aware training" in r.getMessage()]
        with caplog.at_level("INFO"):
            method.after_load(model, [], [])
        said += [r.getMessage() for r in caplog.records if "Quantization-aware training" in r.getMessage()]
    start = (
        "Quantization-aware training (Int8DynActInt4WeightQATQuantizer, 8da4w-qat, groupsize 32): 12 LoRA layers' "
        "frozen base weights and inputs fake-quantized, off for the first 2 optimizer steps, then on"
    )
    assert said == [f"{start}; the profiler's trial steps run with it on", start]


# ---------------------------------------------------------------- full QAT against a step built by hand
FULL = (
    "epochs=1",
    "max_steps_per_epoch=2",
    "batch_size=4",
    "shuffle=False",
    "lr_scheduler=null",
    "clip_grad_norm=null",
    "optimizer.lr=1e-3",
    "dataset.split=train[:8]",
    f"quantizer._component_={QAT_QUANTIZER}",
    "quantizer.groupsize=32",
    "metric_logger._component_=dpo_parity_run.ExactDiskLogger",
    *FIXED_BATCH_SIZE,
)


def _by_hand(assets: Path) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """``qat_distributed``'s step by hand on one process: the tiny model, its weights, torchao's quantizer's
    ``prepare``, the data in order (4 samples a step, ``padded_collate_sft``), chunked CE over the shifted labels
    times their tokens, the gradients scaled by 1 / tokens, AdamW; the two steps' losses and the weights after."""
    from torchtune import config, training
    from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft

    cfg = load_config("tiny_full", [f"assets_dir={assets}", *FULL])
    training.set_seed(cfg.seed)
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset, tokenizer=tokenizer)
    model = config.instantiate(cfg.model)
    weights = config.instantiate(cfg.checkpointer, should_load_recipe_state=False).load_checkpoint()
    model.load_state_dict(weights[training.MODEL_KEY])
    quantizer = config.instantiate(cfg.quantizer)
    quantizer.precision = torch.float32
    model = quantizer.prepare(model)
    loss_fn = config.instantiate(cfg.loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = config.instantiate(cfg.optimizer, model.parameters())
    losses = []
    for step in range(2):
        batch = padded_collate_sft(
            [dataset[i] for i in range(4 * step, 4 * step + 4)],
            padding_idx=tokenizer.pad_id,
            ignore_idx=CROSS_ENTROPY_IGNORE_IDX,
        )
        labels = torch.hstack(
            (batch["labels"][..., 1:], torch.full_like(batch["labels"][..., :1], CROSS_ENTROPY_IGNORE_IDX))
        )
        tokens = (labels != CROSS_ENTROPY_IGNORE_IDX).sum()
        loss = loss_fn(model(batch["tokens"]), labels) * tokens  # qat_distributed's sum, then gradients / tokens
        loss.backward()
        training.scale_grads(model, 1 / tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((loss / tokens).item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


@pytest.fixture(scope="module")
def full(assets: Path, runs: Path) -> dict[str, Any]:
    out = runs / "full"
    result = check(
        tune_run("adaptive_full_finetune", "tiny_full", [f"assets_dir={assets}", f"output_dir={out}", *FULL], cwd=HERE)
    )
    return {"output": result.stdout + result.stderr, "rows": read_metrics(out / "logs"), "out": out}


def _saved(out: Path, assets: Path) -> dict[str, torch.Tensor]:
    from torchtune import config, training

    cfg = load_config(
        "tiny_full",
        [
            f"assets_dir={assets}",
            f"checkpointer.checkpoint_dir={out / 'epoch_0'}",
            "checkpointer.checkpoint_files=[model-00001-of-00001.safetensors]",
        ],
    )
    return config.instantiate(cfg.checkpointer, should_load_recipe_state=False).load_checkpoint()[training.MODEL_KEY]


@pytest.mark.e2e
def test_full_qat_logs_the_hand_built_torchao_steps_losses_and_saves_its_weights(full: dict, assets: Path) -> None:
    """Stock ``qat_distributed`` needs NCCL; on CPU ours equals the step built by hand with torchao's quantizer:
    the losses of both steps and every saved weight. The checkpoint is the plain model (the fake-quantized linear
    layers add no weights), as torchtune's QAT recipes save it."""
    losses, weights, model = _by_hand(assets)
    assert (
        "Quantization-aware training (Int8DynActInt4WeightQATQuantizer, 8da4w-qat, groupsize 32): 15 linear "
        "layers fake-quantized, on from the first step" in full["output"]
    )
    # The same float32 losses: ours logs their token sum / tokens in float64, by hand float32's quotient.
    assert [row["loss"] for row in full["rows"]] == pytest.approx(losses, rel=1e-7, abs=0)
    saved = _saved(full["out"], assets)
    assert saved.keys() == weights.keys()
    assert all(torch.equal(saved[key], weights[key]) for key in weights)
    set_fake_quant(model, False)  # the fake quantization was on: without it the same weights give another loss
    assert len(fake_quantizers(model)) == 30


@pytest.mark.e2e
def test_tune_run_quantize_converts_the_qat_checkpoint_to_int8_weights_with_the_same_quantizer(full: dict) -> None:
    """torchtune's QAT tutorial: ``tune cp quantization my_quantization.yaml``, pointed at the QAT checkpoint,
    with the quantizer that trained it; ``tune run quantize`` prepares, loads our checkpoint strictly, converts."""
    out = full["out"]
    check(run_command("tune", ["cp", "quantization", "my_quantization.yaml"], cwd=out))
    cfg = OmegaConf.load(out / "my_quantization.yaml")
    cfg.output_dir, cfg.device, cfg.dtype = str(out / "quantized"), "cpu", "fp32"
    cfg.model = OmegaConf.to_container(load_config("tiny_full").model)
    cfg.checkpointer.update(
        checkpoint_dir=str(out / "epoch_0"), checkpoint_files=["model-00001-of-00001.safetensors"], model_type="LLAMA3"
    )
    cfg.quantizer = {"_component_": QAT_QUANTIZER, "groupsize": 32}
    OmegaConf.save(cfg, out / "my_quantization.yaml")
    result = check(run_command("tune", ["run", "quantize", "--config", "my_quantization.yaml"], cwd=out))
    assert "Time for quantization" in result.stdout + result.stderr
    quantized = torch.load(out / "quantized" / "model-00001-of-00001-8da4w.pt")
    assert quantized["layers.0.attn.q_proj.weight"].dtype == torch.int8
    assert quantized["layers.0.attn.q_proj.scales"].shape == (64, 2)  # groups of 32 over 64 inputs


# ---------------------------------------------------------------- growth, OOM, SIGTERM and resume with LoRA QAT
QAT = {"recipe": "adaptive_lora_finetune", "config": "tiny_qat_lora"}
SAMPLES, AFTER, STOP_AT = 40, 4, 3
GROWING = (
    f"dataset.split=train[:{SAMPLES}]",
    "batch_size=2",
    "lr_scheduler=null",
    "adaptive_batching.growth_interval=3 steps",
    "batch_increase_function.factor=2",
    "batch_increase_function._component_=adaptive_batching.growth.geometric",
    "adaptive_batching.memory_budget=256MiB",
    "save_every_n_steps=4",
    f"fake_quant_after_n_steps={AFTER}",
    "metric_logger._component_=dpo_parity_run.ExactDiskLogger",
)
OOM_AT_7 = {"phase": "forward", "from_step": 7, "to_step": 7, "above": 4}
EXACT = ("loss", "lr", "gradient_accumulation_steps", "global_batch_size", "micro_batch_size")


@pytest.fixture(scope="module")
def chain(assets: Path, runs: Path) -> dict[str, Any]:
    """Uninterrupted; stopped by SIGTERM after step 3 (fake quantization still off); resumed."""

    def run(name: str, fault: dict, *more: str) -> Any:
        return faulty_run(runs, name, fault, assets, *GROWING, *more, **QAT)

    straight = ok(run("straight", OOM_AT_7, f"adaptive_batching.cache_dir={runs}/straight-cache"))
    first = run(
        "chain",
        {**OOM_AT_7, "signal": "SIGTERM", "signal_at": STOP_AT},
        f"adaptive_batching.cache_dir={runs}/chain-cache",
    )
    resumed = ok(
        run(
            "resumed",
            OOM_AT_7,
            f"output_dir={runs / 'chain'}",
            f"adaptive_batching.cache_dir={runs}/chain-cache",
            "resume_from_checkpoint=True",
        )
    )
    return {"straight": straight, "first": first, "resumed": resumed}


@pytest.mark.e2e
def test_lora_qat_grows_recovers_from_an_oom_and_switches_fake_quantization_on_at_step_4(
    chain: dict, runs: Path
) -> None:
    output = chain["straight"]
    assert (
        "12 LoRA layers' frozen base weights and inputs fake-quantized, off for the first 4 optimizer steps, "
        "then on; the profiler's trial steps run with it on" in output
    )
    assert (
        output.index("Profiler report")
        < output.index("Step 0: fake quantization off, on from step 4")
        < output.index("Step 4: fake quantization on")
    )
    assert "Growth period 1 (every 3 steps) after optimizer step 3: micro batch 2 -> 4" in output
    assert "Out of memory at micro batch 8 in step 7 of epoch 1" in output
    rows = read_metrics(runs / "straight" / "logs")
    assert [row["global_batch_size"] for row in rows[:7]] == [2, 2, 2, 4, 4, 4, 8]
    assert [row["micro_batch_size"] for row in rows[:7]] == [2, 2, 2, 4, 4, 4, 4]
    assert rows[6]["lr"] == pytest.approx(3e-3 * math.sqrt(8 / 2), rel=1e-12)


@pytest.mark.e2e
def test_lora_qat_stopped_before_fake_quantization_turns_on_resumes_bit_for_bit(chain: dict, runs: Path) -> None:
    """Stopped after step 3, resumed at step 3 with fake quantization off (as the uninterrupted run was), on from
    step 4 (step 5 in the log): every logged step equals the uninterrupted run's, bit for bit."""
    assert stopped(chain["first"], "SIGTERM") == STOP_AT
    resumed = chain["resumed"]
    assert f"Resuming at step {STOP_AT} of epoch 1 (optimizer step {STOP_AT})" in resumed
    assert f"Step {STOP_AT}: fake quantization off, on from step {AFTER}" in resumed
    assert f"Step {AFTER}: fake quantization on" in resumed
    straight, chained = read_metrics(runs / "straight" / "logs"), read_metrics(runs / "chain" / "logs")
    assert logged_steps(runs / "chain" / "logs") == [row["step"] for row in straight]
    exact = lambda rows: [{key: row[key] for key in EXACT} for row in rows]  # noqa: E731
    assert exact(chained) == exact(straight)


@pytest.mark.e2e
def test_the_fake_quantization_growth_oom_and_stop_lines_never_land_inside_the_progress_bar(chain: dict) -> None:
    """Each of those lines comes in the middle of an epoch, while its bar is drawn: each is on a line of its own
    (core/logs.py clears the bar first), and the bar goes on after it."""
    first = chain["first"].stdout + chain["first"].stderr
    for output in (chain["straight"], first):
        screen_lines(output)
        assert lines_inside_a_bar(output) == [], lines_inside_a_bar(output)
    assert "Step 4: fake quantization on" in screen_lines(chain["straight"])
    assert any(line.startswith("Growth period 1 (every 3 steps)") for line in screen_lines(chain["straight"]))
    assert any(line.startswith("stopped: SIGTERM received") for line in screen_lines(first))


# ---------------------------------------------------------------- a stock QAT config by name, profiled: docs/qat.md
QAT_FIGURES = (
    r"\| (QAT \(`quantizer.groupsize=32`\)|plain LoRA \(`quantizer=null`\)|QAT with `fake_quant_after_n_steps=100`) "
    r"\| ([^|]+) \| (\d+) \|"
)


@pytest.fixture(scope="module")
def stock_copy(assets: Path, runs: Path) -> dict[str, Any]:
    """``tune cp llama3_2/1B_qat_lora my_qat.yaml`` pointed at the tiny model, tokenizer and data (every other key as
    torchtune ships it: bf16, batch 4 x 8, groupsize 256, which the tiny model's 64 inputs cannot hold), then the
    ``adaptive-batching profile`` commands of docs/qat.md, as written there, in order (one cache: the third reads
    the first's profile)."""
    folder = runs / "stock_copy"
    folder.mkdir()
    copy = folder / "my_qat.yaml"
    copied = run_command("tune", ["cp", "llama3_2/1B_qat_lora", str(copy)], cwd=folder)
    assert copied.returncode == 0, copied.stderr[-3000:]
    cfg, ours = OmegaConf.load(copy), OmegaConf.load(CONFIGS / "tiny_qat_lora.yaml")
    assert stock_configs()["llama3_2/1B_qat_lora"].is_file() and cfg.quantizer.groupsize == 256
    for node in ("model", "tokenizer", "dataset"):
        cfg[node] = ours[node]
    for key in ("checkpoint_dir", "checkpoint_files", "model_type"):
        cfg.checkpointer[key] = OmegaConf.to_container(ours.checkpointer, resolve=False)[key]
    cfg.assets_dir, cfg.output_dir, cfg.device = str(assets), str(folder / "out"), "cpu"
    OmegaConf.save(cfg, copy)
    text = (HERE.parent / "docs" / "qat.md").read_text()
    commands = re.findall(r"^adaptive-batching profile --config my_qat\.yaml (.*)$", text, flags=re.M)
    assert len(commands) == 3, commands
    outputs = []
    for command in commands:
        result = check(
            run_command(
                "cli",
                [
                    "profile",
                    "--config",
                    str(copy),
                    *overrides(command),
                    f"adaptive_batching.cache_dir={folder / 'cache'}",
                ],
                cwd=folder,
            )
        )
        outputs.append(result.stdout + result.stderr)
    return {"commands": commands, "outputs": outputs, "out": folder / "out"}


@pytest.mark.e2e
def test_a_tune_cp_copy_of_the_stock_1b_qat_lora_config_profiles_fake_quantized_steps(stock_copy: dict) -> None:
    """The first command of docs/qat.md: fake-quantized trial steps on the copy, with one override
    (``quantizer.groupsize=32``) besides the budget and the length."""
    command, output = stock_copy["commands"][0], stock_copy["outputs"][0]
    assert [word for word in overrides(command) if not word.startswith(("adaptive_batching.", "tokenizer."))] == [
        "quantizer.groupsize=32"
    ]
    (line,) = re.findall(
        r"^Quantization-aware training \(.*$", (HERE.parent / "docs" / "qat.md").read_text(), flags=re.M
    )
    assert (
        line == "Quantization-aware training (Int8DynActInt4WeightQATQuantizer, 8da4w-qat, groupsize 32): 12 LoRA "
        "layers' frozen base weights and inputs fake-quantized, on from the first step; the profiler's "
        "trial steps run with it on"
    )
    assert line in output  # docs/qat.md's example line: the copy's model is tiny_qat_lora's
    report = json.loads((stock_copy["out"] / "profile" / "profile.json").read_text())
    assert report["seq_len"] == 64 and report["micro_batch"] >= 1
    assert re.search(r"chosen micro batch \d+", output)


@pytest.mark.e2e
def test_the_qat_pages_figures_are_what_its_commands_print(stock_copy: dict) -> None:
    """docs/qat.md's table, row by row against its three commands (tests/doc_figures.py's CPU tolerance). A delayed
    fake quantization takes the QAT run's profile from the cache, with its trials fake-quantized: its worst phase
    (the plain run, whose quantizer is null, has its own)."""
    rows = quoted("qat.md", QAT_FIGURES)
    assert len(rows) == 3
    qat, plain, delayed = (profiled(output) for output in stock_copy["outputs"])
    for row, run in zip(rows[:2], (qat, plain)):
        assert not run.cached
        assert agrees(float(row[2].removesuffix(" MiB")), run.per_sample_mib), (row[0], run)
        assert agrees(int(row[3]), run.chosen, samples=True), (row[0], run)
    assert delayed.cached and (delayed.per_sample_mib, delayed.chosen) == (qat.per_sample_mib, qat.chosen)
    assert rows[2][2] == "the first run's profile, from the cache" and rows[2][3] == rows[0][3]
    delayed_output = stock_copy["outputs"][2]
    assert "off for the first 100 optimizer steps, then on; the profiler's trial steps run with it on" in delayed_output
    cache = re.findall(r"Profiler: using the cached profile (\S+)", delayed_output)
    assert len(cache) == 1 and Path(cache[0]).is_file()
