"""torchtune's single-device memory-saver configs as a user runs them: ``tune cp`` copies of
``llama3_2/1B_full_single_device``, ``qwen2_5/1.5B_full_single_device``, ``phi3/mini_full_low_memory`` and
``mistral/7B_full_low_memory`` (optimizer_in_bwd, bitsandbytes' paged and 8-bit AdamW, bf16), pointed at the tiny
model of the same family, profiler on; and an out-of-memory error in the middle of a backward that already stepped
part of the model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from config_edits import stock_on_tiny
from recipe_runs import FAULTY_RUN, check, losses, run_command, tune_run
from safetensors.torch import load_file

from adaptive_batching.assets.families import write_family_assets

pytestmark = pytest.mark.e2e
pytest.importorskip("bitsandbytes")

# stock config -> (our tiny config of the same family, the family's tiny assets or None for the tiny Llama)
STOCK = {
    "llama3_2/1B_full_single_device": ("tiny_full", None),
    "qwen2_5/1.5B_full_single_device": ("tiny_qwen2_5_full", "qwen2_5"),
    "phi3/mini_full_low_memory": ("tiny_phi3_full", "phi3"),
    "mistral/7B_full_low_memory": ("tiny_mistral_full", "mistral"),
}
# One batch of the same 8 samples of at most 64 tokens per step (one step per epoch), a constant LR: the loss must
# fall on it. The profiler sets the micro batch: its search stops at the 16 samples of the data set, well inside the
# budget (keep_global_batch: 8 fit in one, so no accumulation); activation offloading is CUDA only, as in torchtune.
RUN = (
    "dataset.split=train[:16]",
    "tokenizer.max_seq_len=64",
    "shuffle=False",
    "lr_scheduler=null",
    "optimizer.lr=1e-3",
    "batch_size=8",
    "batch_increase_function=null",
    "use_maximum_batch_size=True",
    "adaptive_batching.keep_global_batch=True",
    "adaptive_batching.memory_budget=512MiB",
    "max_steps_per_epoch=1",
    "enable_activation_offloading=False",
)


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict:
    """Per stock config: 3 epochs of one step each; then a copy of its output without the last epoch, resumed."""
    root = tmp_path_factory.mktemp("memory-savers")
    families = root / "families"
    runs: dict = {}

    def runs_of(stock: str) -> dict:
        if stock not in runs:
            tiny, family = STOCK[stock]
            if family is not None:
                write_family_assets(families, family, num_samples=40)
            name = stock.replace("/", "-")
            copy = stock_on_tiny(stock, tiny, families if family else assets, root / name, root / f"{name}.yaml")
            cache = f"adaptive_batching.cache_dir={root / 'cache'}"
            full = check(tune_run("adaptive_full_finetune", str(copy), [*RUN, cache, "epochs=3"], cwd=root))
            resumed_dir = root / f"{name}-resumed"
            shutil.copytree(root / name, resumed_dir, ignore=shutil.ignore_patterns("epoch_2"))
            resumed = check(
                tune_run(
                    "adaptive_full_finetune",
                    str(copy),
                    [*RUN, cache, "epochs=3", f"output_dir={resumed_dir}", "resume_from_checkpoint=True"],
                    cwd=root,
                )
            )
            runs[stock] = {
                "dir": root / name,
                "resumed_dir": resumed_dir,
                "copy": copy,
                "full": full.stdout + full.stderr,
                "resumed": resumed.stdout + resumed.stderr,
            }
        return runs[stock]

    return {"of": runs_of}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")):
        found.update(load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True))
    assert found, f"no weights in {folder}"
    return found


@pytest.mark.parametrize("stock", STOCK)
def test_a_stock_memory_saver_config_profiles_learns_and_resumes_exactly(stock: str, stock_runs: dict) -> None:
    run = stock_runs["of"](stock)
    assert "optimizer_in_bwd: true" in run["copy"].read_text().lower()
    assert "largest micro batch that ran" in run["full"]  # the profiler ran, with the in-backward optimizer
    assert "micro batch 8 x accumulation 1" in run["full"]
    loss = losses(run["dir"] / "logs")
    assert len(loss) == 3 and loss[2] < loss[0]
    assert "Resuming at the end of epoch 2 (optimizer step 2)" in run["resumed"]
    straight, resumed = weights(run["dir"] / "epoch_2"), weights(run["resumed_dir"] / "epoch_2")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)


def faulty(tmp: Path, name: str, fault: str, assets: Path, *overrides: str):
    return run_command(
        "script",
        [
            str(FAULTY_RUN),
            fault,
            str(tmp / f"{name}-"),
            "adaptive_full_finetune",
            "--config",
            "tiny_full",
            f"assets_dir={assets}",
            f"output_dir={tmp / name}",
            *IN_BWD_TINY,
            *overrides,
        ],
        cwd=tmp,
    )


IN_BWD_TINY = (
    "optimizer_in_bwd=True",
    "clip_grad_norm=null",
    "gradient_accumulation_steps=1",
    "adaptive_batching.grow_past_memory=skip",
    "use_maximum_batch_size=False",
    "batch_increase_function=null",
    "batch_size=4",
    "dataset.split=train[:24]",
    "tokenizer.max_seq_len=96",
    "epochs=1",
    "max_steps_per_epoch=null",
    "save_every_n_steps=1",
    "shuffle=False",
)


def test_an_oom_after_the_backward_stepped_part_of_the_model_stops_and_a_stop_signal_saves(
    tmp_path: Path, assets: Path
) -> None:
    # The embedding's gradient comes last: every other parameter has been stepped when it fails.
    failed = faulty(tmp_path, "run", '{"phase": "embedding_backward", "from_step": 3, "to_step": 3}', assets)
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert "With optimizer_in_bwd=True a step is not run again in smaller micro batches" in output
    assert "the last complete checkpoint (optimizer step 2)" in output
    # The saved run goes on from optimizer step 2 exactly as a run that never failed.
    clean = faulty(tmp_path, "clean", '{"phase": "none"}', assets, "max_steps_per_epoch=4")
    assert clean.returncode == 0, clean.stderr[-3000:]
    resumed = faulty(
        tmp_path, "run", '{"phase": "none"}', assets, "max_steps_per_epoch=4", "resume_from_checkpoint=True"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(optimizer step 2)" in resumed.stdout + resumed.stderr
    assert losses(tmp_path / "run" / "logs")[-2:] == losses(tmp_path / "clean" / "logs")[-2:]
    # A stop signal after optimizer step 2 saves it and exits 75; the resumed run goes on as the clean one.
    preempted = faulty(
        tmp_path,
        "stopped",
        '{"signal": "SIGTERM", "signal_at": 2}',
        assets,
        "max_steps_per_epoch=4",
        "save_every_n_steps=null",
    )
    assert preempted.returncode == 75, preempted.stderr[-3000:]
    again = faulty(
        tmp_path,
        "stopped",
        '{"phase": "none"}',
        assets,
        "max_steps_per_epoch=4",
        "save_every_n_steps=null",
        "resume_from_checkpoint=True",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(tmp_path / "stopped" / "logs") == losses(tmp_path / "clean" / "logs")


@pytest.mark.multiprocess
def test_two_ranks_step_inside_the_backward_under_fsdp2_and_resume_exactly(tmp_path: Path, assets: Path) -> None:
    common = [f"assets_dir={assets}", *IN_BWD_TINY, "save_every_n_steps=null", "epochs=2", "max_steps_per_epoch=2"]
    check(
        tune_run(
            "adaptive_full_finetune", "tiny_full", [*common, f"output_dir={tmp_path / 'run'}"], cwd=tmp_path, nproc=2
        )
    )
    shutil.copytree(tmp_path / "run", tmp_path / "resumed", ignore=shutil.ignore_patterns("epoch_1"))
    resumed = check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from_checkpoint=True"],
            cwd=tmp_path,
            nproc=2,
        )
    )
    assert "Resuming at the end of epoch 1 (optimizer step 2)" in resumed.stdout + resumed.stderr
    straight, again = weights(tmp_path / "run" / "epoch_1"), weights(tmp_path / "resumed" / "epoch_1")
    assert all(torch.equal(straight[key], again[key]) for key in straight)
    loss = losses(tmp_path / "run" / "logs")
    assert len(loss) == 4 and losses(tmp_path / "resumed" / "logs")[-2:] == loss[-2:]


def test_lora_steps_its_adapters_inside_the_backward_and_resumes_exactly(tmp_path: Path, assets: Path) -> None:
    common = [f"assets_dir={assets}", *IN_BWD_TINY, "save_every_n_steps=null", "epochs=2", "max_steps_per_epoch=2"]
    check(tune_run("adaptive_lora_finetune", "tiny_lora", [*common, f"output_dir={tmp_path / 'run'}"], cwd=tmp_path))
    shutil.copytree(tmp_path / "run", tmp_path / "resumed", ignore=shutil.ignore_patterns("epoch_1"))
    resumed = check(
        tune_run(
            "adaptive_lora_finetune",
            "tiny_lora",
            [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from_checkpoint=True"],
            cwd=tmp_path,
        )
    )
    assert "Resuming at the end of epoch 1 (optimizer step 2)" in resumed.stdout + resumed.stderr
    straight, again = weights(tmp_path / "run" / "epoch_1"), weights(tmp_path / "resumed" / "epoch_1")
    assert any("lora" in key for key in straight)
    assert all(torch.equal(straight[key], again[key]) for key in straight)
    assert losses(tmp_path / "resumed" / "logs")[-2:] == losses(tmp_path / "run" / "logs")[-2:]
