"""Checkpoint load and save through the configured torchtune checkpointer, safe against a kill.

A save goes to a hidden staging folder first; its files are synced to disk, ``checkpoint.json``
(the marker) is written last, and only then is the folder swapped in as ``output_dir/epoch_N``.
The recipe state (optimizer, epoch, seed, and the adaptive state under ``ADAPTIVE_KEY``) travels
inside that folder with the weights, so the two always match. A resume first finishes or undoes a
swap that a kill interrupted, then takes the complete ``epoch_N`` with the largest optimizer step,
so a kill at any moment loses at most the save that was under way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptive_batching.runtime.files import write_atomically

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

ADAPTIVE_KEY = "adaptive_batching"
MARKER = "checkpoint.json"
RECIPE_STATE_FILE = "recipe_state.pt"
ADAPTER_FILE = "adapter_model.pt"  # torchtune's own adapter format; adapter_model.safetensors is PEFT's
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")
_STAGING = ".incomplete-"
_ASIDE = ".old-"
_HIDDEN_DIR = re.compile(r"^\.(incomplete|old)-(epoch_\d+)-\d+$")
_LOCK_FILE = ".checkpoint.lock"
STOPPED_FILE = "stopped_before_checkpoint.json"  # a stop signal came before this run's first checkpoint


# ---------------------------------------------------------------------------- save


def save_checkpoint_atomically(
    checkpointer: Any, state: dict[str, Any], *, epoch: int, adapter_only: bool, record: dict[str, Any]
) -> Path:
    """Save ``state`` through ``checkpointer`` as ``output_dir/epoch_{epoch}``, all or nothing.

    torchtune writes into ``output_dir/.incomplete-epoch_{epoch}-<pid>``; the recipe state is moved
    next to the weights, every file is fsynced, ``checkpoint.json`` (``record`` plus ``complete``,
    ``saved_at``, ``folder`` and ``files``) is written last, and the folder replaces any older
    ``epoch_{epoch}`` by two renames. ``record`` must hold an int ``global_step``: resume picks the
    largest. Nothing goes to ``output_dir/recipe_state``. Like torchtune, this pops the weights out
    of ``state``. Returns the final folder.
    """
    from torchtune.training.checkpointing._utils import RECIPE_STATE_DIRNAME

    if not isinstance(record.get("global_step"), int):
        raise ValueError(f"record needs an int 'global_step' (the checkpoint a resume picks); got {record!r}")
    output_dir = Path(checkpointer._output_dir)
    name = f"epoch_{epoch}"
    output_dir.mkdir(parents=True, exist_ok=True)
    with _locked(output_dir):
        staging = output_dir / f"{_STAGING}{name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        new = staging / name
        try:
            # torchtune 0.6.1's checkpointers keep their output folder in the private ``_output_dir``.
            checkpointer._output_dir = staging
            try:
                checkpointer.save_checkpoint(
                    state, epoch=epoch, intermediate_checkpoint=True, adapter_only=adapter_only
                )
            finally:
                checkpointer._output_dir = output_dir
            os.replace(staging / RECIPE_STATE_DIRNAME / RECIPE_STATE_FILE, new / RECIPE_STATE_FILE)
            (staging / RECIPE_STATE_DIRNAME).rmdir()
            files = _fsync_tree(new)
            _write_marker(
                new,
                {
                    **record,
                    "complete": True,
                    "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "folder": name,
                    "files": files,
                },
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        final = _swap_in(new, output_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        (output_dir / STOPPED_FILE).unlink(missing_ok=True)  # the run has a checkpoint now
        _fsync(output_dir)
    return final


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> dict[str, int]:
    """fsync every file and folder below ``folder``; return each file's relative path and size."""
    files: dict[str, int] = {}
    for root, _, names in os.walk(folder):
        for file_name in names:
            path = Path(root) / file_name
            _fsync(path)
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
        _fsync(Path(root))
    return dict(sorted(files.items()))


def _write_marker(folder: Path, record: dict[str, Any]) -> None:
    """Write ``checkpoint.json`` whole or not at all (temp file, fsync, rename, fsync of the folder)."""
    write_atomically(folder / MARKER, json.dumps(record, indent=2, sort_keys=True) + "\n")


def _swap_in(new: Path, final: Path) -> Path:
    """Make the complete folder ``new`` be ``final``: old one aside, new one in, old one deleted.

    At every point ``final``, the aside copy or ``new`` is complete and findable by name
    (see ``_repair``); each rename is made durable before the next step.
    """
    aside = None
    if final.exists():
        aside = final.with_name(f"{_ASIDE}{final.name}-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        _fsync(final.parent)
    os.rename(new, final)
    _fsync(final.parent)
    if aside is not None:
        shutil.rmtree(aside)
        _fsync(final.parent)
    return final


# ---------------------------------------------------------------------------- find


def latest_complete_checkpoint(output_dir: Path, job_id: str | None = None) -> Path | None:
    """The complete ``epoch_N`` folder with the largest ``global_step`` (ties: largest N), if any;
    with ``job_id``, only among those that job wrote (its marker's ``job_id``).

    Repairs an interrupted save first (see ``_repair``). A folder counts only if its
    ``checkpoint.json`` says complete and every file it lists is there at its size, the recipe
    state and weights included; others are skipped with a warning naming them.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    best: tuple[tuple[int, int], Path] | None = None
    with _locked(output_dir):
        _repair(output_dir)
        for path in sorted(output_dir.iterdir()):
            match = _EPOCH_DIR.match(path.name)
            if not match or not path.is_dir():
                continue
            record, reason = _inspect(path)
            if record is None:
                log.warning("Skipping checkpoint folder %s: %s", path, reason)
                continue
            if job_id is not None and record.get("job_id") != job_id:
                continue
            key = (record["global_step"], int(match.group(1)))
            if best is None or key > best[0]:
                best = (key, path)
    return best[1] if best else None


def run_status(output_dir: Path) -> str:
    """What ``output_dir`` says of a run, in one line that starts with ``finished``, ``resumable`` (a complete
    checkpoint of an unfinished run), ``stopped`` (a stop signal before the first checkpoint: a resume starts from
    the beginning) or ``none``: for a job script that decides from the disk whether to run again (see
    docs/preemption.md)."""
    latest = latest_complete_checkpoint(Path(output_dir))
    if latest is None:
        why = stopped_before_first_save(Path(output_dir))
        if why is not None:
            return (
                f"stopped: {why}, before the first checkpoint; resume_from_checkpoint=True starts it from the beginning"
            )
        return f"none: no complete checkpoint in {output_dir}"
    record = json.loads((latest / MARKER).read_text(encoding="utf-8"))
    where = (
        f"optimizer step {record['global_step']}, {record.get('epochs_run', '?')} of "
        f"{record.get('total_epochs', '?')} epochs done"
    )
    total = record.get("total_epochs")
    if total is not None and record.get("epochs_run", 0) >= total:  # all epochs run: saved at the last one's end
        return f"finished: {latest} ({where})"
    return f"resumable: {latest} ({where}); continue with resume_from_checkpoint=True"


def mark_stopped(output_dir: Path, why: str) -> None:
    """Record in ``output_dir`` that a stop signal came before the run's first checkpoint (``why``): the run is to
    go on, from the beginning (see :func:`stopped_before_first_save`). The first save deletes the record."""
    write_atomically(Path(output_dir) / STOPPED_FILE, json.dumps({"why": why}) + "\n")


def stopped_before_first_save(output_dir: Path) -> str | None:
    """Why the run in ``output_dir`` stopped before its first checkpoint, if :func:`mark_stopped` recorded it and no
    ``epoch_N`` folder is there: a folder that holds one, complete or not, saved once (the save deletes the record),
    so a record beside it says nothing of the run, and an incomplete one is not to be started over silently."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir() or any(_EPOCH_DIR.match(path.name) for path in output_dir.iterdir()):
        return None
    try:
        why = json.loads((output_dir / STOPPED_FILE).read_text(encoding="utf-8"))["why"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return why if isinstance(why, str) else None


def _inspect(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """``folder``'s marker record if it is a complete checkpoint, else None and the reason."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no {MARKER} (a save that did not finish, or not written by this version)"
    except (OSError, ValueError) as error:
        return None, f"unreadable {MARKER} ({error})"
    if not isinstance(record, dict) or record.get("complete") is not True:
        return None, f"{MARKER} does not say complete"
    if not isinstance(record.get("global_step"), int) or not isinstance(record.get("files"), dict):
        return None, f"{MARKER} lacks an int global_step or the file list"
    for name, size in record["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None, f"{name} is missing or not {size} bytes"
    if not (folder / RECIPE_STATE_FILE).is_file():
        return None, f"no {RECIPE_STATE_FILE}"
    if not ((folder / ADAPTER_FILE).is_file() or _weight_files(folder)):
        return None, "no weights"
    return record, ""


def _weight_files(folder: Path) -> list[str]:
    """Names of the full-model weight shards torchtune writes (``model-*``), sorted."""
    return sorted(p.name for p in folder.glob("model-*") if p.suffix in _WEIGHT_SUFFIXES)


def _repair(output_dir: Path) -> None:
    """Finish or undo a save that a kill interrupted, and delete what it left behind.

    A complete staged folder is swapped in unless ``epoch_N`` already holds a later step; an
    incomplete one is deleted. An old folder set aside by a swap goes back to ``epoch_N`` if
    that name is free, else it is deleted (the swap had finished).
    """
    hidden = sorted(
        (m.group(1), m.group(2), p) for p in output_dir.iterdir() if (m := _HIDDEN_DIR.match(p.name)) and p.is_dir()
    )
    for kind, name, path in hidden:
        if kind != "incomplete":
            continue
        new, final = path / name, output_dir / name
        record, reason = _inspect(new) if new.is_dir() else (None, f"no {name} written")
        if record is None:
            log.warning("Deleting %s, a save that a kill interrupted: %s", path, reason)
        else:
            current = _inspect(final)[0] if final.is_dir() else None
            if current is None or record["global_step"] >= current["global_step"]:
                log.warning(
                    "Finishing a save that a kill interrupted: %s becomes %s (step %d)",
                    new,
                    final,
                    record["global_step"],
                )
                _swap_in(new, final)
            else:
                log.warning("Deleting %s: %s holds a later step", path, final)
        shutil.rmtree(path, ignore_errors=True)
    for kind, name, path in hidden:
        if kind != "old" or not path.is_dir():
            continue
        final = output_dir / name
        if final.exists():
            log.warning("Deleting %s, the replaced %s a kill left behind", path, name)
            shutil.rmtree(path, ignore_errors=True)
        else:
            log.warning("Restoring %s to %s: a kill interrupted its replacement", path, final)
            os.rename(path, final)
    if hidden:
        _fsync(output_dir)


@contextlib.contextmanager
def _locked(output_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``output_dir``: ranks resuming together repair it once, in turn,
    and a repair never deletes a save under way. Without ``flock`` (another OS, some network
    file systems) it goes on unlocked."""
    try:
        import fcntl

        handle = open(output_dir / _LOCK_FILE, "a")
    except (ImportError, OSError) as error:
        log.warning("Checkpoints in %s are not locked (%s)", output_dir, error)
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            log.warning("Checkpoints in %s are not locked (%s)", output_dir, error)
        yield
    finally:
        handle.close()  # releases the lock


# ---------------------------------------------------------------------------- load


def resume_config(cfg_checkpointer: DictConfig, job_id: str | None = None) -> DictConfig:
    """The checkpointer config (new, resolved) that resumes from the latest complete checkpoint.

    torchtune 0.6.1 joins ``recipe_checkpoint``, ``adapter_checkpoint`` and, when resuming a full
    fine-tune, ``checkpoint_files`` to ``output_dir``; all three are set relative to it here. A LoRA
    run (``adapter_model.pt`` in the folder) keeps its configured base weights.
    """
    from omegaconf import OmegaConf

    output_dir = Path(cfg_checkpointer.output_dir)
    latest = latest_complete_checkpoint(output_dir, job_id)
    if latest is None:
        raise FileNotFoundError(
            f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint (an epoch_N/ "
            f"folder with {MARKER}, {RECIPE_STATE_FILE} and weights); set resume_from_checkpoint=False "
            f"or point output_dir at the run to resume"
        )
    values = OmegaConf.to_container(cfg_checkpointer, resolve=True)
    assert isinstance(values, dict), "a checkpointer node is a mapping"
    resumed = OmegaConf.create(values)
    resumed.recipe_checkpoint = f"{latest.name}/{RECIPE_STATE_FILE}"
    if (latest / ADAPTER_FILE).is_file():
        resumed.adapter_checkpoint = f"{latest.name}/{ADAPTER_FILE}"
    else:
        resumed.checkpoint_files = [f"{latest.name}/{name}" for name in _weight_files(latest)]
    log.info("Resuming from %s", latest)
    return resumed


def load_checkpoint(
    cfg_checkpointer: DictConfig, resume: bool, job_id: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Instantiate the checkpointer and load the weights, plus the recipe state on resume (from the
    latest checkpoint ``job_id`` wrote, when given)."""
    from torchtune import config

    if resume:
        cfg_checkpointer = resume_config(cfg_checkpointer, job_id)
    checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=resume)
    return checkpointer, checkpointer.load_checkpoint()


def recipe_state(
    *,
    seed: int,
    epochs_run: int,
    total_epochs: int,
    max_steps_per_epoch: Any,
    optimizer_state: dict[str, Any],
    adaptive_state: dict[str, Any],
) -> dict[str, Any]:
    """The non-weight entries of a checkpoint, under torchtune's own key names."""
    from torchtune import training

    return {
        training.SEED_KEY: seed,
        training.EPOCHS_KEY: epochs_run,
        training.TOTAL_EPOCHS_KEY: total_epochs,
        training.MAX_STEPS_KEY: max_steps_per_epoch,
        training.OPT_KEY: optimizer_state,
        ADAPTIVE_KEY: adaptive_state,
    }
