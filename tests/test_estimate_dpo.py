"""``estimate`` on DPO configs (issue 37.5): the step of the objective the DPO recipes train with, traced on fake
tensors. The policy runs on a pair's two sequences, the reference's forward runs without autograd (LoRA: the same
model with its adapters off; full DPO: a frozen copy, whose weights count with the policy's, sharded as they are),
and the step's memory is checked against a real CPU step of the same tiny model.

Tiny models of 5 layers (3 traced, the middle one repeated by the extrapolation) at short sequences.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from config_edits import CONFIGS
from real_steps import PeakTracker, assert_matches_real_steps, one_thread, real_activation_bytes
from torch import nn
from torchtune import config
from torchtune.modules.peft import disable_adapter

from adaptive_batching.cli import main
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.trace_inputs import trace_inputs
from adaptive_batching.estimate.layer_timeline import repeats
from adaptive_batching.estimate.prediction import StepTrace, predict, trace_steps
from adaptive_batching.training.objectives import FullDPO, LoRADPO, SupervisedFinetune
from adaptive_batching.training.recipe_table import student, traced_parts

MiB = 2**20
SEQ_LEN = 32
LAYERS = "model.num_layers=5"
CE = "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss"
CHECKPOINTING = "enable_activation_checkpointing=True"


def _cfg(name: str, *overrides: str) -> Any:
    return load_config(str(CONFIGS / f"{name}.yaml"), [LAYERS, *overrides])


def _trace(name: str, *overrides: str, objective: Any = None) -> StepTrace:
    """The trace of config ``name``, of the step of the objective its recipe trains with, or of ``objective``."""
    cfg = _cfg(name, *overrides)
    if objective is not None:  # the model's method (LoRA or full), without the checks of the config's objective
        return trace_steps(trace_inputs(cfg, objective.frozen), student(cfg), objective, seq_len=SEQ_LEN)
    return trace_steps(*traced_parts(cfg), seq_len=SEQ_LEN)


def test_repeats_of_a_dpo_pass_expand_the_middle_layer_of_each_forward_and_the_backward() -> None:
    """Before the layers, the reference's forward and the policy's (in the order they ran: DPO runs the reference's
    first), the backward: each middle layer repeats."""
    assert repeats(3, 32, forwards=2) == [1, 1, 30, 1, 1, 30, 1, 1, 30, 1]
    assert repeats(3, 16, forwards=2, reference=(3, 32), reference_first=True) == [1, 1, 30, 1, 1, 14, 1, 1, 14, 1]
    assert repeats(3, 16, forwards=2, reference=(3, 32)) == [1, 1, 14, 1, 1, 30, 1, 1, 14, 1]
    assert repeats(3, 3, forwards=2) == [1] * 10 and repeats(3, 32) == [1, 1, 30, 1, 1, 30, 1]


def test_a_dpo_config_is_estimated_and_says_its_samples_are_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: 'estimate does not model a DPO step yet' (exit 2)."""
    argv = [
        "estimate",
        "--config",
        "tiny_lora_dpo",
        "--device-memory",
        "64MiB",
        "--seq-len",
        str(SEQ_LEN),
        "--json",
        str(tmp_path / "e.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "e.json").read_text())
    assert out.startswith(
        f"predicted largest micro batch: {written['max_micro_batch']} (pairs of {SEQ_LEN}-token sequences, 1 rank(s))"
    )
    assert written["max_micro_batch"] >= 1 and written["objective"] == "lora_dpo" and written["reference_bytes"] == 0
    assert (
        f"DPO (lora_dpo): a sample is a pair, chosen and rejected each {SEQ_LEN} tokens: the policy's forward "
        "and backward on 2 x micro batch sequences"
    ) in out and "(the policy with its adapters off)" in out


def test_a_dpo_config_the_recipe_refuses_is_refused_by_estimate(capsys: pytest.CaptureFixture) -> None:
    argv = [
        "estimate",
        "--config",
        "tiny_lora_dpo",
        "--device-memory",
        "64MiB",
        "--seq-len",
        "16",
        "dataset.packed=True",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: config key 'dataset.packed' = True") and "\n" not in err


class _Recorded:
    """Every forward of the models it watches while a step runs: (which, input shape, autograd on, adapters off)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], bool, bool]] = []

    def watch(self, model: nn.Module, which: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            lora = next((m for m in module.modules() if hasattr(m, "disabled")), None)
            self.calls.append(
                (which, tuple(args[0].shape), torch.is_grad_enabled(), bool(lora is not None and lora.disabled))
            )

        return model.register_forward_pre_hook(hook)


class _RecordedLoRADPO(LoRADPO):
    def __init__(self, recorded: _Recorded) -> None:
        super().__init__()
        self.recorded = recorded

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        handle = self.recorded.watch(model, "policy")
        try:
            return super().micro_loss(model, loss_fn, batch, activations)
        finally:
            handle.remove()


class _RecordedFullDPO(FullDPO):
    def __init__(self, recorded: _Recorded) -> None:
        super().__init__()
        self.recorded = recorded

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.reference_model is not None
        handles = [self.recorded.watch(model, "policy"), self.recorded.watch(self.reference_model, "reference")]
        try:
            return super().micro_loss(model, loss_fn, batch, activations)
        finally:
            for handle in handles:
                handle.remove()


@pytest.fixture(scope="module")
def traces() -> dict[str, StepTrace]:
    """The tiny fine-tuning step, and the two DPO steps with every forward they run recorded (``recorded``)."""
    recorded = {name: _Recorded() for name in ("tiny_lora_dpo", "tiny_full_dpo")}
    return {
        "tiny_lora": _trace("tiny_lora"),
        "tiny_lora_dpo": _trace("tiny_lora_dpo", objective=_RecordedLoRADPO(recorded["tiny_lora_dpo"])),
        "tiny_full_dpo": _trace("tiny_full_dpo", objective=_RecordedFullDPO(recorded["tiny_full_dpo"])),
        "recorded": recorded,
    }  # type: ignore[dict-item]


@pytest.mark.parametrize("name", ["tiny_lora_dpo", "tiny_full_dpo"])
def test_each_traced_step_runs_the_reference_without_autograd_then_the_policy_on_both_sequences(
    traces: dict[str, Any], name: str
) -> None:
    trace, recorded = traces[name], traces["recorded"][name]
    assert trace.objective == name.removeprefix("tiny_")
    steps = len(recorded.calls) // 2
    assert steps >= len(trace.probes) and len(recorded.calls) == 2 * steps
    reference = ("policy", True) if name == "tiny_lora_dpo" else ("reference", False)
    for i in range(steps):
        ref, policy = recorded.calls[2 * i : 2 * i + 2]
        pairs = policy[1][0] // 2
        assert ref == (reference[0], (2 * pairs, SEQ_LEN), False, reference[1])
        assert policy == ("policy", (2 * pairs, SEQ_LEN), True, False)
    assert set(trace.probes) <= {recorded.calls[2 * i + 1][1][0] // 2 for i in range(steps)}


def test_the_dpo_step_extrapolated_matches_the_full_trace(traces: dict[str, Any]) -> None:
    """Three layers traced and extended to five (the policy's and the reference's middle forward and the middle
    backward repeated), against all five traced (``--full-trace``): the same probes, to 2% as for fine-tuning.
    Full DPO (a separate reference, cut to three layers too); both DPO steps are also checked against real steps
    below."""
    name = "tiny_full_dpo"
    cfg = _cfg(name)
    full = trace_steps(*traced_parts(cfg), seq_len=SEQ_LEN, exact=True)
    fast = traces[name]
    assert sorted(fast.probes) == sorted(full.probes) and fast.traced_layers == 3 and full.traced_layers == 5
    for micro_batch, exact in full.probes.items():
        for field in ("activation_bytes", "forward_backward_peak", "optimizer_peak", "steady_bytes"):
            assert getattr(fast.probes[micro_batch], field) == pytest.approx(getattr(exact, field), rel=0.02), (
                micro_batch,
                field,
            )


def test_full_dpo_counts_the_reference_weights_sharded_as_the_policy(traces: dict[str, StepTrace]) -> None:
    """The same model fine-tuned (cross-entropy) holds the policy and its optimizer state; full DPO holds the
    frozen reference's weights besides, whole on one rank and half of them on each of 2."""
    dpo = traces["tiny_full_dpo"]
    finetune = _trace("tiny_full_dpo", CE, "~loss.beta", objective=SupervisedFinetune())
    with torch.device("meta"):
        model = config.instantiate(_cfg("tiny_full_dpo").model)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))  # and rotary caches
    assert dpo.resident_bytes == weights and finetune.resident_bytes == 0
    assert dpo.probes[1].steady_bytes - finetune.probes[1].steady_bytes == weights
    for ranks in (1, 2):
        with_reference, without = (
            predict(t, device_memory_bytes=64 * MiB, world_size=ranks, verify=False) for t in (dpo, finetune)
        )
        assert with_reference.model_state_bytes - without.model_state_bytes == pytest.approx(weights / ranks, abs=1)
        assert with_reference.reference_bytes == weights // ranks
    assert "a frozen copy of the model" in predict(dpo, device_memory_bytes=64 * MiB, verify=False).describe()


class _NoReferenceForward(LoRADPO):
    """The LoRA DPO step without the reference's forward: the policy's own log-probabilities, detached, stand in."""

    def _reference_log_probs(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, activations: Any
    ) -> torch.Tensor:
        return torch.zeros(tokens.size(0), dtype=torch.float32)


def _reference_forward_peak(name: str, pairs: int) -> int:
    """Bytes the reference's forward and log-probabilities take above where they start, alone, on real tensors:
    the adapters off, no autograd, on 2 x ``pairs`` sequences."""
    from torchtune import rlhf

    cfg = _cfg(name)
    torch.manual_seed(0)
    model = config.instantiate(cfg.model)
    tokens = torch.randint(0, 1280, (2 * pairs, SEQ_LEN))
    with one_thread(), PeakTracker() as tracker, torch.no_grad(), disable_adapter(model):
        start = tracker.total()
        rlhf.get_batch_log_probs(model(tokens), tokens)
    return tracker.highest - start


def test_the_reference_forward_runs_first_and_adds_nothing_to_the_steps_peak(traces: dict[str, StepTrace]) -> None:
    """The reference's forward saves nothing for the backward and runs before the policy's: its logits and
    log-softmax (its own transient peak, real and above zero) are gone before the policy's activations are held,
    so the step holds exactly what it holds with the reference's log-probabilities handed in instead. Run after
    the policy's forward, that transient peak would sit on top of the policy's saved activations."""
    dpo = traces["tiny_lora_dpo"]
    without = _trace("tiny_lora_dpo", objective=_NoReferenceForward())
    assert sorted(without.probes) == sorted(dpo.probes)
    for pairs in dpo.probes:
        assert _reference_forward_peak("tiny_lora_dpo", pairs) > 0
        assert dpo.probes[pairs].activation_bytes == without.probes[pairs].activation_bytes, pairs


def _real_activation_bytes(name: str, micro_batch: int, *overrides: str) -> int:
    """A real step of the tiny config (full DPO's real frozen reference with it), as :func:`real_activation_bytes`."""
    return real_activation_bytes(_cfg(name, *overrides), micro_batch, SEQ_LEN)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny_lora", ()),
        ("tiny_lora_dpo", ()),
        ("tiny_full_dpo", ()),
        ("tiny_lora_dpo", (CHECKPOINTING,)),
        ("tiny_full_dpo", (CHECKPOINTING,)),
    ],
    ids=["finetune", "lora_dpo", "full_dpo", "lora_dpo, checkpointing", "full_dpo, checkpointing"],
)
def test_the_estimate_matches_a_real_cpu_step(
    traces: dict[str, StepTrace], name: str, overrides: tuple[str, ...]
) -> None:
    """The fake, extrapolated step against the real one of the same tiny model, at the micro batches the estimate
    probed: each step's bytes and the bytes a sample (a pair) adds within the fine-tuning estimate's tolerance
    (5%; ``tiny_lora`` is the fine-tuning step, for comparison; on CPU they agree to a few bytes today), without
    and with activation checkpointing (which the stock DPO configs turn on)."""
    trace = _trace(name, *overrides) if overrides else traces[name]
    assert_matches_real_steps(trace, lambda m: _real_activation_bytes(name, m, *overrides))


def test_merged_rows_take_the_place_of_their_configs_in_the_table_and_the_rest_is_kept() -> None:
    """``estimate_stock_configs.py --only NAMES --merge``: how the DPO rows went into docs/estimates.md."""
    from estimate_stock_configs import FIDELITY, merged_page, merged_rows

    def row(name: str, micro_batch: int) -> dict[str, Any]:
        return {
            "config": name,
            "model": "m",
            "method": "LoRA DPO",
            "savers": [],
            "seconds": 1.0,
            "parameters": 10**9,
            "trainable": 10**7,
            "micro_batch": {f"{gib}GiB/{n}": micro_batch for gib in (24, 40, 80) for n in (1, 8)},
        }

    page = (
        "# t\n\nprose `a`\n\n1 of 2 configs estimated; the slowest took 1 s.\n\n| config | x |\n| --- | --- |\n"
        "| `a/1` | old a |\n| `c/1` | not estimated: no | - |\n\nafter\n\n" + FIDELITY + "\n\n| `z` | kept |\n"
    )
    merged = merged_page(page, [row("b/1", 3), row("a/1", 5)], 2048)
    lines = merged.splitlines()
    table = [line for line in lines if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == ["a/1", "b/1", "c/1", "z"]
    assert table[0].endswith("| 5 | 5 | 5 | 5 | 5 | 5 | 1.0 |") and "| LoRA DPO |" in table[1]
    assert table[2] == "| `c/1` | not estimated: no | - |" and table[3] == "| `z` | kept |"  # others kept
    assert "2 of 3 configs estimated; the slowest took 1 s." in lines and "after" in lines and "prose `a`" in lines
    kept = merged_rows([row("a/1", 1), row("c/1", 2)], [row("a/1", 5), row("b/1", 3)])
    assert [(r["config"], r["micro_batch"]["24GiB/1"]) for r in kept] == [("a/1", 5), ("b/1", 3), ("c/1", 2)]
