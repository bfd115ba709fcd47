"""What ``adaptive-batching estimate`` traces, read from a config: the nodes of the torchtune components it builds
and the settings a step follows (:class:`~adaptive_batching.estimate.fake_steps.TraceInputs`), checked as the
recipes check them, so that ``estimate`` below the config layer never reads the config itself."""

from __future__ import annotations

from omegaconf import DictConfig

from adaptive_batching.batching.data import DEFAULT_COLLATE
from adaptive_batching.config.memory_savers import check_activation_offloading, optimizer_in_bwd
from adaptive_batching.core.defaults import DEFAULT_COMPILE, DEFAULT_DTYPE
from adaptive_batching.core.objective import FrozenModel
from adaptive_batching.estimate.fake_steps import Savers, TraceInputs


def savers_of(cfg: DictConfig) -> Savers:
    """The config's memory savers, checked as the recipes check them (a combination torchtune refuses is a
    one-line :class:`ConfigError` naming the key; the device is the one predicted for, so not checked)."""
    return Savers(
        optimizer_in_bwd(cfg),
        check_activation_offloading(cfg, needs_cuda=False),
        bool(cfg.get("enable_activation_checkpointing", False)),
        bool(cfg.get("fsdp_cpu_offload", False)),
        bool(cfg.get("compile", DEFAULT_COMPILE)),
    )


def trace_inputs(cfg: DictConfig, frozen: FrozenModel | None = None) -> TraceInputs:
    """The inputs of a trace of ``cfg``'s step; ``frozen``: the frozen model its objective holds (its
    ``TrainingObjective.frozen``), whose builder node the trace needs too."""
    return TraceInputs(
        model=cfg.model,
        loss=cfg.loss,
        optimizer=cfg.optimizer,
        dtype=cfg.get("dtype", DEFAULT_DTYPE),
        collate_path=str(cfg.get("collate_fn", DEFAULT_COLLATE)),
        savers=savers_of(cfg),
        frozen_model=None if frozen is None else cfg[frozen.model],
    )
