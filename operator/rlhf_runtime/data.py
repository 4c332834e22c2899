"""Prompts: where they come from and which ones a step uses. Pure Python, no torch.

Sources (``spec.data``, exactly one):

* ``prompts``: inline list;
* ``path``: a file on a mounted volume;
* ``configMap``: the runtime reads the ConfigMap as a file at ``/etc/rlhf-data/<key>`` (``DATA_MOUNT``;
  overridable with ``RLHF_DATA_DIR`` for local runs). The operator mounts ConfigMap ``<configMap.name>``
  read-only at ``/etc/rlhf-data`` in every container (outside the read-only config volume).

File format: UTF-8 text (a UTF-8 byte-order mark is allowed), either JSON lines with a ``"prompt"`` field (and
optionally the answer field, ``data.answerField``, default ``"answer"``), or plain text with one prompt per
non-empty line. A line that starts with ``{`` must be one complete JSON object with a non-empty string
``prompt``. A file named ``*.jsonl``, ``*.ndjson`` or ``*.json`` must be JSON lines throughout.

Malformed input is a ``DataError`` whose message names the source (``spec.data.path ...`` or
``spec.data.configMap ...``), the line, and what to change: a file that is not text (binary, compressed,
Parquet, UTF-16) or not UTF-8, a whole JSON document (an array, a pretty-printed object) instead of JSON
lines, a CSV/TSV file, a JSON line that is not an object or has no usable ``prompt``, an empty prompt, and a
source without any prompt. The driver loads the data before it starts Ray, so these fail in seconds.

Order: epoch ``e`` is a permutation of all prompts seeded with ``(seed, e)``; step ``s`` takes the
``promptsPerStep`` prompts starting at ``s * promptsPerStep`` of that endless sequence. A job resumed at
step ``s`` therefore sees the same prompts it would have seen without the restart.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf_api.models import Data

DATA_MOUNT = "/etc/rlhf-data"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
FORMAT = "one JSON object per line with a string 'prompt' field, or plain text with one prompt per line"
#: Leading bytes of formats that are not text, and what they are.
MAGIC = {b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive", b"PAR1": "a Parquet file",
         b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"(\xb5/\xfd": "zstd-compressed"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str | None = None


def config_map_path(key: str) -> Path:
    return Path(os.environ.get("RLHF_DATA_DIR", DATA_MOUNT)) / key


def _clip(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def decode(raw: bytes, source: str = "prompts") -> str:
    """``raw`` as UTF-8 text, or a ``DataError`` saying what the bytes are instead."""
    for magic, what in MAGIC.items():
        if raw.startswith(magic):
            raise DataError(f"{source}: the file is {what}, not text; it must be UTF-8 text: {FORMAT}")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{source}: the file is UTF-16 text; save it as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
    if b"\x00" in raw:
        at = raw.index(b"\x00")
        line = raw[:at].count(b"\n") + 1
        raise DataError(f"{source}: the file is binary (a NUL byte at line {line}, byte offset {at}), not text; "
                        f"it must be UTF-8 text: {FORMAT}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{source}: not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line} (byte offset "
                        f"{e.start}) is invalid UTF-8; convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
                        ) from None


def _json_type(value: object) -> str:
    names = {list: "array", dict: "object", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _whole_json_document(text: str) -> str | None:
    """What ``text`` is if it is one JSON document spanning several lines (not JSON lines), else None."""
    if len([ln for ln in text.splitlines() if ln.strip()]) < 2:
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(doc, list):
        return "a JSON array"
    return "one JSON object over several lines" if isinstance(doc, dict) else None


def _json_line(line: str, n: int, answer_field: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"line {n}: invalid JSON ({e.msg} at column {e.colno}): each line must be one complete "
                        "JSON object, e.g. {\"prompt\": \"...\"}") from None
    if not isinstance(obj, dict):
        raise DataError(f"line {n}: a JSON {_json_type(obj)}, not an object: each line must be a JSON object "
                        "with a string 'prompt' field")
    if "prompt" not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        raise DataError(f"line {n}: the JSON object has no 'prompt' field (its fields: {keys}); every JSON line "
                        "needs a string 'prompt'")
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise DataError(f"line {n}: 'prompt' is a JSON {_json_type(prompt)} ({_clip(json.dumps(prompt))}), "
                        "not a string")
    if not prompt.strip():
        raise DataError(f"line {n}: 'prompt' is empty")
    ans = obj.get(answer_field)
    return Sample(prompt, None if ans is None else str(ans))


def parse_lines(text: str, answer_field: str = "answer", source: str = "prompts", json_only: bool = False
                ) -> list[Sample]:
    """Samples of a prompts file's text (module docstring); ``json_only``: every line must be JSON. A
    ``DataError`` names the first bad line and how many other lines are bad."""
    doc = _whole_json_document(text) if text.lstrip()[:1] in ("[", "{") else None
    if doc:
        raise DataError(f"{source}: the file is {doc}, not JSON lines: write one JSON object per line, "
                        "e.g. {\"prompt\": \"...\", \"answer\": \"...\"}")
    out: list[Sample] = []
    errors: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("{"):
                out.append(_json_line(line, n, answer_field))
            elif json_only:
                raise DataError(f"line {n}: not a JSON object ({_clip(line, 40)}): a {'/'.join(JSON_SUFFIXES)} "
                                "file needs one JSON object per line with a string 'prompt' field (plain-text "
                                "prompts go in a file with another name, e.g. prompts.txt)")
            else:
                out.append(Sample(line))
        except DataError as e:
            errors.append(str(e))
    if errors:
        more = f" (and {len(errors) - 1} more bad line{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise DataError(f"{source}: {errors[0]}{more}")
    return out


def _describe(data: Data) -> tuple[Path, str]:
    if data.path:
        return Path(data.path), f"spec.data.path {data.path}"
    if data.config_map:
        path = config_map_path(data.config_map.key)
        return path, (f"spec.data.configMap {data.config_map.name!r} key {data.config_map.key!r} "
                      f"(mounted at {path})")
    raise DataError("spec.data needs exactly one of prompts, configMap or path")


def load_samples(data: Data) -> list[Sample]:
    if data.prompts:
        for i, p in enumerate(data.prompts):
            if not p.strip():
                raise DataError(f"spec.data.prompts[{i}] is empty: remove it or give it text")
        return [Sample(p) for p in data.prompts]
    path, source = _describe(data)
    name = path.name.lower()
    if name.endswith((".csv", ".tsv")):
        raise DataError(f"{source}: CSV/TSV is not a supported prompts format; convert it to JSON lines: {FORMAT}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        hint = (f" (is {data.config_map.key!r} a key of ConfigMap {data.config_map.name!r}?)"
                if data.config_map else " (is its volume mounted in the pod?)")
        raise DataError(f"{source}: no such file{hint}") from None
    except IsADirectoryError:
        raise DataError(f"{source}: a directory, not a prompts file") from None
    except OSError as e:
        raise DataError(f"cannot read prompts from {source}: {e}") from e
    text = decode(raw, source)
    samples = parse_lines(text, data.answer_field, source, json_only=name.endswith(JSON_SUFFIXES))
    if not samples:
        what = "empty" if not text else f"{len(text.splitlines())} lines, all blank"
        raise DataError(f"{source}: no prompts (the file is {what}); it needs at least one prompt: {FORMAT}")
    return samples


def step_batch(samples: list[Sample], step: int, n: int, seed: int) -> list[Sample]:
    """The ``n`` prompts of (0-based) step ``step``; deterministic in (samples, step, n, seed)."""
    out: list[Sample] = []
    pos = step * n
    size = len(samples)
    while len(out) < n:
        epoch, offset = divmod(pos, size)
        order = list(range(size))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        take = min(n - len(out), size - offset)
        out += [samples[i] for i in order[offset : offset + take]]
        pos += take
    return out
