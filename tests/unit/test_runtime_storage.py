"""Object-storage checkpoints (``rlhf_runtime.infra.storage``) against a real S3-compatible server (S3Proxy,
``tests/s3.py``): save and find the newest, a save killed mid-upload (a real subprocess SIGKILLed while it
uploads) is not a checkpoint, re-saves keep a complete copy, pruning, downloads, and the errors for a missing
bucket, bad credentials and an unreachable endpoint. Nothing is mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rlhf_runtime.infra import storage
from tests.s3 import S3Server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    server = S3Server(tmp_path_factory.mktemp("s3proxy"), buckets=("ckpt",)).start()
    try:
        with server.environ():
            yield server
    finally:
        server.stop()


@pytest.fixture
def root(s3: S3Server) -> str:
    return f"s3://ckpt/jobs/{uuid.uuid4().hex[:8]}"


def _local(tmp: Path, step: int, content: str | None = None, big: int = 0) -> Path:
    d = tmp / f"local-{step}-{uuid.uuid4().hex[:6]}"
    (d / "model").mkdir(parents=True)
    (d / "model" / "weights").write_text(content or f"w{step}")
    (d / "optimizer.pt").write_bytes(os.urandom(big) if big else b"o" * step)
    return d


def _save(tmp: Path, root: str, step: int, content: str | None = None) -> str:
    return storage.commit(_local(tmp, step, content), root, step, {"base_model": "m"})


def _content(found: tuple[int, str] | None, tmp: Path) -> tuple[int, str] | None:
    if found is None:
        return None
    local = storage.download(found[1], tmp / f"dl-{uuid.uuid4().hex[:6]}")
    return found[0], (local / "model" / "weights").read_text()


def test_save_latest_download(root: str, tmp_path: Path) -> None:
    assert storage.latest(root) is None
    _save(tmp_path, root, 2)
    uri = _save(tmp_path, root, 10)
    found = storage.latest(root)
    assert found == (10, uri) and uri.startswith(f"{root}/step-00000010/")
    assert _content(found, tmp_path) == (10, "w10")
    state = storage.read_state(root, 10)
    assert state["base_model"] == "m" and state["files"] == {"model/weights": 3, "optimizer.pt": 10}
    assert storage.is_remote(root) and not storage.is_remote("/data/ckpt") and not storage.is_remote(None)


def test_files_without_marker_are_not_a_checkpoint_and_are_pruned_once_superseded(root: str, tmp_path: Path) -> None:
    _save(tmp_path, root, 1)
    _save(tmp_path, root, 2)
    # a save of step 3 killed after its files, before its marker; a marker whose file is gone (step 4)
    storage.upload_tree(_local(tmp_path, 3), f"{root}/step-00000003/host-1-abc")
    _save(tmp_path, root, 4)
    b = storage.Bucket(root)
    state = json.loads(b.get(b.loc.key("step-00000004", "state.json")))
    b.delete([b.loc.key("step-00000004", state["attempt"], "optimizer.pt")])
    assert _content(storage.latest(root), tmp_path) == (2, "w2")
    assert storage.steps(root) == [1, 2, 3, 4]
    # nothing newer than the newest complete step is removed (it may be a save in progress)
    removed = storage.prune(root, keep=1)
    assert storage.steps(root) == [2, 3, 4] and all("/step-00000001/" in k for k in removed)
    _save(tmp_path, root, 5)
    storage.prune(root, keep=2)
    assert storage.steps(root) == [2, 5]  # the partial 3 and the torn 4 went once 5 was complete
    assert _content(storage.latest(root), tmp_path) == (5, "w5")


def test_resave_of_a_step_replaces_it_whole(root: str, tmp_path: Path) -> None:
    first = _save(tmp_path, root, 7, "old")
    second = _save(tmp_path, root, 7, "new")
    assert first != second and storage.latest(root) == (7, second)
    assert _content(storage.latest(root), tmp_path) == (7, "new")
    b = storage.Bucket(root)
    assert not b.list(first.split("s3://ckpt/", 1)[1])  # the previous copy was removed after the new marker


def test_download_is_reused_and_complete(root: str, tmp_path: Path) -> None:
    uri = storage.commit(_local(tmp_path, 1, big=3 << 20), root, 1)
    dest = tmp_path / "dl"
    storage.download(uri, dest)
    assert (dest / "optimizer.pt").stat().st_size == 3 << 20 and (dest / ".complete").read_text() == uri
    mtime = (dest / "optimizer.pt").stat().st_mtime_ns
    storage.download(uri, dest)
    assert (dest / "optimizer.pt").stat().st_mtime_ns == mtime


KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from rlhf_runtime.infra import storage
    local = Path(sys.argv[1])
    (local / "model").mkdir(parents=True)
    (local / "model" / "weights").write_text("w9")
    for i in range(40):  # many files: the upload takes a while
        (local / "model" / f"shard-{i:02d}").write_bytes(os.urandom(256 << 10))
    print("uploading", flush=True)
    storage.commit(local, sys.argv[2], 9)
    print("committed", flush=True)
""")


def test_a_writer_killed_mid_upload_leaves_no_checkpoint(root: str, tmp_path: Path) -> None:
    _save(tmp_path, root, 8)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO}"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "w"), root], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "uploading"
    b = storage.Bucket(root)
    deadline = time.monotonic() + 60
    # two of its objects listed: the first is whole (uploads go one at a time, and the S3 server lists an
    # object whose upload is still in progress, which the writer's death then removes)
    while len(b.list(b.loc.key("step-00000009"))) < 2:
        assert proc.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline, "the writer uploaded fewer than two objects in 60 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    uploaded = b.list(b.loc.key("step-00000009"))
    assert uploaded and not any(k.endswith("/state.json") for k in uploaded)
    assert len(uploaded) < 42, "killed after its last file: nothing left to show"
    assert storage.steps(root) == [8, 9]
    assert _content(storage.latest(root), tmp_path) == (8, "w8")
    _save(tmp_path, root, 10)  # the resumed run saves on; the torn step goes
    storage.prune(root, keep=2)
    assert storage.steps(root) == [8, 10]


def test_errors_name_what_is_wrong(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(storage.StorageError, match=r"bucket 'no-such-bucket' does not exist"):
        storage.latest("s3://no-such-bucket/x")
    with pytest.raises(storage.StorageError, match=r"does not exist"):
        storage.commit(_local(tmp_path, 1), "s3://no-such-bucket/x", 1)
    with pytest.raises(storage.StorageError, match=r"not an object-store URI"):
        storage.Location.parse("/data/ckpt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    storage._STORES.clear()
    try:
        with pytest.raises(storage.StorageError, match=r"refused the credentials"):
            storage.Bucket("s3://ckpt/x").check()
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # discard: nothing listens
        storage._STORES.clear()
        with pytest.raises(storage.StorageError, match=r"cannot reach"):
            storage.Bucket("s3://ckpt/x").check()
    finally:
        storage._STORES.clear()


def test_publish_an_export_marker_last_and_replace_it(root: str, tmp_path: Path) -> None:
    uri = f"{root}/final"
    assert storage.published(uri) is None
    first = _local(tmp_path, 3, "v1")
    (first / "stale.bin").write_bytes(b"s")
    storage.publish(first, uri)
    assert storage.published(uri) == {"model/weights": 2, "optimizer.pt": 3, "stale.bin": 1}
    storage.publish(_local(tmp_path, 4, "v2"), uri)  # a later export replaces the whole prefix
    assert storage.published(uri) == {"model/weights": 2, "optimizer.pt": 4}
    local = storage.download_tree(uri, tmp_path / "export")
    assert (local / "model" / "weights").read_text() == "v2" and not (local / "stale.bin").exists()
    # files without the marker (an export cut short) are not an export
    b = storage.Bucket(uri)
    b.delete([b.loc.key(storage.COMPLETE)])
    assert storage.published(uri) is None


def test_data_from_the_bucket_a_file_or_a_folder(root: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """spec.data.path s3://...: a JSON lines object and a folder of Parquet shards are downloaded to the head and
    read like local ones; a URI with nothing behind it is a DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_api.models import Data
    from rlhf_runtime.algo import data
    from rlhf_runtime.algo.dataset import DataError

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the downloads land in this test's directory
    b = storage.Bucket(root)
    b.put(b.loc.key("prompts.jsonl"), b'{"prompt": "2+2?", "answer": "4"}\n{"prompt": "3+3?", "answer": "6"}\n')
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"q": ["a", "b"]}), shards / "part-0.parquet")
    pq.write_table(pa.table({"q": ["c"]}), shards / "part-1.parquet")
    storage.upload_tree(shards, f"{root}/train")
    lines = data.load_samples(Data(path=f"{root}/prompts.jsonl"))
    assert [(s.prompt, s.answer) for s in lines] == [("2+2?", "4"), ("3+3?", "6")]
    folder = data.load_samples(Data(path=f"{root}/train", promptField="q"))
    assert sorted(s.prompt for s in folder) == ["a", "b", "c"]
    with pytest.raises(DataError, match=r"spec.data.path: .*no such object"):
        data.load_samples(Data(path=f"{root}/missing.jsonl"))
    assert len(list(tmp_path.glob("rlhf-fetch-*"))) == 2  # one per source; nothing left of the missing one
