"""The base of the API's models: camelCase on the wire, unknown fields refused, CEL rules, common patterns.

Imports only pydantic.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


def cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    """One ``x-kubernetes-validations`` entry."""
    return {"rule": rule, "message": message, **extra}


class Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected (the apiserver prunes them anyway)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def sub(model: type[Model], description: str) -> Any:
    """A nested object that always exists: the apiserver defaults it to the model's full default (the CEL rules
    on the object are checked against that default, so it must be complete, not ``{}``)."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": model().wire()})


CPU_PATTERN = r"^[0-9]+(\.[0-9]+)?m?$"
MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
#: A Kubernetes label value (the rendered pods and RayJob carry these as labels or node selectors).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A Kubernetes label key: an optional DNS-subdomain prefix and a name of at most 63 characters.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------- the API
GROUP = "rlhf.dev"
VERSION = "v1alpha1"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SINGULAR = "rlhfjob"
SHORT_NAMES = ["rlhf"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Longest RLHFJob name: children append suffixes and KubeRay appends more (cluster, group, pod hash).
MAX_NAME_LENGTH = 40
