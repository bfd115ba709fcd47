"""Stock's losses at a fixed batch, for Llama 3.2 Vision (docs/vision.md): ``benchmarks/recipe_vs_torchtune.py
--objective vision_full`` and ``vision_lora`` run ours and torchtune's ``full_finetune_single_device`` and
``lora_finetune_single_device`` on a ``tune cp`` copy of the stock 11B single-device config, pointed at the tiny
vision assets, at its batch of 2 with 2 micro batches a step (the token count of a step spans two micro batches).

Each run is 2 steps (bf16 on a CPU is slow): the first before any update, the second after one. The losses agree to
the float32 rounding of stock's logged figure, and the gradient norms, as each recipe logs them, are equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runs import check, run_command

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "recipe_vs_torchtune.py"
# LoRA's run only: full fine-tuning's is the same benchmark code with the full builder and torch's AdamW (its figures on
# docs/vision.md come from the command's own run)
OBJECTIVES = ("vision_lora",)
FLOAT32_ROUNDING = 1e-6  # stock logs its loss as a float32 (a few units in the last place), ours as a float64

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory, vision_assets: Path) -> dict[str, tuple[dict, str]]:
    """Each vision objective's figures and report: one run of each recipe, 2 steps of 2 x 2 samples of 32 tokens."""
    out = {}
    for objective in OBJECTIVES:
        work = tmp_path_factory.mktemp(objective)
        js = work / "parity.json"
        # fmt: off
        argv = [
            str(SCRIPT), "--objective", objective, "--steps", "1", "--warmup", "1", "--repeats", "1", "--no-switch",
            "--accumulation", "2", "--vision-seq-len", "32", "--assets", str(vision_assets), "--json", str(js),
            "--workdir", str(work / "work"),
        ]
        # fmt: on
        result = check(run_command("script", argv, cwd=work, timeout=300, fork_python=True))
        out[objective] = json.loads(js.read_text()), result.stdout
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_step_one_is_stocks(parity: dict[str, tuple[dict, str]], objective: str) -> None:
    figures, _ = parity[objective]
    first = figures["per_step"][0]
    assert first["step"] == 1 and first["ours_grad_norm"] == first["stock_grad_norm"] > 0
    assert abs(first["ours_loss"] - first["stock_loss"]) <= FLOAT32_ROUNDING * first["stock_loss"]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_step_after_an_update_is_stocks(parity: dict[str, tuple[dict, str]], objective: str) -> None:
    figures, out = parity[objective]
    steps = figures["per_step"]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["ours_grad_norm"] == row["stock_grad_norm"] for row in steps)
    same = figures["same_computation"]
    assert same["loss"]["max_rel_diff"] < FLOAT32_ROUNDING and same["lr"]["max_rel_diff"] == 0
    assert "(same batches, same LR schedule: the same computation)" in out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_both_read_the_stock_config_with_only_the_assets_changed(
    parity: dict[str, tuple[dict, str]], objective: str
) -> None:
    figures, out = parity[objective]
    settings, vision = figures["settings"], figures["vision"]
    assert (settings["batch_size"], settings["gradient_accumulation_steps"], settings["dtype"]) == (2, 2, "bf16")
    assert figures["dropped_keys"] == ["batch_increase_function", "use_maximum_batch_size"]  # stock reads the rest
    assert {"model._component_", "dataset", "checkpointer.checkpoint_dir"} <= set(vision["changed_keys"])
    assert ("optimizer" in vision["changed_keys"]) == (objective == "vision_full")  # bitsandbytes' needs CUDA
    assert Path(vision["copy"]).name == f"11B_{objective.split('_')[1]}_single_device.yaml"
    assert "opened_gates" not in vision  # the tiny checkpoint's gates are open already (tiny_vision.open_gates)


def test_full_fine_tuning_changes_only_the_optimizer_that_needs_cuda(tmp_path: Path) -> None:
    """vision_full's copy of 11B_full_single_device: the assets' keys and torch's AdamW at the stock LR in place of
    bitsandbytes' paged 8-bit AdamW (CUDA only); LoRA's keeps its optimizer."""
    import recipe_vs_torchtune as bench

    full, lora = (
        bench.vision_overrides(bench.parse_args(["--objective", objective, "--assets", str(tmp_path)]))
        for objective in ("vision_full", "vision_lora")
    )
    assert set(full) - set(lora) == {"optimizer"} and set(lora) <= set(full)
    assert full["model._component_"].endswith(".tiny_llama3_2_vision")
    assert lora["model._component_"].endswith(".lora_tiny_llama3_2_vision")
    assert full["optimizer"]["_component_"] == "torch.optim.AdamW" and full["optimizer"]["lr"] == 2e-5
