"""Crash-safe checkpoints: saves are all or nothing, and resume loads the latest complete one.

Saves go through torchtune's real FullModelHFCheckpointer on the tiny model; kills are real
``os._exit`` calls in a child process at each stage of a save.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from config_edits import CONFIGS, modified
from omegaconf import DictConfig, OmegaConf
from recipe_runs import run_command
from torchtune import training
from torchtune.models.llama3 import lora_llama3

from adaptive_batching.assets.tiny import TINY_MODEL_ARGS, write_tiny_assets
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults.checkpoints import (
    ADAPTIVE_KEY,
    latest_complete_checkpoint,
    load_checkpoint,
    recipe_state,
    resume_config,
    save_checkpoint_atomically,
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_assets(tmp_path_factory.mktemp("assets"), num_samples=40).root


def checkpointer_cfg(assets: Path, out: Path, method: str = "full") -> DictConfig:
    """The shipped tiny config's checkpointer section, interpolations left in place."""
    cfg = modified(OmegaConf.load(CONFIGS / f"tiny_{method}.yaml"), {"assets_dir": str(assets), "output_dir": str(out)})
    return cfg.checkpointer


def full_state(base: dict[str, torch.Tensor], step: int, epochs_run: int = 0) -> dict[str, Any]:
    """A full fine-tune checkpoint whose weights and recipe state both encode ``step``."""
    state: dict[str, Any] = {training.MODEL_KEY: {k: v + 0.001 * step for k, v in base.items()}}
    state.update(
        recipe_state(
            seed=7,
            epochs_run=epochs_run,
            total_epochs=3,
            max_steps_per_epoch=None,
            optimizer_state={"state": {}, "param_groups": [{"lr": 0.1 * step}]},
            adaptive_state={"global_step": step, "step_in_epoch": 0},
        )
    )
    return state


def record(step: int, epoch: int = 0) -> dict[str, Any]:
    return {"global_step": step, "epoch": epoch, "step_in_epoch": 0, "epochs_run": epoch}


def save_full(cfg: DictConfig, step: int, epoch: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """Save a full checkpoint at ``step``; return its folder and the (torchtune-format) weights saved."""
    checkpointer, loaded = load_checkpoint(cfg, resume=False)
    state = full_state(loaded[training.MODEL_KEY], step, epochs_run=epoch)
    expected = {k: v.clone() for k, v in state[training.MODEL_KEY].items()}
    folder = save_checkpoint_atomically(
        checkpointer, state, epoch=epoch, adapter_only=False, record=record(step, epoch)
    )
    return folder, expected


def assert_resumes_to(cfg: DictConfig, step: int, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """torchtune, configured by resume_config, loads exactly ``weights`` and the recipe state of ``step``."""
    _, loaded = load_checkpoint(cfg, resume=True)
    assert loaded[ADAPTIVE_KEY]["global_step"] == step
    assert loaded[training.OPT_KEY]["param_groups"][0]["lr"] == pytest.approx(0.1 * step)
    assert loaded[training.SEED_KEY] == 7
    assert loaded[training.MODEL_KEY].keys() == weights.keys()
    assert all(torch.equal(loaded[training.MODEL_KEY][k], weights[k]) for k in weights)
    return loaded


def hidden_leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".checkpoint.lock")


# ---------------------------------------------------------------------------- save and resume


def test_a_full_save_resumes_to_its_weights_and_recipe_state(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    folder, weights = save_full(cfg, step=12, epoch=2)

    assert folder == out / "epoch_2"
    marker = json.loads((folder / "checkpoint.json").read_text())
    assert marker["complete"] is True and marker["global_step"] == 12 and marker["epochs_run"] == 2
    assert marker["folder"] == "epoch_2" and marker["saved_at"].endswith("+00:00")
    assert marker["files"]["recipe_state.pt"] == (folder / "recipe_state.pt").stat().st_size
    assert "model-00001-of-00001.safetensors" in marker["files"] and "config.json" in marker["files"]
    assert not (out / "recipe_state").exists()
    assert hidden_leftovers(out) == []

    resumed = resume_config(cfg)
    assert resumed.recipe_checkpoint == "epoch_2/recipe_state.pt"
    assert list(resumed.checkpoint_files) == ["epoch_2/model-00001-of-00001.safetensors"]
    assert resumed.checkpoint_dir == str(assets / "model")  # interpolation resolved
    assert list(cfg.checkpoint_files) == ["model.safetensors"] and cfg.recipe_checkpoint is None
    assert_resumes_to(cfg, 12, weights)


@pytest.mark.parametrize("adapter_only", [False, True])
def test_a_lora_save_resumes_to_its_adapter_over_the_base_weights(
    assets: Path, tmp_path: Path, adapter_only: bool
) -> None:
    from adaptive_batching.training.methods import LoRAFinetune

    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out, "lora")
    model_cfg = OmegaConf.load(CONFIGS / "tiny_lora.yaml").model
    checkpointer, loaded = load_checkpoint(cfg, resume=False)
    base = loaded[training.MODEL_KEY]
    model = lora_llama3(
        list(model_cfg.lora_attn_modules),
        apply_lora_to_mlp=model_cfg.apply_lora_to_mlp,
        lora_rank=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        **TINY_MODEL_ARGS,
    )
    model.load_state_dict(base, strict=False)
    method = LoRAFinetune(model_cfg, save_adapter_weights_only=adapter_only)
    method.configure(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if adapter_only:
        weights = {k: v for k, v in weights.items() if "lora_" in k}
    state = method.checkpoint_entries(weights)
    adapter = {k: v.clone() for k, v in state[training.ADAPTER_KEY].items()}
    state.update({k: v for k, v in full_state(base, 9).items() if k != training.MODEL_KEY})
    folder = save_checkpoint_atomically(checkpointer, state, epoch=0, adapter_only=adapter_only, record=record(9))

    assert (folder / "adapter_model.pt").is_file() and (folder / "adapter_config.json").is_file()
    assert bool(list(folder.glob("model-*"))) is not adapter_only
    resumed = resume_config(cfg)
    assert resumed.adapter_checkpoint == "epoch_0/adapter_model.pt"
    assert list(resumed.checkpoint_files) == ["model.safetensors"]  # the base weights, as configured
    assert resumed.recipe_checkpoint == "epoch_0/recipe_state.pt"
    reloaded = assert_resumes_to(cfg, 9, base)
    assert reloaded[training.ADAPTER_KEY].keys() == adapter.keys()
    assert all(torch.equal(reloaded[training.ADAPTER_KEY][k], adapter[k]) for k in adapter)


def test_the_end_of_epoch_save_replaces_the_one_inside_the_epoch(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    save_full(cfg, step=3, epoch=0)
    _, weights = save_full(cfg, step=5, epoch=0)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["epoch_0"]
    assert hidden_leftovers(out) == []
    assert json.loads((out / "epoch_0" / "checkpoint.json").read_text())["global_step"] == 5
    assert_resumes_to(cfg, 5, weights)


def test_the_largest_step_wins_over_a_higher_epoch_number_and_ties_go_to_the_higher_number(
    assets: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    save_full(cfg, step=4, epoch=2)
    _, weights = save_full(cfg, step=9, epoch=1)
    assert latest_complete_checkpoint(out) == out / "epoch_1"
    assert_resumes_to(cfg, 9, weights)
    shutil.copytree(out / "epoch_1", out / "epoch_3")
    assert latest_complete_checkpoint(out) == out / "epoch_3"


def test_incomplete_folders_are_skipped_with_a_warning_naming_them(
    assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    _, weights = save_full(cfg, step=5, epoch=0)
    for n in (3, 4, 5, 6, 7):
        shutil.copytree(out / "epoch_0", out / f"epoch_{n}")

    def edit_marker(n: int, **changes: Any) -> None:
        path = out / f"epoch_{n}" / "checkpoint.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    (out / "epoch_3" / "checkpoint.json").unlink()
    with open(out / "epoch_4" / "model-00001-of-00001.safetensors", "r+b") as handle:
        handle.truncate(100)
    edit_marker(5, complete=False, global_step=50)
    (out / "epoch_6" / "checkpoint.json").write_text('{"complete": tr')
    edit_marker(7, global_step=70)
    (out / "epoch_7" / "recipe_state.pt").unlink()
    (out / "epoch_8").mkdir()  # an old-style or foreign folder, left alone
    (out / "epoch_8" / "model-00001-of-00001.safetensors").touch()

    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        assert latest_complete_checkpoint(out) == out / "epoch_0"
    for n in (3, 4, 5, 6, 7, 8):
        assert any(str(out / f"epoch_{n}") in r.getMessage() for r in caplog.records), n
        assert (out / f"epoch_{n}").is_dir()
    assert_resumes_to(cfg, 5, weights)


def test_no_complete_checkpoint_is_a_clear_error(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "epoch_0").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=True.*no complete checkpoint"):
        resume_config(checkpointer_cfg(assets, out))
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=True"):
        resume_config(checkpointer_cfg(assets, tmp_path / "missing"))


def test_a_failed_save_leaves_nothing_and_restores_the_output_dir(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    save_full(cfg, step=5)
    checkpointer, loaded = load_checkpoint(cfg, resume=False)
    with pytest.raises(ValueError, match="Adapter checkpoint not found"):
        save_checkpoint_atomically(
            checkpointer, full_state(loaded[training.MODEL_KEY], 8), epoch=0, adapter_only=True, record=record(8)
        )
    assert checkpointer._output_dir == out
    assert hidden_leftovers(out) == []
    assert json.loads((out / "epoch_0" / "checkpoint.json").read_text())["global_step"] == 5
    with pytest.raises(ValueError, match="global_step"):
        save_checkpoint_atomically(checkpointer, {}, epoch=0, adapter_only=False, record={"epoch": 0})


# ---------------------------------------------------------------------------- interrupted swaps


def test_an_old_folder_set_aside_comes_back_when_its_name_is_free(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    _, weights = save_full(cfg, step=5)
    (out / "epoch_0").rename(out / ".old-epoch_0-123")
    assert latest_complete_checkpoint(out) == out / "epoch_0"
    assert hidden_leftovers(out) == []
    assert_resumes_to(cfg, 5, weights)


def test_a_complete_staged_save_older_than_the_folder_in_place_is_dropped(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    save_full(cfg, step=3)
    (out / ".incomplete-epoch_0-123").mkdir()
    (out / "epoch_0").rename(out / ".incomplete-epoch_0-123" / "epoch_0")
    _, weights = save_full(cfg, step=5)
    assert latest_complete_checkpoint(out) == out / "epoch_0"
    assert hidden_leftovers(out) == []
    assert_resumes_to(cfg, 5, weights)


def test_a_complete_staged_save_of_the_same_step_replaces_the_folder_in_place(assets: Path, tmp_path: Path) -> None:
    """A step saved twice (inside its epoch, then at the epoch's end at the same optimizer step): the staged save is
    the one under way, and a kill before its swap must not lose it to the one in place."""
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    _, staged_weights = save_full(cfg, step=5)
    (out / ".incomplete-epoch_0-123").mkdir()
    (out / "epoch_0").rename(out / ".incomplete-epoch_0-123" / "epoch_0")
    checkpointer, loaded = load_checkpoint(cfg, resume=False)
    state = full_state({k: v + 1.0 for k, v in loaded[training.MODEL_KEY].items()}, 5)
    save_checkpoint_atomically(checkpointer, state, epoch=0, adapter_only=False, record=record(5))
    assert latest_complete_checkpoint(out) == out / "epoch_0"
    assert hidden_leftovers(out) == []
    assert_resumes_to(cfg, 5, staged_weights)


# ---------------------------------------------------------------------------- kills

CHILD = r"""
import os, sys
from pathlib import Path
import torch
from omegaconf import OmegaConf
from adaptive_batching.faults import checkpoints as checkpointing
import torchtune.training.checkpointing._checkpointer as torchtune_checkpointer

stage, cfg_path, state_path, epoch, step = sys.argv[1:]
checkpointer, _ = checkpointing.load_checkpoint(OmegaConf.load(cfg_path), resume=False)
state = torch.load(state_path, weights_only=True)
final_name = f"epoch_{epoch}"

if stage == "weights":  # half the shard on disk, then killed
    real_save_file = torchtune_checkpointer.save_file
    def save_file(tensors, path, metadata=None):
        real_save_file(tensors, path, metadata=metadata)
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
        os._exit(17)
    torchtune_checkpointer.save_file = save_file
elif stage == "marker":  # everything written and synced, killed before checkpoint.json
    checkpointing._write_marker = lambda folder, record: os._exit(17)
else:
    real_rename = os.rename
    def rename(src, dst):
        aside = Path(dst).name.startswith(".old-")
        if stage == "swap" and aside:  # complete, killed before the old folder moves aside
            os._exit(17)
        real_rename(src, dst)
        if stage == "aside" and aside:  # killed between the two renames: epoch_N is missing
            os._exit(17)
        if stage == "cleanup" and Path(dst).name == final_name:  # killed before deleting the old one
            os._exit(17)
    os.rename = rename

record = {"global_step": int(step), "epoch": int(epoch), "step_in_epoch": 0, "epochs_run": int(epoch)}
checkpointing.save_checkpoint_atomically(checkpointer, state, epoch=int(epoch), adapter_only=False, record=record)
"""


@pytest.mark.parametrize(
    "stage,epoch,survivor",
    [
        ("weights", 0, 5),
        ("marker", 0, 5),
        ("swap", 0, 8),
        ("aside", 0, 8),
        ("cleanup", 0, 8),
        ("weights", 1, 5),
        ("marker", 1, 5),
    ],
)
@pytest.mark.e2e
def test_a_kill_at_any_stage_of_a_save_leaves_a_complete_checkpoint(
    assets: Path, tmp_path: Path, stage: str, epoch: int, survivor: int
) -> None:
    """Killed before its marker, a save is lost and the previous one loads; once marked, it wins."""
    out = tmp_path / "run"
    cfg = checkpointer_cfg(assets, out)
    _, previous = save_full(cfg, step=5, epoch=0)
    _, loaded = load_checkpoint(cfg, resume=False)
    state = full_state(loaded[training.MODEL_KEY], 8, epochs_run=epoch)
    killed = {k: v.clone() for k, v in state[training.MODEL_KEY].items()}
    torch.save(state, tmp_path / "state.pt")
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "checkpointer.yaml")

    (tmp_path / "kill_save.py").write_text(CHILD)
    child = run_command(
        "script",
        [
            str(tmp_path / "kill_save.py"),
            stage,
            str(tmp_path / "checkpointer.yaml"),
            str(tmp_path / "state.pt"),
            str(epoch),
            "8",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert child.returncode == 17, child.stderr[-3000:]
    assert hidden_leftovers(out), "the kill should leave a save under way behind"

    expected = previous if survivor == 5 else killed
    assert latest_complete_checkpoint(out) == out / f"epoch_{0 if survivor == 5 else epoch}"
    assert hidden_leftovers(out) == []
    if epoch == 1:
        assert (out / "epoch_1").is_dir() is (survivor == 8)
    assert_resumes_to(cfg, survivor, expected)


@pytest.mark.e2e
def test_a_resume_waits_for_a_save_under_way(tmp_path: Path) -> None:
    """The lock: ranks resuming (and repairing) never delete the staging folder of a live save."""
    (tmp_path / ".incomplete-epoch_0-1").mkdir()
    # Another process, forked without a new interpreter's imports; before the lock is taken, as a child would
    # otherwise hold the lock's file through its copy of the descriptor.
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=_resume_in_child, args=(theirs, tmp_path))
    child.start()
    with checkpointing._locked(tmp_path):
        ours.send("go")
        assert ours.poll(60) and ours.recv() == "start"
        time.sleep(1.0)
        assert child.is_alive() and not ours.poll()
        assert (tmp_path / ".incomplete-epoch_0-1").is_dir()
    assert ours.poll(60)
    found = ours.recv()
    child.join(60)
    assert child.exitcode == 0 and found is None
    assert not (tmp_path / ".incomplete-epoch_0-1").exists()


def _resume_in_child(conn: Any, out: Path) -> None:
    """What a resuming rank does first, in a child process: find the latest complete checkpoint of ``out``, once
    told that the lock is taken."""
    assert conn.recv() == "go"
    conn.send("start")
    conn.send(latest_complete_checkpoint(out))


def state_on(*, ranks: int, step_in_epoch: int) -> dict[str, Any]:
    """The adaptive state's entries check_resumable_on reads, as this version writes them."""
    from adaptive_batching.training.state import STATE_VERSION

    return {
        "version": STATE_VERSION,
        "progress": {"global_step": 7, "epoch": 1, "step_in_epoch": step_in_epoch},
        "feed": {"ranks": ranks},
    }


def test_a_run_saved_inside_an_epoch_resumes_there_only_on_its_own_number_of_ranks(
    said: Callable[[], list[str]],
) -> None:
    from adaptive_batching.errors import ConfigError
    from adaptive_batching.training.state import check_resumable_on

    inside = {"epochs_run": 1, checkpointing.ADAPTIVE_KEY: state_on(ranks=2, step_in_epoch=3)}
    check_resumable_on(inside, 2, elastic=False)  # the same ranks: nothing to say
    check_resumable_on(inside, 1, elastic=True)  # elastic: the feed keeps the global batch
    assert said() == []
    with pytest.raises(
        ConfigError,
        match=r"saved inside epoch 2 on 2 rank\(s\); resume it on 2 rank\(s\) "
        r"\(tune run --nproc_per_node 2",
    ):
        check_resumable_on(inside, 1, elastic=False)
    at_the_end = {"epochs_run": 1, checkpointing.ADAPTIVE_KEY: state_on(ranks=2, step_in_epoch=0)}
    check_resumable_on(at_the_end, 4, elastic=False)
    assert said() == [
        "Resuming on 4 rank(s) instead of 2: the global batch follows the ranks (batch_size x "
        "gradient_accumulation_steps x ranks); adaptive_batching.elastic keeps it across a change of ranks"
    ]


def test_a_state_in_another_format_version_is_refused_before_the_ranks_are_checked() -> None:
    from adaptive_batching.errors import ConfigError
    from adaptive_batching.training.state import STATE_VERSION, check_resumable_on

    older = {
        "epochs_run": 1,
        checkpointing.ADAPTIVE_KEY: {**state_on(ranks=2, step_in_epoch=3), "version": STATE_VERSION - 1},
    }
    with pytest.raises(
        ConfigError,
        match=f"format version {STATE_VERSION - 1}, and this adaptive-batching reads version {STATE_VERSION} only",
    ):
        check_resumable_on(older, 2, elastic=False)
