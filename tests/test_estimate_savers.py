"""``estimate`` with torchtune's memory savers: optimizer_in_bwd, bitsandbytes optimizers, activation offloading.

Tiny 4-layer models (a middle layer is repeated by the extrapolation) at short sequences, traced both ways where
the two counting methods are compared; one stock config checks the case that used to fail.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from config_edits import CONFIGS
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from adaptive_batching.cli import main
from adaptive_batching.config.loading import load_config
from adaptive_batching.errors import ConfigError
from adaptive_batching.estimate.optimizer_state import BitsAndBytesStandIn, fake_optimizer, stand_in_spec
from adaptive_batching.estimate.prediction import StepTrace, predict, trace_steps
from adaptive_batching.training.recipe_table import traced_parts

MiB = 2**20
IN_BWD = ["optimizer_in_bwd=True", "clip_grad_norm=null"]
PAGED_8BIT = "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit"


def _trace(overrides: list[str], seq_len: int = 64, exact: bool = False, config: str = "tiny_full.yaml") -> StepTrace:
    cfg = load_config(str(CONFIGS / config), ["model.num_layers=4", *overrides])
    return trace_steps(*traced_parts(cfg), seq_len=seq_len, exact=exact)


def _same_probes(fast: StepTrace, full: StepTrace) -> None:
    assert sorted(fast.probes) == sorted(full.probes)
    for micro_batch, exact in full.probes.items():
        got = fast.probes[micro_batch]
        for field in ("activation_bytes", "forward_backward_peak", "optimizer_peak", "steady_bytes"):
            assert getattr(got, field) == pytest.approx(getattr(exact, field), rel=0.02), (micro_batch, field)


@pytest.fixture(scope="module")
def in_bwd() -> dict[str, StepTrace]:
    """A tiny full fine-tune at 16 tokens (gradients weigh more than activations), with and without
    optimizer_in_bwd, and with it traced both ways."""
    return {
        "plain": _trace([], seq_len=16),
        "fast": _trace(IN_BWD, seq_len=16),
        "full": _trace(IN_BWD, seq_len=16, exact=True),
    }


def test_optimizer_in_bwd_is_traced_the_same_both_ways(in_bwd: dict[str, StepTrace]) -> None:
    _same_probes(in_bwd["fast"], in_bwd["full"])
    for device_memory in (8 * MiB, 16 * MiB):
        fast, full = (predict(in_bwd[k], device_memory_bytes=device_memory, verify=False) for k in ("fast", "full"))
        assert fast.max_micro_batch == full.max_micro_batch > 0


def test_optimizer_in_bwd_holds_no_full_set_of_gradients_and_fits_more(in_bwd: dict[str, StepTrace]) -> None:
    """Without it the optimizer step after the backward holds every gradient (and the step's temporaries);
    with it each gradient is gone after its own step, so there is no such peak, and a device where that
    peak decides fits more samples."""
    plain, fast = in_bwd["plain"], in_bwd["fast"]
    steady = plain.probes[1].steady_bytes
    assert fast.probes[1].steady_bytes == steady  # the same weights and optimizer state
    assert all(m.optimizer_peak == steady for m in fast.probes.values())  # nothing after the backward
    assert all(m.optimizer_peak > steady for m in plain.probes.values())
    device_memory = max(m.optimizer_peak for m in plain.probes.values()) - 1  # just short of the plain step
    without = predict(plain, device_memory_bytes=device_memory, fraction=1.0)
    with_it = predict(fast, device_memory_bytes=device_memory, fraction=1.0)
    assert without.max_micro_batch == 0 and with_it.max_micro_batch >= 2
    assert with_it.optimizer_peak_bytes < without.optimizer_peak_bytes
    assert with_it.optimizer_in_bwd and "optimizer_in_bwd: each parameter's optimizer" in with_it.describe()


def test_optimizer_in_bwd_at_more_ranks_shards_the_state(in_bwd: dict[str, StepTrace]) -> None:
    """FSDP with optimizer_in_bwd (torchtune's distributed recipe allows it): a rank keeps half the weights and
    state at 2 ranks, plus the layers FSDP gathers, and fits at least as many samples."""
    one, two = (predict(in_bwd["fast"], device_memory_bytes=8 * MiB, world_size=n, verify=False) for n in (1, 2))
    assert two.model_state_bytes == in_bwd["fast"].probes[1].steady_bytes // 2 == one.model_state_bytes // 2
    assert two.max_micro_batch >= one.max_micro_batch > 0 and two.optimizer_in_bwd


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([*IN_BWD, "gradient_accumulation_steps=4"], "optimizer_in_bwd"),
        (["optimizer_in_bwd=True", "clip_grad_norm=1.0"], "optimizer_in_bwd"),
        (["enable_activation_offloading=True"], "enable_activation_offloading"),
    ],
)
def test_combinations_torchtune_refuses_are_one_line_config_errors(
    overrides: list[str], key: str, capsys: pytest.CaptureFixture
) -> None:
    argv = [
        "estimate",
        "--config",
        str(CONFIGS / "tiny_full.yaml"),
        "--device-memory",
        "1GiB",
        "--seq-len",
        "16",
        *overrides,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: config key '{key}'") and "\n" not in err


def _state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the state, distinct tensors once (shared quantile maps)."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[id(value)] = value.numel() * value.element_size()
    return {"total": sum(seen.values())}


def _layers() -> nn.Module:
    """Parameters on both sides of ``min_8bit_size`` (4096 values) and of a 256-value block."""
    return nn.Sequential(nn.Linear(64, 100), nn.Linear(100, 30), nn.Embedding(257, 16))


@pytest.mark.parametrize(
    "name", ["AdamW8bit", "PagedAdamW8bit", "Adam8bit", "PagedAdam8bit", "PagedAdamW", "PagedAdam", "Lion8bit"]
)
def test_the_stand_in_keeps_bitsandbytes_state_at_its_real_size(name: str) -> None:
    """Per parameter of at least 4096 values: a uint8 tensor and a float32 absmax per 256 values for each moment;
    below it (and for 32-bit optimizers) float32 moments; one 256-entry quantile map per moment, shared."""
    model = _layers()
    component = f"bitsandbytes.optim.{name}"
    from omegaconf import OmegaConf

    optimizer = fake_optimizer(OmegaConf.create({"_component_": component, "lr": 1e-3}), list(model.parameters()))
    assert isinstance(optimizer, BitsAndBytesStandIn)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moments = 1 if "Lion" in name else 2
    expected = 0
    for p in model.parameters():
        n = p.numel()
        if "8bit" in name and n >= 4096:
            expected += moments * (n + 4 * -(-n // 256))
        else:
            expected += moments * 4 * n
    if "8bit" in name:
        expected += moments * 256 * 4
    assert _state_bytes(optimizer)["total"] == expected
    big = [p for p in model.parameters() if p.numel() >= 100_000]
    assert optimizer.paged_bytes() == 0 and not big  # state under 100,000 values a parameter is never paged


@pytest.mark.parametrize("min_8bit_size", [4096, 100])
def test_a_parameter_of_exactly_min_8bit_size_values_keeps_8bit_state(min_8bit_size: int) -> None:
    """bitsandbytes keeps 8-bit state from ``min_8bit_size`` values on (``numel() >= min_8bit_size``): one value
    fewer keeps float32 moments."""
    from omegaconf import OmegaConf

    at, below = nn.Parameter(torch.zeros(min_8bit_size)), nn.Parameter(torch.zeros(min_8bit_size - 1))
    optimizer = fake_optimizer(
        OmegaConf.create({"_component_": "bitsandbytes.optim.AdamW8bit", "min_8bit_size": min_8bit_size}),
        [at, below],
    )
    for p in (at, below):
        p.grad = torch.zeros_like(p)
    optimizer.step()
    blocks = -(-min_8bit_size // 256)
    assert {k: (v.dtype, v.numel()) for k, v in optimizer.state[at].items() if k.startswith(("state", "absmax"))} == {
        "state1": (torch.uint8, min_8bit_size),
        "state2": (torch.uint8, min_8bit_size),
        "absmax1": (torch.float32, blocks),
        "absmax2": (torch.float32, blocks),
    }
    assert {k: (v.dtype, v.numel()) for k, v in optimizer.state[below].items() if isinstance(v, torch.Tensor)} == {
        "state1": (torch.float32, min_8bit_size - 1),
        "state2": (torch.float32, min_8bit_size - 1),
    }


def test_paged_state_is_that_of_parameters_of_100k_values() -> None:
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 8))  # 131,072 and 2,048 values
        from omegaconf import OmegaConf

        optimizer = fake_optimizer(
            OmegaConf.create({"_component_": "bitsandbytes.optim.PagedAdamW8bit"}),
            list(model.parameters()),
        )
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        optimizer.step()
    assert optimizer.paged_bytes() == 2 * 512 * 256


def test_the_stand_in_matches_bitsandbytes_when_it_is_installed() -> None:
    """The real optimizer on CPU (paged falls back to unpaged there) creates the same state tensors."""
    bnb = pytest.importorskip("bitsandbytes")
    from omegaconf import OmegaConf

    for name in ("AdamW8bit", "PagedAdamW8bit", "PagedAdamW"):
        model = _layers()
        real = getattr(bnb.optim, name)(model.parameters(), lr=1e-3)
        stand_in = fake_optimizer(
            OmegaConf.create({"_component_": f"bitsandbytes.optim.{name}"}), list(model.parameters())
        )
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with pytest.warns(UserWarning) if name.startswith("Paged") else _nothing():
            real.step()
        stand_in.step()
        for p in model.parameters():
            ours = {k: (tuple(v.shape), v.dtype) for k, v in stand_in.state[p].items() if isinstance(v, torch.Tensor)}
            theirs = {k: (tuple(v.shape), v.dtype) for k, v in real.state[p].items() if isinstance(v, torch.Tensor)}
            assert ours == theirs, (name, tuple(p.shape))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def test_the_estimate_is_the_same_without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in never imports bitsandbytes: blocked, the estimate is unchanged (and nothing tried to import it)."""
    overrides = [PAGED_8BIT, *IN_BWD, "model.vocab_size=2048"]  # embedding and output of 131,072 values: paged
    installed = predict(_trace(overrides, seq_len=16), device_memory_bytes=16 * MiB, verify=False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    absent = predict(_trace(overrides, seq_len=16), device_memory_bytes=16 * MiB, verify=False)
    ignore = {"seconds"}
    assert {k: v for k, v in installed.to_dict().items() if k not in ignore} == {
        k: v for k, v in absent.to_dict().items() if k not in ignore
    }
    assert installed.paged_state_bytes > 0 and installed.optimizer == "bitsandbytes.optim.PagedAdamW8bit"
    assert "counted as device memory" in installed.describe()


def test_the_stock_8b_paged_8bit_config_is_estimated(monkeypatch: pytest.MonkeyPatch) -> None:
    """``llama3_1/8B_full_single_device`` (PagedAdamW8bit, optimizer_in_bwd) stopped in a data-dependent op of
    bitsandbytes' step with it installed; its state is 2 bytes a parameter (8-bit moments), all paged."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    cfg = load_config("llama3_1/8B_full_single_device")
    trace = trace_steps(*traced_parts(cfg), seq_len=2048)
    estimate = predict(trace, device_memory_bytes=80 * 2**30, verify=False)
    parameters = 8_030_261_248
    assert estimate.paged_state_bytes == pytest.approx(2 * parameters, rel=0.01)
    assert estimate.model_state_bytes == pytest.approx(4 * parameters, rel=0.01)  # bf16 weights + state
    assert estimate.max_micro_batch >= 1 and estimate.max_micro_batch_paged_out >= estimate.max_micro_batch
    assert not estimate.paged_state_evicted and "counted as device memory" in estimate.describe()
    # The single 24 GiB card torchtune writes it for: the state does not fit beside one sample, so the answer is
    # what the GPU does, the driver evicting the paged state to host memory, and it says so.
    card = predict(trace, device_memory_bytes=24 * 2**30, verify=False)
    room = card.budget_bytes - (card.model_state_bytes - card.paged_state_bytes)
    assert card.paged_state_evicted and card.max_micro_batch == card.max_micro_batch_paged_out >= 1
    assert card.model_state_bytes > card.budget_bytes and room >= card.bytes_per_sample
    assert card.describe().startswith(
        f"predicted largest micro batch: {card.max_micro_batch} (2048-token samples, "
        "1 rank(s), the paged optimizer state evicted)"
    )
    assert "the driver evicts its pages to host memory" in card.describe()


@pytest.mark.parametrize(
    "component, fragment",
    [
        ("bitsandbytes.optim.SGD8bit", "cannot be estimated on fake tensors"),
        ("torch.optim.LBFGS", "cannot step on fake tensors"),
    ],
)
def test_an_optimizer_that_cannot_run_on_fake_tensors_is_a_one_line_error(
    component: str, fragment: str, capsys: pytest.CaptureFixture
) -> None:
    argv = [
        "estimate",
        "--config",
        str(CONFIGS / "tiny_full.yaml"),
        "--device-memory",
        "1GiB",
        "--seq-len",
        "16",
        f"optimizer._component_={component}",
        "~optimizer.weight_decay",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: config key 'optimizer._component_'") and fragment in err and "\n" not in err


def test_an_argument_the_bitsandbytes_optimizer_does_not_take_is_named() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"optimizer": {"_component_": "bitsandbytes.optim.AdamW8bit", "momentum": 0.9}})
    with pytest.raises(ConfigError, match=r"'optimizer.momentum'.*allowed:"):
        fake_optimizer(cfg.optimizer, list(nn.Linear(2, 2).parameters()))
    assert stand_in_spec("bitsandbytes.optim.adamw.PagedAdamW8bit") == (2, 8, True)
    assert stand_in_spec("torch.optim.AdamW") is None and stand_in_spec("bitsandbytes.optim.SGD") is None


@pytest.fixture(scope="module")
def offloading() -> dict[str, StepTrace]:
    checkpointing = ["enable_activation_checkpointing=True"]
    return {
        "checkpointing": _trace(checkpointing, seq_len=128),
        "offloading": _trace([*checkpointing, "enable_activation_offloading=True"], seq_len=128),
        "offloading, full trace": _trace(
            [*checkpointing, "enable_activation_offloading=True"], seq_len=128, exact=True
        ),
    }


def test_activation_offloading_keeps_less_on_the_device_per_sample(offloading: dict[str, StepTrace]) -> None:
    checkpointing, offloaded = (
        predict(offloading[k], device_memory_bytes=64 * MiB, verify=False) for k in ("checkpointing", "offloading")
    )
    assert offloaded.bytes_per_sample < checkpointing.bytes_per_sample
    assert offloaded.max_micro_batch >= checkpointing.max_micro_batch
    assert checkpointing.host_bytes == 0 and not checkpointing.activation_offloading


def test_offloaded_activations_take_host_memory_that_grows_with_the_micro_batch(
    offloading: dict[str, StepTrace],
) -> None:
    trace = offloading["offloading"]
    host = [trace.host_bytes[m] for m in sorted(trace.host_bytes)]
    assert len(host) >= 2 and all(a < b for a, b in zip(host, host[1:]))
    small, large = (predict(trace, device_memory_bytes=m * MiB, verify=False) for m in (32, 64))
    assert 0 < small.host_bytes < large.host_bytes and large.max_micro_batch > small.max_micro_batch
    assert large.host_bytes_per_sample > 0
    assert "activation offloading:" in large.describe() and "host (pinned) memory" in large.describe()


def test_activation_offloading_is_traced_the_same_both_ways(offloading: dict[str, StepTrace]) -> None:
    fast, full = offloading["offloading"], offloading["offloading, full trace"]
    _same_probes(fast, full)
    assert fast.host_bytes == full.host_bytes


class _CompiledTraces(dict):
    """tiny_lora at 64 tokens, traced when a test first asks: eager, and compiled (with or without activation
    checkpointing) extrapolated or traced in full; one module-wide trace each."""

    CASES = {
        "eager": ([], False),
        "compiled": (["compile=True"], False),
        "compiled, full trace": (["compile=True"], True),
        "checkpointing": (["compile=True", "enable_activation_checkpointing=True"], False),
        "checkpointing, full trace": (["compile=True", "enable_activation_checkpointing=True"], True),
    }

    def __missing__(self, case: str) -> StepTrace:
        extra, exact = self.CASES[case]
        self[case] = _trace(extra, seq_len=64, exact=exact, config="tiny_lora.yaml")
        return self[case]


@pytest.fixture(scope="module")
def compiled_traces() -> dict[str, StepTrace]:
    return _CompiledTraces()


def test_compile_traces_a_compiled_step_that_keeps_less_a_sample(compiled_traces: dict[str, StepTrace]) -> None:
    """Compiled (layers through the min-cut partition, the cross-entropy without a float32 copy of the logits) a
    sample costs less than eager, by more than the logits' float32 copy alone; what each part keeps is checked
    against inductor in ``test_compiled_fake.py``."""
    seq_len, vocab = 64, 1280  # tiny_lora's vocabulary
    eager, compiled = compiled_traces["eager"], compiled_traces["compiled"]
    eager_sample, compiled_sample = (
        predict(t, device_memory_bytes=64 * MiB, verify=False).bytes_per_sample for t in (eager, compiled)
    )
    assert eager_sample - compiled_sample > 4 * seq_len * vocab
    assert (
        compiled.savers.compile
        and "compile: a compiled step" in predict(compiled, device_memory_bytes=64 * MiB, verify=False).describe()
    )
    assert "compile: off" in predict(eager, device_memory_bytes=64 * MiB, verify=False).describe()


@pytest.mark.parametrize("case", ["compiled", "checkpointing"], ids=["plain", "checkpointing"])
def test_a_compiled_step_is_traced_the_same_both_ways(compiled_traces: dict[str, StepTrace], case: str) -> None:
    """Layer extrapolation over partitioned layers gives what tracing every layer gives."""
    _same_probes(compiled_traces[case], compiled_traces[f"{case}, full trace"])


def test_compiled_nf4_dequantization_writes_the_bf16_weight_only() -> None:
    from torchao.dtypes.nf4tensor import to_nf4

    from adaptive_batching.estimate.compiled import fused_nf4_dequantization
    from adaptive_batching.runtime.mem_tracker import FrozenAwareMemTracker

    weight = to_nf4(torch.randn(256, 512, dtype=torch.bfloat16))
    peaks = {}
    for fused in (False, True):
        tracker = FrozenAwareMemTracker()
        with tracker, fused_nf4_dequantization() if fused else _nothing():
            dense = weight.get_original_weight()
        peaks[fused] = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
        assert dense.shape == weight.shape and dense.dtype == torch.bfloat16
    assert peaks[True] == 2 * weight.numel() < peaks[False]
    assert type(weight).get_original_weight.__name__ == "get_original_weight"  # restored
