"""DPO of the whole model (issue 37): ``adaptive_full_dpo``'s config checks, its frozen reference model, the profile
counting the reference's weights, the same losses and rewards as a step built by hand from torchtune's parts, an
exact resume inside an epoch, and two ranks with the reference sharded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from recipe_runs import check, read_metrics, run_command, tune_run
from test_first_hour import warning_lines
from torchtune.models.llama3 import llama3
from torchtune.rlhf.loss import DPOLoss

from adaptive_batching.config.loading import load_config
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.training_kinds import check_full_dpo, check_lora_dpo, recipe_for_model
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.objectives import FullDPO, LoRADPO, PairCollate
from adaptive_batching.training.recipe_table import method_and_objective

HERE = Path(__file__).parent
CONFIG = HERE.parent / "configs" / "tiny_full_dpo.yaml"


def test_the_stock_full_dpo_config_validates_by_name_for_adaptive_full_dpo() -> None:
    cfg = load_config("llama3_1/8B_full_dpo", ["use_maximum_batch_size=True"])
    assert recipe_for_model(cfg) == "adaptive_full_dpo"
    assert validate_config(cfg, "adaptive_full_dpo").use_maximum_batch_size
    check_full_dpo(cfg)
    assert isinstance(method_and_objective(cfg, profiled=True)[1], FullDPO)
    assert type(method_and_objective(load_config("tiny_lora_dpo"), profiled=True)[1]) is LoRADPO


def test_tune_cp_copies_the_stock_config_and_ours_names_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptive_batching.cli import main

    result = run_command("tune", ["cp", "llama3_1/8B_full_dpo", "mine.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert recipe_for_model(OmegaConf.load(tmp_path / "mine.yaml")) == "adaptive_full_dpo"
    monkeypatch.chdir(tmp_path)
    assert main(["cp", "llama3_1/8B_full_dpo", "ours.yaml"]) == 0
    assert "Run it with: tune run adaptive_full_dpo --config ours.yaml" in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, override, message",
    [
        (
            "tiny_lora_dpo",
            None,
            "config key 'model._component_' = 'torchtune.models.llama3.lora_llama3' is a LoRA model, "
            "whose reference is the policy with its adapters off; use adaptive_lora_dpo",
        ),
        (
            "tiny_full_dpo",
            "ref_checkpointer=null",
            "config key 'ref_checkpointer' is missing: adaptive_full_dpo loads its "
            "reference model, a frozen copy of 'model', with it (a checkpointer such as "
            "torchtune.training.FullModelHFCheckpointer pointing at the original weights)",
        ),
        (
            "tiny_full_dpo",
            "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss",
            "config key 'loss._component_' = 'torchtune.modules.loss.CEWithChunkedOutputLoss': adaptive_full_dpo "
            "trains with torchtune.rlhf.loss.DPOLoss or torchtune.rlhf.loss.RSOLoss",
        ),
        (
            "tiny_full_dpo",
            "dataset.packed=True",
            "config key 'dataset.packed' = True: packing does not apply to DPO, whose "
            "chosen and rejected answers are two sequences padded to each other; set it to False",
        ),
    ],
)
def test_what_adaptive_full_dpo_cannot_train_is_refused_in_one_line(
    config: str, override: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        check_full_dpo(load_config(config, [override] if override else []))
    assert str(error.value) == message


def test_the_other_recipes_name_adaptive_full_dpo_for_a_full_dpo_config() -> None:
    cfg = load_config("tiny_full_dpo")
    with pytest.raises(
        ConfigError, match=r"has no LoRA adapters; .* use adaptive_full_dpo for DPO of the whole model$"
    ):
        check_lora_dpo(cfg)
    with pytest.raises(ConfigError, match=r"which adaptive_full_finetune does not do; use adaptive_full_dpo$"):
        validate_config(cfg, "adaptive_full_finetune")


def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llama3(
        vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=16, intermediate_dim=32
    )


def test_the_frozen_reference_is_the_checkpoints_copy_without_gradients_and_the_trials_count_it(assets: Path) -> None:
    """build_components gives the objective its reference: the ref_checkpointer's weights, frozen, eval mode,
    not in the optimizer. A profiler's trial step counts its weights among the step's long-lived tensors."""
    from torchtune import training

    from adaptive_batching.faults.guard import StepGuard
    from adaptive_batching.runtime import memory
    from adaptive_batching.runtime.distributed import ParallelInfo
    from adaptive_batching.training.components import build_components, build_data
    from adaptive_batching.training.methods import FullFinetune
    from adaptive_batching.training.stepping import StepRunner

    cfg = load_config("tiny_full_dpo", [f"assets_dir={assets}"])
    one_rank, cpu = ParallelInfo(world_size=1, rank=0, local_rank=0), torch.device("cpu")
    objective = FullDPO()
    checkpoint = {training.MODEL_KEY: {k: v + 1 for k, v in _checkpoint(cfg).items()}}  # the policy's: other values
    parts = build_components(
        cfg,
        FullFinetune(),
        objective,
        checkpoint,
        build_data(cfg),
        device=cpu,
        dtype=torch.float32,
        parallel=one_rank,
        is_rank_zero=True,
    )
    reference = objective.reference_model
    assert reference is not None and objective.resident == (reference,) and not reference.training
    assert not any(param.requires_grad for param in reference.parameters())
    assert all(param.requires_grad for param in parts.model.parameters())
    optimized = {id(param) for group in parts.optimizer.param_groups for param in group["params"]}
    assert not optimized & {id(param) for param in reference.parameters()}
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    assert not torch.equal(parts.model.tok_embeddings.weight, reference.tok_embeddings.weight)

    runner = StepRunner(
        parts.model,
        parts.optimizer,
        DPOLoss(),
        StepGuard(one_rank, cpu),
        one_rank,
        cpu,
        clip_grad_norm=None,
        oom_recovery=True,
        where=lambda: (1, None, "."),
        objective=objective,
    )
    measured = runner.trial_step(2, seq_len=8, accumulation=1, collate=parts.collate, vocab_size=1280, packed=False)
    assert memory.live_tensor_bytes(reference) == sum(p.numel() * 4 for p in reference.parameters()) + sum(
        b.numel() * b.element_size() for b in reference.buffers()
    )
    policy_bytes, reference_bytes = (
        memory.current_bytes(cpu, parts.model, parts.optimizer),
        memory.current_bytes(cpu, reference),
    )  # as the trial's meters count: the same path on every machine
    assert reference_bytes > 0 and measured.steady_bytes == policy_bytes + reference_bytes
    assert all(torch.equal(original[k], v) for k, v in reference.state_dict().items())  # the step left it alone


def _checkpoint(cfg) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from torchtune import config, training

    return config.instantiate(cfg.checkpointer, should_load_recipe_state=False).load_checkpoint()[training.MODEL_KEY]


def test_the_reference_forward_runs_without_autograd_on_the_reference_model() -> None:
    """The reference's forward first (a separate model, no autograd), then the policy's (with autograd), on the
    same 2 x pairs sequences; the loss is torchtune's DPOLoss on their log-probabilities, summed over the pairs."""
    from torchtune import rlhf
    from torchtune.data import padded_collate_dpo

    policy, reference, objective = _tiny(0), _tiny(1), FullDPO()
    objective.hold(reference.eval().requires_grad_(False))
    seen: list[tuple[str, tuple[int, ...], bool]] = []
    for name, model in (("policy", policy), ("reference", reference)):
        model.register_forward_pre_hook(
            lambda module, args, name=name: seen.append((name, tuple(args[0].shape), torch.is_grad_enabled()))
        )
    samples = [
        {
            "chosen_input_ids": [1, 2, 3],
            "chosen_labels": [1, 2, 3],
            "rejected_input_ids": [4, 5],
            "rejected_labels": [4, 5],
        },
        {
            "chosen_input_ids": [6],
            "chosen_labels": [6],
            "rejected_input_ids": [7, 8, 9, 10],
            "rejected_labels": [7, 8, 9, 10],
        },
    ]
    loss, pairs = objective.micro_loss(policy, DPOLoss(beta=0.1), PairCollate(pad_id=0)(samples), torch.enable_grad())
    assert seen == [("reference", (4, 4), False), ("policy", (4, 4), True)] and pairs == 2
    tokens, labels = padded_collate_dpo(samples)
    ours = rlhf.get_batch_log_probs(policy(tokens), labels)
    with torch.no_grad():
        theirs = rlhf.get_batch_log_probs(reference(tokens), labels)
    expected, _, _ = DPOLoss(beta=0.1)(ours[:2], ours[2:], theirs[:2], theirs[2:])
    assert torch.equal(loss.detach(), expected.sum().detach()) and objective.last["rewards/margins"] != 0


STEPS, SAVED = 4, 2
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
# 4 pairs x accumulation 2, the data in order, the LR warming up over 2 steps to 1e-3 (so the weights move).
PARITY = (
    "epochs=1",
    f"max_steps_per_epoch={STEPS}",
    "shuffle=False",
    "optimizer.lr=1e-3",
    "metric_logger._component_=dpo_parity_run.ExactDiskLogger",
)


@pytest.fixture(scope="module")
def parity_runs(assets: Path, runs: Path) -> dict[str, list[dict[str, float]]]:
    """The step built by hand from torchtune's parts (full_dpo_parity_run.py), and adaptive_full_dpo on the same
    config, killed after optimizer step 2 (saved there, inside the epoch: save_every_n_steps=2) then resumed to
    step 4: every metric of both, in full."""
    common = ["--config", str(CONFIG), f"assets_dir={assets}", *PARITY]
    by_hand = runs / "by_hand"
    check(
        run_command(
            "script", [str(HERE / "full_dpo_parity_run.py"), "by_hand", *common, f"output_dir={by_hand}"], cwd=runs
        )
    )
    ours = runs / "ours"  # not the recipe's name: a folder in the cwd would shadow its module
    killed = run_command(
        "script",
        [
            str(HERE / "crashing_run.py"),
            str(SAVED),
            "adaptive_full_dpo",
            *common,
            f"output_dir={ours}",
            f"save_every_n_steps={SAVED}",
        ],
        cwd=runs,
    )
    assert killed.returncode == 17, killed.stderr[-3000:]
    killed_rows = read_metrics(ours / "logs")
    check(
        run_command(
            "script",
            [
                str(HERE / "full_dpo_parity_run.py"),
                "adaptive_full_dpo",
                *common,
                f"output_dir={ours}",
                f"save_every_n_steps={SAVED}",
                "resume_from_checkpoint=True",
            ],
            cwd=runs,
        )
    )
    return {"by_hand": read_metrics(by_hand / "logs"), "killed": killed_rows, "ours": read_metrics(ours / "logs")}


@pytest.mark.e2e
def test_adaptive_full_dpo_logs_the_hand_built_steps_loss_and_rewards_bit_for_bit(parity_runs: dict) -> None:
    """Profiler off, batch fixed: the loss, LR and every reward, log-probability and logit metric equal bit for bit
    on CPU at every step, the last two after a kill and an exact resume inside the epoch."""
    by_hand, ours = parity_runs["by_hand"], parity_runs["ours"]
    assert [row["step"] for row in parity_runs["killed"]] == [1, 2]
    assert [row["step"] for row in ours] == [1, 2, 3, 4] and len(by_hand) == STEPS
    assert ours[-1]["rewards/margins"] != 0 and ours[-1]["loss"] != ours[0]["loss"]  # the policy trained
    for row_by_hand, row_ours in zip(by_hand, ours):
        assert {key: row_ours[key] for key in EXACT} == {key: row_by_hand[key] for key in EXACT}


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_ranks_profile_with_the_reference_sharded_and_train(assets: Path, runs: Path) -> None:
    """torchrun, 2 ranks (gloo on CPU): the reference is sharded as the policy (half its bytes on rank 0), the
    profiler's trials run with it resident, the run trains at the micro batch of pairs it chose and exits cleanly.
    64 pairs of at most 128 tokens and a 32 MiB budget: a few pairs a micro batch, so that the trials and the two
    steps are short."""
    out = runs / "two_ranks"
    result = check(
        tune_run(
            "adaptive_full_dpo",
            "tiny_full_dpo",
            [
                f"assets_dir={assets}",
                f"output_dir={out}",
                "use_maximum_batch_size=True",
                "adaptive_batching.memory_budget=32MiB",
                "tokenizer.max_seq_len=128",
                "dataset.split=train[:64]",
                "gradient_accumulation_steps=1",
                "epochs=1",
                "max_steps_per_epoch=2",
            ],
            cwd=runs,
            nproc=2,
        )
    )
    line = re.search(
        r"Reference model \(ref_checkpointer\): a frozen copy of the model, ([\d.]+) MiB of weights, "
        r"([\d.]+) MiB on this rank \(sharded over 2 ranks as the policy\)",
        result.stderr,
    )
    assert line and 0.45 < float(line[2]) / float(line[1]) < 0.55, result.stderr[-3000:]
    chosen = re.search(r"largest micro batch that ran (\d+); chosen micro batch (\d+)", result.stderr)
    assert chosen and 1 <= int(chosen[2]) <= int(chosen[1]), result.stderr[-3000:]
    rows = read_metrics(out / "logs")
    assert [row["micro_batch_size"] for row in rows] == [int(chosen[2])] * 2 and "rewards/margins" in rows[0]
    report = json.loads((out / "profile" / "profile.json").read_text())
    assert report["micro_batch"] == int(chosen[2])
    saved = sorted(p.name for p in (out / "epoch_0").iterdir())
    assert "recipe_state.pt" in saved and not [name for name in saved if "ref" in name]
    finals = [
        line.split("last loss ")[1] for line in result.stderr.splitlines() if "finished at optimizer step 2" in line
    ]
    assert len(finals) == 2 and finals[0] == finals[1], result.stderr[-3000:]
    assert warning_lines(result) == []  # no warning at 2 ranks (issue 53)
