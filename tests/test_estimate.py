"""``adaptive-batching estimate``: the 3-layer extrapolation against the full trace of every layer.

The equivalence tests trace the tiny models with 4 layers (so a middle layer is repeated) both
ways and compare every probe and the predicted micro batch; the unit tests show why whole-step
peaks cannot be extrapolated and that the segment walk is exact for any depth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from adaptive_batching.cli import main
from adaptive_batching.config import load_config
from adaptive_batching.estimate import EXTRAPOLATED, FULL_TRACE, estimate_max_micro_batch, predict, trace_steps
from adaptive_batching.layer_timeline import Segment, decoder_layers, extrapolate_peak, repeats
from adaptive_batching.methods import method_for
from config_edits import CONFIGS

MiB = 2**20
FOUR_LAYERS = {
    "full, activation checkpointing": ("tiny_full.yaml", ["model.num_layers=4", "enable_activation_checkpointing=True"]),
    "LoRA": ("tiny_lora.yaml", ["model.num_layers=4", "model.apply_lora_to_mlp=False",
                                "model.lora_attn_modules=[q_proj,v_proj]"]),
}


def _segments(head: int, grads_per_layer: int) -> list[Segment]:
    """A 3-layer pass: each layer's forward keeps 1 MiB; the head briefly needs ``head`` bytes; each
    layer's backward frees its 1 MiB and keeps ``grads_per_layer`` of gradients."""
    return [
        Segment("before the layers", 0, MiB, MiB),
        Segment("forward 0", MiB, 2 * MiB, 2 * MiB),
        Segment("forward 1", 2 * MiB, 3 * MiB, 3 * MiB),
        Segment("forward 2", 3 * MiB, 4 * MiB, 4 * MiB + head),
        Segment("backward 2", 4 * MiB, 4 * MiB + grads_per_layer - MiB, 4 * MiB + grads_per_layer),
        Segment("backward 1", 3 * MiB + grads_per_layer, 2 * MiB + 2 * grads_per_layer, 3 * MiB + 2 * grads_per_layer),
        Segment("backward 0", 2 * MiB + 2 * grads_per_layer, MiB + 3 * grads_per_layer, 2 * MiB + 3 * grads_per_layer),
    ]


def _walk_every_layer(segments: list[Segment], layers: int) -> int:
    """The peak of a ``layers``-deep pass, walking every repeat of the middle layer one by one."""
    level, highest = 0, 0
    for segment, count in zip(segments, repeats(3, layers)):
        for _ in range(count):
            highest = max(highest, level + segment.peak - segment.start)
            level += segment.end - segment.start
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
        result[case] = (trace_steps(cfg, method_for(cfg)), trace_steps(cfg, method_for(cfg), exact=True))
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
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("device_memory", [48 * MiB, 512 * MiB])
def test_extrapolation_predicts_the_same_micro_batch(traces: dict, case: str, world_size: int,
                                                     device_memory: int) -> None:
    fast, full = (predict(t, device_memory_bytes=device_memory, world_size=world_size) for t in traces[case])
    assert fast.max_micro_batch == full.max_micro_batch > 0
    at_8 = [e.fixed_bytes + e.bytes_per_sample * 8 for e in (fast, full)]
    assert at_8[0] == pytest.approx(at_8[1], rel=0.02)
    if world_size == 2:  # sharded weights and optimizer state leave room for more samples
        single = predict(traces[case][1], device_memory_bytes=device_memory)
        assert full.model_state_bytes < single.model_state_bytes
        assert full.max_micro_batch >= single.max_micro_batch


def test_cli_extrapolates_by_default_and_says_so(traces: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    name, overrides = FOUR_LAYERS["full, activation checkpointing"]
    out = tmp_path / "e.json"
    code = main(["estimate", "--config", str(CONFIGS / name), "--device-memory", "512MiB", "--world-size", "2",
                 "--json", str(out), *overrides])
    assert code == 0
    assert "method: layer extrapolation (traced 3 of 4 layers; --full-trace traces all)" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert (written["method"], written["world_size"], written["traced_layers"]) == (EXTRAPOLATED, 2, 3)
    full = predict(traces["full, activation checkpointing"][1], device_memory_bytes=512 * MiB, world_size=2)
    assert written["max_micro_batch"] == full.max_micro_batch


def test_cli_full_trace_flag_asks_for_the_exact_trace(traces: dict, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """The flag reaches ``trace_steps``; the trace itself is the fixture's (already compared above)."""
    import adaptive_batching.estimate as estimate

    asked = []

    def recorded(cfg: object, method: object, *, exact: bool, max_probe: int) -> object:
        asked.append(exact)
        return traces["LoRA"][1 if exact else 0]

    monkeypatch.setattr(estimate, "trace_steps", recorded)
    config = ["--config", str(CONFIGS / "tiny_lora.yaml"), "--device-memory", "512MiB"]
    assert main(["estimate", *config, "--full-trace"]) == 0
    assert "method: full trace of all 4 layers" in capsys.readouterr().out
    assert main(["estimate", *config]) == 0
    assert "method: layer extrapolation (traced 3 of 4 layers" in capsys.readouterr().out
    assert asked == [True, False]


@pytest.mark.parametrize("argv, flag", [
    (["--device-memory", "lots"], "--device-memory"),
    (["--device-memory", "1GiB", "--fraction", "1.5"], "--fraction"),
    (["--device-memory", "1GiB", "--world-size", "0"], "--world-size"),
])
def test_cli_bad_input_names_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--config", str(CONFIGS / "tiny_full.yaml"), *argv]) == 2
    assert flag in capsys.readouterr().err


def test_bad_arguments_are_refused_before_any_tracing() -> None:
    cfg = load_config(str(CONFIGS / "tiny_full.yaml"))
    with pytest.raises(ValueError, match=r"device_memory_bytes \(--device-memory\)"):
        estimate_max_micro_batch(cfg, method_for(cfg), device_memory_bytes=0)
    with pytest.raises(ValueError, match=r"world_size \(--world-size\)"):
        estimate_max_micro_batch(cfg, method_for(cfg), device_memory_bytes=MiB, world_size=1.5)
    with pytest.raises(ValueError, match="max_probe"):
        trace_steps(cfg, method_for(cfg), max_probe=1)
