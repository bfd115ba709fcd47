"""Helpers ``validate_device.py`` runs in child processes: the device, the assets, the data sets, padding.

They create tensors or import heavy modules, so the parent (which forks the recipe runs on CPU)
never does.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Optional


def device_info() -> dict[str, Any]:
    """This machine's accelerator (or CPU): name, memory and versions, for the results file."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(type="cuda", name=props.name, memory_bytes=int(props.total_memory), cuda=torch.version.cuda)
    else:
        info.update(type="cpu", name=platform.processor() or platform.machine(),
                    memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return info


def write_assets(root: str, model: str) -> dict[str, Any]:
    """The tiny assets, or ``model``'s random-initialised checkpoint next to them (as the CLI writes them)."""
    if model == "tiny":
        from adaptive_batching.assets.tiny import write_tiny_assets

        paths = write_tiny_assets(root)
        return {"root": str(paths.root), "model_dir": str(paths.model_dir)}
    from adaptive_batching.assets.models import write_model_assets

    paths = write_model_assets(root, model)
    size = (paths.model_dir / "model.safetensors").stat().st_size
    return {"root": str(paths.tiny.root), "model_dir": str(paths.model_dir), "checkpoint_bytes": size}


def write_long_dataset(source: str, target: str, seq_len: int, num_samples: int) -> dict[str, Any]:
    """Alpaca records every one of which is longer than ``seq_len`` tokens once tokenized (so truncated
    to exactly ``seq_len``): each output joins the tiny data set's outputs until it has ``seq_len``
    words, and every word is at least one token. A micro batch of them has the profiler's worst-case
    shape, so fixed-batch runs on them meet the memory the profiler measured."""
    records = json.loads(Path(source).read_text())
    out, index = [], 0
    for _ in range(num_samples):
        words: list[str] = []
        instruction = records[index % len(records)]["instruction"]
        while len(words) < seq_len:
            words.extend(records[index % len(records)]["output"].split())
            index += 1
        out.append({"instruction": instruction, "input": "", "output": " ".join(words)})
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(out))
    return {"path": target, "samples": num_samples, "min_words": min(len(r["output"].split()) for r in out)}


def token_lengths(config: str, overrides: list[str]) -> list[int]:
    """Every sample's token count as the recipe's data pipeline gives it (truncated to max_seq_len)."""
    from torchtune import config as tune_config

    from adaptive_batching.batching.data import build_dataset
    from adaptive_batching.config.loading import load_config

    cfg = load_config(config, overrides)
    dataset, _ = build_dataset(cfg.dataset, tune_config.instantiate(cfg.tokenizer))
    return [len(dataset[i]["tokens"]) for i in range(len(dataset))]


def padding(config: str, overrides: list[str], micro_batch: int, max_tokens: Optional[int]) -> dict[str, Any]:
    """Padding waste of one epoch cut by both samplers the runs use: fixed micro batches of ``micro_batch``
    samples (shuffled), and ``max_tokens`` padded tokens per micro batch (similar lengths together)."""
    from adaptive_batching.batching.sampler import StepBatchSampler
    from adaptive_batching.batching.token_sampler import TokenBudgetBatchSampler, padding_waste

    lengths = token_lengths(config, overrides)
    fixed = list(StepBatchSampler(len(lengths), micro_batch=micro_batch, accumulation=1, rank=0, world_size=1,
                                  shuffle=True, seed=0))
    result: dict[str, Any] = {"samples": len(lengths), "real_tokens": sum(lengths), "max_length": max(lengths),
                              "fixed": {"micro_batches": len(fixed), "waste": padding_waste(lengths, fixed)}}
    if max_tokens is not None:
        token = list(TokenBudgetBatchSampler(lengths, max_tokens=max_tokens, picking_order="seqlen",
                                             min_batch_size=None, max_batch_size=None, accumulation=1, rank=0,
                                             world_size=1, shuffle=True, seed=0))
        result["token budget"] = {"micro_batches": len(token), "waste": padding_waste(lengths, token)}
    return result
