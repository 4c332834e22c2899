"""The committed CRD YAML (top level and chart copy) is exactly what the typed models generate."""

from pathlib import Path

import yaml

from rlhf_api import crdgen
from rlhf_api import models as m


def test_committed_crds_are_fresh() -> None:
    text = crdgen.render()
    for path in crdgen.OUTPUTS:
        assert path.exists(), f"{path} missing: run python -m rlhf_api.crdgen --write"
        assert path.read_text() == text, f"{path} is stale: run python -m rlhf_api.crdgen --write"


def _walk(node, path="spec"):
    yield path, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural_and_documented() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema["properties"]["spec"]):
        assert "type" in node, f"{path} has no type (not structural)"
        assert not {"$ref", "anyOf", "allOf", "oneOf", "const", "title"} & node.keys(), path
        if path != "spec" and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description (kubectl explain would be empty)"


def test_every_cel_rule_has_a_message() -> None:
    text = crdgen.render()
    crd = yaml.safe_load(text)
    rules = []
    for _, node in _walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]):
        rules += node.get("x-kubernetes-validations", [])
    assert len(rules) >= 15
    for r in rules:
        assert len(r["message"]) > 20, r


def test_samples_validate_against_models() -> None:
    samples = sorted((Path(crdgen.REPO) / "crds" / "samples").glob("*.yaml"))
    assert len(samples) >= 4
    for s in samples:
        doc = yaml.safe_load(s.read_text())
        assert doc["apiVersion"] == m.API_VERSION and doc["kind"] == m.KIND
        assert len(doc["metadata"]["name"]) <= m.MAX_NAME_LENGTH
        m.RLHFJobSpec.model_validate(doc["spec"])
