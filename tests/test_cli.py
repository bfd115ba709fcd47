"""The ``adaptive-batching`` console script: ls, cp and tiny-assets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adaptive_batching.assets.tiny import TinyAssetPaths
from adaptive_batching.assets.tiny_vision import TinyVisionPaths
from adaptive_batching.cli import main, recipe_for
from adaptive_batching.config.loading import RECIPES, shipped_config_names, shipped_configs_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every command from an empty directory, so no local file can stand in for a shipped one."""
    monkeypatch.chdir(tmp_path)


def test_ls_lists_recipes_and_their_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls"]) == 0
    lines, _, note = capsys.readouterr().out.partition("\n\n")
    lines = lines.splitlines()
    assert "torchtune's own configs by their names (`tune ls`): full, LoRA, QLoRA, QAT, DPO and distillation" in note
    assert lines[0].split() == ["RECIPE", "CONFIG"]
    listing: dict[str, list[str]] = {}
    current = None
    for line in lines[1:]:
        fields = line.split()
        if len(fields) == 2:
            current = fields[0]
            listing[current] = []
        assert current is not None and 1 <= len(fields) <= 2, line
        listing[current].append(fields[-1])
    assert list(listing) == list(RECIPES)
    assert "tiny_full" in listing["adaptive_full_finetune"]
    assert "tiny_lora" in listing["adaptive_lora_finetune"]
    listed = [name for names in listing.values() for name in names]
    assert sorted(listed) == shipped_config_names()
    for name in listing["adaptive_lora_finetune"]:
        assert name.endswith("lora")  # _lora, _qlora
    for name in listing["adaptive_full_finetune"]:
        assert not name.endswith("lora")


def test_ls_names_torchtunes_configs_of_every_recipe_each_by_the_recipe_that_runs_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The footer: for each recipe, torchtune configs it runs by name (QLoRA and QAT among them), each in torchtune's
    registry and mapped to that recipe as ``adaptive-batching cp`` maps it."""
    from adaptive_batching.cli import recipe_for
    from adaptive_batching.config.loading import stock_configs

    assert main(["ls"]) == 0
    footer = capsys.readouterr().out.partition("\n\n")[2].splitlines()[1:]
    named = {line.split()[0]: [name.strip() for name in line.split(None, 1)[1].split(",")] for line in footer}
    assert list(named) == list(RECIPES)
    stock = stock_configs()
    assert {name: recipe_for(stock[name]) for names in named.values() for name in names} == {
        name: recipe for recipe, names in named.items() for name in names
    }
    kinds = " ".join(name for names in named.values() for name in names)
    assert all(kind in kinds for kind in ("qlora", "qat_lora", "qat_full", "lora_dpo", "full_dpo", "KD"))


def test_cp_config_into_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "dest_dir"
    assert main(["cp", "tiny_full", f"{dest}/"]) == 0
    copied = dest / "tiny_full.yaml"
    assert copied.read_bytes() == (REPO / "configs" / "tiny_full.yaml").read_bytes()
    assert copied.read_bytes() == (shipped_configs_dir() / "tiny_full.yaml").read_bytes()
    assert str(copied) in capsys.readouterr().out
    assert sorted(p.name for p in dest.iterdir()) == ["tiny_full.yaml"]


def test_cp_config_into_existing_directory_without_slash(tmp_path: Path) -> None:
    dest = tmp_path / "existing"
    dest.mkdir()
    assert main(["cp", "tiny_lora.yaml", str(dest)]) == 0
    assert (dest / "tiny_lora.yaml").read_bytes() == (REPO / "configs" / "tiny_lora.yaml").read_bytes()


def test_cp_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "out.yaml"
    shipped = (REPO / "configs" / "tiny_full.yaml").read_bytes()
    assert main(["cp", "tiny_full", "out.yaml"]) == 0
    assert target.read_bytes() == shipped
    capsys.readouterr()

    target.write_text("edited: true\n")
    assert main(["cp", "tiny_full", "out.yaml"]) == 2
    err = capsys.readouterr().err
    assert "out.yaml" in err and "--force" in err
    assert target.read_text() == "edited: true\n"

    assert main(["cp", "tiny_full", "out.yaml", "--force"]) == 0
    assert target.read_bytes() == shipped


def test_cp_adds_suffix_to_bare_destination(tmp_path: Path) -> None:
    assert main(["cp", "tiny_lora", "mine"]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == (REPO / "configs" / "tiny_lora.yaml").read_bytes()
    assert not (tmp_path / "mine").exists()


@pytest.mark.parametrize("recipe", RECIPES)
def test_cp_recipe(recipe: str, tmp_path: Path) -> None:
    assert main(["cp", recipe, "dest/"]) == 0
    copied = tmp_path / "dest" / f"{recipe}.py"
    assert copied.read_bytes() == (REPO / "recipes" / f"{recipe}.py").read_bytes()


def test_cp_unknown_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cp", "no_such_thing", "out.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'no_such_thing'" in err and "`adaptive-batching ls` lists ours" in err
    assert list(tmp_path.iterdir()) == []


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "tiny-assets" in capsys.readouterr().err


def test_tiny_assets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "assets"
    assert main(["tiny-assets", "--output-dir", str(out), "--num-samples", "50"]) == 0
    paths = TinyAssetPaths.from_root(out)
    files = [
        paths.model_dir / "config.json",
        paths.model_dir / "model.safetensors",
        paths.tokenizer_path,
        paths.special_tokens_path,
        paths.dataset_path,
        paths.preference_path,
        paths.student_dir / "config.json",
        paths.student_dir / "model.safetensors",
    ]
    for file in files:
        assert file.is_file() and file.stat().st_size > 0, file
    vision = TinyVisionPaths(out)
    images = sorted(vision.image_dir.glob("image_*.png"))
    vision_files = [vision.model_dir / "config.json", vision.model_dir / "model.safetensors", vision.dataset_path]
    assert len(images) == 10 and all(file.stat().st_size > 0 for file in [*vision_files, *images])
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        str(f.relative_to(out)) for f in [*files, *vision_files, *images]
    )
    printed = capsys.readouterr().out
    assert f"tiny assets in {out}" in printed
    assert "samples: 50" in printed
    for file in files:
        assert f"{file.relative_to(out)}: {file.stat().st_size:,} bytes" in printed
    assert "p50=" in printed and "p95=" in printed
    # a run line for every recipe and QAT, each a shipped tiny config of that recipe, pointed at these assets
    runs = re.findall(r"^run: tune run (\S+) --config (\S+) assets_dir=(\S+)$", printed, flags=re.M)
    assert {recipe for recipe, _, _ in runs} == set(RECIPES) and "tiny_qat_lora" in {c for _, c, _ in runs}
    assert {"tiny_vision_full", "tiny_vision_lora", "tiny_vision_qlora"} <= {c for _, c, _ in runs}
    assert all(
        recipe_for(shipped_configs_dir() / f"{config}.yaml") == recipe and root == str(out)
        for recipe, config, root in runs
    )


# Run in a fresh interpreter: pytest's own process has torch imported already.
_LIGHT_COMMANDS = textwrap.dedent("""
    import contextlib, io, json, sys
    from adaptive_batching.cli import main
    from adaptive_batching.faults.checkpoints import mark_stopped

    run, stopped, copy = sys.argv[1:]
    mark_stopped(stopped, "SIGTERM")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        codes = [main(["status", run]), main(["status", stopped]), main(["ls"]), main(["cp", "tiny_full", copy])]
    heavy = sorted(name for name in ("torch", "torchtune", "torchao") if name in sys.modules)
    print(json.dumps({"codes": codes, "out": out.getvalue(), "heavy": heavy}))
""")


def test_status_ls_and_cp_do_not_import_torch_torchtune_or_torchao(tmp_path: Path) -> None:
    """The commands that read files only start without torch, torchtune and torchao (5 s of CPU): a job script
    calls ``status`` before each resubmission. A module-level import of any of them on that path fails this."""
    run = tmp_path / "run"
    epoch = run / "epoch_0"
    epoch.mkdir(parents=True)
    (epoch / "recipe_state.pt").write_bytes(b"x")
    (epoch / "model-00001-of-00001.safetensors").write_bytes(b"yy")
    (epoch / "checkpoint.json").write_text(
        json.dumps(
            {
                "complete": True,
                "global_step": 4,
                "epochs_run": 1,
                "total_epochs": 2,
                "files": {"recipe_state.pt": 1, "model-00001-of-00001.safetensors": 2},
            }
        )
    )
    (tmp_path / "stopped").mkdir()
    copy = tmp_path / "copy.yaml"
    done = subprocess.run(
        [sys.executable, "-c", _LIGHT_COMMANDS, str(run), str(tmp_path / "stopped"), str(copy)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0]
    lines = result["out"].splitlines()
    assert lines[0] == (
        f"resumable: {epoch} (optimizer step 4, 1 of 2 epochs done); continue with resume_from_checkpoint=True"
    )
    assert lines[1].startswith("stopped: SIGTERM, before the first checkpoint")
    assert "tiny_full" in result["out"] and f"Copied tiny_full to {copy}" in result["out"]
    assert copy.read_bytes() == (shipped_configs_dir() / "tiny_full.yaml").read_bytes()
    assert result["heavy"] == []


def test_tiny_assets_model_choices_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny-assets arguments are added when that command is parsed (their choices import torchtune)."""
    with pytest.raises(SystemExit) as info:
        main(["tiny-assets", "--model", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --model: invalid choice: 'nope' (choose from 'tiny', 'llama3_2_1b', 'tiny_qlora'" in err


def test_cp_copies_the_shipped_config_even_when_a_local_file_has_its_name(tmp_path: Path) -> None:
    local = tmp_path / "tiny_full.yaml"
    local.write_text("batch_size: 99\n")
    assert main(["cp", "tiny_full.yaml", str(tmp_path / "copy.yaml")]) == 0
    assert (tmp_path / "copy.yaml").read_bytes() == (shipped_configs_dir() / "tiny_full.yaml").read_bytes()
    assert main(["cp", "tiny_full.yaml", ".", "--force"]) == 0
    assert local.read_bytes() == (shipped_configs_dir() / "tiny_full.yaml").read_bytes()


@pytest.mark.e2e
def test_plan_profiles_and_logs_the_plan_without_training(assets: Path, tmp_path: Path) -> None:
    from recipe_runs import check, run_command

    out = tmp_path / "run"
    result = check(
        run_command(
            "cli",
            [
                "plan",
                "--config",
                "tiny_full",
                f"assets_dir={assets}",
                f"output_dir={out}",
                "adaptive_batching.memory_budget=96MiB",
            ],
            cwd=tmp_path,
        )
    )  # trials 5x smaller than at 512 MiB
    output = result.stdout + result.stderr
    assert "largest micro batch that ran" in output and "Batch plan (micro batch" in output
    assert "Epoch 1/3" not in output and not list(out.glob("epoch_*"))  # not a step trained, nothing saved
    assert not re.findall(r"(?im)^.*warn.*$", output)  # no warning at start (issue 40.4)
