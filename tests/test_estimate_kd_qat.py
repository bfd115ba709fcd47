"""``estimate`` on knowledge distillation and quantization-aware training configs (issue 38.5).

KD: the step of the objective ``adaptive_knowledge_distillation`` trains with, traced on fake tensors: the student's
forward and backward, the frozen teacher's forward without autograd on the same micro batch, both losses; the
teacher's weights count with the student's, sharded as they are. QAT: the model prepared by the config's
``quantizer`` as the fine-tuning recipes prepare it, traced with fake quantization on. Each step's memory is checked
against a real CPU step of the same tiny model. Tiny students of 5 layers (3 traced), a teacher of 4 (3 traced, its
own middle layer repeated), at short sequences.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from config_edits import CONFIGS
from real_steps import assert_matches_real_steps, real_activation_bytes
from torch import nn
from torchtune import config

from adaptive_batching.cli import main
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.trace_inputs import trace_inputs
from adaptive_batching.estimate.layer_timeline import repeats
from adaptive_batching.estimate.prediction import StepTrace, predict, trace_steps
from adaptive_batching.training.objectives import SupervisedFinetune
from adaptive_batching.training.recipe_table import traced_parts

MiB = 2**20
SEQ_LEN = 32
KD = ("model.num_layers=5", "teacher_model.num_layers=4")
QAT_LORA = ("model.num_layers=5",)
QAT_FULL = (
    "model.num_layers=5",
    "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer",
    "quantizer.groupsize=32",
)
CASES = {
    "kd": ("tiny_kd", KD),
    "qat_lora": ("tiny_qat_lora", QAT_LORA),
    "qat_full": ("tiny_full", QAT_FULL),
    "qat_lora_bf16": ("tiny_qat_lora", (*QAT_LORA, "dtype=bf16")),  # the stock KD and QAT configs' dtype
    "kd_bf16": ("tiny_kd", (*KD, "dtype=bf16")),
}


def _cfg(name: str, overrides: tuple[str, ...]) -> Any:
    return load_config(str(CONFIGS / f"{name}.yaml"), list(overrides))


def _trace(name: str, overrides: tuple[str, ...], *, exact: bool = False, finetune: bool = False) -> StepTrace:
    cfg = _cfg(name, overrides)
    inputs, method, objective = traced_parts(cfg)
    if finetune:
        inputs, objective = trace_inputs(cfg), SupervisedFinetune()
    return trace_steps(inputs, method, objective, seq_len=SEQ_LEN, exact=exact)


class _Traces(dict):
    """Each case's trace, made when a test first asks for it (one module-wide trace a case)."""

    def __missing__(self, case: str) -> StepTrace:
        self[case] = _trace(*CASES[case])
        return self[case]


@pytest.fixture(scope="module")
def traces() -> dict[str, StepTrace]:
    return _Traces()


def _weights(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_repeats_of_a_kd_pass_expand_the_teacher_over_its_own_depth() -> None:
    """A 16-layer student and a 32-layer teacher (Llama 3.2 1B from 3.1 8B): the student's forward, the teacher's,
    the student's backward; each middle layer repeats over its own model's depth."""
    assert repeats(3, 16, forwards=2, reference=(3, 32)) == [1, 1, 14, 1, 1, 30, 1, 1, 14, 1]
    assert repeats(1, 1, forwards=2, reference=(2, 2)) == [1] * 5  # tiny_kd: 1 student layer, 2 teacher layers
    with pytest.raises(ValueError):
        repeats(3, 16, forwards=2, reference=(2, 5))


def test_a_kd_config_is_estimated_with_its_teacher(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Before: 'config key 'teacher_model': estimate does not model knowledge distillation yet' (exit 2)."""
    argv = [
        "estimate",
        "--config",
        "tiny_kd",
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
    with torch.device("meta"):
        teacher = config.instantiate(load_config("tiny_kd").teacher_model)
    assert written["objective"] == "kd" and written["reference_bytes"] == _weights(teacher)
    assert out.startswith(f"predicted largest micro batch: {written['max_micro_batch']} ({SEQ_LEN}-token samples, ")
    assert written["max_micro_batch"] >= 1
    assert (
        "KD: the student's forward and backward on the micro batch, and the teacher's forward on it without "
        "autograd" in out
    )


def test_kd_counts_the_teacher_weights_sharded_as_the_student(traces: dict[str, StepTrace]) -> None:
    """The student fine-tuned alone (cross-entropy) holds itself and its optimizer state; KD holds the frozen
    teacher's weights besides, whole on one rank and half of them on each of 2."""
    kd = traces["kd"]
    alone = _trace(*CASES["kd"], finetune=True)
    with torch.device("meta"):
        teacher = config.instantiate(_cfg(*CASES["kd"]).teacher_model)
    weights = _weights(teacher)
    assert kd.resident_bytes == weights and alone.resident_bytes == 0
    assert kd.probes[1].steady_bytes - alone.probes[1].steady_bytes == weights
    for ranks in (1, 2):
        with_teacher, without = (
            predict(t, device_memory_bytes=64 * MiB, world_size=ranks, verify=False) for t in (kd, alone)
        )
        assert with_teacher.model_state_bytes - without.model_state_bytes == pytest.approx(weights / ranks, abs=1)
        assert with_teacher.reference_bytes == weights // ranks
    for micro_batch in kd.probes:  # the teacher's forward and logits: more than the student's step alone
        assert kd.probes[micro_batch].activation_bytes > alone.probes[micro_batch].activation_bytes


def test_the_kd_step_extrapolated_matches_the_full_trace(traces: dict[str, StepTrace]) -> None:
    """Three layers of each model traced and extended (the student's to 5, the teacher's to 4), against all of
    them traced (``--full-trace``): the same probes, to 2% as for fine-tuning."""
    fast, full = traces["kd"], _trace(*CASES["kd"], exact=True)
    assert sorted(fast.probes) == sorted(full.probes) and fast.traced_layers == 3 and full.traced_layers == 5
    assert fast.reference_layers == (3, 4) and full.reference_layers == (4, 4)
    for micro_batch, exact in full.probes.items():
        for field in ("activation_bytes", "forward_backward_peak", "optimizer_peak", "steady_bytes"):
            assert getattr(fast.probes[micro_batch], field) == pytest.approx(getattr(exact, field), rel=0.02), (
                micro_batch,
                field,
            )


def test_fake_quantization_keeps_tensors_for_the_backward(traces: dict[str, StepTrace]) -> None:
    """The same tiny LoRA and full models without a quantizer keep less for the backward, at every micro batch and
    per sample: the estimate counts what the fake quantizers keep, and says what it traced."""
    for case, off in (("qat_lora", ("quantizer=null",)), ("qat_full", ())):
        name, overrides = CASES[case]
        plain = _trace(name, (*overrides[:1], *off))
        qat = traces[case]
        low, _high = min(qat.probes), max(qat.probes)
        assert sorted(plain.probes)[:2] == sorted(qat.probes)[:2]
        for m in (low, sorted(qat.probes)[1]):
            assert qat.probes[m].activation_bytes > plain.probes[m].activation_bytes, (case, m)
        assert plain.quantization == "" and "fake-quantized" in qat.quantization
    text = predict(traces["qat_lora"], device_memory_bytes=64 * MiB, verify=False).describe()
    assert (
        "QAT: Int8DynActInt4WeightQATQuantizer (8da4w-qat, groupsize 32), 30 LoRA layers' frozen base weights "
        "and inputs fake-quantized; traced with fake quantization on" in text
    )


def _real_activation_bytes(case: str, micro_batch: int) -> int:
    """A real step of the case's tiny config (KD: a real frozen teacher), as :func:`real_activation_bytes`."""
    return real_activation_bytes(_cfg(*CASES[case]), micro_batch, SEQ_LEN)


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_matches_a_real_cpu_step(traces: dict[str, StepTrace], case: str) -> None:
    """The fake, extrapolated step against the real one of the same tiny model, at the micro batches the estimate
    probed: each step's bytes and the bytes a sample adds within the fine-tuning estimate's tolerance (5%); QAT LoRA
    and KD also in bf16 (the stock configs' dtype: the fake quantizers' float32 copies are larger than the
    activations they copy, and the KD loss upcasts each chunk of both models' logits)."""
    trace = traces[case]
    assert_matches_real_steps(trace, lambda m: _real_activation_bytes(case, m))


def test_the_stock_table_names_kd_and_qat_configs_and_their_teacher() -> None:
    """``estimate_stock_configs.py``: the 10 KD and QAT stock configs are among those it estimates, each named by
    its method (and a KD config's model cell by its student, then its teacher)."""
    from estimate_stock_configs import DPO_RECIPES, KD_RECIPES, QAT_RECIPES, method_of, model_of

    from adaptive_batching.config.loading import FINETUNE_RECIPES, stock_configs

    names = stock_configs((*FINETUNE_RECIPES, *DPO_RECIPES, *KD_RECIPES, *QAT_RECIPES))
    kd = sorted(n for n in names if "_KD_" in n)
    qat = sorted(n for n in names if "_qat_" in n)
    assert len(kd) == 4 and len(qat) == 6
    methods = {n: method_of(load_config(n)) for n in (*kd, *qat)}
    assert {methods[n] for n in kd} == {"LoRA KD"}
    assert {n for n in qat if methods[n] == "full QAT"} == {"llama2/7B_qat_full", "llama3/8B_qat_full"}
    assert {methods[n] for n in qat} == {"full QAT", "LoRA QAT"}
    assert model_of(load_config("llama3_2/8B_to_1B_KD_lora_single_device")) == "lora_llama3_2_1b, teacher llama3_1_8b"
    assert model_of(load_config("llama3_2/1B_qat_lora")) == "lora_llama3_2_1b"


def test_the_issues_command_counts_the_8b_teacher(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 38's command. Before: 2.76 GB of fixed bytes, the 1B student alone (and after 38.1, a one-line
    refusal); now the 8B teacher's bf16 weights (about 16 GB) count with the student's."""
    argv = [
        "estimate",
        "--config",
        "llama3_2/8B_to_1B_KD_lora_single_device",
        "--device-memory",
        "80GiB",
        "--seq-len",
        "2048",
        "--json",
        str(tmp_path / "e.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "e.json").read_text())
    with torch.device("meta"):
        teacher = config.instantiate(load_config("llama3_2/8B_to_1B_KD_lora_single_device").teacher_model)
    bf16_weights = sum(p.numel() for p in teacher.parameters()) * 2
    assert written["reference_bytes"] >= bf16_weights > 16 * 10**9
    assert min(written["fixed_bytes"], written["model_state_bytes"]) > bf16_weights + 2 * 2**30  # and the student
    assert out.startswith(f"predicted largest micro batch: {written['max_micro_batch']} (2048-token samples, ")
    assert written["max_micro_batch"] >= 1 and "KD: the student's forward and backward" in out
    assert written["reference_layers"] == [3, 32] and "; 3 of its 32 layers traced)" in out


def test_fake_quant_after_n_steps_is_estimated_with_fake_quantization_on(traces: dict[str, StepTrace]) -> None:
    """With ``fake_quant_after_n_steps`` the first steps train without fake quantization; the plan must fit the
    steps after it turns on, so the estimate traces those: the same bytes as with it on from the start."""
    name, overrides = CASES["qat_lora"]
    later = _trace(name, (*overrides, "fake_quant_after_n_steps=5"))
    assert later.probes == traces["qat_lora"].probes
