"""The operator -> runtime contract: ``RuntimeConfig``, the job configuration the operator writes into a ConfigMap
(``job.json``) and the runtime reads; it tolerates a newer operator. Imports only pydantic."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from rlhf_api.base import (
    API_VERSION,
    Model,
)
from rlhf_api.inputs import Reference
from rlhf_api.spec import RLHFJobSpec
from rlhf_api.training import RolloutCorrection

# ------------------------------------------------------------------------------ operator <-> runtime
#: Spec fields only the operator reads (pod sizes): left out of the runtime's job.json.
OPERATOR_ONLY_FIELDS: tuple[tuple[str, ...], ...] = (("head",), ("backoffLimit",), ("ttlSecondsAfterFinished",),
                                                     ("activeDeadlineSeconds",), ("envFrom",))
#: Spec fields added after runtime 0.1.0, with their defaults. Runtimes up to 0.1.0 refuse a job.json with a key
#: they do not know, so the operator leaves these out while they hold their default: an older runtime image
#: then runs every job that does not ask for the newer feature.
ADDED_AFTER_0_1: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("weightSync", "validate"), False),
    (("weightSync", "timeoutSeconds"), 600),
    (("progressDeadlineSeconds",), 1800),
    (("inRunRecoveries",), 3),
    (("algorithm", "klMode"), "loss"),
    (("algorithm", "lossAggregation"), "token"),
    (("data", "evalEveryNSteps"), 10),
    (("reward", "ruleWeight"), 1.0),
    (("reward", "normalize"), "none"),
    (("reference",), Reference().wire()),
    (("weightSync", "format"), "auto"),
    (("rollout", "asyncEngine"), "asyncllm"),
    (("trainer", "masterWeights"), "float32"),
    (("algorithm", "rolloutCorrection"), RolloutCorrection().wire()),
    (("trainer", "maxTokensPerMicroBatch"), 16384),
    (("trainer", "compile"), False),
    (("trainer", "reshardAfterForward"), True),
    (("trainer", "autocast"), False),
    (("reward", "mathTimeoutSeconds"), 5),
    (("data", "promptField"), "prompt"),
    (("data", "invalidSamples"), "drop"),
    (("trainer", "offloadDuringRollout"), "auto"),
    (("weightSync", "maxStaleness"), 1),
    (("data", "evalOnStart"), False),
)


class RuntimeConfig(Model):
    """The job configuration the operator hands to the runtime (ConfigMap key ``job.json``).

    Compatibility: the operator may be newer than the runtime image (``spec.image``). ``to_runtime_json`` leaves
    out operator-only fields and newer fields at their default; ``from_runtime_json`` (the runtime's reader)
    ignores keys it does not know instead of refusing the job, and names them."""

    api_version: str = Field(API_VERSION, description="API version of the spec below.")
    name: str = Field(description="RLHFJob name.")
    namespace: str = Field(description="RLHFJob namespace.")
    uid: str | None = Field(None, description="RLHFJob uid; reports for another uid are refused.")
    spec: RLHFJobSpec

    def to_runtime_json(self) -> dict[str, Any]:
        """The wire form for job.json (see the class docstring)."""
        out = self.wire()
        spec = out["spec"]
        for path in OPERATOR_ONLY_FIELDS:
            _pop(spec, path)
        for path, default in ADDED_AFTER_0_1:
            if _get(spec, path, default) == default:
                _pop(spec, path)
        return out

    @classmethod
    def from_runtime_json(cls, text: str | bytes) -> tuple[RuntimeConfig, list[str]]:
        """Parse job.json, ignoring keys this version does not know (written by a newer operator); returns the
        config and the dotted paths of the ignored keys. Every other error is raised as usual."""
        data = json.loads(text)
        ignored: list[str] = []
        while True:
            try:
                return cls.model_validate(data), ignored
            except ValidationError as e:
                errors = e.errors()
                if not errors or any(err["type"] != "extra_forbidden" for err in errors):
                    raise
                for err in errors:
                    _pop(data, tuple(err["loc"]))
                    ignored.append(".".join(str(p) for p in err["loc"]))


def _get(d: Any, path: tuple[Any, ...], default: Any) -> Any:
    for key in path:
        if not isinstance(d, (dict, list)):
            return default
        try:
            d = d[key]
        except (KeyError, IndexError, TypeError):
            return default
    return d


def _pop(d: Any, path: tuple[Any, ...]) -> None:
    parent = _get(d, path[:-1], None)
    if isinstance(parent, dict):
        parent.pop(path[-1], None)
