"""Prompts: where they come from and which ones a step uses. Pure Python, no torch.

Sources (``spec.data``, and the held-out eval set ``spec.data.eval``: exactly one each):

* ``prompts``: inline list;
* ``path``: a file on a mounted volume;
* ``configMap``: the runtime reads the ConfigMap as a file at ``/etc/rlhf-data/<key>`` (``DATA_MOUNT``;
  overridable with ``RLHF_DATA_DIR`` for local runs). The operator mounts ConfigMap ``<configMap.name>``
  read-only at ``/etc/rlhf-data`` in every container (outside the read-only config volume).

File format: UTF-8 text (a UTF-8 byte-order mark is allowed), either JSON lines or plain text with one prompt
per non-empty line. A JSON line (a line that starts with ``{``) is one complete JSON object with exactly one of

* ``"prompt"``: a non-empty string, or
* ``"messages"``: a chat conversation, a non-empty list of ``{"role": ..., "content": ...}`` objects (role
  ``system``, ``user``, ``assistant`` or ``tool``; content a string) with at least one non-empty user message
  and not ending with an assistant message (the model writes the next one). The sample's ``prompt`` is the
  last user message's content (what reward hooks see); ``render_prompt`` renders the whole conversation with
  the model's chat template;

and optionally the answer field (``data.answerField``, default ``"answer"``). A file named ``*.jsonl``,
``*.ndjson`` or ``*.json`` must be JSON lines throughout.

Malformed input is a ``DataError`` whose message names the source (``spec.data.path ...``,
``spec.data.configMap ...``, ``spec.data.eval.path ...``, ...), the line, and what to change: a file that is
not text (binary, compressed, Parquet, UTF-16) or not UTF-8, a whole JSON document (an array, a pretty-printed
object) instead of JSON lines, a CSV/TSV file, a JSON line that is not an object, has neither or both of
``prompt`` and ``messages``, or a malformed conversation, an empty prompt, and a source without any prompt.
The driver loads the data before it starts Ray, so these fail in seconds.

Order: epoch ``e`` is a permutation of all prompts seeded with ``(seed, e)``; step ``s`` takes the
``promptsPerStep`` prompts starting at ``s * promptsPerStep`` of that endless sequence. A job resumed at
step ``s`` therefore sees the same prompts it would have seen without the restart. The eval set is the first
``spec.data.eval.maxPrompts`` prompts of its source in file order (``load_eval_samples``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_api.models import Data, EvalData

DATA_MOUNT = "/etc/rlhf-data"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
FORMAT = ("one JSON object per line with a string 'prompt' field or a chat 'messages' list, or plain text with "
          "one prompt per line")
ROLES = ("system", "user", "assistant", "tool")
MESSAGES_FORMAT = 'a list like [{"role": "user", "content": "..."}]'
#: Leading bytes of formats that are not text, and what they are.
MAGIC = {b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive", b"PAR1": "a Parquet file",
         b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"(\xb5/\xfd": "zstd-compressed"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    """``prompt``: the text (for a chat sample the last user message's content, what reward hooks see);
    ``messages``: a chat sample's whole conversation as (role, content) pairs, None for a plain prompt."""

    prompt: str
    answer: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None


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


def _messages(value: object, n: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The last user message's content and the (role, content) pairs of a JSON line's ``messages``."""
    if not isinstance(value, list):
        raise DataError(f"line {n}: 'messages' is a JSON {_json_type(value)} ({_clip(json.dumps(value))}), not a "
                        f"list: 'messages' must be {MESSAGES_FORMAT}")
    if not value:
        raise DataError(f"line {n}: 'messages' is empty: it needs at least one user message, {MESSAGES_FORMAT}")
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(value):
        at = f"line {n}: messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} is a JSON {_json_type(m)} ({_clip(json.dumps(m))}), not an object: each "
                            "message must be an object like {\"role\": \"user\", \"content\": \"...\"}")
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            keys = ", ".join(repr(k) for k in list(m)[:8]) or "none"
            raise DataError(f"{at} has no {' and no '.join(repr(k) for k in missing)} field (its fields: {keys}); "
                            "each message needs a string 'role' and a string 'content'")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in ROLES:
            what = _clip(role) if isinstance(role, str) else f"a JSON {_json_type(role)} ({_clip(json.dumps(role))})"
            raise DataError(f"{at}: 'role' is {what}; it must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{at} ({role}): 'content' is a JSON {_json_type(content)} "
                            f"({_clip(json.dumps(content))}), not a string: write the message's text as one string")
        pairs.append((role, content))
    if pairs[-1][0] == "assistant":
        raise DataError(f"line {n}: the conversation ends with an assistant message (messages[{len(pairs) - 1}]); "
                        "it must end with the message the model answers (e.g. a user message): remove the "
                        "trailing assistant message (a reference answer goes in the answer field)")
    users = [i for i, (role, _) in enumerate(pairs) if role == "user"]
    if not users:
        raise DataError(f"line {n}: 'messages' has no user message (roles: "
                        f"{', '.join(r for r, _ in pairs[:8])}); a conversation needs at least one")
    if not pairs[users[-1]][1].strip():
        raise DataError(f"line {n}: the last user message (messages[{users[-1]}]) has empty 'content'")
    return pairs[users[-1]][1], tuple(pairs)


def _json_line(line: str, n: int, answer_field: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"line {n}: invalid JSON ({e.msg} at column {e.colno}): each line must be one complete "
                        "JSON object, e.g. {\"prompt\": \"...\"}") from None
    if not isinstance(obj, dict):
        raise DataError(f"line {n}: a JSON {_json_type(obj)}, not an object: each line must be a JSON object "
                        "with a string 'prompt' field or a chat 'messages' list")
    if "prompt" in obj and "messages" in obj:
        raise DataError(f"line {n}: the JSON object has both 'prompt' and 'messages'; give exactly one: 'prompt' "
                        "for a plain-text prompt or 'messages' for a chat conversation")
    ans = obj.get(answer_field)
    answer = None if ans is None else str(ans)
    if "messages" in obj:
        prompt, messages = _messages(obj["messages"], n)
        return Sample(prompt, answer, messages)
    if "prompt" not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        raise DataError(f"line {n}: the JSON object has no 'prompt' field (its fields: {keys}); every JSON line "
                        "needs a string 'prompt' or a chat 'messages' list")
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise DataError(f"line {n}: 'prompt' is a JSON {_json_type(prompt)} ({_clip(json.dumps(prompt))}), "
                        "not a string")
    if not prompt.strip():
        raise DataError(f"line {n}: 'prompt' is empty")
    return Sample(prompt, answer)


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
                                "file needs one JSON object per line with a string 'prompt' field or a chat "
                                "'messages' list (plain-text prompts go in a file with another name, e.g. "
                                "prompts.txt)")
            else:
                out.append(Sample(line))
        except DataError as e:
            errors.append(str(e))
    if errors:
        more = f" (and {len(errors) - 1} more bad line{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise DataError(f"{source}: {errors[0]}{more}")
    return out


def _describe(src: Data | EvalData, name: str) -> tuple[Path, str]:
    """The file of a file source (``spec.data`` or ``spec.data.eval``, called ``name``) and how messages name it."""
    if src.path:
        return Path(src.path), f"{name}.path {src.path}"
    if src.config_map:
        path = config_map_path(src.config_map.key)
        return path, (f"{name}.configMap {src.config_map.name!r} key {src.config_map.key!r} "
                      f"(mounted at {path})")
    raise DataError(f"{name} needs exactly one of prompts, configMap or path")


def _load(src: Data | EvalData, name: str, answer_field: str) -> list[Sample]:
    if src.prompts:
        for i, p in enumerate(src.prompts):
            if not p.strip():
                raise DataError(f"{name}.prompts[{i}] is empty: remove it or give it text")
        return [Sample(p) for p in src.prompts]
    path, source = _describe(src, name)
    fname = path.name.lower()
    if fname.endswith((".csv", ".tsv")):
        raise DataError(f"{source}: CSV/TSV is not a supported prompts format; convert it to JSON lines: {FORMAT}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        hint = (f" (is {src.config_map.key!r} a key of ConfigMap {src.config_map.name!r}?)"
                if src.config_map else " (is its volume mounted in the pod?)")
        raise DataError(f"{source}: no such file{hint}") from None
    except IsADirectoryError:
        raise DataError(f"{source}: a directory, not a prompts file") from None
    except OSError as e:
        raise DataError(f"cannot read prompts from {source}: {e}") from e
    text = decode(raw, source)
    samples = parse_lines(text, answer_field, source, json_only=fname.endswith(JSON_SUFFIXES))
    if not samples:
        what = "empty" if not text else f"{len(text.splitlines())} lines, all blank"
        raise DataError(f"{source}: no prompts (the file is {what}); it needs at least one prompt: {FORMAT}")
    return samples


def load_samples(data: Data) -> list[Sample]:
    """The training prompts (``spec.data``), in file order."""
    return _load(data, "spec.data", data.answer_field)


def load_eval_samples(data: Data) -> list[Sample]:
    """The held-out eval set (``spec.data.eval``): its first ``maxPrompts`` prompts in file order, no
    shuffling; answers come from the same ``answerField``. Empty when ``spec.data.eval`` is not set."""
    if data.eval is None:
        return []
    return _load(data.eval, "spec.data.eval", data.answer_field)[: data.eval.max_prompts]


def render_prompt(sample: Sample, tokenizer: Any) -> list[int]:
    """The prompt's token ids. A chat sample: its conversation through the tokenizer's chat template with the
    generation prompt appended. A plain prompt: its text without special tokens (a BOS, else EOS, token for an
    empty encoding), exactly what the driver has always encoded."""
    if sample.messages is None:
        ids = list(tokenizer.encode(sample.prompt, add_special_tokens=False))
    else:
        if tokenizer.chat_template is None:
            raise DataError("spec.model's tokenizer has no chat template and the data uses 'messages' (chat "
                            "conversations): use 'prompt' (plain text) instead, or a model whose tokenizer has a "
                            "chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
        conversation = [{"role": role, "content": content} for role, content in sample.messages]
        try:
            out = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template's raise_exception (e.g. "roles must alternate"), a Jinja error
            roles = ", ".join(role for role, _ in sample.messages[:8])
            raise DataError(f"spec.model's chat template rejected the conversation (roles: {roles}) ending "
                            f"{_clip(sample.prompt)}: {type(e).__name__}: {str(e)[:300]}") from e
        if not isinstance(out, list):  # transformers 5: a BatchEncoding (a dict) unless return_dict=False
            out = out["input_ids"]
        ids = list(out[0] if out and isinstance(out[0], list) else out)
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    return ids


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
