"""Prompts: where they come from and which ones a step uses. Pure Python, no torch.

Sources (``spec.data``, and the held-out eval set ``spec.data.eval``: exactly one each):

* ``prompts``: inline list;
* ``path``: a file on a mounted volume;
* ``configMap``: the runtime reads the ConfigMap as a file at ``/etc/rlhf-data/<key>`` (``DATA_MOUNT``;
  overridable with ``RLHF_DATA_DIR`` for local runs). The operator mounts ConfigMap ``<configMap.name>``
  read-only at ``/etc/rlhf-data`` in every container (outside the read-only config volume).

``path`` may also name a Parquet file, an Arrow file, a folder of Parquet files (a hub dataset's ``data/``) or a
folder written by Hugging Face datasets' ``save_to_disk`` (``algo.dataset``: read a record batch at a time; a row is
a sample as a JSON line's object is, its columns the fields, nulls absent). Every file source is streamed into a
memory-mapped Arrow cache on the driver's disk (``algo.dataset.Dataset``): memory holds a batch, not the file.

File format of a prompts file: UTF-8 text (a UTF-8 byte-order mark is allowed), either JSON lines or plain text with
one prompt per non-empty line. A JSON line (a line that starts with ``{``) is one complete JSON object with exactly
one of

* the prompt field (``data.promptField``, default ``"prompt"``): a non-empty string, or
* ``"messages"``: a chat conversation, a non-empty list of ``{"role": ..., "content": ...}`` objects (role
  ``system``, ``user``, ``assistant`` or ``tool``; content a string) with at least one non-empty user message
  and not ending with an assistant message (the model writes the next one). The sample's ``prompt`` is the
  last user message's content (what reward hooks see); ``render_prompt`` renders the whole conversation with
  the model's chat template;

and optionally the answer field (``data.answerField``, default ``"answer"``). A file named ``*.jsonl``,
``*.ndjson`` or ``*.json`` must be JSON lines throughout.

Malformed input is a ``DataError`` whose message names the source (``spec.data.path ...``,
``spec.data.configMap ...``, ``spec.data.eval.path ...``, ...), the line, and what to change: a file that is
not text (binary, compressed, UTF-16) or not UTF-8, an unreadable Parquet or Arrow file, a whole JSON document (an array, a pretty-printed
object) instead of JSON lines, a CSV/TSV file, a JSON line that is not an object, has neither or both of
``prompt`` and ``messages``, or a malformed conversation, an empty prompt, and a source without any prompt.
The driver loads the data before it starts Ray, so these fail in seconds.

Before the first step (``check_samples``) every training sample is checked against what the run can take: its
rendered prompt plus ``maxTokens`` within the engines' context, and an answer where the reward compares with one.
``data.invalidSamples``: ``drop`` (the default) leaves such samples out and reports them (``status.data``, the
``SamplesValid`` condition and a Warning Event), ``fail`` fails the run naming them. A data problem therefore never
surfaces at a random step of a long run.

Order: epoch ``e`` is a permutation of all prompts seeded with ``(seed, e)``; step ``s`` takes the
``promptsPerStep`` prompts starting at ``s * promptsPerStep`` of that endless sequence. A job resumed at
step ``s`` therefore sees the same prompts it would have seen without the restart. The eval set is the first
``spec.data.eval.maxPrompts`` prompts of its source in file order (``load_eval_samples``).
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import Any

from rlhf_api.models import Data, EvalData
from rlhf_runtime.algo.dataset import CacheWriter, DataError, Dataset, Sample, is_columnar, record_batches
from rlhf_runtime.infra import storage

DATA_MOUNT = "/etc/rlhf-data"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
FORMAT = ("one JSON object per line with a string 'prompt' field or a chat 'messages' list, or plain text with "
          "one prompt per line")
ROLES = ("system", "user", "assistant", "tool")
MESSAGES_FORMAT = 'a list like [{"role": "user", "content": "..."}]'
#: Leading bytes of formats that are not text, and what they are.
MAGIC = {b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive",
         b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"(\xb5/\xfd": "zstd-compressed"}
#: The largest file the loader reads whole to tell one JSON document (an array, a pretty-printed object) from JSON
#: lines; a bigger one gets the per-line errors.
WHOLE_DOCUMENT_BYTES = 256 << 20


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


def _messages(value: object, where: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The last user message's content and the (role, content) pairs of a sample's ``messages`` (``where``: its
    line or row, for messages)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: 'messages' is a JSON {_json_type(value)} ({_clip(json.dumps(value))}), not a "
                        f"list: 'messages' must be {MESSAGES_FORMAT}")
    if not value:
        raise DataError(f"{where}: 'messages' is empty: it needs at least one user message, {MESSAGES_FORMAT}")
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(value):
        at = f"{where}: messages[{i}]"
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
        raise DataError(f"{where}: the conversation ends with an assistant message (messages[{len(pairs) - 1}]); "
                        "it must end with the message the model answers (e.g. a user message): remove the "
                        "trailing assistant message (a reference answer goes in the answer field)")
    users = [i for i, (role, _) in enumerate(pairs) if role == "user"]
    if not users:
        raise DataError(f"{where}: 'messages' has no user message (roles: "
                        f"{', '.join(r for r, _ in pairs[:8])}); a conversation needs at least one")
    if not pairs[users[-1]][1].strip():
        raise DataError(f"{where}: the last user message (messages[{users[-1]}]) has empty 'content'")
    return pairs[users[-1]][1], tuple(pairs)


def _json_line(line: str, n: int, answer_field: str, prompt_field: str = "prompt") -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"line {n}: invalid JSON ({e.msg} at column {e.colno}): each line must be one complete "
                        "JSON object, e.g. {\"prompt\": \"...\"}") from None
    if not isinstance(obj, dict):
        raise DataError(f"line {n}: a JSON {_json_type(obj)}, not an object: each line must be a JSON object "
                        f"with a string {prompt_field!r} field or a chat 'messages' list")
    return sample_of(obj, f"line {n}", answer_field, prompt_field)


def sample_of(obj: dict[str, Any], where: str, answer_field: str, prompt_field: str = "prompt") -> Sample:
    """The sample of one JSON line's object or one Parquet/Arrow row (``where`` names it in errors): exactly one of
    ``prompt_field`` (a non-empty string) and ``messages``; the answer, if any, as text. A row's null is no value."""
    obj = {k: v for k, v in obj.items() if v is not None}
    row = where.startswith("row")
    what, kind, unit = ("the row", "column", "row") if row else ("the JSON object", "field", "JSON line")
    if prompt_field in obj and "messages" in obj:
        raise DataError(f"{where}: {what} has both {prompt_field!r} and 'messages'; give exactly one: "
                        f"{prompt_field!r} for a plain-text prompt or 'messages' for a chat conversation")
    ans = obj.get(answer_field)
    answer = None if ans is None else str(ans)
    if "messages" in obj:
        prompt, messages = _messages(obj["messages"], where)
        return Sample(prompt, answer, messages)
    if prompt_field not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        named = "" if prompt_field == "prompt" else " (data.promptField)"
        raise DataError(f"{where}: {what} has no {prompt_field!r} {kind} (its {kind}s: {keys}); every {unit} "
                        f"needs a string {prompt_field!r}{named} or a chat 'messages' list")
    prompt = obj[prompt_field]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: {prompt_field!r} is a JSON {_json_type(prompt)} "
                        f"({_clip(json.dumps(prompt, default=str))}), not a string")
    if not prompt.strip():
        raise DataError(f"{where}: {prompt_field!r} is empty")
    return Sample(prompt, answer)


def _line_sample(line: str, n: int, answer_field: str, prompt_field: str, json_only: bool) -> Sample:
    """The sample of one stripped, non-empty line of a prompts file (module docstring)."""
    if line.startswith("{"):
        return _json_line(line, n, answer_field, prompt_field)
    if json_only:
        raise DataError(f"line {n}: not a JSON object ({_clip(line, 40)}): a {'/'.join(JSON_SUFFIXES)} "
                        f"file needs one JSON object per line with a string {prompt_field!r} field or a chat "
                        "'messages' list (plain-text prompts go in a file with another name, e.g. prompts.txt)")
    return Sample(line)


def _bad_lines(source: str, first: str, count: int, unit: str = "line") -> DataError:
    more = f" (and {count - 1} more bad {unit}{'s' if count > 2 else ''})" if count > 1 else ""
    return DataError(f"{source}: {first}{more}")


def parse_lines(text: str, answer_field: str = "answer", source: str = "prompts", json_only: bool = False,
                prompt_field: str = "prompt") -> list[Sample]:
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
            out.append(_line_sample(line, n, answer_field, prompt_field, json_only))
        except DataError as e:
            errors.append(str(e))
    if errors:
        raise _bad_lines(source, errors[0], len(errors))
    return out


def _describe(src: Data | EvalData, name: str) -> tuple[Path, str]:
    """The file of a file source (``spec.data`` or ``spec.data.eval``, called ``name``) and how messages name it."""
    if src.path and storage.is_remote(src.path):
        try:
            local = storage.fetch(src.path)
        except storage.StorageError as e:
            raise DataError(f"{name}.path: {e}") from e
        return local, f"{name}.path {src.path} (downloaded to {local})"
    if src.path:
        return Path(src.path), f"{name}.path {src.path}"
    if src.config_map:
        path = config_map_path(src.config_map.key)
        return path, (f"{name}.configMap {src.config_map.name!r} key {src.config_map.key!r} "
                      f"(mounted at {path})")
    raise DataError(f"{name} needs exactly one of prompts, configMap or path")


def _load(src: Data | EvalData, name: str, answer_field: str, prompt_field: str = "prompt") -> list[Sample] | Dataset:
    """The samples of a source: inline prompts as a list; a file or folder streamed into a ``Dataset``."""
    if src.prompts:
        for i, p in enumerate(src.prompts):
            if not p.strip():
                raise DataError(f"{name}.prompts[{i}] is empty: remove it or give it text")
        return [Sample(p) for p in src.prompts]
    path, source = _describe(src, name)
    fname = path.name.lower()
    if fname.endswith((".csv", ".tsv")):
        raise DataError(f"{source}: CSV/TSV is not a supported prompts format; convert it to JSON lines or "
                        f"Parquet: {FORMAT}")
    if not path.exists():
        hint = (f" (is {src.config_map.key!r} a key of ConfigMap {src.config_map.name!r}?)"
                if src.config_map else " (is its volume mounted in the pod?)")
        raise DataError(f"{source}: no such file{hint}")
    if is_columnar(path):
        return _load_columnar(path, source, answer_field, prompt_field)
    return _load_lines(path, source, answer_field, prompt_field, json_only=fname.endswith(JSON_SUFFIXES))


def _load_columnar(path: Path, source: str, answer_field: str, prompt_field: str) -> Dataset:
    """A Parquet or Arrow source (``algo.dataset.record_batches``), a record batch at a time, into the cache."""
    writer = CacheWriter("row")
    errors, first = 0, ""
    for rows, row0 in record_batches(path, source, [prompt_field, "messages", answer_field]):
        for k, obj in enumerate(rows):
            try:
                writer.add(sample_of(obj, f"row {row0 + k}", answer_field, prompt_field), row0 + k)
            except DataError as e:
                errors, first = errors + 1, first or str(e)
    if errors:
        raise _bad_lines(source, first, errors, "row")
    if not writer.count:
        raise DataError(f"{source}: no rows; it needs at least one prompt")
    return writer.close()


def _load_lines(path: Path, source: str, answer_field: str, prompt_field: str, json_only: bool) -> Dataset:
    """A prompts file (JSON lines or text) line by line into the cache: memory holds a batch, not the file."""
    writer = CacheWriter("line")
    errors, first, offset, lines, blank = 0, "", 0, 0, True
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read prompts from {source}: {e}") from e
    with f:
        decode(f.read(8), source)  # compressed, zip, UTF-16: say what the file is
        f.seek(0)
        for n, raw in enumerate(f, 1):
            lines = n
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, offset = raw[3:], 3
            if b"\x00" in raw:
                at = offset + raw.index(b"\x00")
                raise DataError(f"{source}: the file is binary (a NUL byte at line {n}, byte offset {at}), not text; "
                                f"it must be UTF-8 text: {FORMAT}")
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise DataError(f"{source}: not UTF-8 text: byte 0x{raw[e.start]:02x} at line {n} (byte offset "
                                f"{offset + e.start}) is invalid UTF-8; convert the file to UTF-8 (e.g. iconv -f "
                                "LATIN1 -t UTF-8)") from None
            offset += len(raw)
            if not line:
                continue
            if blank:  # the first line with text: one JSON document over several lines is not JSON lines
                blank = False
                _refuse_whole_document(path, source, line)
            try:
                writer.add(_line_sample(line, n, answer_field, prompt_field, json_only), n)
            except DataError as e:
                errors, first = errors + 1, first or str(e)
    if errors:
        raise _bad_lines(source, first, errors)
    if not writer.count:
        what = "empty" if not lines else f"{lines} lines, all blank"
        raise DataError(f"{source}: no prompts (the file is {what}); it needs at least one prompt: {FORMAT}")
    return writer.close()


def _refuse_whole_document(path: Path, source: str, first_line: str) -> None:
    """A file whose first line opens a JSON array, or an object that does not close on that line, may be one JSON
    document: read whole (up to ``WHOLE_DOCUMENT_BYTES``) to say so."""
    if not first_line.startswith("["):
        if not first_line.startswith("{"):
            return
        try:
            json.loads(first_line)
            return
        except json.JSONDecodeError:
            pass
    if path.stat().st_size > WHOLE_DOCUMENT_BYTES:
        return
    doc = _whole_json_document(path.read_bytes().decode("utf-8-sig", errors="replace"))
    if doc:
        raise DataError(f"{source}: the file is {doc}, not JSON lines: write one JSON object per line, "
                        "e.g. {\"prompt\": \"...\", \"answer\": \"...\"}")


def load_samples(data: Data) -> list[Sample] | Dataset:
    """The training prompts (``spec.data``), in file order."""
    return _load(data, "spec.data", data.answer_field, data.prompt_field)


def load_eval_samples(data: Data) -> list[Sample]:
    """The held-out eval set (``spec.data.eval``): its first ``maxPrompts`` prompts in file order, no
    shuffling; answers come from the same ``answerField``. Empty when ``spec.data.eval`` is not set."""
    if data.eval is None:
        return []
    return list(_load(data.eval, "spec.data.eval", data.answer_field, data.prompt_field)[: data.eval.max_prompts])


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


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, size: int) -> list[int]:
    """Epoch ``epoch``'s permutation of the samples (made once per epoch, not per step)."""
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def step_batch(samples: list[Sample] | Dataset, step: int, n: int, seed: int) -> list[Sample]:
    """The ``n`` prompts of (0-based) step ``step``; deterministic in (samples, step, n, seed)."""
    picks: list[int] = []
    pos = step * n
    size = len(samples)
    while len(picks) < n:
        epoch, offset = divmod(pos, size)
        order = _epoch_order(seed, epoch, size)
        take = min(n - len(picks), size - offset)
        picks += order[offset : offset + take]
        pos += take
    if isinstance(samples, Dataset):
        return samples.take(picks)  # one gather from the memory-mapped cache
    return [samples[i] for i in picks]


#: Reward rules that compare with the sample's answer (else ``reward.target``).
ANSWER_RULES = ("exactMatch", "contains", "math")
#: How many lines or rows a message names per reason.
NAMED = 8


def check_samples(samples: list[Sample] | Dataset, tokenizer: Any, context: int | None, max_tokens: int,
                  needs_answer: bool, policy: str = "drop", source: str = "spec.data"
                  ) -> tuple[list[Sample] | Dataset, dict[str, Any]]:
    """Every sample against what the run can take, before the first step (so a bad sample never surfaces at a
    random step of a long run): its rendered prompt plus ``max_tokens`` within ``context`` (the engines' context;
    None: not checked) and, when ``needs_answer``, an answer. ``policy`` ``drop``: the samples kept and
    ``status.data`` (``samples``, ``dropped``, ``message`` naming the first lines or rows per reason); ``fail``: a
    ``DataError`` naming them. Tokenizes in batches (``BATCH``), so memory stays bounded by a batch."""
    from rlhf_runtime.algo.dataset import BATCH

    unit = samples.unit if isinstance(samples, Dataset) else "prompt"
    long_, unanswered, keep = [], [], []
    longest = 0
    for start in range(0, len(samples), BATCH):
        positions = range(start, min(start + BATCH, len(samples)))
        batch = samples.take(positions) if isinstance(samples, Dataset) else [samples[i] for i in positions]
        origins = samples.origins(positions) if isinstance(samples, Dataset) else [i + 1 for i in positions]
        lengths = _prompt_lengths(batch, tokenizer) if context else [0] * len(batch)
        for pos, s, origin, n in zip(positions, batch, origins, lengths):
            bad = False
            if context and n + max_tokens > context:
                long_.append(origin)
                longest = max(longest, n)
                bad = True
            if needs_answer and (s.answer is None or not s.answer.strip()):
                unanswered.append(origin)
                bad = True
            if not bad:
                keep.append(pos)
    dropped = len(samples) - len(keep)
    status: dict[str, Any] = {"samples": len(keep), "dropped": dropped}
    if not dropped:
        return samples, status

    def named(where: list[int]) -> str:
        more = f", ... ({len(where) - NAMED} more)" if len(where) > NAMED else ""
        return f"{unit}s {', '.join(map(str, where[:NAMED]))}{more}"

    reasons = []
    if long_:
        reasons.append(f"{len(long_)} too long for the engines' context (rendered prompt + maxTokens {max_tokens} > "
                       f"{context} tokens, the longest prompt {longest} tokens: {named(long_)})")
    if unanswered:
        reasons.append(f"{len(unanswered)} without an answer (spec.reward compares with one and has no target: "
                       f"{named(unanswered)})")
    what = f"{source}: {dropped} of {len(samples)} samples cannot run: {'; '.join(reasons)}"
    if policy == "fail" or not keep:
        why = "data.invalidSamples fail" if policy == "fail" else "none is left to train on"
        raise DataError(f"{what} ({why}); fix or remove them, or raise rollout.maxModelLen")
    status["message"] = f"{what}; dropped (data.invalidSamples drop)"[:1000]
    kept = samples.subset(keep) if isinstance(samples, Dataset) else [samples[i] for i in keep]
    return kept, status


def _prompt_lengths(batch: list[Sample], tokenizer: Any) -> list[int]:
    """Token counts of the samples' rendered prompts (plain prompts encoded in one batch call)."""
    plain = [i for i, s in enumerate(batch) if s.messages is None]
    out = [0] * len(batch)
    if plain:
        enc = tokenizer([batch[i].prompt for i in plain], add_special_tokens=False)["input_ids"]
        for i, ids in zip(plain, enc):
            out[i] = max(1, len(ids))
    for i, s in enumerate(batch):
        if s.messages is not None:
            out[i] = len(render_prompt(s, tokenizer))
    return out
