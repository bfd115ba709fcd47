"""DPO of LoRA adapters (issue 37): the objective's collate and step, the recipe's config checks, the tiny
preference data, and the same losses and rewards as torchtune's ``lora_dpo_single_device`` step for step."""

from __future__ import annotations

import json
import re
import statistics
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from config_edits import CONFIGS, TINY_CHECKPOINTER_KEYS, TINY_NODES
from doc_figures import agrees, overrides, page_text, profiled, quoted
from omegaconf import OmegaConf
from recipe_runs import check, read_metrics, run_command
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.models.llama3 import lora_llama3
from torchtune.rlhf.loss import DPOLoss

from adaptive_batching.config.loading import load_config
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import check_lora_dpo, recipe_for_model
from adaptive_batching.core.objective import sample_length
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.objectives import LoRADPO, PairCollate

HERE = Path(__file__).parent
STOCK_DPO = ("llama2/7B_lora_dpo_single_device", "llama3_1/8B_lora_dpo_single_device")


def _pair(chosen: list[int], rejected: list[int]) -> dict[str, list[int]]:
    return {
        "chosen_input_ids": chosen,
        "chosen_labels": chosen,
        "rejected_input_ids": rejected,
        "rejected_labels": rejected,
    }


def test_pair_collate_keeps_each_pair_in_a_row_and_gives_back_torchtunes_batch() -> None:
    samples = [_pair([1, 2, 3], [4, 5]), _pair([6, 7], [8, 9, 10, 11])]
    batch = PairCollate(pad_id=0)(samples)
    tokens, labels = padded_collate_dpo(samples, padding_idx=0, ignore_idx=CROSS_ENTROPY_IGNORE_IDX)
    assert batch["tokens"].shape == (2, 2, 4)  # pairs, chosen/rejected, the longest of the four
    assert batch["tokens"][1].tolist() == [[6, 7, 0, 0], [8, 9, 10, 11]]
    assert torch.equal(batch["tokens"].transpose(0, 1).reshape(4, 4), tokens)
    assert torch.equal(batch["labels"].transpose(0, 1).reshape(4, 4), labels)
    assert sample_length(samples[1]) == 4 and sample_length({"tokens": [1, 2]}) == 2
    empty = PairCollate(pad_id=0)([])
    assert empty["tokens"].shape == (1, 2, 1) and (empty["labels"] == CROSS_ENTROPY_IGNORE_IDX).all()


def _tiny_lora() -> torch.nn.Module:
    torch.manual_seed(0)
    model = lora_llama3(
        lora_attn_modules=["q_proj", "v_proj"],
        vocab_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        max_seq_len=16,
        intermediate_dim=32,
        lora_rank=2,
        lora_alpha=4,
    )
    for name, param in model.named_parameters():  # adapters away from zero: the policy differs from the reference
        if "lora_b" in name:
            torch.nn.init.normal_(param, std=0.5)
    return model


def test_the_dpo_step_sums_torchtunes_loss_over_pairs_and_an_empty_pair_counts_nothing() -> None:
    model, loss_fn, objective = _tiny_lora(), DPOLoss(beta=0.1), LoRADPO()
    collate = PairCollate(pad_id=0)
    samples = [_pair([1, 2, 3, 4], [5, 6]), _pair([7, 8], [9, 10, 11])]
    loss, pairs = objective.micro_loss(model, loss_fn, collate(samples), torch.enable_grad())
    assert pairs == 2 and loss.requires_grad
    chosen, _rejected = objective.last["log_probs/chosen"], objective.last["log_probs/rejected"]
    assert chosen.item() != 0 and objective.last["rewards/margins"].item() != 0  # adapters on vs off differ
    from torchtune import rlhf
    from torchtune.modules.peft import disable_adapter

    tokens, labels = padded_collate_dpo(samples)
    log_probs = rlhf.get_batch_log_probs(model(tokens), labels)
    with torch.no_grad(), disable_adapter(model):
        reference = rlhf.get_batch_log_probs(model(tokens), labels)
    expected, _, _ = loss_fn(log_probs[:2], log_probs[2:], reference[:2], reference[2:])
    assert torch.equal(loss.detach() / 2, expected.mean().detach())
    empty_loss, empty_pairs = objective.micro_loss(model, loss_fn, collate([]), torch.enable_grad())
    assert empty_pairs == 0 and empty_loss.item() == 0


def test_the_dpo_worst_case_is_full_length_pairs_whose_every_label_counts() -> None:
    objective = LoRADPO()
    batch = objective.worst_case_batch(PairCollate(pad_id=0), micro_batch=3, seq_len=7, vocab_size=32, packed=False)
    assert batch["tokens"].shape == (3, 2, 7) and (batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).all()


@pytest.mark.parametrize("name", STOCK_DPO)
def test_the_stock_lora_dpo_configs_validate_by_name_for_adaptive_lora_dpo(name: str) -> None:
    cfg = load_config(name, ["use_maximum_batch_size=True"])
    assert recipe_for_model(cfg) == "adaptive_lora_dpo"
    assert validate_config(cfg, "adaptive_lora_dpo").use_maximum_batch_size
    check_lora_dpo(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "dataset.packed=True",
            "config key 'dataset.packed' = True: packing does not apply to DPO, whose chosen and "
            "rejected answers are two sequences padded to each other; set it to False",
        ),
        (
            "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss",
            "config key 'loss._component_' = 'torchtune.modules.loss.CEWithChunkedOutputLoss': adaptive_lora_dpo "
            "trains with torchtune.rlhf.loss.DPOLoss or torchtune.rlhf.loss.RSOLoss",
        ),
    ],
)
def test_what_cannot_apply_to_dpo_is_refused_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_lora_dpo(load_config("tiny_lora_dpo", [override]))
    assert str(error.value) == message


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, line",
    [
        ("dataset.packed=True", "config error: config key 'dataset.packed' = True: packing does not apply to DPO"),
        (
            "adaptive_batching.growth_interval=3 steps",
            "config error: config key 'adaptive_batching.growth_interval' = "
            "'3 steps' says when the batch grows, but batch_increase_function is "
            "null: set one, or remove the key",
        ),
    ],
)
def test_the_recipe_stops_on_a_bad_key_in_one_line_before_any_model_loads(
    override: str, line: str, assets: Path, tmp_path: Path
) -> None:
    from recipe_runs import tune_run

    result = tune_run(
        "adaptive_lora_dpo", "tiny_lora_dpo", [f"assets_dir={assets}", f"output_dir={tmp_path}", override], cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr[-3000:]
    (said,) = (result.stdout + result.stderr).strip().splitlines()  # one line: nothing was set up before it
    assert said.startswith(line)


def test_a_full_dpo_config_is_refused_by_adaptive_lora_dpo() -> None:
    with pytest.raises(ConfigError, match="has no LoRA adapters; adaptive_lora_dpo's reference model is the policy"):
        check_lora_dpo(load_config("llama3_1/8B_full_dpo"))


def test_the_tiny_preference_pairs_have_a_long_tail_of_lengths(assets: Path) -> None:
    pairs = json.loads((assets / "data" / "preference_tiny.json").read_text())
    assert len(pairs) == len(json.loads((assets / "data" / "alpaca_tiny.json").read_text()))
    words = sorted(max(len(p[side][1]["content"].split()) for side in ("chosen", "rejected")) for p in pairs)
    assert all(p["chosen"][0] == p["rejected"][0] and p["chosen"][0]["role"] == "user" for p in pairs)
    assert words[-1] > 8 * statistics.median(words)  # a few pairs far longer than the typical one


STEPS = 4
EXACT = (
    "loss",
    "lr",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "log_probs/chosen",
    "log_probs/rejected",
    "logits/chosen",
    "logits/rejected",
)


@pytest.fixture(scope="module")
def dpo_runs(assets: Path, runs: Path) -> dict[str, list[dict[str, float]]]:
    """torchtune's lora_dpo_single_device and ours on the tiny pairs, the same config and batch (4 pairs x 2
    micro batches), through dpo_parity_run.py (the adapters' first values from one generator, every metric
    logged in full)."""
    metrics = {}
    for recipe in ("lora_dpo_single_device", "adaptive_lora_dpo"):
        out = runs / f"parity_{recipe}"  # not the recipe's name: a folder in the cwd would shadow its module
        result = run_command(
            "script",
            [
                str(HERE / "dpo_parity_run.py"),
                recipe,
                "--config",
                str(HERE.parent / "configs" / "tiny_lora_dpo.yaml"),
                f"assets_dir={assets}",
                f"output_dir={out}",
                "epochs=1",
                f"max_steps_per_epoch={STEPS}",
                "shuffle=False",
                "lr_scheduler.num_warmup_steps=0",
                "metric_logger._component_=dpo_parity_run.ExactDiskLogger",
            ],
            cwd=runs,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[recipe] = read_metrics(out / "logs")
    return metrics


@pytest.mark.e2e
def test_adaptive_lora_dpo_logs_stocks_loss_and_rewards_bit_for_bit(dpo_runs: dict) -> None:
    stock, ours = dpo_runs["lora_dpo_single_device"], dpo_runs["adaptive_lora_dpo"]
    assert len(stock) == len(ours) == STEPS
    assert ours[-1]["rewards/margins"] != 0 and ours[-1]["loss"] != ours[0]["loss"]  # the adapters trained
    for step_stock, step_ours in zip(stock, ours):
        assert {key: step_ours[key] for key in EXACT} == {key: step_stock[key] for key in EXACT}


def test_the_worst_case_of_preference_data_is_its_longest_pair() -> None:
    from adaptive_batching.batching.sequence_lengths import sequence_lengths

    pairs = [_pair([1] * 5, [2] * 9), _pair([3] * 12, [4] * 2), _pair([5] * 3, [6] * 3)]
    assert sequence_lengths(pairs, cache_dir=None, key_parts={}) == [9, 12, 3]


def test_a_token_budget_counts_a_pairs_two_sequences_at_the_longer_ones_length() -> None:
    """Each micro batch the budget cuts, collated as training collates it, holds exactly the padded tokens the budget
    counted (chosen and rejected, both padded to the longest sequence), and no more than the budget; the check of
    the budget on the shortest pairs runs pairs of the shortest pair's sequence length."""
    from adaptive_batching.batching.policy import DataContext, TokenBatching
    from adaptive_batching.batching.settings import BatchingSettings
    from adaptive_batching.batching.shape import BatchShape, EpochBatch
    from adaptive_batching.batching.token_sampler import padded_tokens
    from adaptive_batching.batching.worst_case import LengthSource
    from adaptive_batching.core.steps import StepMemory
    from adaptive_batching.runtime.distributed import ParallelInfo

    check_lora_dpo(load_config("tiny_lora_dpo", ["adaptive_batching.max_tokens=2048"]))  # accepted
    pairs = [
        _pair([1] * 5, [2] * 9),
        _pair([3] * 12, [4] * 2),
        _pair([5] * 3, [6] * 3),
        _pair([7] * 4, [8] * 6),
        _pair([9] * 2, [1] * 2),
    ]
    collate = PairCollate(pad_id=0)
    policy = TokenBatching(BatchingSettings(max_tokens=50))
    policy.prepare(
        DataContext(
            pairs,
            collate,
            ParallelInfo(),
            shuffle=False,
            seed=0,
            max_steps=None,
            sequences_per_sample=LoRADPO.sequences_per_sample,
        ),
        LengthSource(dataset={}, tokenizer={}, data_files=(), max_seq_len=None, cache_dir=None),
        profiles=False,
    )
    assert policy.lengths == [18, 24, 6, 12, 4]
    trials: list[tuple[int, int]] = []

    @contextmanager
    def verify():  # type: ignore[no-untyped-def]
        yield lambda samples, seq_len: trials.append((samples, seq_len)) or StepMemory(0, 0, 0, 0)

    shape = BatchShape(micro_batch=2, accumulation=1, ranks=1)
    policy.use_plan(
        [EpochBatch(epoch=0, requested=2, increment=0, shape=shape, reason="start")], start=2, profiled=2, verify=verify
    )
    assert policy.budgets == [48]  # min(50, the profiled 2 pairs x 2 x the longest sequence's 12 tokens)
    assert trials == [(12, 2)]  # 48 tokens: 12 pairs of the shortest pair's 2-token sequences
    micro_batches = list(policy.loader(0, split=1, start_step=0).batch_sampler)
    assert sorted(i for micro in micro_batches for i in micro) == list(range(5)) and len(micro_batches) > 1
    for micro in micro_batches:
        tokens = collate([pairs[i] for i in micro])["tokens"]
        assert tokens.numel() == padded_tokens(policy.lengths, micro) <= 48, micro


def test_the_profilers_dpo_trial_step_runs_both_forwards_the_loss_the_backward_and_the_optimizer() -> None:
    """Two forwards of 2 x micro batch full-length sequences: the reference's first (adapters off, no autograd, its
    logits freed before the policy's activations are held), then the policy's (adapters on, saving for the
    backward); then the backward and the optimizer step move the adapters."""
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from adaptive_batching.faults.guard import StepGuard
    from adaptive_batching.runtime.distributed import ParallelInfo
    from adaptive_batching.training.stepping import StepRunner

    model, one_rank, cpu = _tiny_lora(), ParallelInfo(world_size=1, rank=0, local_rank=0), torch.device("cpu")
    set_trainable_params(model, get_adapter_params(model))
    adapters = {name: param.detach().clone() for name, param in get_adapter_params(model).items()}
    forwards: list[tuple[tuple[int, ...], bool, bool]] = []
    attention = model.layers[0].attn.q_proj
    model.register_forward_pre_hook(
        lambda module, args: forwards.append((tuple(args[0].shape), attention.disabled, torch.is_grad_enabled()))
    )
    runner = StepRunner(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        DPOLoss(),
        StepGuard(one_rank, cpu),
        one_rank,
        cpu,
        clip_grad_norm=None,
        oom_recovery=True,
        where=lambda: (1, None, "."),
        objective=LoRADPO(),
    )
    measured = runner.trial_step(
        3, seq_len=8, accumulation=1, collate=PairCollate(pad_id=0), vocab_size=32, packed=False
    )
    assert forwards == [((6, 8), True, False), ((6, 8), False, True)]
    assert measured.forward_backward_peak > 0  # what a trial measures: the e2e profiled run below fits it
    moved = [name for name, param in get_adapter_params(model).items() if not torch.equal(param, adapters[name])]
    assert any("lora_a" in name for name in moved) and any("lora_b" in name for name in moved)


# docs/dpo.md's figures: each `adaptive-batching profile --config C OVERRIDES` it names, what that prints per pair
# and the pairs it chooses (tests/doc_figures.py).
DPO_FIGURE = (
    r"`adaptive-batching profile --config (tiny_(?:lora|full)_dpo) ([^`]*)` fits about ([\d.]+) MiB per "
    r"pair of (\d+) tokens and chooses (\d+) pairs"
)


@pytest.fixture(scope="module")
def dpo_figures(assets: Path, runs: Path) -> dict[str, tuple[re.Match, str]]:
    """Each command docs/dpo.md quotes a figure of, as written there (in a folder of its own, the tiny assets of
    the suite); one cache, which the profiled run below reads."""
    found = {}
    for quote in quoted("dpo.md", DPO_FIGURE):
        config = quote[1]
        result = check(
            run_command(
                "cli",
                [
                    "profile",
                    "--config",
                    config,
                    *overrides(quote[2]),
                    f"assets_dir={assets}",
                    f"output_dir={runs / config}",
                    f"adaptive_batching.cache_dir={runs / 'cache'}",
                ],
                cwd=runs,
            )
        )
        found[config] = (quote, result.stdout + result.stderr)
    return found


@pytest.mark.e2e
def test_the_dpo_pages_profile_figures_are_what_its_commands_print(dpo_figures: dict) -> None:
    """Per pair and pairs chosen, for LoRA and full DPO, within tests/doc_figures.py's CPU tolerance; the pages'
    pairs are of the length the command measured."""
    assert sorted(dpo_figures) == ["tiny_full_dpo", "tiny_lora_dpo"]
    for config, (quote, output) in dpo_figures.items():
        run = profiled(output)
        assert f"samples of {quote[4]} tokens" in output, config
        assert agrees(float(quote[3]), run.per_sample_mib), (config, quote[0], run)
        assert agrees(int(quote[5]), run.chosen, samples=True), (config, quote[0], run)
    text = page_text("dpo.md")  # the full DPO sentence repeats LoRA's figures: the same as its section's
    lora = dpo_figures["tiny_lora_dpo"][0]
    assert f"against {lora[3]} MiB and {lora[5]} pairs with LoRA" in text


@pytest.mark.e2e
def test_a_profiled_dpo_run_trains_at_the_largest_micro_batch_of_pairs_that_fits(
    dpo_figures: dict, assets: Path, runs: Path
) -> None:
    """The profiler's trial steps are DPO steps on pairs as long as the data's longest (here cut at
    tokenizer.max_seq_len); the run trains at the micro batch it chose. The run reads the profile the page's
    command cached (the same set-up)."""
    from recipe_runs import tune_run

    out = runs / "profiled"
    quote, _ = dpo_figures["tiny_lora_dpo"]
    result = tune_run(
        "adaptive_lora_dpo",
        "tiny_lora_dpo",
        [
            f"assets_dir={assets}",
            f"output_dir={out}",
            "use_maximum_batch_size=True",
            *overrides(quote[2]),
            f"adaptive_batching.cache_dir={runs / 'cache'}",
            "epochs=1",
            "max_steps_per_epoch=1",
        ],
        cwd=runs,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = profiled(result.stderr)
    assert run.cached and 1 < run.chosen <= run.largest < 32, result.stderr[-3000:]
    measured = profiled(dpo_figures["tiny_lora_dpo"][1])
    assert (run.per_sample_mib, run.chosen) == (measured.per_sample_mib, measured.chosen)
    assert f"samples of {quote[4]} tokens" in result.stderr
    step = read_metrics(out / "logs")[0]
    assert step["micro_batch_size"] == run.chosen and "rewards/margins" in step


# adaptive-batching's command line, printing the shape of each DPO micro batch it runs: what a profile's trials ran on.
PROFILE_SHOWING_DPO_STEPS = """
import sys
from adaptive_batching.cli import main
from adaptive_batching.training.objectives import LoRADPO

step = LoRADPO.micro_loss

def micro_loss(self, model, loss_fn, batch, activations):
    print("DPO micro batch", tuple(batch["tokens"].shape), flush=True)
    return step(self, model, loss_fn, batch, activations)

LoRADPO.micro_loss = micro_loss
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_a_tune_cp_copy_of_a_stock_dpo_config_profiles_dpo_steps_with_one_override(
    assets: Path, tmp_path: Path
) -> None:
    """``tune cp llama3_1/8B_lora_dpo_single_device X.yaml``, the copy pointed at the tiny model, tokenizer and pairs
    (every other key as torchtune ships it: bf16, activation checkpointing, batch 4 x 8), then ``adaptive-batching
    profile --config X.yaml use_maximum_batch_size=True``: each trial step is a DPO step on pairs of the data's
    longest length."""
    copy = tmp_path / "X.yaml"
    copied = run_command("tune", ["cp", "llama3_1/8B_lora_dpo_single_device", str(copy)], cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr[-3000:]
    cfg, ours = OmegaConf.load(copy), OmegaConf.load(CONFIGS / "tiny_lora_dpo.yaml")
    assert cfg.model._component_ == "torchtune.models.llama3_1.lora_llama3_1_8b"
    assert cfg.gradient_accumulation_steps == 8 and cfg.enable_activation_checkpointing
    for node in TINY_NODES:
        cfg[node] = ours[node]
    for key in TINY_CHECKPOINTER_KEYS:
        cfg.checkpointer[key] = OmegaConf.to_container(ours.checkpointer, resolve=False)[key]
    cfg.assets_dir, cfg.output_dir, cfg.device = str(assets), str(tmp_path / "out"), "cpu"
    OmegaConf.save(cfg, copy)
    script = tmp_path / "profile_showing_dpo_steps.py"
    script.write_text(PROFILE_SHOWING_DPO_STEPS)
    result = run_command(
        "script",
        [
            str(script),
            "profile",
            "--config",
            str(copy),
            "use_maximum_batch_size=True",
            "adaptive_batching.memory_budget=24MiB",
            "tokenizer.max_seq_len=64",
            f"adaptive_batching.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "profile" / "profile.json").read_text())
    shapes = {
        (int(pairs), int(length)) for pairs, length in re.findall(r"DPO micro batch \((\d+), 2, (\d+)\)", result.stdout)
    }
    assert report["seq_len"] == 64 and report["micro_batch"] >= 1
    assert shapes == {(trial["micro_batch"], 64) for trial in report["trials"]}
