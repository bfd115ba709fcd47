"""``optimizer_in_bwd: True``: one optimizer per parameter, stepped inside the backward, as torchtune's
single-device configs ask; with torch's AdamW and bitsandbytes' 8-bit and paged optimizers (on CPU)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from config_edits import modified
from omegaconf import DictConfig
from torch import nn

from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.config.settings import validate_config
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.growth.plan import starting_batch
from adaptive_batching.profiling.max_micro_batch import preserved_training_state
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.optimizers import AfterBackward, InBackward, InBackwardOptimizer, gradients_for

bnb = pytest.importorskip("bitsandbytes")
BUILDS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    # min_8bit_size 16: every parameter of the small model keeps 8-bit state, as a real model's large ones do
    "PagedAdamW8bit": lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-2, min_8bit_size=16),
    "PagedAdamW": lambda params: bnb.optim.PagedAdamW(params, lr=1e-2),
}
ONE_RANK = ParallelInfo(world_size=1, rank=0, local_rank=0)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(80, 64), nn.GELU(), nn.Linear(64, 48)).to(torch.bfloat16)


def tensors(state: dict[str, Any]) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (index, key): value
        for index, entry in state["state"].items()
        for key, value in entry.items()
        if torch.is_tensor(value)
    }


def in_backward(model: nn.Module, build: Callable) -> InBackwardOptimizer:
    optimizer = InBackwardOptimizer(model.parameters(), build)
    optimizer.register_hooks()
    return optimizer


BATCH = torch.randn(8, 80, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def loss_of(model: nn.Module) -> torch.Tensor:
    return model(BATCH).float().pow(2).mean()


@pytest.mark.parametrize("name", BUILDS)
def test_stepping_in_the_backward_equals_stepping_after_it(name: str) -> None:
    after, inside = small_model(), small_model()
    reference = BUILDS[name](list(after.parameters()))
    optimizer = in_backward(inside, BUILDS[name])
    for _ in range(3):
        loss_of(after).backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in inside.parameters()]
        loss_of(inside).backward()  # every parameter stepped by its hook, and its gradient freed
        assert all(p.grad is None and not torch.equal(p, b) for p, b in zip(inside.parameters(), before))
    assert all(torch.equal(a, b) for a, b in zip(after.parameters(), inside.parameters()))
    assert len(optimizer.state) == len(reference.state) == 4


@pytest.mark.parametrize("name", BUILDS)
def test_the_state_dict_round_trips_bit_for_bit_with_its_dtypes(name: str) -> None:
    model = small_model()
    optimizer = in_backward(model, BUILDS[name])
    loss_of(model).backward()
    saved = copy.deepcopy(optimizer.state_dict())
    assert len(saved["param_groups"]) == 4  # one per parameter
    other = in_backward(small_model(), BUILDS[name])
    other.load_state_dict(copy.deepcopy(saved))
    loaded = tensors(other.state_dict())
    for key, value in tensors(saved).items():  # 8-bit moments stay uint8, their scales float32 (params: bf16)
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
    assert all(o.state is other.state for o in other.optimizers)  # the parts step the loaded state


def test_an_lr_set_on_it_reaches_every_parameters_optimizer() -> None:
    optimizer = in_backward(small_model(), BUILDS["PagedAdamW8bit"])
    for group in optimizer.param_groups:
        group["lr"] = 0.25
    assert [o.param_groups[0]["lr"] for o in optimizer.optimizers] == [0.25] * 4


def test_a_state_saved_without_it_is_refused_in_one_line() -> None:
    model = small_model()
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError,
        match=r"1 param group\(s\); with optimizer_in_bwd=True there is one per trainable "
        r"parameter \(4\)",
    ):
        in_backward(model, BUILDS["AdamW"]).load_state_dict(plain.state_dict())


@pytest.mark.parametrize("name", ["AdamW", "PagedAdamW8bit"])
def test_the_profilers_snapshot_undoes_steps_taken_inside_the_backward(name: str) -> None:
    model = small_model()
    optimizer = in_backward(model, BUILDS[name])
    loss_of(model).backward()  # the state exists, as after the first trial or a resume
    weights, state = [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())
    with preserved_training_state(model, optimizer):
        for _ in range(2):
            loss_of(model).backward()
        assert not torch.equal(next(model.parameters()), weights[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    restored = tensors(optimizer.state_dict())
    assert all(torch.equal(restored[key], value) for key, value in tensors(state).items())


def test_step_steps_only_parameters_whose_gradient_is_still_there() -> None:
    model = small_model()
    optimizer = InBackwardOptimizer(model.parameters(), BUILDS["AdamW"])  # no hooks: gradients stay
    loss_of(model).backward()
    first = next(model.parameters())
    first.grad = None
    before = first.detach().clone()
    optimizer.step()
    assert torch.equal(first, before) and len(optimizer.state) == 3


def test_the_loss_is_divided_by_the_steps_tokens_before_the_backward_that_steps() -> None:
    # SGD at lr 1: the step is minus the gradient, so the update shows the normalisation.
    model, reference = nn.Linear(3, 1, bias=False), nn.Linear(3, 1, bias=False)
    reference.load_state_dict(model.state_dict())
    optimizer = in_backward(model, lambda params: torch.optim.SGD(params, lr=1.0))
    gradients = gradients_for(optimizer, StepGuard(ONE_RANK, torch.device("cpu")), ONE_RANK)
    assert isinstance(gradients, InBackward) and not gradients.retries_out_of_memory
    x, tokens = torch.randn(4, 3), torch.tensor(4)
    gradients.backward(model(x).sum(), tokens)
    reference(x).sum().backward()
    assert torch.allclose(model.weight, reference.weight.detach() - reference.weight.grad / 4)
    step_tokens = torch.tensor(0)
    gradients.normalise(model, step_tokens)
    assert int(step_tokens) == 4
    plain = gradients_for(
        torch.optim.SGD(reference.parameters(), lr=1.0), StepGuard(ONE_RANK, torch.device("cpu")), ONE_RANK
    )
    assert isinstance(plain, AfterBackward) and plain.retries_out_of_memory


# ---------------------------------------------------------------- what does not go with it
IN_BWD = {
    "optimizer_in_bwd": True,
    "gradient_accumulation_steps": 1,
    "clip_grad_norm": None,
    "adaptive_batching.grow_past_memory": "skip",
}


@pytest.mark.parametrize(
    "updates, names",
    [
        ({"gradient_accumulation_steps": 2}, ("'optimizer_in_bwd' = True", "gradient_accumulation_steps=1")),
        ({"clip_grad_norm": 1.0}, ("'optimizer_in_bwd' = True", "clip_grad_norm=null")),
        (
            {"adaptive_batching.grow_past_memory": "accumulate"},
            ("'adaptive_batching.grow_past_memory' = 'accumulate'", "'optimizer_in_bwd' = True"),
        ),
        ({"adaptive_batching.max_tokens": 512}, ("'adaptive_batching.max_tokens' = 512", "'optimizer_in_bwd' = True")),
        (
            {
                "batch_increase_function": None,
                "adaptive_batching.elastic": {"max_global_batch": 64, "micro_batches": [8, 16], "max_ranks": 2},
            },
            ("'adaptive_batching.elastic'", "'optimizer_in_bwd' = True"),
        ),
        ({"optimizer_in_bwd": "yes"}, ("'optimizer_in_bwd' = 'yes' is invalid", "true, false or null")),
    ],
)
def test_what_needs_accumulation_or_clipping_is_refused_in_one_line_naming_both_keys(
    base_cfg: DictConfig, updates: dict, names: tuple
) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(modified(base_cfg, {**IN_BWD, **updates}))
    message = str(error.value)
    assert "\n" not in message and all(name in message for name in names)


def test_the_config_validates_with_it_and_says_so(base_cfg: DictConfig) -> None:
    assert validate_config(modified(base_cfg, IN_BWD)).optimizer_in_bwd
    assert not validate_config(base_cfg).optimizer_in_bwd


@pytest.mark.parametrize(
    "updates, says",
    [
        ({"device": "cpu", "enable_activation_checkpointing": True}, "needs device=cuda"),
        ({"device": "cuda", "enable_activation_checkpointing": False}, "needs enable_activation_checkpointing=True"),
    ],
)
def test_activation_offloading_is_refused_as_torchtune_refuses_it(
    base_cfg: DictConfig, updates: dict, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        validate_config(modified(base_cfg, {"enable_activation_offloading": True, **updates}))


def test_keep_global_batch_that_needs_accumulation_names_both_keys(base_cfg: DictConfig) -> None:
    settings = validate_config(
        modified(
            base_cfg,
            {
                **IN_BWD,
                "use_maximum_batch_size": True,
                "batch_increase_function": None,
                "adaptive_batching.keep_global_batch": True,
            },
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"keep_global_batch' = True and 'optimizer_in_bwd' = True: the config's "
        r"global batch 32 needs 32 samples per forward .* above the profiled micro "
        r"batch 20",
    ):
        starting_batch(
            settings.growth,
            None,
            BatchShape(32, 1, 1),
            1,
            20,
            use_maximum_batch_size=True,
            optimizer_in_bwd=settings.optimizer_in_bwd,
        )
    start = starting_batch(
        settings.growth,
        None,
        BatchShape(16, 1, 1),
        1,
        20,
        use_maximum_batch_size=True,
        optimizer_in_bwd=settings.optimizer_in_bwd,
    )
    assert (start.micro_batch, start.accumulation) == (16, 1)


def test_an_optimizer_from_a_package_not_installed_names_the_pip_install(
    base_cfg: DictConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ConfigError) as error:
        validate_config(modified(base_cfg, {"optimizer._component_": "bitsandbytes.optim.PagedAdamW8bit"}))
    assert str(error.value) == (
        "config key 'optimizer._component_' = 'bitsandbytes.optim.PagedAdamW8bit' needs "
        'bitsandbytes, which is not installed: pip install "adaptive-batching[bnb]"'
    )


def test_every_forward_runs_inside_the_activations_context_and_the_loss_outside_it() -> None:
    from adaptive_batching.training.stepping import StepRunner

    entered: list[str] = []

    class Recording:
        def __enter__(self) -> None:
            entered.append("enter")

        def __exit__(self, *exc: object) -> None:
            entered.append("exit")

    class Loss(nn.Module):
        ignore_index = -100

        def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            entered.append("loss")
            return nn.functional.cross_entropy(logits, labels, ignore_index=self.ignore_index)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 10)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            entered.append("forward")
            return self.embed(tokens)

    model = Model()
    runner = StepRunner(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Loss(),
        StepGuard(ONE_RANK, torch.device("cpu")),
        ONE_RANK,
        torch.device("cpu"),
        clip_grad_norm=None,
        oom_recovery=True,
        where=lambda: (1, None, "."),
        activations=Recording(),
    )
    tokens = torch.randint(0, 10, (2, 5))
    runner.forward_backward({"tokens": tokens, "labels": tokens.clone()})
    assert entered == ["enter", "forward", "exit", "loss"]
