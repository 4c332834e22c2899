"""Render the RLHFJob CustomResourceDefinition from the typed models.

``python -m rlhf_api.crdgen --write`` rewrites ``crds/rlhf.dev_rlhfjobs.yaml`` and the chart's copy;
``--check`` exits 1 when either committed file differs from what the models produce (CI runs the same check
as a unit test). The output is a structural OpenAPI v3 schema: ``$ref`` inlined, ``Optional`` collapsed,
pydantic's titles dropped, CEL rules carried over as ``x-kubernetes-validations``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from rlhf_api import models as m

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = f"{m.GROUP}_{m.PLURAL}.yaml"
OUTPUTS = [REPO / "crds" / CRD_FILE, REPO / "charts" / "rlhf-operator" / "crds" / CRD_FILE]

_DROP = {"title", "additionalProperties"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Turn pydantic's JSON schema into a Kubernetes structural schema."""
    if isinstance(node, list):
        return [_structural(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:  # inline, keeping sibling keys (description, default) of the reference
        ref = defs[node.pop("$ref").split("/")[-1]]
        node = {**ref, **node}
    if "anyOf" in node:  # Optional[X] -> X
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unsupported union in schema: {options}")
        node = {**_structural(options[0], defs), **node}
    if node.get("default", 0) is None:
        node.pop("default")
    out: dict[str, Any] = {}
    extra = node.get("additionalProperties")
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items",):
            out[key] = _structural(value, defs)
        elif key == "required":
            out[key] = list(value)
        else:
            out[key] = value
    if isinstance(extra, dict):  # dict[str, X] -> map of X
        out["additionalProperties"] = _structural(extra, defs)
    elif extra is True or (node.get("type") == "object" and "properties" not in node and extra is None):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in out:  # Literal with one value
        out["enum"] = [out.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), (int, float)) and not isinstance(out.get(bound), bool):
            out[plain], out[bound] = out[bound], True  # JSON Schema 2020 -> OpenAPI v3 form
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "required" in out:
        # A field the apiserver defaults is not required from the user.
        props = out.get("properties", {})
        out["required"] = [r for r in out["required"] if "default" not in props.get(r, {})]
        if not out["required"]:
            del out["required"]
    return out


def schema_of(model: type[m.Model]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="serialization", ref_template="#/$defs/{model}")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Job phase."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Last completed step."},
    {"name": "Steps", "type": "integer", "jsonPath": ".status.totalSteps", "description": "Total steps."},
    {
        "name": "Tokens/s",
        "type": "number",
        "jsonPath": ".status.throughput.rolloutTokensPerSecond",
        "description": "Rollout tokens per second (last step).",
    },
    {
        "name": "Sync-s",
        "type": "number",
        "jsonPath": ".status.throughput.weightSyncSeconds",
        "description": "Weight sync seconds (last sync).",
    },
    {
        "name": "Reward",
        "type": "number",
        "jsonPath": ".status.throughput.rewardMean",
        "description": "Mean reward (last step).",
        "priority": 1,
    },
    {
        "name": "Placement",
        "type": "string",
        "jsonPath": ".spec.placement.mode",
        "description": "separate or colocated.",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    spec = schema_of(m.RLHFJobSpec)
    spec["description"] = "What to train and how to lay it out on GPUs."
    status = schema_of(m.RLHFJobStatus)
    status["description"] = "Observed state, written by the operator and (step/throughput/runtime) the runtime."
    root = {
        "type": "object",
        "description": "RLHFJob runs RL post-training (GRPO) of an LLM on a KubeRay cluster with vLLM rollouts.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {m.MAX_NAME_LENGTH}",
                "message": f"RLHFJob names are at most {m.MAX_NAME_LENGTH} characters: Ray cluster, service "
                "and pod names are derived from them",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{m.PLURAL}.{m.GROUP}"},
        "spec": {
            "group": m.GROUP,
            "names": {
                "kind": m.KIND,
                "listKind": f"{m.KIND}List",
                "plural": m.PLURAL,
                "singular": m.SINGULAR,
                "shortNames": m.SHORT_NAMES,
                "categories": ["all", "rlhf"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": m.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = "# Generated by `python -m rlhf_api.crdgen --write` from operator/rlhf_api/models.py. Do not edit.\n"


class _Dumper(yaml.SafeDumper):
    """A schema used in two places (a model two fields share) is written out in both, not as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render() -> str:
    return HEADER + yaml.dump(crd(), Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="write the CRD files")
    g.add_argument("--check", action="store_true", help="exit 1 if a committed CRD file is stale")
    g.add_argument("--stdout", action="store_true", help="print the CRD")
    args = p.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    stale = []
    for path in OUTPUTS:
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path))
    if stale:
        print("stale CRD files (run `python -m rlhf_api.crdgen --write`):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
