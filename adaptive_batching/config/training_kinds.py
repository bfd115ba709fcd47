"""torchtune's catalogue of kinds of training, the config keys that ask for each, and which recipe trains that way:
one place for all of them.

torchtune's other recipes read keys that turn fine-tuning into another kind of training (a ``quantizer`` for
quantization-aware training, a ``teacher_model`` for distillation, a DPO loss, ...). Ignored, such a key would
train a plain fine-tune that nobody asked for; so a recipe of ours that does not train that way refuses it in one
line, before any model loads, naming the recipes that do. When a recipe of ours learns one, it is listed in
:data:`OURS` and named instead of torchtune's. (A kind of training is not the training objective a recipe composes,
``core.objective``: QAT is a kind here and a fine-tuning method there.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.core.nodes import optional_component, plain
from adaptive_batching.errors import ConfigError

QAT, PTQ, KD, DPO, PPO, GRPO, EARLY_EXIT, MULTI_DATASET = (
    "qat",
    "ptq",
    "kd",
    "dpo",
    "ppo",
    "grpo",
    "early_exit",
    "multi_dataset",
)


@dataclass(frozen=True)
class TrainingKind:
    """A way of training other than supervised fine-tuning: what it is, in words, and torchtune 0.6.1's recipes
    that train so."""

    what: str
    torchtune: tuple[str, ...]


TRAINING_KINDS: dict[str, TrainingKind] = {
    QAT: TrainingKind("quantization-aware training", ("qat_distributed", "qat_lora_finetune_distributed")),
    PTQ: TrainingKind("quantizing a trained model (post-training quantization)", ("quantize",)),
    KD: TrainingKind(
        "knowledge distillation from a teacher model",
        ("knowledge_distillation_single_device", "knowledge_distillation_distributed"),
    ),
    DPO: TrainingKind(
        "preference optimisation (DPO) on chosen and rejected answers",
        ("lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed"),
    ),
    PPO: TrainingKind("reinforcement learning from a reward model (PPO)", ("ppo_full_finetune_single_device",)),
    GRPO: TrainingKind("group relative policy optimisation (GRPO)", ("dev/grpo_full_finetune_distributed",)),
    EARLY_EXIT: TrainingKind(
        "early-exit training (layer dropout, an early-exit loss)", ("dev/early_exit_finetune_distributed",)
    ),
    MULTI_DATASET: TrainingKind(
        "training on several data sets, each with its own loader", ("dev/lora_finetune_distributed_multi_dataset",)
    ),
}

# Our recipes and the kinds of training above that each trains (besides supervised fine-tuning).
OURS: dict[str, frozenset[str]] = {
    "adaptive_full_finetune": frozenset({QAT}),
    "adaptive_lora_finetune": frozenset({QAT}),
    "adaptive_lora_dpo": frozenset({DPO}),
    "adaptive_full_dpo": frozenset({DPO}),
    "adaptive_knowledge_distillation": frozenset({KD}),
}

# Top-level keys that only torchtune's recipes of one kind of training read (``quantizer``: see :func:`_quantizer`).
TRAINING_KEYS: dict[str, str] = {
    "quantizer": QAT,
    "fake_quant_after_n_steps": QAT,
    "teacher_model": KD,
    "teacher_checkpointer": KD,
    "kd_loss": KD,
    "kd_ratio": KD,
    "ref_checkpointer": DPO,
    **{
        key: PPO
        for key in (
            "policy_model",
            "reward_and_value_model",
            "ref_policy_checkpointer",
            "value_checkpointer",
            "reward_checkpointer",
            "ppo_epochs",
            "ppo_batch_size",
            "forward_batch_size",
            "kl_coeff",
            "gamma",
            "lmbda",
            "whiten_rewards",
            "penalise_no_eos",
            "reward_penalty",
            "min_response_length",
            "max_generated_tokens",
            "num_steps",
        )
    },
    "grpo_samples": GRPO,
    "early_exit_loss": EARLY_EXIT,
    "layer_dropout": EARLY_EXIT,
    "datasets": MULTI_DATASET,
}

# Components of torchtune's, by their last name, that make a node train another way.
LOSSES: dict[str, str] = {
    "DPOLoss": DPO,
    "RSOLoss": DPO,
    "PPOLoss": PPO,
    **{
        f"{kind}KL{chunked}Loss": KD
        for kind in ("Forward", "Reverse", "Symmetric")
        for chunked in ("", "WithChunkedOutput")
    },
}
DATASETS: dict[str, str] = {
    name: DPO
    for name in ("preference_dataset", "PreferenceDataset", "stack_exchange_paired_dataset", "hh_rlhf_helpful_dataset")
}
_NAMED = 3  # other keys a refusal names besides the first
KD_RATIO = 0.5  # the weight of the KD loss against the cross-entropy when the config sets no 'kd_ratio'
LORA_ARGUMENT = "lora_attn_modules"  # an argument every LoRA model builder of torchtune's requires, and no other takes


def builds_lora(cfg: DictConfig) -> bool:
    """Whether config key ``model`` builds a LoRA model (LoRA, QLoRA, DoRA adapters): its builder is one of
    torchtune's LoRA builders, which all require ``lora_attn_modules`` (and the node must give it), and which the
    full builders do not take. Read from the node, so that the commands which only read files (``ls``, ``cp``)
    import no builder."""
    model = OmegaConf.select(cfg, "model", default=None)
    return OmegaConf.is_dict(model) and LORA_ARGUMENT in model


def recipe_for_model(cfg: DictConfig) -> str:
    """The recipe of ours that runs a config: LoRA (and QLoRA, DoRA) when its model builder is a LoRA one, full
    otherwise; ``adaptive_lora_dpo`` or ``adaptive_full_dpo`` when the config asks for DPO,
    ``adaptive_knowledge_distillation`` (a LoRA or a full student) when it asks for distillation."""
    lora = builds_lora(cfg)
    asked = {kind for _, kind, _ in training_asked(cfg)}
    if KD in asked:
        return "adaptive_knowledge_distillation"
    dpo = DPO in asked
    return f"adaptive_{'lora' if lora else 'full'}_{'dpo' if dpo else 'finetune'}"


def _torchtune_name(component: Any, names: dict[str, str]) -> str | None:
    """The kind of training of a torchtune component path found in ``names`` by its last name, else None."""
    path = str(component or "")
    return names.get(path.rsplit(".", 1)[-1]) if path.startswith("torchtune.") else None


def _quantizer(node: Any) -> str:
    """A QAT quantizer (``...QATQuantizer``) trains with fake quantization; any other quantizes a trained model."""
    component = str(OmegaConf.select(node, "_component_", default="") or "") if OmegaConf.is_dict(node) else ""
    return QAT if "QAT" in component.rsplit(".", 1)[-1] or not component else PTQ


def _asks(value: Any) -> bool:
    """Whether a key's value asks for anything: null and a switched-off component do not."""
    return value is not None and optional_component(value) is not None


def training_asked(cfg: DictConfig) -> list[tuple[str, str, Any]]:
    """``(key, kind, value shown)`` for every key of ``cfg`` that asks for training other than supervised
    fine-tuning: the keys first, then losses, then data sets (the weakest sign), each in the config's order."""
    found: list[tuple[str, str, Any]] = []
    for key in (str(k) for k in cfg.keys()):
        value = cfg.get(key)
        if key in TRAINING_KEYS and _asks(value):
            kind = _quantizer(value) if key == "quantizer" else TRAINING_KEYS[key]
            found.append((key, kind, _shown(value)))
        elif key == "loss" and OmegaConf.is_dict(value):
            loss_kind = _torchtune_name(value.get("_component_"), LOSSES)
            if loss_kind:
                found.append(("loss._component_", loss_kind, value.get("_component_")))
        elif key == "dataset" and value is not None:
            parts = list(value) if OmegaConf.is_list(value) else [value]
            for i, part in enumerate(parts):
                data_kind = _torchtune_name(part.get("_component_") if OmegaConf.is_dict(part) else None, DATASETS)
                if data_kind:
                    where = "dataset" if not OmegaConf.is_list(value) else f"dataset[{i}]"
                    found.append((f"{where}._component_", data_kind, part.get("_component_")))
    return sorted(found, key=lambda item: item[0].startswith(("dataset.", "dataset[")))


def _shown(value: Any) -> Any:
    """What a message shows of a key's value: a node's component, a scalar itself, else nothing (None)."""
    if OmegaConf.is_dict(value):
        return value.get("_component_", None)
    return None if OmegaConf.is_config(value) else plain(value)


def refusal(recipe: str, keys: list[tuple[str, Any]], kind: str, runs: str | None = None) -> str:
    """The one line that refuses ``keys`` (key, value shown; the first is shown with its value, at most
    :data:`_NAMED` of the others are named) asking for ``kind`` in ``recipe``; ``runs``, the recipe of ours
    for the config's model, is the one named when it trains so (the full or the LoRA DPO recipe)."""
    what = TRAINING_KINDS[kind]
    (key, shown), others = keys[0], [f"'{other}'" for other, _ in keys[1:]]
    subject = f"config key '{key}'" + ("" if shown is None else f" = {shown!r}")
    if others:
        more = f" and {len(others) - _NAMED} more" if len(others) > _NAMED else ""
        subject += f" (with {', '.join(others[:_NAMED])}{more})"
    ours = [name for name, kinds in OURS.items() if kind in kinds]
    ours = [runs] if runs in ours else ours
    if ours:
        return f"{subject} asks for {what.what}, which {recipe} does not do; use {' or '.join(ours)}"
    recipes = ", ".join(what.torchtune[:-1]) + (" or " if len(what.torchtune) > 1 else "") + what.torchtune[-1]
    return f"{subject} asks for {what.what}, which {recipe} does not do yet; use torchtune's {recipes}"


def check_training_kind(cfg: DictConfig, recipe: str | None = None) -> None:
    """Refuse, in one line, keys asking for training that ``recipe`` (default: the one of ours that runs the
    config) does not do: the kind of the first such key (see :func:`training_asked`), with all of its keys."""
    recipe = recipe or recipe_for_model(cfg)
    done = OURS.get(recipe, frozenset())
    asked = [(key, kind, shown) for key, kind, shown in training_asked(cfg) if kind not in done]
    if asked:
        kind = asked[0][1]
        raise ConfigError(
            refusal(
                recipe,
                [(key, shown) for key, o, shown in asked if o == kind],
                kind,
                runs=recipe_for_model(cfg),
            )
        )


_PAIR_LOSSES = ("DPOLoss", "RSOLoss")


def _check_pairs(cfg: DictConfig, recipe: str) -> None:
    """What neither DPO recipe can train: a loss that is not a preference loss over log-probabilities and packed
    data (a pair's chosen and rejected answers are two sequences padded to each other). A token budget applies: it
    counts a pair's two sequences (``batching.token_sampler.budget_lengths``)."""
    loss = str(OmegaConf.select(cfg, "loss._component_", default="") or "")
    if loss.rsplit(".", 1)[-1] not in _PAIR_LOSSES:
        raise ConfigError(
            f"config key 'loss._component_' = {loss!r}: {recipe} trains with "
            "torchtune.rlhf.loss.DPOLoss or torchtune.rlhf.loss.RSOLoss"
        )
    dataset = plain(cfg.get("dataset", None))
    for part in dataset if isinstance(dataset, list) else [dataset]:
        if isinstance(part, dict) and part.get("packed", False):
            raise ConfigError(
                "config key 'dataset.packed' = True: packing does not apply to DPO, whose chosen "
                "and rejected answers are two sequences padded to each other; set it to False"
            )


def check_lora_dpo(cfg: DictConfig) -> None:
    """Refuse, in one line before any model loads, what ``adaptive_lora_dpo`` cannot train: a model without LoRA
    adapters (the reference is the policy with its adapters off), a separate reference model, and what neither DPO
    recipe trains (see :func:`_check_pairs`)."""
    component = str(OmegaConf.select(cfg, "model._component_", default="") or "")
    if not builds_lora(cfg):
        raise ConfigError(
            f"config key 'model._component_' = {component!r} has no LoRA adapters; adaptive_lora_dpo's "
            "reference model is the policy with its adapters off, so it needs a LoRA model builder; "
            "use adaptive_full_dpo for DPO of the whole model"
        )
    if _asks(OmegaConf.select(cfg, "ref_checkpointer", default=None)):  # refused, not read
        raise ConfigError(
            "config key 'ref_checkpointer' asks for a separate reference model (full DPO), which "
            "adaptive_lora_dpo does not do: its reference is the policy with its adapters off"
        )
    _check_pairs(cfg, "adaptive_lora_dpo")


def check_full_dpo(cfg: DictConfig) -> None:
    """Refuse, in one line before any model loads, what ``adaptive_full_dpo`` cannot train: a LoRA model (its
    reference is the policy with its adapters off: the LoRA recipe's), no ``ref_checkpointer`` (the frozen
    reference model's weights, as torchtune's ``full_dpo_distributed`` reads them), and what neither DPO recipe
    trains (see :func:`_check_pairs`)."""
    component = str(OmegaConf.select(cfg, "model._component_", default="") or "")
    if builds_lora(cfg):
        raise ConfigError(
            f"config key 'model._component_' = {component!r} is a LoRA model, whose reference is the "
            "policy with its adapters off; use adaptive_lora_dpo"
        )
    reference = OmegaConf.select(cfg, "ref_checkpointer", default=None)
    if not _asks(reference) or not OmegaConf.is_dict(reference):
        raise ConfigError(
            "config key 'ref_checkpointer' is missing: adaptive_full_dpo loads its reference model, "
            "a frozen copy of 'model', with it (a checkpointer such as "
            "torchtune.training.FullModelHFCheckpointer pointing at the original weights)"
        )
    _check_pairs(cfg, "adaptive_full_dpo")


_KD_LOSSES = tuple(
    f"{kind}KL{chunked}Loss" for kind in ("Forward", "Reverse", "Symmetric") for chunked in ("", "WithChunkedOutput")
)
_CHUNKED_CE = "CEWithChunkedOutputLoss"


def check_kd(cfg: DictConfig) -> None:
    """Refuse, in one line before any model loads, what ``adaptive_knowledge_distillation`` cannot train, as
    torchtune's ``knowledge_distillation_single_device`` reads its keys: no ``teacher_model`` or
    ``teacher_checkpointer`` (the frozen teacher and its weights), a ``kd_loss`` that is not one of torchtune's KL
    losses, a ``kd_ratio`` outside [0, 1], and a ``loss`` and ``kd_loss`` that do not both take the logits in the
    same chunks (the student's output is chunked for the cross-entropy, and the teacher's as the student's)."""
    recipe = "adaptive_knowledge_distillation"
    for key, what in (
        ("teacher_model", "the teacher's model builder, e.g. torchtune.models.qwen2.qwen2_1_5b"),
        ("teacher_checkpointer", "a checkpointer pointing at the teacher's weights"),
    ):
        node = OmegaConf.select(cfg, key, default=None)
        if not OmegaConf.is_dict(node) or optional_component(node) is None:
            state = (
                "is missing"
                if node is None
                else f"= {plain(node)!r} is not a node"
                if not OmegaConf.is_dict(node)
                else "is null"
            )
            raise ConfigError(f"config key '{key}' {state}: {recipe} needs {what}")
    kd_loss = str(OmegaConf.select(cfg, "kd_loss._component_", default="") or "")
    if not kd_loss.startswith("torchtune.") or kd_loss.rsplit(".", 1)[-1] not in _KD_LOSSES:
        node = OmegaConf.select(cfg, "kd_loss", default=None)
        subject = (
            "'kd_loss' is missing"
            if node is None
            else "'kd_loss' is null"
            if not kd_loss
            else f"'kd_loss._component_' = {kd_loss!r}"
        )
        raise ConfigError(
            f"config key {subject}: {recipe} distils with one of torchtune.modules.loss.{', '.join(_KD_LOSSES)}"
        )
    kd_ratio(cfg)
    loss = str(OmegaConf.select(cfg, "loss._component_", default="") or "").rsplit(".", 1)[-1]
    chunked = (loss == _CHUNKED_CE, kd_loss.endswith("WithChunkedOutputLoss"))
    if chunked[0] != chunked[1]:
        raise ConfigError(
            f"config key 'kd_loss._component_' = {kd_loss!r} with 'loss._component_' = {loss!r}: "
            f"both take chunked logits or neither does (torchtune.modules.loss.{_CHUNKED_CE} with a "
            "...WithChunkedOutputLoss KD loss)"
        )
    chunks = [OmegaConf.select(cfg, f"{key}.num_output_chunks", default=8) for key in ("loss", "kd_loss")]
    if all(chunked) and chunks[0] != chunks[1]:
        raise ConfigError(
            f"config key 'kd_loss.num_output_chunks' = {chunks[1]!r}: it must equal "
            f"'loss.num_output_chunks' = {chunks[0]!r} (the student's and teacher's logits are chunked "
            "alike)"
        )


def kd_ratio(cfg: DictConfig) -> float:
    """``kd_ratio``: the weight of the KD loss against the cross-entropy, a number in [0, 1] (default
    :data:`KD_RATIO`, as torchtune's KD recipes)."""
    ratio = plain(cfg.get("kd_ratio", KD_RATIO))
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(
            f"config key 'kd_ratio' = {ratio!r}: the weight of the KD loss against the cross-entropy "
            "must be a number in [0, 1]"
        )
    return float(ratio)
