"""What the parts need from the config besides their settings sections, read here as typed values; and what the
run reads from disk, checked before any model is built (:func:`check_inputs`).

A part never receives the config (docs/contributing.md): the profiler gets a
:class:`~adaptive_batching.profiling.profiler.ProfiledSetup`, the batching a
:class:`~adaptive_batching.batching.worst_case.LengthSource`, both built from the config by the functions below.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.batching.data import data_files
from adaptive_batching.batching.worst_case import LengthSource, WorstCase, measure
from adaptive_batching.core.defaults import DEFAULT_COMPILE
from adaptive_batching.core.nodes import one_line, optional_component, packed, plain
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.core.paths import cache_dir
from adaptive_batching.errors import ConfigError
from adaptive_batching.profiling.profiler import ProfiledSetup

# Optimizer arguments that change the numbers, not the state tensors kept per parameter.
_OPTIMIZER_SCALARS = ("lr", "weight_decay", "betas", "eps")


def _select(cfg: DictConfig, key: str, default: Any) -> Any:
    return plain(OmegaConf.select(cfg, key, default=default))


def memory_setup(cfg: DictConfig) -> dict[str, Any]:
    """The config's part of the profile cache's fingerprint: every key that changes the largest micro batch that
    fits, as plain JSON-able values (the learning rate and other optimizer scalars left out on purpose)."""
    optimizer = _select(cfg, "optimizer", None)
    if isinstance(optimizer, Mapping):
        optimizer = {k: v for k, v in optimizer.items() if k not in _OPTIMIZER_SCALARS}
    return {
        "model": _select(cfg, "model", None),
        "dtype": _select(cfg, "dtype", "fp32"),
        "dataset.packed": packed(cfg.get("dataset", None)),
        "optimizer": optimizer,
        "loss._component_": _select(cfg, "loss._component_", None),
        "enable_activation_checkpointing": _select(cfg, "enable_activation_checkpointing", False),
        "compile": _select(cfg, "compile", False),
        # With accumulation, gradients stay alive through the next micro batches' forward passes.
        "gradients_alive_in_forward": int(_select(cfg, "gradient_accumulation_steps", 1) or 1) > 1,
        "fsdp_cpu_offload": _select(cfg, "fsdp_cpu_offload", False),
        "custom_sharded_layers": _select(cfg, "custom_sharded_layers", None),
        # Fake quantization keeps more for the backward (QAT); absent without a quantizer, as before it was read.
        **({"quantizer": quantizer} if (quantizer := _select(cfg, "quantizer", None)) else {}),
    }


def profiled_setup(cfg: DictConfig) -> ProfiledSetup:
    """What the profiler needs from the config: its memory fingerprint, the report's folder, ``compile``."""
    return ProfiledSetup(
        memory=memory_setup(cfg), output_dir=Path(cfg.output_dir), compile=bool(cfg.get("compile", DEFAULT_COMPILE))
    )


def length_source(cfg: DictConfig, folder: str | Path | None) -> LengthSource:
    """What measuring the samples' token counts needs from the config; ``folder``: ``adaptive_batching.cache_dir``
    (None: the default cache folder)."""
    return LengthSource(
        dataset=OmegaConf.to_container(cfg.dataset, resolve=True),
        tokenizer=OmegaConf.to_container(cfg.tokenizer, resolve=True),
        data_files=tuple(data_files(cfg.dataset)),
        max_seq_len=cfg.tokenizer.get("max_seq_len", None),
        cache_dir=cache_dir(folder),
    )


def worst_case_of(cfg: DictConfig, folder: str | Path | None) -> WorstCase:
    """The worst case of a config's data, building its tokenizer and data set here (``estimate``, which has
    no run). A data set or tokenizer that cannot be read here (a hub data set offline, a tokenizer file
    not downloaded) is one error that says to give the length instead."""
    from torchtune import config

    from adaptive_batching.batching.data import build_dataset

    try:
        tokenizer = config.instantiate(cfg.tokenizer)
        dataset, is_packed = build_dataset(cfg.dataset, tokenizer)
    except Exception as error:  # noqa: BLE001 - whatever stops the data being read, the way out is the same
        raise ConfigError(
            f"the worst-case sample length comes from the data of config keys 'tokenizer' and "
            f"'dataset', which could not be read here ({one_line(error)[:300]}); give it with "
            f"--seq-len N (tokens in the longest sample after truncation)"
        ) from None
    return measure(dataset, length_source(cfg, folder), packed=is_packed, quiet=True)[0]


# The checkpointers a recipe reads: the model's, full DPO's reference and distillation's teacher (the others
# refuse the last two before this runs).
CHECKPOINTERS = ("checkpointer", "ref_checkpointer", "teacher_checkpointer")
# torchtune's message transforms whose ``column_map`` leaves out the columns it keeps by default.
_DEFAULT_COLUMNS = {"AlpacaToMessages": ("instruction", "input", "output")}
_SHOWN = 6  # entries of a folder a message names
_HEAD = 1 << 20  # characters of a JSON array read for its first record
# torchtune's checkpointers that refuse an output_dir inside their checkpoint_dir.
_FULL_MODEL_CHECKPOINTERS = ("FullModelHFCheckpointer", "FullModelMetaCheckpointer", "FullModelTorchTuneCheckpointer")


def check_inputs(cfg: DictConfig, objective: TrainingObjective, resume: bool = False) -> None:
    """Raise ConfigError, in one line naming the key, for an input of the run that is not there or does not fit
    ``objective``, before any model is built: the metric logger (the run builds
    it), the tokenizer's files, the data set's local files and its first sample (:func:`check_first_sample`),
    each checkpointer's folder and weight files (the model's files but with ``resume``, whose weights are the
    run's own, checked by the resume: ``faults.checkpoints``)."""
    logger = cfg.metric_logger if "metric_logger" in cfg else None
    if optional_component(logger) is None:
        raise ConfigError(
            f"config key 'metric_logger' is {'missing' if logger is None else 'null'}: the run logs "
            "its metrics with it (a torchtune logger such as "
            "torchtune.training.metric_logging.DiskLogger)"
        )
    tokenizer = plain(cfg.tokenizer)
    for name, value in tokenizer.items():
        if (name == "path" or name.endswith(("_path", "_file"))) and isinstance(value, str):
            _check_exists(f"tokenizer.{name}", value, value)
    parts = (
        [(f"dataset[{i}]", part) for i, part in enumerate(cfg.dataset)]
        if OmegaConf.is_list(cfg.dataset)
        else [("dataset", cfg.dataset)]
    )
    for key, node in parts:
        _check_data_files(key, plain(node))
    for key in CHECKPOINTERS:
        node = optional_component(cfg.get(key, None))
        if node is not None:
            _check_checkpointer(key, plain(node), files=not (resume and key == "checkpointer"))
    for key, node in parts:
        check_first_sample(key, node, objective)


def _check_exists(key: str, value: Any, path: str, folder: bool = False) -> None:
    """``path`` (what config key ``key`` = ``value`` names) is a file, or a folder with ``folder``."""
    there = Path(path).is_dir() if folder else Path(path).exists()
    if not there:
        raise ConfigError(
            f"config key '{key}' = {value!r}: no such {'folder' if folder else 'file'}"
            + (f" ({path})" if path != value else "")
        )


def _check_data_files(key: str, node: Mapping[str, Any]) -> None:
    """The local files a data set built by one of Hugging Face's file loaders (``source: json``, ``csv``, ...)
    reads; a hub data set's ``data_files`` are inside its repository, and patterns and URLs are left to it."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    given = node.get("data_files", None)
    if node.get("source", None) not in _PACKAGED_DATASETS_MODULES or given is None:
        return
    paths = given.values() if isinstance(given, Mapping) else [given]
    for path in (p for group in paths for p in ([group] if isinstance(group, str) else group)):
        if isinstance(path, str) and "://" not in path and not any(c in path for c in "*?["):
            _check_exists(f"{key}.data_files", given, path)


def _check_checkpointer(key: str, node: Mapping[str, Any], files: bool) -> None:
    """A checkpointer's folder is there, with the weight files it names (and a Hugging Face checkpointer's
    ``config.json``, which it reads first)."""
    from torchtune.training.checkpointing._utils import FormattedCheckpointFiles, check_outdir_not_in_ckptdir

    folder = node.get("checkpoint_dir", None)
    if not isinstance(folder, str):
        raise ConfigError(
            f"config key '{key}.checkpoint_dir' = {folder!r} is invalid: expected the folder of the weights"
        )
    _check_exists(f"{key}.checkpoint_dir", folder, folder, folder=True)
    output, component = node.get("output_dir", None), str(node.get("_component_", ""))
    if isinstance(output, str) and component.rsplit(".", 1)[-1] in _FULL_MODEL_CHECKPOINTERS:
        try:
            check_outdir_not_in_ckptdir(Path(folder), Path(output))
        except ValueError:
            raise ConfigError(
                f"config key '{key}.output_dir' = {output!r} is its checkpoint_dir {folder!r} or "
                "inside it, which torchtune refuses (it copies the folder's files into the output); "
                "write the run's checkpoints elsewhere"
            ) from None
    if component.endswith("HFCheckpointer") and not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"config key '{key}.checkpoint_dir' = {folder!r} has no config.json, which {component} "
            f"reads the model's shape from; it holds {_holds(Path(folder))}"
        )
    names = node.get("checkpoint_files", None)
    if not files or "checkpoint_files" not in node:
        return
    if isinstance(names, Mapping):
        try:
            names = FormattedCheckpointFiles.from_dict(dict(names)).build_checkpoint_filenames()
        except (ValueError, TypeError) as error:
            raise ConfigError(f"config key '{key}.checkpoint_files': {one_line(error)}") from None
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise ConfigError(
            f"config key '{key}.checkpoint_files' = {names!r} is invalid: expected a list of the "
            f"weight files in {folder}"
        )
    for name in names:
        if not (Path(folder) / name).is_file():
            raise ConfigError(
                f"config key '{key}.checkpoint_files' names {name!r}, which is not in {folder}; "
                f"it holds {_holds(Path(folder))}"
            )


def _holds(folder: Path) -> str:
    """What a folder holds, for a message: its first few entries by name."""
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir())
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return (", ".join(names[:_SHOWN]) + more) if names else "nothing"


def check_first_sample(key: str, node: DictConfig, objective: TrainingObjective) -> None:
    """Read the first sample of the data set at config key ``key`` (one part of ``dataset``) as its builder reads it and
    raise ConfigError, in one line, when its columns are not the ones the builder's column map reads (naming both),
    when the builder cannot read it, or when its samples do not fit ``objective`` (pairs of chosen and rejected
    answers for an objective whose samples are two sequences, DPO's; one answer otherwise). Only local data (one of
    Hugging Face's file loaders, or a local folder) is read, cheaply: the builder streams it (a JSON array's first
    record comes from the file's head), nothing is tokenized or cached. A builder that fails so is built as the run
    builds it: its error is the config's, else the check is left to the run (a builder that does not stream, a split
    streaming lacks)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    from torchtune import config

    source = _select(node, "source", None)
    if not isinstance(source, str) or not (source in _PACKAGED_DATASETS_MODULES or Path(source).is_dir()):
        return
    component, files = _select(node, "_component_", None), _select(node, "data_files", None)
    shown = files if isinstance(files, str) else files[0] if isinstance(files, list) and len(files) == 1 else source
    where = f"the first sample of {shown}"
    streamed: dict[str, Any] = {"streaming": True, **({"packed": False} if "packed" in node else {})}
    if isinstance(split := _select(node, "split", None), str) and "[" in split:  # streaming takes no slice
        streamed["split"] = split.split("[", 1)[0]
    try:
        dataset = config.instantiate(node, None, **streamed)
        record = _first_record(dataset, files if source == "json" and "field" not in node else None)
    except Exception:  # noqa: BLE001 - streamed; built as the run builds it, the error is the config's or nothing
        try:
            dataset = config.instantiate(node, None, **{k: v for k, v in streamed.items() if k == "packed"})
            record = _first_record(dataset, None)
        except (TypeError, StopIteration):  # arguments the builder does not take (the build says so), no sample
            return
        except Exception as error:  # noqa: BLE001 - the builder refused its arguments, or the file is not its format
            raise ConfigError(f"config key '{key}': {one_line(error)}") from None
    transform, column = getattr(dataset, "_message_transform", None), getattr(dataset, "_column", None)
    if not isinstance(record, Mapping) or (transform is None and column is None):
        return
    needed = _columns(transform) if transform is not None else [column]
    try:
        sample = transform(record) if transform is not None else {"text": record[column]}
    except KeyError as error:
        missing = error.args[0] if error.args else None
        if missing in needed and missing not in record:
            raise ConfigError(
                f"config key '{key}': {where} has no column {missing!r}: {component} reads the columns "
                f"{', '.join(map(repr, needed))} and the data has {', '.join(map(repr, sorted(record))) or 'none'}; "
                f"give data with those columns{_mapped_by(component, key)}"
            ) from None
        raise ConfigError(
            f"config key '{key}': {where} cannot be read as {component} reads it: {one_line(error)}"
        ) from None
    except Exception as error:  # noqa: BLE001 - the run would fail on it at its first step
        raise ConfigError(
            f"config key '{key}': {where} cannot be read as {component} reads it: {one_line(error)}"
        ) from None
    pairs = isinstance(sample, Mapping) and "chosen" in sample and "rejected" in sample
    wants_pairs = objective.sequences_per_sample == 2
    if pairs != wants_pairs:
        gives = "pairs of chosen and rejected answers" if pairs else "one answer per sample"
        wants = (
            "pairs of chosen and rejected answers, as torchtune.datasets.preference_dataset gives"
            if wants_pairs
            else "one answer per sample (DPO trains on pairs: adaptive_lora_dpo, adaptive_full_dpo)"
        )
        raise ConfigError(
            f"config key '{key}._component_' = {component!r} gives {gives}; {objective.trained_by} trains on {wants}"
        )


def _first_record(dataset: Any, files: Any) -> Any:
    """The first raw record of a torchtune data set (its ``_data``; None for another kind), of its JSON file's
    head when ``files`` is one JSON array (Hugging Face's reader parses the whole file to stream one)."""
    path = files[0] if isinstance(files, list) and len(files) == 1 else files
    if isinstance(path, str) and Path(path).is_file():
        with open(path, encoding="utf-8") as handle:
            head = handle.read(_HEAD)
        if head.lstrip().startswith("["):
            with contextlib.suppress(ValueError):  # a record longer than the head: read as the builder streams it
                return json.JSONDecoder().raw_decode(head.lstrip()[1:].lstrip())[0]
    data = getattr(dataset, "_data", None)
    return None if data is None else next(iter(data))


def _mapped_by(component: Any, key: str) -> str:
    """How the config names a data set's columns: the builder's argument that does (``column_map``, chat's
    ``conversation_column``, text completion's ``column``), as the end of a message; empty if it has none."""
    from torchtune.config._utils import _get_component_from_path

    with contextlib.suppress(Exception):
        arguments = inspect.signature(_get_component_from_path(component)).parameters
        for name in ("column_map", "conversation_column", "column"):
            if name in arguments:
                return f", or map them with {key}.{name}"
    return ""


def _columns(transform: Any) -> list[str]:
    """The columns a torchtune message transform reads, by its column map (the columns it keeps by default
    included); the optional image column left out."""
    mapped = getattr(transform, "column_map", None) or getattr(transform, "_column_map", None) or {}
    default = {name: name for name in _DEFAULT_COLUMNS.get(type(transform).__name__, ())}
    return [column for name, column in {**default, **dict(mapped)}.items() if name != "image"]
