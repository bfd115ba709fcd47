"""The worst-case sample comes from the data: its longest sample after truncation, or the pack size."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_runs import check, read_metrics, tune_run

from adaptive_batching.batching import worst_case
from adaptive_batching.config.inputs import length_source, worst_case_of
from adaptive_batching.errors import ConfigError

CFG = OmegaConf.create({"tokenizer": {"max_seq_len": None}, "dataset": {"source": "json"}})


class Samples:
    """A data set whose samples have the given token counts; counts its reads."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.reads = lengths, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        self.reads += 1
        return {"tokens": [1] * self.lengths[index], "labels": [1] * self.lengths[index]}


class Packs:
    max_seq_len = 2048


def test_the_worst_case_is_the_longest_sample_and_says_where_it_came_from(
    tmp_path: Path, said: Callable[[], list[str]]
) -> None:
    data = Samples([5, 1450, 9, 300])
    worst, lengths = worst_case.measure(data, length_source(CFG, tmp_path), packed=False)
    assert (worst.tokens, lengths) == (1450, [5, 1450, 9, 300])
    assert worst.source == "the longest of 4 samples after tokenizer.max_seq_len=null: no truncation"
    assert len(said()) == 1 and said()[0].startswith("Worst-case sample: 1450 tokens, the longest of 4 samples")
    reads = data.reads
    again, _ = worst_case.measure(data, length_source(CFG, tmp_path), packed=False, quiet=True)
    assert again == worst and data.reads == reads  # the lengths came from the cache
    assert len(said()) == 1  # quiet (``estimate``): nothing more said


def test_truncation_is_named_and_a_packed_data_set_is_one_pack_long() -> None:
    truncated = length_source(OmegaConf.create({"tokenizer": {"max_seq_len": 256}, "dataset": {}}), None)
    assert (
        worst_case.from_lengths([3, 256], truncated).source
        == "the longest of 2 samples after tokenizer.max_seq_len=256"
    )
    worst, lengths = worst_case.measure(Packs(), truncated, packed=True)
    assert (worst.tokens, lengths) == (2048, None) and worst.source == "the pack size (tokenizer.max_seq_len=256)"


def test_a_worst_case_beyond_the_model_is_a_config_error_naming_the_key() -> None:
    worst_case.check_fits(worst_case.WorstCase(512, "x"), 512)
    worst_case.check_fits(None, 8)
    with pytest.raises(
        ConfigError, match="above the model's max_seq_len 512: set tokenizer.max_seq_len to at most 512"
    ):
        worst_case.check_fits(worst_case.WorstCase(1450, "the longest"), 512)


def test_estimate_without_data_asks_for_the_length(tmp_path: Path) -> None:
    cfg = OmegaConf.create(
        {
            "tokenizer": {
                "_component_": "torchtune.models.llama3.llama3_tokenizer",
                "path": "/nonexistent/tokenizer.model",
            },
            "dataset": {"_component_": "torchtune.datasets.alpaca_dataset"},
        }
    )
    with pytest.raises(ConfigError, match=r"could not be read here \(FileNotFoundError: .*give it with --seq-len N"):
        worst_case_of(cfg, tmp_path)


@pytest.mark.e2e
def test_a_131072_token_model_profiles_at_the_datas_longest_sample_and_trains(assets: Path, tmp_path: Path) -> None:
    """Llama 3.1/3.2 configs leave ``tokenizer.max_seq_len`` null, so the model's 131072 tokens used to be the
    worst case (minutes for one trial step on the tiny model, then no micro batch at all); the tiny data's
    longest sample is 1450 tokens."""
    out = tmp_path / "run"
    result = check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [
                f"assets_dir={assets}",
                f"output_dir={out}",
                "tokenizer.max_seq_len=null",
                "model.max_seq_len=131072",
                "batch_increase_function=null",
                "epochs=1",
                "max_steps_per_epoch=2",
                "adaptive_batching.memory_budget=128MiB",
            ],
            cwd=tmp_path,
        )
    )  # the demo's 512 MiB: more and dearer trials
    output = result.stdout + result.stderr
    lengths = json.loads(next((out / "profile_cache").glob("lengths-*.json")).read_text())["lengths"]
    longest = max(lengths)
    assert longest > 1024 and len(lengths) == 3000  # the long tail of the tiny data, untruncated
    source = "the longest of 3000 samples after tokenizer.max_seq_len=null: no truncation"
    report = json.loads((out / "profile" / "profile.json").read_text())
    assert (report["seq_len"], report["seq_len_source"]) == (longest, source)
    assert f"samples of {longest} tokens ({source})" in output
    assert f"memory cap measured with worst-case samples of {longest} tokens, {source}" in output
    assert report["micro_batch"] >= 1
    assert [row["micro_batch_size"] for row in read_metrics(out / "logs")] == [report["micro_batch"]] * 2
    assert re.search(rf"Rank 0: finished at optimizer step 2, micro batch {report['micro_batch']}\b", output)
