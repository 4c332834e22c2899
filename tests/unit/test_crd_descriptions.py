"""Field descriptions (what ``kubectl explain`` prints) say what a field does, its default and its bounds;
they quote no measurements. Figures live in benchmarks/RESULTS.md, where they can be regenerated and dated."""

import re
from collections.abc import Iterator
from typing import Any

import pytest

from rlhf_api import crdgen

_NUMBER = r"(?<![\w.])\d+(?:\.\d+)?"
#: Signs of a measurement: a number with a time, speed-up, share, size or rate unit; words that cite a run.
MEASURED = re.compile(
    "|".join(
        [
            _NUMBER + r"\s?(?:ms|us|µs|s|min|%|GB|GiB|TB|TiB)(?![\w])",
            _NUMBER + r"\s?(?:[KMGT]i?B|tokens?|samples?)/s(?![\w])",
            _NUMBER + r"x(?![\w])",
            r"\bmeasured\b",
            r"\b(?:[HAB]100|[HB]200|GB200|MI[23]\d\dX?|L40S?)s?\b",
            r"\b20\d\d-[01]\d-[0-3]\d\b",
            r"\bbenchmarks?/",
        ]
    ),
    re.IGNORECASE,
)


def measured_figures(text: str) -> list[str]:
    """The parts of a description that read as a measurement (empty: none)."""
    return [m.group(0) for m in MEASURED.finditer(text)]


def descriptions(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every ``description`` in a schema tree, with where it is."""
    if isinstance(node, dict):
        if isinstance(node.get("description"), str):
            yield path or ".", node["description"]
        for key, value in node.items():
            yield from descriptions(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from descriptions(value, f"{path}[{i}]")


def test_no_measured_figures_in_crd_descriptions() -> None:
    found = list(descriptions(crdgen.crd()))
    assert len(found) > 100  # the walk reaches the fields
    bad = {path: hits for path, text in found if (hits := measured_figures(text))}
    assert not bad, f"descriptions quote measurements (move them to benchmarks/RESULTS.md): {bad}"


@pytest.mark.parametrize(
    "text",
    [
        "Compile each layer: 1.24-1.43x the training tokens/s.",
        "A 1.7B model in ~5.4 ms per sync.",
        "4.20 -> 4.01 s per step.",
        "MFU 38.6% -> 40.3%.",
        "12.6 GiB more peak memory per GPU.",
        "61 GB sent at 310 GB/s.",
        "8,000 tokens/s per GPU.",
        "Measured on one H200.",
        "On 2 H100s.",
        "Validated 2026-11-27.",
        "See benchmarks/README.md.",
    ],
)
def test_checker_refuses_measurements(text: str) -> None:
    assert measured_figures(text), text


@pytest.mark.parametrize(
    "text",
    [
        "Token budget of a micro-batch; default 16384, at least 16.",
        "Sync weights every N trainer steps (1-100000).",
        "Kueue LocalQueue: label kueue.x-k8s.io/queue-name.",
        "6 x parameters x tokens plus causal attention.",
        "16 bytes per trained parameter (+2 with one worker).",
        "KV cache per engine GPU in GiB (vLLM's kv_cache_memory_bytes).",
        "Deadline of one weight sync in seconds; the runtime measures the mismatch.",
    ],
)
def test_checker_passes_plain_descriptions(text: str) -> None:
    assert measured_figures(text) == [], text


def test_checker_finds_a_planted_description_in_a_schema() -> None:
    crd = crdgen.crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["trainer"]["properties"]["compile"]["description"] += " 1.19x on 2 H200s."
    bad = {path: hits for path, text in descriptions(crd) if (hits := measured_figures(text))}
    root = ".spec.versions[0].schema.openAPIV3Schema.properties.spec"
    compile_path = root + ".properties.trainer.properties.compile"
    assert bad == {compile_path: ["1.19x", "H200s"]}
