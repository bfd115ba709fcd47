"""``compile: True``: one graph for every micro batch and sample length (the batch's sizes marked dynamic), and a
profile whose trials neither compile nor recompile.

Dynamo's behaviour (guards, marks, recompiles) does not depend on the backend; these tests use ``aot_eager``
(torchtune reads ``TORCH_COMPILE_BACKEND``), which traces forward and backward as inductor's does, in seconds.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from recipe_runs import run_command
from torch._dynamo.utils import counters
from torchtune import config

from adaptive_batching.config.loading import load_config
from adaptive_batching.core.loss import summed_token_loss
from adaptive_batching.training import compiling


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_tiny(assets: Path) -> tuple[torch.nn.Module, Any]:
    """The tiny Llama and its chunked loss, compiled as ours compiles them."""
    cfg = load_config("tiny_full", [f"assets_dir={assets}"])
    model, loss_fn = config.instantiate(cfg.model), config.instantiate(cfg.loss)
    compiling.compile_model(model, verbose=False)
    loss_fn = compiling.compile_loss(loss_fn, verbose=False)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    return model, loss_fn


def test_one_graph_serves_every_micro_batch_and_length(aot_eager: None, assets: Path) -> None:
    model, loss_fn = _compiled_tiny(assets)
    graphs = []
    for micro_batch, length in [(1, 64), (2, 64), (5, 64), (3, 40), (1, 17)]:
        tokens = torch.randint(0, 100, (micro_batch, length))
        loss, _ = summed_token_loss(model, loss_fn, {"tokens": tokens, "labels": tokens.clone()})
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2] * 5  # the decoder layer (shared by all layers) and the loss's cross-entropy


def test_the_marks_step_aside_once_a_call_with_gradients_has_compiled(aot_eager: None, assets: Path) -> None:
    model, loss_fn = _compiled_tiny(assets)
    marking = loss_fn.compute_cross_entropy

    def step(micro_batch: int) -> None:
        tokens = torch.randint(0, 100, (micro_batch, 48))
        loss, _ = summed_token_loss(model, loss_fn, {"tokens": tokens, "labels": tokens.clone()})
        if loss.requires_grad:
            loss.backward()

    with torch.no_grad():
        step(1)  # a forward without gradients compiles a graph of its own: the marks stay for the next
    assert loss_fn.compute_cross_entropy is marking and model.tok_embeddings._forward_hooks and model._forward_hooks
    step(1)
    assert loss_fn.compute_cross_entropy is not marking  # the compiled function itself: no wrapper, no marks
    assert not model.tok_embeddings._forward_hooks and not model._forward_hooks
    graphs = counters["stats"]["unique_graphs"]
    for micro_batch in (2, 5, 3):
        step(micro_batch)
    assert counters["stats"]["unique_graphs"] == graphs  # unmarked inputs reuse the unbacked graphs


def test_the_micro_batch_is_unbacked_with_the_traced_size_as_its_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a hint inductor cannot size the dimension and fuses less (on CPU, silu and its backward in two kernels
    # instead of one); the size traced is the hint a backed dimension would have had.
    seen: list[tuple[int, object]] = []
    monkeypatch.setattr(
        torch._dynamo.decorators,
        "mark_unbacked",
        lambda t, index, **kwargs: seen.append((index, kwargs.get("hint_override"))),
    )
    compiling._mark(torch.zeros(3, 5, 4))
    assert seen == [(0, 3)]


def test_below_torch_2_12_a_compiled_run_turns_mix_order_reduction_off() -> None:
    # torch 2.11 sizes the fused RMSNorm backward with size_hint, which raises on the unbacked micro batch on CUDA;
    # 2.12 on read its hint_override (training/compiling.py)
    assert compiling.inductor_settings("2.11.0+cu130") == {"triton.mix_order_reduction": False}
    assert compiling.inductor_settings("2.10.0") == {"triton.mix_order_reduction": False}
    for version in ("2.12.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.14.1"):
        assert compiling.inductor_settings(version) == {}


def test_compile_model_sets_inductor_for_the_installed_torch(monkeypatch: pytest.MonkeyPatch, assets: Path) -> None:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.mix_order_reduction": True}):
        _compiled_tiny(assets)
        assert inductor_config.triton.mix_order_reduction  # this torch: unchanged
        monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
        _compiled_tiny(assets)
        assert not inductor_config.triton.mix_order_reduction


def test_this_torch_hints_a_mix_order_reduction_over_the_unbacked_micro_batch() -> None:
    """What the CUDA backward's mix-order reduction reads on the installed torch, traced on the CPU: the rows of a
    marked hidden state (micro batch x length) hold an unbacked symbol, and the split's hint is the traced size.
    Where inductor still reads ``size_hint`` there (before 2.12), the settings turn the fusion off instead."""
    from torch._inductor.codegen.simd import SIMDScheduling
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    source = inspect.getsource(SIMDScheduling._codegen_mix_order_reduction)
    hinted = "sizevars.optimization_hint(numel)" in source
    assert hinted == (compiling.inductor_settings(str(torch.__version__)) == {})
    sizes: list[Any] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        values = [node.meta["example_value"] for node in graph.graph.nodes if node.op == "placeholder"]
        sizes.extend(value.size() for value in values if isinstance(value, torch.Tensor))
        return graph.forward

    torch._dynamo.reset()
    rms_norm = torch.compile(
        lambda x, w: torch.nn.functional.rms_norm(x, (x.size(-1),), w), backend=capture, fullgraph=True
    )
    rms_norm(compiling._mark(torch.randn(3, 5, 8)), torch.randn(8))
    torch._dynamo.reset()
    micro_batch, length, _ = sizes[0]
    rows = (micro_batch * length).node.expr
    assert free_unbacked_symbols(rows)  # what size_hint cannot turn into an int
    if hinted:
        assert SizeVarAllocator(micro_batch.node.shape_env).optimization_hint(rows) == 15


def test_without_the_marks_the_micro_batch_recompiles(aot_eager: None, assets: Path) -> None:
    from torchtune import training

    cfg = load_config("tiny_full", [f"assets_dir={assets}"])
    model, loss_fn = config.instantiate(cfg.model), config.instantiate(cfg.loss)
    training.compile_model(model, verbose=False)  # torchtune's own, as the stock recipes compile
    training.compile_loss(loss_fn, verbose=False)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    for micro_batch in (1, 2, 5):
        tokens = torch.randint(0, 100, (micro_batch, 64))
        loss, _ = summed_token_loss(model, loss_fn, {"tokens": tokens, "labels": tokens.clone()})
        loss.backward()
    assert counters["stats"]["unique_graphs"] > 2


# ``tune ARGV...`` with dynamo's recompile log on: torch reads TORCH_LOGS when it is imported, and the suite's fork
# server has imported it, so the run turns the log on itself before the recipe starts.
TUNE_LOGGING_RECOMPILES = """
import sys
import torch._logging
from torchtune._cli.tune import main

torch._logging.set_logs(recompiles=True)
sys.argv = ["tune", *sys.argv[1:]]
main()
"""


@pytest.mark.e2e
def test_a_compiled_run_compiles_once_before_its_trials_and_never_again(tmp_path: Path, assets: Path) -> None:
    (tmp_path / "tune_logging_recompiles.py").write_text(TUNE_LOGGING_RECOMPILES)
    result = run_command(
        "script",
        [
            str(tmp_path / "tune_logging_recompiles.py"),
            "run",
            "adaptive_full_finetune",
            "--config",
            "tiny_full",
            f"assets_dir={assets}",
            f"output_dir={tmp_path / 'run'}",
            "compile=True",
            "epochs=2",
            "max_steps_per_epoch=2",
            "adaptive_batching.memory_budget=128MiB",  # about 23 samples, not 98
            f"adaptive_batching.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        env=dict(os.environ, TORCH_COMPILE_BACKEND="aot_eager"),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Profiler: compiled in" in output and "compiled before them in" in output
    steps = int(re.search(r"(\d+) trial steps in", output)[1])
    assert steps <= 8
    assert "Recompiling function" not in output  # over the profile, training and the epoch switch
    assert "Epoch switch 1 -> 2" in output
    fit = re.search(r"fit: peak = (-?[\d.]+) GiB", output)
    assert fit is not None and float(fit[1]) >= 0  # no negative intercept from a compile inside a probe
