"""Deterministic names and labels of everything an RLHFJob owns.

Guarantees: the same job always yields the same names (so a restarted operator finds what it created instead
of creating twice); names are DNS-1123 labels because the job name is (the CRD caps it at
``MAX_NAME_LENGTH``); two jobs in one namespace never share a child name.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_api.models import GROUP

LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "rlhf-operator"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FINALIZER = f"{GROUP}/finalizer"
CONFIG_KEY = "job.json"
CONFIG_MOUNT = "/etc/rlhf"
#: Where a ConfigMap named by spec.data.configMap is mounted; the runtime reads <DATA_MOUNT>/<key>
#: (not under CONFIG_MOUNT: a configMap volume is read-only and cannot hold a nested mount point).
DATA_MOUNT = "/etc/rlhf-data"


@dataclass(frozen=True)
class ChildNames:
    config_map: str
    ray_job: str
    runtime_identity: str  # ServiceAccount, Role and RoleBinding of the job's runtime

    def as_status(self) -> dict[str, str]:
        return {"configMap": self.config_map, "rayJob": self.ray_job}


def child_names(job_name: str) -> ChildNames:
    return ChildNames(config_map=f"{job_name}-config", ray_job=job_name, runtime_identity=f"{job_name}-runtime")


def labels(job_name: str, role: str | None = None) -> dict[str, str]:
    out = {LABEL_JOB: job_name, LABEL_MANAGED_BY: MANAGER}
    if role:
        out[LABEL_ROLE] = role
    return out
