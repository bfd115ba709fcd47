"""``adaptive-batching estimate``: the 3-layer extrapolation against the full trace of every layer.

The equivalence tests trace the tiny models with 4 layers (so a middle layer is repeated) both
ways and compare every probe and the predicted micro batch; the unit tests show why whole-step
peaks cannot be extrapolated and that the segment walk is exact for any depth.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from config_edits import CONFIGS
from torch import nn

from adaptive_batching.cli import main
from adaptive_batching.config.loading import load_config
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.estimate.layer_timeline import PassStretch, decoder_layers, extrapolate_peak, repeats
from adaptive_batching.estimate.prediction import (
    EXTRAPOLATED,
    FULL_TRACE,
    StepTrace,
    estimate_max_micro_batch,
    predict,
    trace_steps,
)
from adaptive_batching.training.objectives import SupervisedFinetune
from adaptive_batching.training.recipe_table import traced_parts

MiB = 2**20
FOUR_LAYERS = {
    "full, activation checkpointing": (
        "tiny_full.yaml",
        ["model.num_layers=4", "enable_activation_checkpointing=True"],
    ),
    "LoRA": (
        "tiny_lora.yaml",
        ["model.num_layers=4", "model.apply_lora_to_mlp=False", "model.lora_attn_modules=[q_proj,v_proj]"],
    ),
}


def _segments(head: int, grads_per_layer: int) -> list[PassStretch]:
    """A 3-layer pass: each layer's forward keeps 1 MiB; the head briefly needs ``head`` bytes; each
    layer's backward frees its 1 MiB and keeps ``grads_per_layer`` of gradients."""
    return [
        PassStretch("before the layers", 0, MiB, MiB),
        PassStretch("forward 0", MiB, 2 * MiB, 2 * MiB),
        PassStretch("forward 1", 2 * MiB, 3 * MiB, 3 * MiB),
        PassStretch("forward 2", 3 * MiB, 4 * MiB, 4 * MiB + head),
        PassStretch(
            "backward 2",
            4 * MiB,
            4 * MiB + grads_per_layer - MiB,
            4 * MiB + grads_per_layer,
            grads_added=grads_per_layer,
        ),
        PassStretch(
            "backward 1",
            3 * MiB + grads_per_layer,
            2 * MiB + 2 * grads_per_layer,
            3 * MiB + 2 * grads_per_layer,
            grads_added=grads_per_layer,
        ),
        PassStretch(
            "backward 0",
            2 * MiB + 2 * grads_per_layer,
            MiB + 3 * grads_per_layer,
            2 * MiB + 3 * grads_per_layer,
            grads_added=grads_per_layer,
        ),
    ]


def _walk_every_layer(segments: list[PassStretch], layers: int, ranks: int = 1) -> int:
    """The peak of a ``layers``-deep pass, walking every repeat of the middle layer one by one; on one of
    ``ranks``, each layer's gradients are whole during its backward and a 1/ranks shard after it."""
    level, highest = 0, 0
    for segment, count in zip(segments, repeats(3, layers)):
        for _ in range(count):
            highest = max(highest, level + segment.peak - segment.start)
            level += segment.end - segment.start - segment.grads_added * (1 - 1 / ranks)
    return highest


def test_repeats_expand_the_middle_layer() -> None:
    assert repeats(3, 32) == [1, 1, 30, 1, 1, 30, 1]
    assert repeats(3, 3) == [1] * 7 and repeats(2, 2) == [1] * 5
    with pytest.raises(ValueError, match="3 traced layers"):
        repeats(2, 5)
    with pytest.raises(ValueError, match="cannot extrapolate"):
        repeats(3, 2)


def test_the_peak_moves_from_the_head_to_the_gradients_and_is_still_exact() -> None:
    """With a large head and 3 MiB of gradients per layer, the head sets the peak of a shallow pass
    and the gradients that of a deep one; a line through two shallow peaks misses the deep one."""
    segments = _segments(head=40 * MiB, grads_per_layer=3 * MiB)
    for layers in range(3, 41):
        assert extrapolate_peak(segments, repeats(3, layers)) == _walk_every_layer(segments, layers)
    shallow = [extrapolate_peak(segments, repeats(3, n)) for n in (3, 4)]
    deep = extrapolate_peak(segments, repeats(3, 32))
    assert shallow == [44 * MiB, 45 * MiB]  # head on top of the 4 (then 5) MiB kept by the forward
    assert deep == 2 * MiB + 32 * 3 * MiB  # every layer's gradients, the bottom layer's backward under way
    line = shallow[0] + (shallow[1] - shallow[0]) * (32 - 3)
    assert line < 0.8 * deep


@pytest.mark.parametrize("ranks", [2, 8])
def test_under_fsdp_each_layers_gradients_shrink_to_a_shard_after_its_backward(ranks: int) -> None:
    segments = _segments(head=4 * MiB, grads_per_layer=3 * MiB)
    for layers in (3, 4, 32):
        assert extrapolate_peak(segments, repeats(3, layers), 1 / ranks) == _walk_every_layer(segments, layers, ranks)
    # 32 layers: at the bottom layer's backward, 31 layers' gradients are shards and its own is whole; at 8
    # ranks that is less than the top of the forward (1 MiB a layer kept, and the head's 4 MiB).
    forward_top, bottom_backward = (1 + 32) * MiB + 4 * MiB, 2 * MiB + 31 * 3 * MiB // ranks + 3 * MiB
    assert extrapolate_peak(segments, repeats(3, 32), 1 / ranks) == max(forward_top, bottom_backward)
    assert extrapolate_peak(segments, repeats(3, 32), 0.0) == forward_top  # no gradient stays: in host memory


def _convex(micro_batch: int) -> StepMemory:
    """A step whose peak is set by 10 MiB of gradients up to 2 samples, then by 6 MiB of logits per sample."""
    activation = max(10 * MiB + micro_batch * MiB, 6 * MiB * micro_batch)
    return StepMemory(activation, 4 * MiB + activation, 5 * MiB, 4 * MiB)


def test_fake_steps_correct_a_fit_that_underestimates_larger_batches() -> None:
    """The line through micro batch 1 and 2 (1 MiB per sample) promises 26 samples in 40 MiB; the
    steps say 6 (4 + 36 MiB), as 7 needs 46 MiB."""
    measured = []

    def measure(micro_batch: int, ranks: int = 1) -> StepMemory:
        if micro_batch not in measured:  # a trace's measure keeps the steps it traced
            measured.append(micro_batch)
        return _convex(micro_batch)

    trace = StepTrace({1: _convex(1), 2: _convex(2)}, 64, "test", False, 4, 3, EXTRAPOLATED, 0.0, measure)
    assert predict(trace, device_memory_bytes=40 * MiB, fraction=1.0, verify=False).max_micro_batch == 26
    estimate = predict(trace, device_memory_bytes=40 * MiB, fraction=1.0)
    assert (estimate.fit_micro_batch, estimate.max_micro_batch) == (26, 6)
    assert 6 in measured and 7 in measured and estimate.verify_steps >= len(measured) - 2  # the probes were traced
    assert "the fit predicted 26; " in estimate.describe()
    traced = len(measured)
    again = predict(trace, device_memory_bytes=40 * MiB, fraction=1.0)  # reuses the steps it measured
    assert again.max_micro_batch == 6 and len(measured) == traced


def test_a_plateau_of_sharded_state_at_more_ranks_is_probed_past() -> None:
    """At 8 ranks a rank's step can stay flat for longer (Llama 3.3 70B, full: about 23 GiB up to 4 samples, then
    4.3 GiB a sample): the probes of the trace show no slope there, so more are measured at those ranks."""

    def measure(micro_batch: int, ranks: int = 1) -> StepMemory:
        activation = 100 * MiB * micro_batch if ranks == 1 else max(400 * MiB, 60 * MiB * micro_batch)
        return StepMemory(activation, 800 * MiB + activation, 900 * MiB, 800 * MiB)

    trace = StepTrace({1: measure(1), 2: measure(2)}, 64, "test", False, 4, 3, EXTRAPOLATED, 0.0, measure)
    estimate = predict(trace, device_memory_bytes=2000 * MiB, fraction=1.0, world_size=8)
    # 100 MiB of model state per rank + 60 MiB x b <= 2000 MiB, and the optimizer step's 900 / 8 MiB
    assert estimate.max_micro_batch == 31 and estimate.bytes_per_sample == pytest.approx(60 * MiB)


def test_layers_must_be_identical_to_extrapolate() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8)])

    with pytest.raises(ValueError, match="layer 1 of Odd differs.*--full-trace"):
        decoder_layers(Odd())
    with pytest.raises(ValueError, match="no non-empty `layers`.*--full-trace"):
        decoder_layers(nn.Linear(2, 2))


@pytest.fixture(scope="module")
def traces() -> dict[str, tuple]:
    """Each 4-layer config traced both ways, once for the whole module: (extrapolated, full)."""
    result = {}
    for case, (name, overrides) in FOUR_LAYERS.items():
        cfg = load_config(str(CONFIGS / name), overrides)
        seq_len = int(cfg.tokenizer.max_seq_len)
        result[case] = (
            trace_steps(*traced_parts(cfg), seq_len=seq_len),
            trace_steps(*traced_parts(cfg), seq_len=seq_len, exact=True),
        )
    return result


@pytest.mark.parametrize("case", list(FOUR_LAYERS))
def test_extrapolated_steps_match_the_full_trace(traces: dict, case: str) -> None:
    fast, full = traces[case]
    assert (fast.method, fast.num_layers, fast.traced_layers) == (EXTRAPOLATED, 4, 3)
    assert (full.method, full.num_layers, full.traced_layers) == (FULL_TRACE, 4, 4)
    assert sorted(fast.probes) == sorted(full.probes) and len(full.probes) >= 2
    for micro_batch, exact in full.probes.items():
        got = fast.probes[micro_batch]
        for field in ("activation_bytes", "forward_backward_peak", "optimizer_peak", "steady_bytes"):
            assert getattr(got, field) == pytest.approx(getattr(exact, field), rel=0.02), (micro_batch, field)


@pytest.mark.parametrize("case", list(FOUR_LAYERS))
@pytest.mark.parametrize("device_memory", [48 * MiB, 512 * MiB])
def test_extrapolation_predicts_the_same_micro_batch(traces: dict, case: str, device_memory: int) -> None:
    fast, full = (predict(t, device_memory_bytes=device_memory, verify=False) for t in traces[case])
    assert fast.max_micro_batch == full.max_micro_batch > 0
    at_8 = [e.fixed_bytes + e.bytes_per_sample * 8 for e in (fast, full)]
    assert at_8[0] == pytest.approx(at_8[1], rel=0.02)


@pytest.mark.parametrize("case", list(FOUR_LAYERS))
def test_at_two_ranks_the_sharded_state_leaves_room_for_more_samples(traces: dict, case: str) -> None:
    """FSDP shards weights, gradients and optimizer state (the full trace, an upper bound, divides the
    weights and optimizer state only); the extrapolation also adds the two layers FSDP gathers at a time."""
    fast, full = traces[case]
    one, two, bound = (
        predict(t, device_memory_bytes=48 * MiB, world_size=n, verify=False)
        for t, n in ((fast, 1), (fast, 2), (full, 2))
    )
    assert two.model_state_bytes < one.model_state_bytes and two.max_micro_batch >= one.max_micro_batch
    assert two.max_micro_batch >= bound.max_micro_batch


def test_cli_says_which_method_ran_and_what_the_fake_steps_found(
    traces: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The command and its flags reach ``trace_steps``, which answers with the fixture's traces of the
    same config (the tracing itself is compared above; ``tests/test_profile_recipe.py`` runs the
    command end to end); the extrapolated one verifies its prediction with 2 more fake steps."""
    import adaptive_batching.estimate.prediction as estimate

    case = "full, activation checkpointing"
    fast, full = traces[case]
    asked = []

    def recorded(
        inputs: object,
        method: object,
        objective: object,
        *,
        seq_len: int,
        seq_len_source: str,
        exact: bool,
        max_probe: int,
    ) -> StepTrace:
        assert type(objective) is SupervisedFinetune  # the step of the recipe that runs the config
        asked.append((exact, inputs.model.num_layers, method.name, seq_len, seq_len_source))
        return replace(full, measure=None) if exact else fast  # verifying the full trace costs seconds

    monkeypatch.setattr(estimate, "trace_steps", recorded)
    name, overrides = FOUR_LAYERS[case]
    out = tmp_path / "e.json"
    argv = [
        "estimate",
        "--config",
        str(CONFIGS / name),
        "--device-memory",
        "512MiB",
        "--world-size",
        "2",
        "--seq-len",
        "256",
        "--json",
        str(out),
        *overrides,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "method: layer extrapolation (traced 3 of 4 layers; --full-trace traces all)" in printed
    written = json.loads(out.read_text())
    assert (written["method"], written["world_size"], written["traced_layers"]) == (EXTRAPOLATED, 2, 3)
    # The tiny model's peaks are linear in the micro batch: the fit is right and 2 fake steps
    # confirm it (it fits, one more sample does not).
    exact = predict(full, device_memory_bytes=512 * MiB, world_size=2, verify=False).max_micro_batch
    assert written["max_micro_batch"] == written["fit_micro_batch"] == exact
    assert written["verify_steps"] == 2
    assert f"the fit predicted {exact}; 2 fake steps from there found {exact}" in printed

    assert main([*argv, "--full-trace"]) == 0
    printed = capsys.readouterr().out
    assert "method: full trace of all 4 layers" in printed and "the fit's prediction, not verified" in printed
    assert json.loads(out.read_text())["method"] == FULL_TRACE
    assert asked == [(False, 4, "full", 256, "--seq-len"), (True, 4, "full", 256, "--seq-len")]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--device-memory", "lots"], "--device-memory"),
        (["--device-memory", "1GiB", "--fraction", "1.5"], "--fraction"),
        (["--device-memory", "1GiB", "--world-size", "0"], "--world-size"),
    ],
)
def test_cli_bad_input_names_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--config", str(CONFIGS / "tiny_full.yaml"), "--seq-len", "256", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_bad_arguments_are_refused_before_any_tracing() -> None:
    cfg = load_config(str(CONFIGS / "tiny_full.yaml"))
    with pytest.raises(ValueError, match=r"device_memory_bytes \(--device-memory\)"):
        estimate_max_micro_batch(*traced_parts(cfg), device_memory_bytes=0, seq_len=256)
    with pytest.raises(ValueError, match=r"world_size \(--world-size\)"):
        estimate_max_micro_batch(*traced_parts(cfg), device_memory_bytes=MiB, world_size=1.5, seq_len=256)
    with pytest.raises(ValueError, match="max_probe"):
        trace_steps(*traced_parts(cfg), max_probe=1, seq_len=256)
    with pytest.raises(ValueError, match=r"seq_len \(--seq-len\)"):
        trace_steps(*traced_parts(cfg), seq_len=0)


def test_the_optimizer_state_and_its_step_peak_are_divided_over_the_ranks() -> None:
    """A trace where the optimizer step sets the limit: 8 GiB of state on 1 rank, 1 GiB a rank on 8. A 4 GiB
    device fits no micro batch on 1 rank, and some on 8; the reported peak is a rank's share."""
    from adaptive_batching.core.steps import StepMemory
    from adaptive_batching.estimate.prediction import EXTRAPOLATED, StepTrace, predict

    gib = 2**30
    steady, per_sample, optimizer_peak = 2 * gib, 16 * 2**20, 8 * gib
    probes = {
        m: StepMemory(
            activation_bytes=m * per_sample,
            forward_backward_peak=steady + m * per_sample,
            optimizer_peak=optimizer_peak,
            steady_bytes=steady,
        )
        for m in (1, 2, 4, 8, 16)
    }
    trace = StepTrace(
        probes,
        seq_len=128,
        seq_len_source="given",
        cpu_offload=False,
        num_layers=2,
        traced_layers=2,
        method=EXTRAPOLATED,
        seconds=0.0,
    )
    one = predict(trace, device_memory_bytes=4 * gib, fraction=1.0, world_size=1)
    eight = predict(trace, device_memory_bytes=4 * gib, fraction=1.0, world_size=8)
    assert one.optimizer_peak_bytes == optimizer_peak and one.max_micro_batch == 0
    assert eight.optimizer_peak_bytes == optimizer_peak // 8 and eight.model_state_bytes == steady // 8
    assert eight.max_micro_batch == (4 * gib - steady // 8) // per_sample
