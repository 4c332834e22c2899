"""The CPU RLHFJob that runs in real pods (demo and the real-pod tests): a tiny model built from a config,
shared with the pods through a hostPath directory, the locally built CPU runtime image, every pod on a real
node with requests small enough for a few 2-CPU nodes. Only the standard library and rlhf_testing.tiny."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from realnodes import NODE_LABEL
from rlhf_testing.tiny import tiny_job_spec

SHARED_MOUNT = "/shared"


def make_shared_dir(path: Path) -> Path:
    """``path`` with a tiny model in ``tiny/`` and a tiny chat model (a chat template, for ``spec.environment``) in
    ``tiny-chat/``, built by one interpreter; world-writable, as the runtime image's user writes checkpoints."""
    path.mkdir(parents=True, exist_ok=True)
    if not all((path / d / "config.json").exists() for d in ("tiny", "tiny-chat")):
        code = (f"from rlhf_testing.tiny import build_tiny_model; build_tiny_model({str(path / 'tiny')!r}, seed=0); "
                "from rlhf_testing.tiny_chat import build_tiny_chat_model; "
                f"build_tiny_chat_model({str(path / 'tiny-chat')!r})")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True)
    for p in [path, *path.rglob("*")]:
        os.chmod(p, 0o777 if p.is_dir() else 0o666)
    return path


def cpu_job(name: str, image: str, shared: Path, steps: int, *, trainers: int = 1) -> dict:
    spec = tiny_job_spec(f"{SHARED_MOUNT}/tiny", steps)
    spec["image"] = image
    spec["trainer"] = {**spec["trainer"], "replicas": trainers, "resources": {"cpu": "100m", "memory": "3Gi"},
                       **({"strategy": "fsdp2"} if trainers > 1 else {})}
    spec["rollout"] = {**spec["rollout"], "resources": {"cpu": "100m", "memory": "4Gi"}}
    spec["head"] = {"resources": {"cpu": "100m", "memory": "2Gi"}}
    spec["scheduling"] = {"nodeSelector": {NODE_LABEL: "true"}}
    spec["volumes"] = [{"name": "shared", "hostPath": {"path": str(shared), "type": "Directory"}}]
    spec["volumeMounts"] = [{"name": "shared", "mountPath": SHARED_MOUNT}]
    # the tiny model is a local directory; there is no hub here
    spec["env"] = [*spec.get("env", []), {"name": "HF_HUB_OFFLINE", "value": "1"}]
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name}, "spec": spec}
