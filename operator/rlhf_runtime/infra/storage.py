"""Object storage for checkpoints, exports and data: ``s3://bucket/prefix`` (also ``gs://``), torch-free.

The client is obstore (Python bindings of the Rust ``object_store`` crate of the Apache Arrow project): one
wheel without Python dependencies that speaks S3 (and S3-compatible servers), GCS and Azure through one API.
s3fs and boto3 were the alternatives; both go through botocore, which pins ``python-dateutil<3`` while the
``kubernetes`` client this project needs (37.x) requires ``>=3``: installing s3fs downgrades dateutil under the
operator's client, so neither is used.

Endpoint and credentials come from the environment, as every AWS tool reads them: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``), ``AWS_REGION``/``AWS_DEFAULT_REGION`` and, for an
S3-compatible server, ``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``); the operator renders them from
``spec.checkpoint.storage`` and its Secret. ``http://`` endpoints are allowed (in-cluster servers).

Exports (``publish``/``published``): ``<uri>/final`` (and ``<uri>/step-<N>``) holds the Hugging Face files and a
``_COMPLETE`` object written after them. Data (``fetch``): an object or a prefix downloaded once to a local path.

Listings: every decision lists the whole prefix once (object stores have no directories; SeaweedFS's filer even
keeps empty "directories" after their objects are deleted, which a delimiter listing would report as steps).

Checkpoints (object stores have no rename, so a directory cannot appear atomically): the layout is

    <prefix>/step-<8 digits>/<attempt>/...     the files of one save (model/, optimizer.pt), attempt = host-pid-time
    <prefix>/step-<8 digits>/state.json        the commit marker, written last: {"step", "attempt", "files": {path: size}}

A save (``commit``) uploads every file of the local directory under a fresh ``<attempt>/``, then writes
``state.json`` (one PUT: an object store shows either the old or the new object, never a torn one). A kill at any
point before that leaves files without a marker: not a checkpoint. A re-save of a step first uploads its own
attempt, then replaces the marker, then removes the previous attempt, so the step always has a complete copy.

``latest`` is the highest step whose marker exists, parses, names its own step and whose listed files all exist
with their recorded sizes; anything else is skipped with a warning. ``prune`` keeps the newest ``keep`` complete
steps and removes every step below the newest complete one that is not kept (partial ones included), and the
attempts of kept steps that their marker does not name once a newer step is complete (a live writer of the
newest step is never touched). Every FSDP rank resumes from the step rank 0 found (``checkpoint.agree``), and
downloads it (``download``) into a local directory of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("rlhf_runtime.infra.storage")

SCHEMES = ("s3", "s3a", "gs")  # Azure (az://account/container/...) has another URI shape: not offered
STATE = "state.json"
STEP_PREFIX = re.compile(r"^step-(\d{8})$")
Found = tuple[int, str]


class StorageError(RuntimeError):
    """An object-store operation failed; the message names the location and what to check."""


def is_remote(location: str | os.PathLike | None) -> bool:
    """Whether ``location`` is an object-store URI (``s3://...``) rather than a path."""
    if location is None:
        return False
    m = re.match(r"^([a-z0-9]+)://", str(location))
    return bool(m) and m.group(1) in SCHEMES


@dataclass(frozen=True)
class Location:
    """A parsed ``scheme://bucket/prefix`` (prefix without leading or trailing slashes)."""

    scheme: str
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> Location:
        m = re.match(r"^([a-z0-9]+)://([^/]+)/?(.*)$", uri)
        if not m or m.group(1) not in SCHEMES:
            raise StorageError(f"{uri!r} is not an object-store URI (s3://bucket/prefix or gs://bucket/prefix)")
        return cls(m.group(1), m.group(2), m.group(3).strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def uri(self, *parts: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key(*parts)}".rstrip("/")

    def child(self, *parts: str) -> Location:
        return Location(self.scheme, self.bucket, self.key(*parts))


def _endpoint(endpoint: str | None) -> str | None:
    return endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_STORES: dict[tuple[str, str, str | None, str | None], Any] = {}


def store_for(loc: Location, endpoint: str | None = None, region: str | None = None) -> Any:
    """The obstore store of ``loc``'s bucket (cached per bucket, endpoint and region)."""
    from obstore.store import from_url

    endpoint = _endpoint(endpoint)
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    key = (loc.scheme, loc.bucket, endpoint, region)
    if key in _STORES:
        return _STORES[key]
    kw: dict[str, Any] = {}
    client: dict[str, Any] = {"connect_timeout": "10s", "timeout": "300s"}
    if loc.scheme in ("s3", "s3a"):
        config: dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False  # path style: what S3-compatible servers serve
            client["allow_http"] = endpoint.startswith("http://")
        kw["config"] = config
    store = from_url(f"{loc.scheme}://{loc.bucket}", client_options=client,
                     retry_config={"max_retries": 3, "retry_timeout": _td(30),
                                   "backoff": {"init_backoff": _td(0.1), "max_backoff": _td(2), "base": 2}}, **kw)
    _STORES[key] = store
    return store


def _td(seconds: float) -> Any:
    from datetime import timedelta
    return timedelta(seconds=seconds)


def _explain(e: BaseException, loc: Location, what: str) -> StorageError:
    """A specific message for the usual misconfigurations (the raw error kept as the cause)."""
    text = str(e)
    where = f"{loc.scheme}://{loc.bucket}" + (f" at {_endpoint(None)}" if _endpoint(None) else "")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        hint = f"bucket {loc.bucket!r} does not exist ({where}): create it first"
    elif any(s in text for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden",
                                  "Unauthenticated", "PermissionDenied")):
        hint = (f"{where} refused the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the storage "
                "credentialsSecret): check the keys and their permissions on the bucket")
    elif any(s in text.lower() for s in ("connection refused", "error sending request", "dns error",
                                          "timed out", "tcp connect")):
        hint = f"cannot reach {where}: check the endpoint (spec.checkpoint.storage.endpoint, AWS_ENDPOINT_URL_S3)"
    else:
        hint = f"{where}: {text.splitlines()[0] if text else type(e).__name__}"
    return StorageError(f"{what} {loc.uri()}: {hint}")


# ------------------------------------------------------------------------------------------- primitives
class Bucket:
    """Operations under one ``Location`` (keys relative to the bucket)."""

    def __init__(self, uri: str | Location, endpoint: str | None = None, region: str | None = None):
        self.loc = uri if isinstance(uri, Location) else Location.parse(uri)
        self.store = store_for(self.loc, endpoint, region)

    def _do(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except StorageError:
            raise
        except Exception as e:  # obstore's errors: NotFoundError (a FileNotFoundError), GenericError, ...
            if isinstance(e, FileNotFoundError) and "NoSuchBucket" not in str(e):
                raise  # a missing object: the caller decides
            raise _explain(e, self.loc, what) from e

    def check(self) -> None:
        """Raise a ``StorageError`` saying what is wrong unless the bucket exists and the credentials may list it."""
        import obstore

        def first() -> None:
            for _ in obstore.list(self.store, prefix=self.loc.key() or None, chunk_size=1):
                break
        self._do("cannot list", first)

    def list(self, key: str) -> dict[str, int]:
        """``{key: size}`` of every object under the key prefix ``key`` (a "directory": ``key/``)."""
        import obstore

        out: dict[str, int] = {}
        prefix = key.strip("/") + "/" if key.strip("/") else None

        def run() -> None:
            for chunk in obstore.list(self.store, prefix=prefix):
                for meta in chunk:
                    out[meta["path"]] = int(meta["size"])
        self._do("cannot list", run)
        return out

    def get(self, key: str) -> bytes:
        import obstore
        return bytes(self._do("cannot read", lambda: obstore.get(self.store, key).bytes()))

    def put(self, key: str, data: bytes | Path) -> None:
        import obstore
        if isinstance(data, Path):
            self._do("cannot write", obstore.put, self.store, key, data, chunk_size=8 << 20, max_concurrency=4)
        else:
            self._do("cannot write", obstore.put, self.store, key, data)

    def download(self, key: str, dest: Path) -> None:
        import obstore

        def run() -> None:
            got = obstore.get(self.store, key)  # a missing object raises here, before any local file
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(dest.name + ".part")
            with open(part, "wb") as f:
                f.writelines(got.stream(min_chunk_size=8 << 20))
            os.replace(part, dest)
        self._do("cannot read", run)

    def delete(self, keys: list[str]) -> None:
        import obstore
        for i in range(0, len(keys), 500):
            self._do("cannot delete", obstore.delete, self.store, keys[i:i + 500])


def upload_tree(local: str | Path, uri: str | Location, endpoint: str | None = None) -> dict[str, int]:
    """Upload every regular file under the local directory ``local`` to ``uri/<relative path>``; returns
    ``{relative path: size}``."""
    b = Bucket(uri, endpoint)
    local = Path(local)
    files: dict[str, int] = {}
    for p in sorted(local.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = p.relative_to(local).as_posix()
            b.put(b.loc.key(rel), p)
            files[rel] = p.stat().st_size
    return files


def download_tree(uri: str | Location, local: str | Path, endpoint: str | None = None) -> Path:
    """Download every object under ``uri/`` into the local directory ``local`` (created); returns it."""
    b = Bucket(uri, endpoint)
    local = Path(local)
    local.mkdir(parents=True, exist_ok=True)
    base = b.loc.key()
    for key in b.list(base):
        rel = key[len(base):].lstrip("/")
        if rel:
            b.download(key, local / rel)
    return local


# ------------------------------------------------------------------------------------------ checkpoints
def _step(step: int) -> str:
    return f"step-{step:08d}"


def _attempt() -> str:
    return f"{socket.gethostname() or 'localhost'}-{os.getpid()}-{time.time_ns():x}"


def read_state(uri: str | Location, step: int, endpoint: str | None = None,
               listing: dict[str, int] | None = None) -> dict[str, Any]:
    """The marker of step ``step`` under the checkpoint root ``uri``, checked for completeness (every listed file
    present with its size; ``listing``: the root's objects, when already listed); raises ``ValueError`` saying
    what is wrong."""
    b = Bucket(uri, endpoint)
    marker = b.loc.key(_step(step), STATE)
    try:
        state = json.loads(b.get(marker))
    except FileNotFoundError:
        raise ValueError(f"{b.loc.uri(_step(step))}: no {STATE} (an incomplete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{b.loc.uri(_step(step), STATE)} is not valid JSON ({e})") from e
    if not isinstance(state, dict) or state.get("step") != step or not isinstance(state.get("attempt"), str) \
            or not isinstance(state.get("files"), dict):
        raise ValueError(f"{b.loc.uri(_step(step), STATE)}: not the marker of step {step} "
                         "(needs 'step', 'attempt' and 'files')")
    base = b.loc.key(_step(step), state["attempt"])
    have = listing if listing is not None else b.list(base)
    for name, size in state["files"].items():
        got = have.get(f"{base}/{name}")
        if got is None:
            raise ValueError(f"{b.loc.uri(_step(step), state['attempt'])}: {name} is missing")
        if got != size:
            raise ValueError(f"{b.loc.uri(_step(step), state['attempt'])}: {name} has {got} bytes, "
                             f"{STATE} recorded {size}")
    return state


def _by_step(b: Bucket) -> tuple[dict[str, int], dict[int, list[str]]]:
    """Every object under the root (one listing: object stores have no directories, and a server that keeps
    empty "directories" after deletes, as SeaweedFS's filer does, must not make a step appear) and the keys
    of each step."""
    listing = b.list(b.loc.key())
    base = b.loc.key()
    per: dict[int, list[str]] = {}
    for key in listing:
        rel = key[len(base):].lstrip("/") if base else key
        if m := STEP_PREFIX.match(rel.split("/", 1)[0]):
            per.setdefault(int(m.group(1)), []).append(key)
    return listing, per


def steps(uri: str | Location, endpoint: str | None = None) -> list[int]:
    """Every step with objects under ``uri`` (complete or not), ascending."""
    return sorted(_by_step(Bucket(uri, endpoint))[1])


def latest(uri: str | Location, endpoint: str | None = None) -> Found | None:
    """``(step, URI of its files)`` of the highest complete checkpoint under ``uri``, or None."""
    b = Bucket(uri, endpoint)
    listing, per = _by_step(b)
    for s in sorted(per, reverse=True):
        try:
            state = read_state(b.loc, s, endpoint, listing)
        except ValueError as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        return s, b.loc.uri(_step(s), state["attempt"])
    return None


def commit(local: str | Path, uri: str | Location, step: int, extra: dict | None = None,
           endpoint: str | None = None) -> str:
    """Upload the fully written local directory ``local`` as checkpoint ``step`` under ``uri``, then its marker
    (module docstring). Returns the URI of the step's files. An error before the marker leaves no checkpoint of
    the step (a complete earlier copy of the same step stays)."""
    b = Bucket(uri, endpoint)
    attempt = _attempt()
    files = upload_tree(local, b.loc.child(_step(step), attempt), endpoint)
    files.pop(STATE, None)
    try:
        previous = json.loads(b.get(b.loc.key(_step(step), STATE))).get("attempt")
    except (FileNotFoundError, ValueError, AttributeError):
        previous = None
    marker = {"step": step, **(extra or {}), "attempt": attempt, "files": files}
    b.put(b.loc.key(_step(step), STATE), json.dumps(marker).encode())
    if previous and previous != attempt:
        try:
            b.delete(list(b.list(b.loc.key(_step(step), previous))))
        except StorageError as e:  # committed all the same; prune() retries
            log.warning("could not remove the previous copy of step %d: %s", step, e)
    return b.loc.uri(_step(step), attempt)


def prune(uri: str | Location, keep: int = 2, endpoint: str | None = None) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints; remove the rest below the newest complete one (module
    docstring). Returns the removed keys."""
    b = Bucket(uri, endpoint)
    listing, per = _by_step(b)
    complete: dict[int, str] = {}
    for s in per:
        try:
            complete[s] = read_state(b.loc, s, endpoint, listing)["attempt"]
        except ValueError:
            pass
    if not complete:
        return []
    newest = max(complete)
    kept = set(sorted(complete)[-keep:]) if keep > 0 else set()
    doomed: list[str] = []
    for s, keys in sorted(per.items()):
        if s >= newest and s not in complete:
            continue  # a newer save may be in progress
        if s in kept:
            if s == newest:
                continue  # a re-save of the newest step may be in progress
            live = b.loc.key(_step(s), complete[s]) + "/"
            marker = b.loc.key(_step(s), STATE)
            keys = [k for k in keys if not k.startswith(live) and k != marker]
        doomed.extend(keys)
    if doomed:
        # markers first: a step is never complete with some of its files gone
        doomed.sort(key=lambda k: not k.endswith("/" + STATE))
        b.delete(doomed)
    return doomed


def download(found_uri: str, local: str | Path, endpoint: str | None = None) -> Path:
    """The files of a checkpoint (``latest``'s URI) in the local directory ``local``; a complete earlier download
    there (``.complete`` names the URI) is reused."""
    local = Path(local)
    done = local / ".complete"
    if done.is_file() and done.read_text() == found_uri:
        return local
    if local.exists():
        import shutil
        shutil.rmtree(local)
    download_tree(found_uri, local, endpoint)
    done.write_text(found_uri)
    return local


# ---------------------------------------------------------------------------------------------- exports
COMPLETE = "_COMPLETE"


def publish(local: str | Path, uri: str | Location, endpoint: str | None = None) -> dict[str, int]:
    """A model export (``spec.output.uri``): the local directory ``local`` at ``uri/``. The previous export's
    ``_COMPLETE`` marker goes first and its other objects next, then the files are uploaded and ``_COMPLETE``
    (``{"files": {path: size}}``) is written last: a prefix without the marker is an export in progress or cut
    short, never mistaken for a complete one. Returns the files."""
    b = Bucket(uri, endpoint)
    marker = b.loc.key(COMPLETE)
    old = b.list(b.loc.key())
    if marker in old:
        b.delete([marker])
    stale = [k for k in old if k != marker]
    if stale:
        b.delete(stale)
    files = upload_tree(local, b.loc, endpoint)
    b.put(marker, json.dumps({"files": files}).encode())
    return files


def published(uri: str | Location, endpoint: str | None = None) -> dict[str, int] | None:
    """The files of a complete export at ``uri`` (its ``_COMPLETE`` marker, every file present with its size),
    or None."""
    b = Bucket(uri, endpoint)
    have = b.list(b.loc.key())
    if b.loc.key(COMPLETE) not in have:
        return None
    files = json.loads(b.get(b.loc.key(COMPLETE)))["files"]
    ok = all(have.get(b.loc.key(name)) == size for name, size in files.items())
    return files if ok else None


# ------------------------------------------------------------------------------------------------- data
def fetch(uri: str, cache: str | Path | None = None, endpoint: str | None = None) -> Path:
    """The object (a file) or the prefix (a folder, e.g. Parquet shards) at ``uri`` as a local path under
    ``cache`` (default: the temporary directory), downloaded once per process: ``spec.data.path``."""
    import hashlib

    b = Bucket(uri, endpoint)
    key = b.loc.key()
    base = Path(cache or tempfile.gettempdir()) / f"rlhf-fetch-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"
    name = key.rsplit("/", 1)[-1] or b.loc.bucket
    local = base / name
    if (base / ".complete").is_file():
        return local
    base.mkdir(parents=True, exist_ok=True)
    try:
        try:
            b.download(key, local)  # one object
        except FileNotFoundError:
            if not b.list(key):
                raise StorageError(f"{uri}: no such object, and no objects under it as a prefix") from None
            download_tree(b.loc, local, endpoint)  # a "folder"
    except BaseException:
        import shutil
        shutil.rmtree(base, ignore_errors=True)
        raise
    (base / ".complete").write_text(uri)
    return local
