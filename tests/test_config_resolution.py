"""``--config`` resolution, torchtune's overrides through ``adaptive_batching.config.loading.parse``, and the
recipe entry points failing at validation before anything is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from config_edits import setting, typed
from omegaconf import DictConfig, OmegaConf
from recipe_runs import tune_run

from adaptive_batching.config import loading
from adaptive_batching.config.loading import (
    parse,
    resolve_config,
    resolve_config_argument,
    shipped_config_names,
    shipped_configs_dir,
)
from adaptive_batching.config.settings import KNOBS, validate_config
from adaptive_batching.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("tiny_full", "tiny_lora")


# --------------------------------------------------------------------------- #
# resolve_config
# --------------------------------------------------------------------------- #


def test_shipped_config_names() -> None:
    assert set(SHIPPED) <= set(shipped_config_names())
    for name in SHIPPED:
        shipped = shipped_configs_dir() / f"{name}.yaml"
        assert shipped.read_bytes() == (REPO / "configs" / f"{name}.yaml").read_bytes()


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("suffix", ["", ".yaml"])
def test_resolve_shipped_by_name(name: str, suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = resolve_config(name + suffix)
    assert path.is_file() and path.is_absolute()
    assert path.resolve() == (shipped_configs_dir() / f"{name}.yaml").resolve()


def test_local_file_wins_over_shipped_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "tiny_full.yaml"
    local.write_text("batch_size: 99\n")
    monkeypatch.chdir(tmp_path)
    path = resolve_config("tiny_full.yaml")
    assert path.resolve() == local.resolve()
    assert OmegaConf.load(path).batch_size == 99
    # A bare name is not an existing path here, so it still means the shipped config.
    assert resolve_config("tiny_full").resolve() == (shipped_configs_dir() / "tiny_full.yaml").resolve()


def test_relative_path_in_subdirectory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.yaml").write_text("batch_size: 5\n")
    monkeypatch.chdir(tmp_path)
    path = resolve_config("runs/a.yaml")
    assert path.resolve() == (tmp_path / "runs" / "a.yaml").resolve()


def test_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    custom = tmp_path / "elsewhere" / "custom.yaml"
    custom.parent.mkdir()
    custom.write_text("batch_size: 7\n")
    monkeypatch.chdir(REPO)
    assert resolve_config(str(custom)) == custom


def test_home_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.yaml").write_text("batch_size: 7\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_config("~/mine.yaml").resolve() == (tmp_path / "mine.yaml").resolve()


@pytest.mark.parametrize(
    "name, close",
    [
        ("no_such_config", None),
        ("no_such_config.yaml", None),
        ("sub/tiny_full", "tiny_full"),
        ("./missing.yaml", None),
        ("tiny_lor", "tiny_lora"),
    ],
)
def test_an_unknown_config_names_the_folder_and_close_names(
    name: str, close: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        resolve_config(name)
    message = str(info.value)
    assert repr(name) in message and str(tmp_path) in message and "\n" not in message
    assert ("did you mean" in message) == (close is not None)
    if close:
        assert f"did you mean {close}" in message


# --------------------------------------------------------------------------- #
# resolve_config_argument
# --------------------------------------------------------------------------- #


def test_resolve_config_argument_separate_value() -> None:
    argv = ["recipe.py", "--config", "tiny_full", "batch_size=3", "~lr_scheduler"]
    out = resolve_config_argument(argv)
    assert out == [
        "recipe.py",
        "--config",
        str(shipped_configs_dir() / "tiny_full.yaml"),
        "batch_size=3",
        "~lr_scheduler",
    ]
    assert argv[2] == "tiny_full"  # the input is not modified


def test_resolve_config_argument_equals_form() -> None:
    out = resolve_config_argument(["recipe.py", "--config=tiny_lora.yaml", "epochs=1"])
    assert out == ["recipe.py", "--config=" + str(shipped_configs_dir() / "tiny_lora.yaml"), "epochs=1"]


def test_resolve_config_argument_local_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_run.yaml").write_text("batch_size: 1\n")
    monkeypatch.chdir(tmp_path)
    out = resolve_config_argument(["r", "--config=./my_run.yaml"])
    assert Path(out[1].split("=", 1)[1]).resolve() == (tmp_path / "my_run.yaml").resolve()


def test_resolve_config_argument_without_config_unchanged() -> None:
    argv = ["recipe.py", "batch_size=3", "--config"]
    assert resolve_config_argument(argv) == argv


def test_resolve_config_argument_unknown() -> None:
    with pytest.raises(FileNotFoundError, match="tiny_full"):
        resolve_config_argument(["recipe.py", "--config", "tiny_fulll"])


# --------------------------------------------------------------------------- #
# parse: torchtune's parser with resolved --config
# --------------------------------------------------------------------------- #


def run_parse(monkeypatch: pytest.MonkeyPatch, argv: list[str], body: Any = None) -> tuple[SystemExit, list]:
    """Run ``parse(fake_main)()`` with ``argv``; return the SystemExit and the captured configs."""
    captured: list[DictConfig] = []

    def fake_main(cfg: DictConfig) -> Any:
        captured.append(cfg)
        return body(cfg) if body else None

    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as info:
        parse(fake_main)()
    return info.value, captured


def test_parse_applies_overrides_and_removals(monkeypatch: pytest.MonkeyPatch) -> None:
    exit_, captured = run_parse(
        monkeypatch,
        [
            "x",
            "--config",
            "tiny_full",
            "batch_size=3",
            "~max_steps_per_epoch",
            "adaptive_batching.reprofile=false",
            "lr_scheduler=None",
        ],
    )
    assert exit_.code is None
    (cfg,) = captured
    shipped = OmegaConf.load(shipped_configs_dir() / "tiny_full.yaml")
    assert "max_steps_per_epoch" in shipped and shipped.batch_size != 3
    assert cfg.batch_size == 3
    assert "max_steps_per_epoch" not in cfg
    assert cfg.adaptive_batching.reprofile is False
    assert cfg.adaptive_batching.memory_budget == "512MiB"
    # torchtune turns `component=None` into a null `_component_` (how a scheduler is switched off).
    assert cfg.lr_scheduler._component_ is None
    assert cfg.epochs == shipped.epochs
    assert cfg.model == shipped.model
    settings = validate_config(cfg)
    assert settings.profiler.reprofile is False


def test_parse_freezes_the_imports_objects_before_the_recipe_builds_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that a run's own objects stay collectable: one cheap collection at the end frees its process group
    (tests/test_clean_exit.py), and the profiler's collections skip torch's and torchtune's objects."""
    from adaptive_batching.runtime import memory

    order: list[str] = []
    monkeypatch.setattr(memory, "freeze_long_lived_objects", lambda: order.append("freeze"))
    run_parse(monkeypatch, ["x", "--config", "tiny_full"], body=lambda cfg: order.append("recipe"))
    assert order == ["freeze", "recipe"]


def test_parse_component_removal_is_refused_by_torchtune(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtune 0.6.1 does not remove a node holding `_component_` with `~key`; it raises ValueError."""
    monkeypatch.setattr(sys, "argv", ["x", "--config", "tiny_full", "~lr_scheduler"])
    called = []
    with pytest.raises(ValueError, match="lr_scheduler"):
        parse(called.append)()
    assert called == []


def test_parse_equals_form_and_section_removal(monkeypatch: pytest.MonkeyPatch) -> None:
    exit_, captured = run_parse(
        monkeypatch,
        ["x", "--config=tiny_lora.yaml", "~adaptive_batching", "epochs=1"],
        body=lambda cfg: validate_config(cfg) and 0,
    )
    assert exit_.code == 0
    (cfg,) = captured
    assert "adaptive_batching" not in cfg
    assert cfg.epochs == 1
    assert cfg.model._component_ == "torchtune.models.llama3.lora_llama3"
    settings = validate_config(cfg)
    assert {name: setting(settings, name) for name in KNOBS} == {
        name: typed(name, k.default) for name, k in KNOBS.items()
    }


def test_parse_local_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (shipped_configs_dir() / "tiny_full.yaml").read_text().replace("batch_size: 16", "batch_size: 5")
    assert "batch_size: 5" in text
    (tmp_path / "tiny_full.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    _, captured = run_parse(monkeypatch, ["x", "--config", "tiny_full.yaml"])
    assert captured[0].batch_size == 5


def test_parse_returns_recipe_result_as_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    exit_, _ = run_parse(monkeypatch, ["x", "--config", "tiny_full"], body=lambda cfg: 3)
    assert exit_.code == 3


def test_config_error_becomes_one_line_exit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def body(cfg: DictConfig) -> None:
        raise ConfigError("config key 'batch_size' = 0 is invalid: expected an integer >= 1")

    exit_, captured = run_parse(monkeypatch, ["x", "--config", "tiny_full"], body=body)
    assert len(captured) == 1
    assert exit_.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error:") and "'batch_size' = 0" in line


def test_real_validation_error_through_parse(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    exit_, _ = run_parse(monkeypatch, ["x", "--config", "tiny_full", "batch_size=0"], body=validate_config)
    err = capsys.readouterr().err
    assert exit_.code == 1 and err.startswith("config error:") and "'batch_size'" in err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_rank_zero_says_a_config_error_and_the_others_wait(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, rank: str
) -> None:
    """Rank zero says the line and exits; another rank says nothing and waits for torchrun to end it (the wait
    itself: tests/test_config_error_ranks.py)."""
    waited: list[str] = []
    monkeypatch.setattr(loading, "wait_for_rank_zero", waited.append)
    monkeypatch.setenv("RANK", rank)
    exit_, _ = run_parse(monkeypatch, ["x", "--config", "tiny_full", "batch_size=0"], body=validate_config)
    said = capsys.readouterr().err
    assert exit_.code == 1
    if rank == "0":
        assert said.startswith("config error:") and "'batch_size'" in said and waited == []
    else:
        assert "config error:" not in said and len(waited) == 1 and waited[0].startswith("config error:")


def test_other_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(cfg: DictConfig) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(sys, "argv", ["x", "--config", "tiny_full"])
    with pytest.raises(RuntimeError, match="boom"):
        parse(body)()


def test_unknown_config_exits_before_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exit_, captured = run_parse(monkeypatch, ["x", "--config", "tiny_ful"])
    assert captured == []
    assert isinstance(exit_.code, str) and exit_.code.startswith("error:")
    assert "tiny_ful" in exit_.code and "did you mean tiny_full" in exit_.code


# --------------------------------------------------------------------------- #
# End to end: `tune run` from a directory that is not the repo, failing at validation
# --------------------------------------------------------------------------- #


def _cases(root: Path) -> dict[str, tuple[str, str, list[str], Path]]:
    """name -> (recipe, config, overrides, cwd). Each run has an adaptive key error and a checkpoint dir that does not
    exist."""
    full = root / "full"
    full_yaml = root / "full_yaml"
    custom = root / "custom"
    for d in (full, full_yaml, custom):
        d.mkdir()
    text = (shipped_configs_dir() / "tiny_lora.yaml").read_text()
    assert "adaptive_batching:\n" in text
    (custom / "my_run.yaml").write_text(
        text.replace("adaptive_batching:\n", "adaptive_batching:\n  memory_budgett: 12GiB\n")
    )
    common = ["checkpointer.checkpoint_dir=/nonexistent/ckpt"]
    return {
        "tiny_full": (
            "adaptive_full_finetune",
            "tiny_full",
            ["adaptive_batching.bogus=1", f"output_dir={full / 'out'}", *common],
            full,
        ),
        "tiny_full.yaml": (
            "adaptive_full_finetune",
            "tiny_full.yaml",
            ["adaptive_batching.bogus=1", f"output_dir={full_yaml / 'out'}", *common],
            full_yaml,
        ),
        "custom": ("adaptive_lora_finetune", "./my_run.yaml", [f"output_dir={custom / 'out'}", *common], custom),
    }


@pytest.fixture(scope="module")
def e2e_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The recipe runs, each a ``tune run`` (recipe_runs.tune_run: forked from the test fork server)."""
    root = tmp_path_factory.mktemp("e2e")
    assert not str(root.resolve()).startswith(str(REPO))
    return {
        name: (tune_run(recipe, config, overrides, cwd=cwd, timeout=180), cwd)
        for name, (recipe, config, overrides, cwd) in _cases(root).items()
    }


@pytest.mark.parametrize(
    "name, bad_key",
    [
        ("tiny_full", "adaptive_batching.bogus"),
        ("tiny_full.yaml", "adaptive_batching.bogus"),
        ("custom", "adaptive_batching.memory_budgett"),
    ],
)
@pytest.mark.e2e
def test_recipe_fails_at_validation(e2e_runs: dict, name: str, bad_key: str) -> None:
    result, cwd = e2e_runs[name]
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode != 0, detail
    config_lines = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert len(config_lines) == 1, detail
    line = config_lines[0]
    assert bad_key in line
    assert "known keys under 'adaptive_batching'" in line
    for knob in KNOBS:
        assert knob in line
    # Failed before any model, checkpoint or output directory was touched.
    assert "Traceback" not in result.stderr, detail
    assert "/nonexistent" not in result.stderr + result.stdout, detail
    assert not (cwd / "out").exists()
    assert sorted(p.name for p in cwd.iterdir()) == (["my_run.yaml"] if name == "custom" else [])
