"""Sequence lengths measured once and cached on disk, keyed by what decides them."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from adaptive_batching.batching.sequence_lengths import data_files_digest, lengths_cache_file, sequence_lengths

KEY = {
    "dataset": {"source": "json", "data_files": "train.json"},
    "tokenizer": {"max_seq_len": 64},
    "data_files": "abc123",
}


class CountingDataset:
    """A dataset that counts how often its samples are read."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.reads = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        self.reads += 1
        return {"tokens": list(range(self.lengths[index])), "labels": [0] * self.lengths[index]}


def only_file(directory: Path) -> Path:
    files = list(directory.iterdir())
    assert len(files) == 1, files
    return files[0]


def test_a_miss_measures_and_writes_then_a_hit_reads_nothing(tmp_path: Path) -> None:
    dataset = CountingDataset([3, 1, 4, 1, 5, 9])
    assert sequence_lengths(dataset, cache_dir=tmp_path, key_parts=KEY) == [3, 1, 4, 1, 5, 9]
    assert dataset.reads == 6
    record = json.loads(only_file(tmp_path).read_text())
    assert record["lengths"] == [3, 1, 4, 1, 5, 9]
    again = CountingDataset([3, 1, 4, 1, 5, 9])
    assert sequence_lengths(again, cache_dir=tmp_path, key_parts=dict(reversed(KEY.items()))) == [3, 1, 4, 1, 5, 9]
    assert again.reads == 0
    assert [p.name for p in tmp_path.iterdir()] == [only_file(tmp_path).name]  # no temp file left


@pytest.mark.parametrize("change", ["key", "size"])
def test_another_key_or_dataset_size_measures_again(tmp_path: Path, change: str) -> None:
    sequence_lengths(CountingDataset([3, 1, 4]), cache_dir=tmp_path, key_parts=KEY)
    if change == "key":
        dataset, key = CountingDataset([2, 7, 1]), {**KEY, "tokenizer": {"max_seq_len": 128}}
    else:
        dataset, key = CountingDataset([2, 7, 1, 8]), KEY
    assert sequence_lengths(dataset, cache_dir=tmp_path, key_parts=key) == dataset.lengths
    assert dataset.reads == len(dataset.lengths)
    assert len(list(tmp_path.iterdir())) == 2
    first = CountingDataset([3, 1, 4])
    assert sequence_lengths(first, cache_dir=tmp_path, key_parts=KEY) == [3, 1, 4] and first.reads == 0


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2, 3]",
        json.dumps({"schema": 1, "key": "x", "lengths": [1, "a", 3]}),
        "KEYED:[1, 2]",
        "KEYED:[1, -2, 3]",
        "NOT-UTF8",
    ],
)
def test_a_corrupt_or_stale_file_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    sequence_lengths(CountingDataset([3, 1, 4]), cache_dir=tmp_path, key_parts=KEY)
    path = only_file(tmp_path)
    if content.startswith("KEYED:"):
        record = json.loads(path.read_text())
        record["lengths"] = json.loads(content.removeprefix("KEYED:"))
        path.write_text(json.dumps(record))
    elif content == "NOT-UTF8":
        path.write_bytes(b"\xff\xfe not utf-8")
    else:
        path.write_text(content)
    dataset = CountingDataset([3, 1, 4])
    with caplog.at_level(logging.WARNING, logger="adaptive_batching.batching.sequence_lengths"):
        assert sequence_lengths(dataset, cache_dir=tmp_path, key_parts=KEY) == [3, 1, 4]
    assert dataset.reads == 3
    assert "ignoring" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["lengths"] == [3, 1, 4]


def test_a_file_for_another_key_under_the_same_name_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sequence_lengths(CountingDataset([3, 1, 4]), cache_dir=tmp_path, key_parts=KEY)
    path = only_file(tmp_path)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "key": "0" * 64, "lengths": [7, 7, 7]}))
    dataset = CountingDataset([3, 1, 4])
    with caplog.at_level(logging.WARNING, logger="adaptive_batching.batching.sequence_lengths"):
        assert sequence_lengths(dataset, cache_dir=tmp_path, key_parts=KEY) == [3, 1, 4]
    assert "stale" in caplog.text and dataset.reads == 3


def test_without_a_cache_dir_nothing_is_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for _ in range(2):
        dataset = CountingDataset([2, 2])
        assert sequence_lengths(dataset, cache_dir=None, key_parts=KEY) == [2, 2]
        assert dataset.reads == 2
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_dir_still_gives_the_lengths(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="adaptive_batching.batching.sequence_lengths"):
        assert sequence_lengths(CountingDataset([5]), cache_dir=blocker / "sub", key_parts=KEY) == [5]
    assert "could not write" in caplog.text


def test_cache_file_name_and_empty_dataset(tmp_path: Path) -> None:
    assert lengths_cache_file(tmp_path, "ab" * 32) == tmp_path / f"lengths-{'ab' * 8}.json"
    assert sequence_lengths(CountingDataset([]), cache_dir=tmp_path, key_parts=KEY) == []
    assert sequence_lengths(CountingDataset([]), cache_dir=tmp_path, key_parts=KEY) == []


def test_data_files_digest_hashes_contents_in_order(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"hello")
    c.write_bytes(b"hello")
    digest = data_files_digest([a, str(b)])
    expected = hashlib.sha256(
        (3_000_000).to_bytes(8, "little") + b"x" * 3_000_000 + (5).to_bytes(8, "little") + b"hello"
    ).hexdigest()
    assert digest == expected
    assert data_files_digest([a, c]) == digest  # names do not count
    assert data_files_digest([b, a]) != digest
    b.write_bytes(b"hellO")
    assert data_files_digest([a, b]) != digest
    # File boundaries count: "ab" + "c" is not "a" + "bc".
    (tmp_path / "1").write_bytes(b"ab"), (tmp_path / "2").write_bytes(b"c")
    (tmp_path / "3").write_bytes(b"a"), (tmp_path / "4").write_bytes(b"bc")
    assert data_files_digest([tmp_path / "1", tmp_path / "2"]) != data_files_digest([tmp_path / "3", tmp_path / "4"])
    with pytest.raises(FileNotFoundError):
        data_files_digest([tmp_path / "missing"])
