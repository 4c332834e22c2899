"""Datasets as users have them (``spec.data.path``): Parquet files and folders, Hugging Face ``save_to_disk`` folders
and JSON lines, read in batches into a memory-mapped cache (memory bounded by a batch, shown under a data-segment
limit far below the file's size), and every sample checked before the first step (``data.invalidSamples``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_api.models import Data
from rlhf_runtime.algo.data import (
    DataError,
    Sample,
    check_samples,
    load_eval_samples,
    load_samples,
    step_batch,
)
from rlhf_runtime.algo.dataset import Dataset


def test_parquet_with_its_own_column_names_and_numeric_answers(tmp_path: Path) -> None:
    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["2+2=", "3+4=", "1+1="], "solution": [4, 7, None],
                             "extra": [b"x", b"y", b"z"]}), f, row_group_size=2)
    got = load_samples(Data(path=str(f), prompt_field="question", answer_field="solution"))
    assert isinstance(got, Dataset) and len(got) == 3
    assert list(got) == [Sample("2+2=", "4"), Sample("3+4=", "7"), Sample("1+1=", None)]
    assert got.origins([0, 2]) == [1, 3] and got.unit == "row"
    # without promptField the error lists the columns there are
    with pytest.raises(DataError, match=r"no column 'prompt' \(data.promptField\) and no 'messages' column; its "
                                        r"columns: question, solution, extra"):
        load_samples(Data(path=str(f)))


def test_parquet_chat_messages_and_bad_rows_say_which_row(tmp_path: Path) -> None:
    f = tmp_path / "chat.parquet"
    msgs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"messages": msgs, "answer": ["hello"]}), f)
    (s,) = load_samples(Data(path=str(f)))
    assert s == Sample("hi", "hello", (("system", "be brief"), ("user", "hi")))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok", None, " ", "fine"]}), bad)
    with pytest.raises(DataError, match=rf"^spec.data.path {bad}: row 2: the row has no 'prompt' column .* "
                                        r"\(and 1 more bad row\)$"):
        load_samples(Data(path=str(bad)))


def test_a_folder_of_parquet_shards_and_a_save_to_disk_folder(tmp_path: Path) -> None:
    """A hub dataset's data/ folder (train-0000N-of-0000M.parquet, read in name order) and what Hugging Face
    datasets' ``save_to_disk`` writes (Arrow stream files named in state.json); a DatasetDict names its splits."""
    import datasets

    shards = tmp_path / "data"
    shards.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"prompt": [f"p{i}{j}" for j in range(3)]}), shards / f"train-0000{i}-of-00002.parquet")
    assert [s.prompt for s in load_samples(Data(path=str(shards)))] == ["p00", "p01", "p02", "p10", "p11", "p12"]

    ds = datasets.Dataset.from_dict({"problem": [f"q{i}" for i in range(50)], "answer": [str(i) for i in range(50)]})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # several shards, all read
    got = load_samples(Data(path=str(tmp_path / "saved"), prompt_field="problem"))
    assert [(s.prompt, s.answer) for s in got] == [(f"q{i}", str(i)) for i in range(50)]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"a Hugging Face DatasetDict \(splits: test, train\); point data.path at "
                                        r"one split's folder, e.g. .*/dict/test"):
        load_samples(Data(path=str(tmp_path / "dict")))
    evals = load_eval_samples(Data.model_validate({"prompts": ["x"], "promptField": "problem",
                                                   "eval": {"path": str(tmp_path / "saved"), "maxPrompts": 3}}))
    assert [s.prompt for s in evals] == ["q0", "q1", "q2"]


def test_step_batches_from_the_cache_equal_those_of_the_same_samples_in_memory(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(37)]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cached = load_samples(Data(path=str(f)))
    in_memory = [Sample(r["prompt"], r["answer"]) for r in rows]
    assert isinstance(cached, Dataset) and cached == in_memory
    for step in range(6):  # over two epochs
        assert step_batch(cached, step, 16, seed=3) == step_batch(in_memory, step, 16, seed=3)
    assert cached[5] == in_memory[5] and cached[-1] == in_memory[-1] and cached[2:4] == in_memory[2:4]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from rlhf_testing.tiny import build_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_samples_the_run_cannot_take_are_dropped_and_counted_or_refused(tmp_path: Path, tokenizer) -> None:
    """Before the first step: a prompt whose rendered tokens plus maxTokens exceed the engines' context, and one
    without the answer the reward compares with. drop: the rest train, status.data names the lines; fail: the
    error names them; nothing left: an error either way."""
    f = tmp_path / "p.jsonl"
    lines = [{"prompt": "ab", "answer": "1"}, {"prompt": "x" * 40, "answer": "2"}, {"prompt": "cd"},
             {"prompt": "ef", "answer": "3"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    samples = load_samples(Data(path=str(f)))
    kept, status = check_samples(samples, tokenizer, context=32, max_tokens=16, needs_answer=True)
    assert [s.prompt for s in kept] == ["ab", "ef"] and kept.origins([0, 1]) == [1, 4]
    assert status["samples"] == 2 and status["dropped"] == 2
    assert ("2 of 4 samples cannot run: 1 too long for the engines' context (rendered prompt + maxTokens 16 > 32 "
            "tokens, the longest prompt 40 tokens: lines 2); 1 without an answer") in status["message"]
    assert "lines 3)" in status["message"] and status["message"].endswith("dropped (data.invalidSamples drop)")
    with pytest.raises(DataError, match=r"2 of 4 samples cannot run: .* \(data.invalidSamples fail\)"):
        check_samples(samples, tokenizer, 32, 16, True, policy="fail")
    same, ok = check_samples(samples, tokenizer, context=None, max_tokens=16, needs_answer=False)
    assert same is samples and ok == {"samples": 4, "dropped": 0}
    with pytest.raises(DataError, match="none is left to train on"):
        check_samples(samples, tokenizer, context=8, max_tokens=16, needs_answer=False)


def test_a_file_far_larger_than_the_memory_it_may_use(tmp_path: Path) -> None:
    """A ~180 MB JSON-lines file and the same as Parquet, loaded and checked in a process whose data segment
    (heap and anonymous mappings: RLIMIT_DATA) may grow by 120 MB only: the file is never held in memory."""
    code = textwrap.dedent(f"""
        import json, resource, sys
        import pyarrow as pa, pyarrow.parquet as pq
        from rlhf_api.models import Data
        from rlhf_runtime.algo.data import check_samples, load_samples, step_batch
        jsonl, parquet = {str(tmp_path / 'big.jsonl')!r}, {str(tmp_path / 'big.parquet')!r}
        row = "y" * 600
        with open(jsonl, "w") as f:
            for i in range(300_000):
                f.write(json.dumps({{"prompt": f"{{i}} {{row}}", "answer": str(i)}}) + "\\n")
        w = pq.ParquetWriter(parquet, pa.schema([("prompt", pa.string()), ("answer", pa.string())]))
        for start in range(0, 300_000, 20_000):
            w.write_table(pa.table({{"prompt": [f"{{i}} {{row}}" for i in range(start, start + 20_000)],
                                     "answer": [str(i) for i in range(start, start + 20_000)]}}))
        w.close()
        class Lengths:  # a tokenizer's batch call: one token per character
            def __call__(self, texts, add_special_tokens=False):
                return {{"input_ids": [[0] * len(t) for t in texts]}}
        data = int(open("/proc/self/status").read().split("VmData:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (data + (120 << 20), resource.RLIM_INFINITY))
        for path in (jsonl, parquet):
            s = load_samples(Data(path=path))
            kept, status = check_samples(s, Lengths(), context=706, max_tokens=100, needs_answer=True)
            assert status == {{"samples": 100_000, "dropped": 200_000, "message": status["message"]}}, status
            assert step_batch(kept, 7, 4, 0)[0].prompt.endswith(row)
            del s, kept
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert (tmp_path / "big.jsonl").stat().st_size > 170e6
