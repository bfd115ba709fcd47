"""Quantization-aware training (QAT): the config's ``quantizer`` fake-quantizes the linear layers, as torchtune's
``qat_distributed`` and ``qat_lora_finetune_distributed`` do, on torchao's own QAT API as installed.

- Full fine-tuning: the quantizer's ``prepare`` swaps every ``nn.Linear`` for torchao's fake-quantized linear, on the
  meta-device model, before FSDP shards it and before the weights load (as ``qat_distributed``).
- LoRA: each ``LoRALinear`` becomes a :class:`FakeQuantizedLoRALinear`: the frozen base weight and its input are
  fake-quantized with the quantizer's own configs (int8 dynamic per token activations, int4 per group weights for
  ``Int8DynActInt4WeightQATQuantizer``), the adapters' path is not (as torchtune's ``QATLoRALinear``, whose type check
  fails with torchao 0.13's config classes).
- ``fake_quant_after_n_steps: N``: steps 0 .. N-1 train with fake quantization off, then on; the step runner asks
  the method (its :class:`~adaptive_batching.core.method.FakeQuantization`) at every step, so a resumed run is in the
  state an uninterrupted one was (:func:`switch_fake_quant`).
- The profiler's trial steps always run with fake quantization on: the plan fits the steps after it turns on, not
  only the cheaper ones before.

The fake-quantized modules add no weights: the saved checkpoint is the plain model (or the merged LoRA model),
as torchtune's QAT recipes save it, for ``tune run quantize`` with the same quantizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torchao.quantization.qat import FakeQuantizerBase
from torchtune import config
from torchtune.modules.peft import DoRALinear, LoRALinear
from torchtune.training.quantization import get_quantizer_mode

from adaptive_batching.core import logs
from adaptive_batching.core.defaults import DEFAULT_DTYPE
from adaptive_batching.core.method import FakeQuantization, FinetuneMethod
from adaptive_batching.core.nodes import building, optional_component
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.methods import LoRAFinetune

_QAT_QUANTIZERS = "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer or Int4WeightOnlyQATQuantizer"


class FakeQuantizedLoRALinear(LoRALinear):
    """A LoRA linear layer whose frozen base path is fake-quantized: ``fq(W) @ fq(x) + (alpha / rank) B A x``.

    torchtune's ``QATLoRALinear`` on torchao 0.13's fake quantizers (built from any of its configs); no bias, no
    DoRA, no NF4 base weight, as there."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        rank: int,
        alpha: float,
        dropout: float,
        activation_config: Any,
        weight_config: Any,
    ) -> None:
        super().__init__(in_dim, out_dim, rank, alpha, dropout, use_bias=False, quantize_base=False)
        group = getattr(weight_config, "group_size", None)
        if group is not None and in_dim % group != 0:
            raise ConfigError(
                f"config key 'quantizer.groupsize' = {group}: it must divide every adapted layer's "
                f"input size, and {in_dim} is not a multiple of it"
            )
        self.activation_fake_quantizer = _fake_quantizer(activation_config)
        self.weight_fake_quantizer = _fake_quantizer(weight_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(self.activation_fake_quantizer(x), self.weight_fake_quantizer(self.weight))
        if self.disabled:
            return out
        return out + (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))


def _fake_quantizer(fake_quantize_config: Any) -> nn.Module:
    return nn.Identity() if fake_quantize_config is None else FakeQuantizerBase.from_config(fake_quantize_config)


def swap_lora_linears(model: nn.Module, activation_config: Any, weight_config: Any) -> int:
    """Replace every ``LoRALinear`` of ``model`` by a :class:`FakeQuantizedLoRALinear` on the same device, sharing
    its weights (none on the meta device); the number replaced."""
    swapped = 0
    for name, child in list(model.named_children()):
        if isinstance(child, DoRALinear):
            raise ConfigError(
                "config key 'quantizer' cannot train with DoRA adapters (model.use_dora=True), as in "
                "torchtune's qat_lora_finetune_distributed; use LoRA"
            )
        if isinstance(child, LoRALinear):
            if child._quantize_base or child.use_bias:
                raise ConfigError(
                    "config key 'quantizer' cannot fake-quantize a QLoRA (NF4) base or a biased LoRA "
                    "layer; use a plain LoRA model builder"
                )
            dropout = child.dropout.p if isinstance(child.dropout, nn.Dropout) else 0.0
            with torch.device(child.weight.device):
                new = FakeQuantizedLoRALinear(
                    child.in_dim, child.out_dim, child.rank, child.alpha, dropout, activation_config, weight_config
                ).to(child.weight.dtype)
            if child.weight.device.type != "meta":
                new.weight, new.lora_a.weight, new.lora_b.weight = (
                    child.weight,
                    child.lora_a.weight,
                    child.lora_b.weight,
                )
            setattr(model, name, new)
            swapped += 1
        else:
            swapped += swap_lora_linears(child, activation_config, weight_config)
    return swapped


def fake_quantizers(model: nn.Module) -> list[FakeQuantizerBase]:
    """Every fake quantizer of ``model`` (activations' and weights'), each switched by its ``enabled``."""
    return [module for module in model.modules() if isinstance(module, FakeQuantizerBase)]


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch every fake quantizer of ``model`` on or off (torchao's ``enable_linear_fake_quant``, for all)."""
    for module in fake_quantizers(model):
        module.enabled = enabled


def switch_fake_quant(model: nn.Module, when: FakeQuantization, was: bool | None, global_step: int | None) -> bool:
    """Fake quantization of ``model`` as ``when`` says for the optimizer step after ``global_step`` finished ones,
    or on for a trial step (``global_step`` None); ``was``: its state before (None: not yet set in this run). Says
    the switch at the run's first step and at the step it turns on. Returns the state now."""
    enabled = True if global_step is None else when.enabled_at(global_step)
    if enabled != was:
        set_fake_quant(model, enabled)
    after = when.after_n_steps
    if global_step is not None and after and was is not enabled:
        if global_step == 0 or global_step == after or was is None:
            logs.info(
                f"Step {global_step}: fake quantization {'on' if enabled else 'off'}"
                + ("" if enabled else f", on from step {after}")
            )
    return enabled


class QuantizationAware:
    """A fine-tuning method (full or LoRA) trained with fake quantization: ``configure`` swaps the linear layers
    on the meta-device model first; what trains, loads and is saved is the method's. Once the weights are loaded it
    says what is fake-quantized and when (``profiled``: and that the profiler's trial steps run with it on)."""

    def __init__(
        self,
        method: FinetuneMethod,
        quantizer: Any,
        dtype: torch.dtype,
        fake_quant_after_n_steps: int | None,
        *,
        profiled: bool,
    ) -> None:
        self.method, self.quantizer, self.profiled = method, quantizer, profiled
        self.mode = get_quantizer_mode(quantizer) or type(quantizer).__name__
        self.fake_quantization = FakeQuantization(fake_quant_after_n_steps)
        quantizer.precision = dtype  # as torchtune's qat_distributed: the fake-quantized weights in the run's dtype
        self.swapped = 0

    @property
    def name(self) -> str:
        return f"{self.method.name}+qat"

    @property
    def adapter_only(self) -> bool:
        return self.method.adapter_only

    @property
    def lora(self) -> bool:
        """Whether the adapters' base layers are what is fake-quantized (a LoRA method), or every linear layer."""
        return isinstance(self.method, LoRAFinetune)

    def configure(self, model: nn.Module) -> None:
        if self.lora:
            self.swapped = swap_lora_linears(
                model,
                self.quantizer.get_activation_fake_quantize_config(),
                self.quantizer.get_weight_fake_quantize_config(),
            )
        else:
            linears = sum(isinstance(module, nn.Linear) for module in model.modules())
            with building("quantizer"):
                self.quantizer.prepare(model)
            self.swapped = linears - sum(type(module) is nn.Linear for module in model.modules())
        if not fake_quantizers(model):
            raise ConfigError(
                f"config key 'quantizer' = {self.mode!r} fake-quantized no layer of config key 'model' "
                f"(its groupsize must divide the layers' input sizes)"
            )
        self.method.configure(model)

    def _what(self) -> tuple[str, str]:
        """The groupsize (", groupsize N", or "") and the layers fake-quantized, in words."""
        config = self.quantizer.get_weight_fake_quantize_config()
        group = f", groupsize {config.group_size}" if getattr(config, "group_size", None) else ""
        return group, "LoRA layers' frozen base weights and inputs" if self.lora else "linear layers"

    def quantized(self) -> str:
        """What is fake-quantized, in words: the quantizer, its mode and groupsize, and the layers."""
        group, layers = self._what()
        return f"{type(self.quantizer).__name__} ({self.mode}{group}), {self.swapped} {layers} fake-quantized"

    def describe(self) -> str:
        """One line: what is fake-quantized, and when (and that the trial steps run with it on, when they run: a
        run's set-up says it, not the offline estimate, which runs no trial and says :meth:`quantized`)."""
        group, layers = self._what()
        after = self.fake_quantization.after_n_steps
        when = f"off for the first {after} optimizer steps, then on" if after else "on from the first step"
        trials = "; the profiler's trial steps run with it on" if self.profiled else ""
        return (
            f"Quantization-aware training ({type(self.quantizer).__name__}, {self.mode}{group}): {self.swapped} "
            f"{layers} fake-quantized, {when}{trials}"
        )

    def initialize(self, model: nn.Module) -> None:
        self.method.initialize(model)

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        return self.method.weights(checkpoint)

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        self.method.after_load(model, missing, unexpected)
        logs.info(self.describe())

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        return self.method.checkpoint_entries(full_state_dict)


def quantization_aware(cfg: DictConfig, method: FinetuneMethod, *, profiled: bool) -> FinetuneMethod:
    """``method`` trained with fake quantization when ``cfg`` has a ``quantizer`` (a QAT quantizer: refused in one
    line otherwise), else ``method`` itself (``profiled``: see :class:`QuantizationAware`)."""
    node = optional_component(cfg.get("quantizer", None))
    after = fake_quant_steps(cfg)
    if node is None:
        if after is not None:
            raise ConfigError(
                f"config key 'fake_quant_after_n_steps' = {after} needs config key 'quantizer' (a QAT "
                f"quantizer: {_QAT_QUANTIZERS}); without one nothing is fake-quantized"
            )
        return method
    with building("quantizer"):
        quantizer = config.instantiate(node)
    mode = get_quantizer_mode(quantizer)
    if not hasattr(quantizer, "get_weight_fake_quantize_config") or (mode is not None and "qat" not in mode):
        raise ConfigError(
            f"config key 'quantizer' = {node.get('_component_')!r} is not a QAT quantizer; use {_QAT_QUANTIZERS}"
        )
    from torchtune import training

    # the fake-quantized weights in the run's dtype (the trainer checks the device)
    dtype = training.get_dtype(cfg.get("dtype", DEFAULT_DTYPE), device=torch.device("cpu"))
    return QuantizationAware(method, quantizer, dtype, after, profiled=profiled)


def fake_quant_steps(cfg: DictConfig) -> int | None:
    """``fake_quant_after_n_steps``: None (on from the start) or a whole number of optimizer steps >= 0."""
    value = cfg.get("fake_quant_after_n_steps", None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(
            f"config key 'fake_quant_after_n_steps' = {value!r}: a whole number of optimizer steps "
            ">= 0, or null (fake quantization on from the first step)"
        )
    return value
