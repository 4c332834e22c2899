"""Prompts: where they come from and which ones a step uses. Pure Python, no torch.

Sources (``spec.data``, exactly one):

* ``prompts``: inline list;
* ``path``: a file on a mounted volume;
* ``configMap``: the runtime reads the ConfigMap as a file at ``/etc/rlhf-data/<key>`` (``DATA_MOUNT``;
  overridable with ``RLHF_DATA_DIR`` for local runs). The operator mounts ConfigMap ``<configMap.name>``
  read-only at ``/etc/rlhf-data`` in every container (outside the read-only config volume).

File format: JSON lines with a ``"prompt"`` field (and optionally the answer field, ``data.answerField``,
default ``"answer"``), or plain text with one prompt per non-empty line. A line that starts with ``{`` must
be valid JSON with a ``prompt``.

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


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str | None = None


def config_map_path(key: str) -> Path:
    return Path(os.environ.get("RLHF_DATA_DIR", DATA_MOUNT)) / key


def parse_lines(text: str, answer_field: str = "answer") -> list[Sample]:
    out: list[Sample] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"line {n}: invalid JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise DataError(f"line {n}: a JSON line needs a string 'prompt'")
            ans = obj.get(answer_field)
            out.append(Sample(obj["prompt"], None if ans is None else str(ans)))
        else:
            out.append(Sample(line))
    return out


def load_samples(data: Data) -> list[Sample]:
    if data.prompts:
        samples = [Sample(p) for p in data.prompts]
    else:
        if data.path:
            path = Path(data.path)
        elif data.config_map:
            path = config_map_path(data.config_map.key)
        else:
            raise DataError("data needs exactly one of prompts, configMap or path")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(f"cannot read prompts from {path}: {e}") from e
        samples = parse_lines(text, data.answer_field)
    if not samples:
        raise DataError("no prompts")
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
