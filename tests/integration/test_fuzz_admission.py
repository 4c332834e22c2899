"""Property-based bad input against the real kube-apiserver (hypothesis, reproducible: derandomized, fixed
example counts).

Generated RLHFJob specs (valid layouts plus wrong types, huge and negative numbers, unicode and very long
strings, missing required fields, unknown fields, contradictory placement, bad quantities) and generated edits
of a live job are sent to the apiserver (server-side dry run). Properties:

(a) every request is either accepted or refused at admission with a specific message: HTTP 400/422 naming a
    mutated field or the rule it broke; never a 5xx, a generic error or a timeout;
(b) accepted => ``RLHFJobSpec.model_validate`` of the stored (defaulted) spec succeeds: admission and the
    operator's Python models agree;
(c) a sample (>= 30) of the accepted specs is created for real with a running operator: each job reaches a
    sensible phase (Pending, Provisioning, Running; Suspended when suspended) and the operator neither crashes
    nor stalls (alive at the end, still reconciling a fresh job);
(e) accepted => what the operator renders from it (the RayJob and the pod templates inside it) is admissible
    too (server-side dry run): otherwise the job is accepted and then stuck, or its pods can never be made;
(d) edits: a change of allowlisted fields only (``models.MUTABLE_FIELDS``) with valid values is accepted, any
    other change is refused with a message naming the field.

Failures are collected over the whole run (not stopped at the first) so one run reports every disagreement,
each with the mutations that produced it.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import time
import types
import typing
import uuid
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from rlhf_api import models as m
from rlhf_operator import render
from tests.helpers import wait_for
from tests.integration.conftest import Operator

pytestmark = pytest.mark.cluster

CREATE_EXAMPLES = 460  # dry-run creates
UPDATE_EXAMPLES = 120  # dry-run edits of a live job
REAL_SAMPLE = 32  # accepted specs created for real (property c)
SETTINGS = {"derandomize": True, "deadline": None, "database": None, "print_blob": True,
                "suppress_health_check": list(HealthCheck)}
PLURAL_PATH = f"/apis/{m.GROUP}/{m.VERSION}/namespaces/{{ns}}/{m.PLURAL}"
SENSIBLE = {"Pending", "Provisioning", "Running"}


# ------------------------------------------------------------------------------------------------ raw API
class Raw:
    """The apiserver over plain HTTP (exact bodies, exact status codes; no client-side validation)."""

    def __init__(self, kubeconfig) -> None:
        cfg = json.loads(kubeconfig.read_text())
        self.server = cfg["clusters"][0]["cluster"]["server"]
        self.s = requests.Session()
        self.s.verify = False
        self.s.trust_env = False  # a CA bundle from the environment would override verify=False
        self.s.headers.update({"Authorization": f"Bearer {cfg['users'][0]['user']['token']}",
                               "User-Agent": "rlhf-fuzz-test", "Content-Type": "application/json"})

    def url(self, ns: str, name: str = "") -> str:
        return self.server + PLURAL_PATH.format(ns=ns) + (f"/{name}" if name else "")

    def create(self, ns: str, obj: dict, dry: bool = True, strict: bool = True) -> requests.Response:
        params = {"fieldValidation": "Strict" if strict else "Warn", **({"dryRun": "All"} if dry else {})}
        return self.s.post(self.url(ns), params=params, data=json.dumps(obj), timeout=30)

    def replace(self, ns: str, obj: dict, dry: bool = True) -> requests.Response:
        params = {"fieldValidation": "Strict", **({"dryRun": "All"} if dry else {})}
        return self.s.put(self.url(ns, obj["metadata"]["name"]), params=params, data=json.dumps(obj), timeout=30)

    def get(self, ns: str, name: str) -> dict:
        r = self.s.get(self.url(ns, name), timeout=30)
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def raw(cluster) -> Raw:
    return Raw(cluster.kubeconfig)


@pytest.fixture(scope="module")
def fuzz_ns(cluster) -> str:
    ns = f"fz-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# ------------------------------------------------------------------------------------------ valid bases
SMALL = {"cpu": "1", "memory": "2Gi"}
COMMON = {
    "model": {"name": "Qwen/Qwen3-0.6B"},
    "image": "runtime:0.1.0",
    "data": {"prompts": ["What is 1+1?", "What is 2+2?"]},
    "reward": {"rule": "exactMatch", "target": "2"},
    "algorithm": {"steps": 20, "promptsPerStep": 4},
    "head": {"resources": {"cpu": "1", "memory": "2Gi"}, "submitter": {"cpu": "100m", "memory": "256Mi"}},
}
BASES: dict[str, dict] = {
    "separate-tp2": {**COMMON, "trainer": {"replicas": 1, "gpusPerReplica": 1, "resources": SMALL},
                     "rollout": {"engines": 1, "tensorParallelSize": 2, "resources": SMALL},
                     "placement": {"mode": "separate", "gpusPerNode": 8}, "weightSync": {"backend": "nccl"}},
    "colocated-dp2": {**COMMON, "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2",
                                            "resources": SMALL},
                      "rollout": {"engines": 2, "tensorParallelSize": 1, "gpuMemoryUtilization": 0.4},
                      "placement": {"mode": "colocated", "gpusPerNode": 8}, "weightSync": {"backend": "ipc"}},
    "cpu-only": {**COMMON, "trainer": {"replicas": 1, "gpusPerReplica": 0, "resources": SMALL},
                 "rollout": {"engines": 1, "tensorParallelSize": 1, "resources": SMALL},
                 "data": {"configMap": {"name": "prompts", "key": "p.jsonl"}}},
    "moe-ep": {**COMMON, "trainer": {"replicas": 1, "gpusPerReplica": 1, "resources": SMALL},
               "rollout": {"engines": 2, "tensorParallelSize": 1, "expertParallel": True, "resources": SMALL},
               "reward": {"function": "rewards.math:score"}},
    "checkpointed": {**COMMON, "trainer": {"replicas": 1, "gpusPerReplica": 1, "resources": SMALL},
                     "rollout": {"engines": 1, "tensorParallelSize": 1, "resources": SMALL},
                     "volumes": [{"name": "data", "emptyDir": {}}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                     "checkpoint": {"volume": "data", "path": "/data/ckpt", "everyNSteps": 5},
                     "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                     "scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
                     "weightSync": {"mode": "async"}},
}


def job(name: str, spec: dict) -> dict:
    return {"apiVersion": m.API_VERSION, "kind": m.KIND, "metadata": {"name": name}, "spec": spec}


# --------------------------------------------------------------------------- fields, from the models
def _unwrap(ann: Any) -> Any:
    if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def _constraints(field) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for md in field.metadata:
        for key in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(md, key, None) is not None:
                out[key] = getattr(md, key)
    return out


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def fields(model: type[BaseModel] = m.RLHFJobSpec, prefix: tuple = ()) -> list[tuple[tuple, Any, Any]]:
    """(wire path, FieldInfo, unwrapped annotation) of every field, objects and leaves."""
    out = []
    for name, f in model.model_fields.items():
        path = (*prefix, f.alias or name)
        ann = _unwrap(f.annotation)
        out.append((path, f, ann))
        if _is_model(ann):
            out.extend(fields(ann, path))
    return out


FIELDS = fields()
LEAVES = [x for x in FIELDS if not _is_model(x[2])]

# ------------------------------------------------------------------------------------ value strategies
WEIRD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=20),
    st.sampled_from(["", " ", "\n", "\x00", "é", "日本語", "🦙" * 5, "a\u202eb", "\ud800", "null", "true", "0",
                     "-1", "1e999", "${HOME}", "'; DROP TABLE", "../../etc/passwd", "x" * 70_000]),
)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | WEIRD_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
QUANTITIES = ["1", "0", "100m", "0.5", "1.5Gi", "2Gi", "256Mi", "1Ki", "1K", "1k", "1M", "1G", "1T", "1Pi", "1Ei",
              "1e3", "-1", "-1Gi", "Gi", "", " 1Gi", "1gi", "1.Gi", ".5Gi", "1.5m", "0.0001m", "1Mi\n",
              "99999999999999999999999999Ti", "123456789012345678901234567890", "1m" * 20]
HUGE_INTS = [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63), -(2**63) - 1, -1, 0]


def valid_value(f, ann) -> st.SearchStrategy:
    c = _constraints(f)
    if ann is bool:
        return st.booleans()
    if ann is int:
        lo = c.get("ge", c["gt"] + 1 if "gt" in c else -(2**40))
        hi = c.get("le", c["lt"] - 1 if "lt" in c else 2**40)
        return st.one_of(st.integers(lo, min(hi, lo + 20)), st.integers(lo, hi), st.sampled_from([lo, hi]))
    if ann is float:
        lo = c.get("ge", c.get("gt", -1e6))
        hi = c.get("le", c.get("lt", 1e6))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min="gt" in c,
                         exclude_max="lt" in c)
    if typing.get_origin(ann) is typing.Literal:
        return st.sampled_from(typing.get_args(ann))
    if ann is str:
        if "pattern" in c:
            return st.from_regex(c["pattern"], fullmatch=True).filter(
                lambda s: len(s) <= c.get("max_length", 10**9))
        lo, hi = c.get("min_length", 0), c.get("max_length", 300)
        return st.one_of(st.text(min_size=lo, max_size=min(hi, 40)), st.just("x" * hi), st.just("é" * hi),
                         st.text(alphabet=st.characters(codec="utf-8"), min_size=max(lo, 1), max_size=min(hi, 30)))
    return ANY_JSON  # lists/dicts: their own strategies below


def invalid_value(f, ann) -> st.SearchStrategy:
    c = _constraints(f)
    opts: list[Any] = []
    if ann is int:
        opts = [*HUGE_INTS, 1.5, "3", True]
        for k, d in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
            if k in c:
                opts.append(c[k] + d)
    elif ann is float:
        opts = [1e308, -1e308, "0.5", True]
        for k, d in (("ge", -1e-9), ("gt", 0), ("le", 1e-9), ("lt", 0)):
            if k in c:
                opts.append(c[k] + d)
    elif typing.get_origin(ann) is typing.Literal:
        opts = [str(typing.get_args(ann)[0]).upper(), "", "other", 1]
    elif ann is str:
        opts = [1, True, ["a"], {"a": 1}]
        if "max_length" in c:
            opts += ["y" * (c["max_length"] + 1), "ü" * (c["max_length"] + 1)]
        if c.get("min_length"):
            opts.append("")
        if "pattern" in c:
            return st.one_of(st.sampled_from(opts), st.text(max_size=20).filter(
                lambda s: not re.fullmatch(c["pattern"].strip("^$"), s)))
    elif ann is bool:
        opts = ["true", 1, None, "yes"]
    else:
        return ANY_JSON
    return st.sampled_from(opts)


def wrong_type(ann) -> st.SearchStrategy:
    by_type = {bool: ["true", 1, [True]], int: ["1", 1.5, [1], {"a": 1}], float: ["0.5", [0.5], {"x": 1.0}],
               str: [1, 2.5, False, ["s"], {"s": "t"}]}
    return st.sampled_from(by_type.get(ann, ["a string", 7, 1.25, True, [1, 2], {"k": "v"}]))


def special(path: tuple) -> st.SearchStrategy | None:
    """Lists and maps: generated from their item shapes (valid or not)."""
    name = path[-1]
    if name == "prompts":
        return st.one_of(st.lists(WEIRD_TEXT, max_size=5), st.just([]), st.just(["p"] * 10_001),
                         st.just(["q" * 100_000]))
    if name == "nodeSelector":
        return st.dictionaries(WEIRD_TEXT, WEIRD_TEXT, max_size=3)
    if name == "tolerations":
        tol = st.fixed_dictionaries({}, optional={
            "key": WEIRD_TEXT, "operator": st.sampled_from(["Exists", "Equal", "In", ""]), "value": WEIRD_TEXT,
            "effect": st.sampled_from(["NoSchedule", "NoExecute", "PreferNoSchedule", "Bogus"]),
            "tolerationSeconds": st.sampled_from([0, 60, -5, 2**63])})
        return st.lists(tol, max_size=3) | st.just([{}] * 65)
    if name == "env":
        var = st.fixed_dictionaries({"name": st.from_regex(r"^[A-Za-z_][A-Za-z0-9_.-]{0,20}$", fullmatch=True)
                                     | WEIRD_TEXT}, optional={"value": WEIRD_TEXT})
        return st.lists(var, max_size=4) | st.just([{"name": f"V{i}"} for i in range(257)])
    if name == "volumes":
        vol = st.fixed_dictionaries({"name": st.sampled_from(["data", "v1", ""]) | WEIRD_TEXT},
                                    optional={"emptyDir": st.just({}), "hostPath": st.just({"path": "/x"}),
                                              "bogus": ANY_JSON})
        return st.lists(vol, max_size=4) | st.just([{"name": f"v{i}", "emptyDir": {}} for i in range(64)])
    if name == "volumeMounts":
        vm = st.fixed_dictionaries({"name": st.sampled_from(["data", "v1", "nope"]),
                                    "mountPath": st.sampled_from(["/data", "/m", "relative", ""])},
                                   optional={"readOnly": st.booleans(), "subPath": WEIRD_TEXT})
        return st.lists(vm, max_size=3)
    return None


@st.composite
def leaf_mutation(draw) -> tuple:
    path, f, ann = draw(st.sampled_from(LEAVES))
    sp = special(path)
    kind = draw(st.sampled_from(["valid", "valid", "invalid", "wrongtype", "delete"]))
    if kind == "delete":
        return ("delete", path, None)
    if sp is not None and kind != "wrongtype":
        return ("set", path, draw(sp))
    if kind == "valid":
        return ("set", path, draw(valid_value(f, ann)))
    if kind == "invalid":
        return ("set", path, draw(invalid_value(f, ann)))
    return ("set", path, draw(wrong_type(ann)))


@st.composite
def object_mutation(draw) -> tuple:
    objs = [(), *[p for p, _, ann in FIELDS if _is_model(ann)]]
    path = draw(st.sampled_from(objs))
    kind = draw(st.sampled_from(["unknown", "unknown", "delete", "wrongtype", "empty"]))
    if kind == "unknown":
        key = draw(st.sampled_from(["bogusField", "replica", "Trainer", "gpus_per_node", "ünïcode", "x" * 300]))
        return ("set", (*path, key), draw(ANY_JSON))
    if not path:
        return ("set", ("suspend",), draw(st.booleans()))
    if kind == "delete":
        return ("delete", path, None)
    if kind == "empty":
        return ("set", path, {})
    return ("set", path, draw(wrong_type(dict)))


@st.composite
def layout_mutation(draw) -> tuple:
    """Trainer, rollout, placement and weight sync sizes drawn together: contradictory placements."""
    small = st.integers(0, 18)
    layout = {
        ("trainer", "replicas"): draw(st.integers(1, 4)),
        ("trainer", "gpusPerReplica"): draw(small),
        ("trainer", "strategy"): draw(st.sampled_from(["single", "fsdp2"])),
        ("rollout", "engines"): draw(st.integers(1, 8)),
        ("rollout", "tensorParallelSize"): draw(st.integers(1, 18)),
        ("rollout", "expertParallel"): draw(st.booleans()),
        ("placement", "mode"): draw(st.sampled_from(["separate", "colocated"])),
        ("placement", "gpusPerNode"): draw(st.integers(1, 16)),
        ("placement", "colocatedSleep"): draw(st.booleans()),
        ("weightSync", "backend"): draw(st.sampled_from(["nccl", "ipc"])),
        ("weightSync", "mode"): draw(st.sampled_from(["sync", "async"])),
    }
    return ("layout", tuple(layout), tuple(layout.values()))


@st.composite
def quantity_mutation(draw) -> tuple:
    where = draw(st.sampled_from([("trainer", "resources"), ("rollout", "resources"), ("head", "resources"),
                                  ("head", "submitter")]))
    key = draw(st.sampled_from(["cpu", "memory"]))
    value = draw(st.sampled_from(QUANTITIES) | st.from_regex(m.MEMORY_PATTERN, fullmatch=True).filter(
        lambda s: len(s) <= 32))
    return ("set", (*where, key), value)


@st.composite
def name_mutation(draw) -> tuple:
    name = draw(st.sampled_from(["a" * 40, "a" * 41, "UPPER", "dots.are.ok", "-lead", "x" * 254, "é"])
                | st.from_regex(r"^[a-z][a-z0-9-]{0,45}$", fullmatch=True))
    return ("name", ("metadata", "name"), name)


MUTATION = st.one_of(leaf_mutation(), leaf_mutation(), layout_mutation(), quantity_mutation(), object_mutation(),
                     name_mutation())
CASE = st.tuples(st.sampled_from(sorted(BASES)), st.lists(MUTATION, max_size=3), st.booleans())


def _set(d: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[path[-1]] = copy.deepcopy(value)


def _delete(d: Any, path: tuple) -> None:
    for k in path[:-1]:
        d = d.get(k) if isinstance(d, dict) else None
        if not isinstance(d, dict):
            return
    d.pop(path[-1], None)


def build(case: tuple) -> tuple[dict, list[tuple], bool]:
    base, mutations, strict = case
    obj = job("fz", copy.deepcopy(BASES[base]))
    paths: list[tuple] = []
    for kind, path, value in mutations:
        if kind == "set":
            _set(obj["spec"], path, value)
            paths.append(path)
        elif kind == "delete":
            _delete(obj["spec"], path)
            paths.append(path)
        elif kind == "layout":
            for p, v in zip(path, value, strict=True):
                _set(obj["spec"], p, v)
            paths.extend(path)
        elif kind == "name":
            obj["metadata"]["name"] = value
            paths.append(path)
    return obj, paths, strict


def describe(case: tuple) -> str:
    base, mutations, strict = case

    def short(v: Any) -> str:
        s = json.dumps(v, ensure_ascii=True)
        return s if len(s) <= 80 else f"{s[:60]}...<{len(s)} chars>"

    parts = []
    for kind, path, value in mutations:
        if kind == "layout":
            parts.append("layout " + ", ".join(f"{'.'.join(p)}={v}" for p, v in zip(path, value, strict=True)))
        else:
            parts.append(f"{kind} {'.'.join(map(str, path))}" + ("" if kind == "delete" else f"={short(value)}"))
    return f"base={base} strict={strict}: " + ("; ".join(parts) or "(unchanged)")


# ---------------------------------------------------------------------------------------- the properties
GENERIC = ("Internal error", "internal error", "context deadline exceeded", "the server was unable",
           "etcdserver", "cost budget", "no such key", "no such overload", "panic")


def refusal_problem(r: requests.Response, paths: list[tuple]) -> str | None:
    """None when the refusal is specific (400/422 naming a mutated field or its rule), else what is wrong."""
    if r.status_code not in (400, 422):
        return f"HTTP {r.status_code} (want 400/422): {r.text[:400]}"
    try:
        msg = r.json().get("message", "")
    except ValueError:
        return f"HTTP {r.status_code} with a non-JSON body: {r.text[:300]}"
    if any(g in msg for g in GENERIC):
        return f"generic error: {msg[:600]}"
    segments = {str(s) for p in paths for s in p if len(str(s)) > 2 and s != "spec"}
    if not any(s in msg for s in segments):
        return f"message names none of {sorted(segments)}: {msg[:600]}"
    return None


class Findings:
    def __init__(self) -> None:
        self.by_kind: dict[str, list[str]] = collections.defaultdict(list)
        self.counts: collections.Counter = collections.Counter()

    def add(self, kind: str, text: str) -> None:
        self.by_kind[kind].append(text)

    def report(self) -> str:
        lines = []
        for kind, items in self.by_kind.items():
            lines.append(f"== {kind}: {len(items)}")
            lines += [f"  - {t}" for t in items[:8]]
        return "\n".join(lines)


RESULTS: dict[str, Any] = {}


#: Always-run examples (besides the generated ones): values next to a limit of what the operator renders them
#: into (KubeRay's int32 fields, label values, Kubernetes quantity suffixes, label-valued node selectors).
EDGE_CASES = [
    ("cpu-only", [("set", ("trainer", "resources", "memory"), "64K")], True),
    ("cpu-only", [("set", ("rollout", "resources", "cpu"), "0.5m")], True),
    ("cpu-only", [("set", ("activeDeadlineSeconds",), 2**31)], True),
    ("cpu-only", [("set", ("ttlSecondsAfterFinished",), 2**31)], True),
    ("cpu-only", [("set", ("scheduling", "queueName"), "team a")], True),
    ("cpu-only", [("set", ("scheduling", "nodeSelector"), {"pool name": "a"})], True),
    ("separate-tp2", [("set", ("placement", "gpuProduct"), "NVIDIA H100 80GB")], True),
    ("cpu-only", [("set", ("env",), [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}])], True),
    ("cpu-only", [("set", ("scheduling", "tolerations"), [{"operator": "Equal", "value": "x"}])], True),
]


def _edge_examples(fn):
    for case in reversed(EDGE_CASES):
        fn = example(case=case)(fn)
    return fn


def run_create_fuzz(raw: Raw, ns: str) -> dict[str, Any]:
    """(a) and (b) over CREATE_EXAMPLES generated specs; cached per module (test (c) reuses the accepted ones)."""
    if "create" in RESULTS:
        return RESULTS["create"]
    findings, accepted = Findings(), []
    started = time.monotonic()

    @settings(max_examples=CREATE_EXAMPLES, **SETTINGS)
    @given(case=CASE)
    @_edge_examples
    def check(case: tuple) -> None:
        obj, paths, strict = build(case)
        findings.counts["sent"] += 1
        try:
            r = raw.create(ns, obj, dry=True, strict=strict)
        except requests.RequestException as e:  # a timeout or a dropped connection
            findings.add("(a) no answer", f"{describe(case)} -> {e!r}")
            return
        if r.status_code in (200, 201):
            findings.counts["accepted"] += 1
            stored = r.json()["spec"]
            try:
                m.RLHFJobSpec.model_validate(stored)
            except ValidationError as e:
                findings.add("(b) accepted by the apiserver, refused by RLHFJobSpec",
                             f"{describe(case)} -> {e.errors()[0]['loc']}: {e.errors()[0]['msg']}")
                return
            accepted.append((case, obj, stored))
            return
        findings.counts["refused"] += 1
        findings.counts[f"HTTP {r.status_code}"] += 1
        problem = refusal_problem(r, paths)
        if problem:
            findings.add("(a) refusal not specific", f"{describe(case)} -> {problem}")

    check()
    RESULTS["create"] = {"findings": findings, "accepted": accepted, "seconds": time.monotonic() - started}
    return RESULTS["create"]


def test_generated_specs_admission_agrees_with_models(raw, fuzz_ns) -> None:
    res = run_create_fuzz(raw, fuzz_ns)
    f = res["findings"]
    print(f"\n[fuzz create] {dict(f.counts)} in {res['seconds']:.1f}s")
    print(f.report())
    assert f.counts["sent"] >= CREATE_EXAMPLES * 0.95, f.counts
    assert f.counts["accepted"] >= 50 and f.counts["refused"] >= 100, f"too one-sided a generator: {f.counts}"
    assert not f.by_kind, "admission/model disagreements or unspecific refusals:\n" + f.report()


def _probe_pods(rj: dict) -> list[tuple[str, dict]]:
    """The pod templates inside a rendered RayJob, as Pods to dry-run (without the job's ServiceAccount, which
    exists only once the operator made it)."""
    spec = rj["spec"]
    groups = [("head", spec["rayClusterSpec"]["headGroupSpec"]["template"]),
              *[(g["groupName"], g["template"]) for g in spec["rayClusterSpec"]["workerGroupSpecs"]],
              ("submitter", spec["submitterPodTemplate"])]
    out = []
    for group, tpl in groups:
        pod_spec = copy.deepcopy(tpl["spec"])
        pod_spec.pop("serviceAccountName", None)
        for c in pod_spec.get("containers", []):
            c.setdefault("image", "x")
        out.append((group, {"apiVersion": "v1", "kind": "Pod", "spec": pod_spec,
                            "metadata": {**copy.deepcopy(tpl.get("metadata") or {}), "name": f"probe-{group}"}}))
    return out


def test_accepted_specs_render_admissible_children(raw, fuzz_ns) -> None:
    """(e) for every accepted spec of the create run: its RayJob and pod templates pass the apiserver too."""
    res = run_create_fuzz(raw, fuzz_ns)
    findings = Findings()
    for case, obj, stored in res["accepted"]:
        spec = m.RLHFJobSpec.model_validate(stored)
        rj = render.render_ray_job(render.Job(obj["metadata"]["name"], fuzz_ns, "00000000-fuzz", spec))
        findings.counts["rayjobs"] += 1
        r = raw.s.post(f"{raw.server}/apis/ray.io/v1/namespaces/{fuzz_ns}/rayjobs", params={"dryRun": "All"},
                       data=json.dumps(rj), timeout=30)
        if r.status_code != 201:
            findings.add("(e) accepted spec, RayJob refused (the job would be stuck without a phase)",
                         f"{describe(case)} -> HTTP {r.status_code}: {r.json().get('message', '')[:400]}")
            continue
        for group, pod in _probe_pods(rj):
            findings.counts["pods"] += 1
            r = raw.s.post(f"{raw.server}/api/v1/namespaces/{fuzz_ns}/pods", params={"dryRun": "All"},
                           data=json.dumps(pod), timeout=30)
            if r.status_code == 403 and "no PriorityClass with name" in r.text:
                continue  # cluster state, not the spec: the operator reports it (test_missing_priority_class...)
            if r.status_code != 201:
                findings.add("(e) accepted spec, its pods can never be created",
                             f"{describe(case)} -> {group} pod HTTP {r.status_code}: "
                             f"{r.json().get('message', '')[:400]}")
                break
    print(f"\n[fuzz render] {dict(findings.counts)}")
    print(findings.report())
    assert findings.counts["rayjobs"] >= 50
    assert not findings.by_kind, "accepted specs whose children are refused:\n" + findings.report()


# ------------------------------------------------------------------------------------------------ edits
MUTABLE = set(m.MUTABLE_FIELDS)
EDIT_VALID: dict[str, st.SearchStrategy] = {
    "suspend": st.booleans(),
    "algorithm.steps": st.integers(1, 10_000_000),
    "progressDeadlineSeconds": st.integers(10, 7 * 24 * 3600),
    "activeDeadlineSeconds": st.integers(1, 2**40) | st.none(),
    "ttlSecondsAfterFinished": st.integers(0, 2**40) | st.none(),
    "backoffLimit": st.integers(0, 100),
}
EDIT_INVALID: dict[str, list[Any]] = {
    "suspend": ["yes", 1],
    "algorithm.steps": [0, -1, 10_000_001, "10", 2**63],
    "progressDeadlineSeconds": [9, 7 * 24 * 3600 + 1, -1],
    "activeDeadlineSeconds": [0, -5, "1h"],
    "ttlSecondsAfterFinished": [-1, "x"],
    "backoffLimit": [101, -1, 1.5],
}
#: Fields that may not change, with other values that are valid on their own (so the only error is the edit).
FROZEN_CHANGES: list[tuple[str, str, Any]] = [
    ("image", "image", "runtime:0.2.0"),
    ("model", "model.name", "other/model"),
    ("model", "model.revision", "main"),
    ("trainer", "trainer.resources.cpu", "3"),
    ("trainer", "trainer.optimizer.weightDecay", 0.1),
    ("trainer", "trainer.gradientCheckpointing", True),
    ("rollout", "rollout.sampling.temperature", 0.5),
    ("rollout", "rollout.gpuMemoryUtilization", 0.3),
    ("rollout", "rollout.enforceEager", True),
    ("placement", "placement.gpusPerNode", 4),
    ("placement", "placement.gpuProduct", "NVIDIA-H200"),
    ("weightSync", "weightSync.bucketSizeMB", 64),
    ("weightSync", "weightSync.timeoutSeconds", 60),
    ("weightSync", "weightSync.validate", True),
    ("head", "head.resources.cpu", "3"),
    ("algorithm.learningRate", "algorithm.learningRate", 2e-6),
    ("algorithm.promptsPerStep", "algorithm.promptsPerStep", 8),
    ("algorithm.klCoef", "algorithm.klCoef", 0.01),
    ("algorithm.seed", "algorithm.seed", 7),
    ("algorithm.epochsPerStep", "algorithm.epochsPerStep", 2),
    ("algorithm.clipRatio", "algorithm.clipRatio", 0.3),
    ("data", "data.prompts", ["another prompt"]),
    ("reward", "reward.target", "4"),
    ("scheduling", "scheduling.nodeSelector", {"pool": "b"}),
    ("scheduling", "scheduling.queueName", "team-b"),
    ("scheduling", "scheduling.priorityClassName", "high"),
    ("env", "env", [{"name": "A", "value": "1"}]),
    ("checkpoint", "checkpoint.everyNSteps", 3),
    ("volumes", "volumes", [{"name": "data", "emptyDir": {"medium": "Memory"}}]),
    ("volumeMounts", "volumeMounts", [{"name": "data", "mountPath": "/other"}]),
]
EDIT_BASE = "checkpointed"


#: Invalid edit values of the wrong JSON type: the apiserver then skips the CEL rules ("some validation rules
#: were not checked because the object was invalid"), so a frozen field in the same edit need not be named.
def _type_error(value: Any, path: str) -> bool:
    want = bool if path == "suspend" else int
    return type(value) is not want


@st.composite
def edits(draw) -> list[tuple[str, str, Any, str]]:
    """(kind, wire path, value, rule field) with kind allowed / invalid / frozen; one edit per path."""
    out: dict[str, tuple[str, str, Any, str]] = {}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["allowed", "allowed", "invalid", "frozen"]))
        if kind == "frozen":
            field, path, value = draw(st.sampled_from(FROZEN_CHANGES))
            out[path] = (kind, path, value, field)
        else:
            path = draw(st.sampled_from(sorted(MUTABLE)))
            value = draw(EDIT_VALID[path]) if kind == "allowed" else draw(st.sampled_from(EDIT_INVALID[path]))
            out[path] = (kind, path, value, path)
    return list(out.values())


def run_update_fuzz(raw: Raw, ns: str) -> Findings:
    findings = Findings()
    base = job("fz-edit", copy.deepcopy(BASES[EDIT_BASE]))
    r = raw.create(ns, base, dry=False)
    assert r.status_code == 201, r.text
    live = raw.get(ns, "fz-edit")

    @settings(max_examples=UPDATE_EXAMPLES, **SETTINGS)
    @given(changes=edits())
    def check(changes: list) -> None:
        obj = copy.deepcopy(live)
        for _kind, path, value, _field in changes:
            if value is None:
                _delete(obj["spec"], tuple(path.split(".")))
            else:
                _set(obj["spec"], tuple(path.split(".")), value)
        desc = "; ".join(f"{k} {p}={json.dumps(v)[:60]}" for k, p, v, _ in changes)
        findings.counts["sent"] += 1
        try:
            r = raw.replace(ns, obj, dry=True)
        except requests.RequestException as e:
            findings.add("(d) no answer", f"{desc} -> {e!r}")
            return
        kinds = {k for k, *_ in changes}
        msg = r.json().get("message", "") if r.headers.get("content-type", "").startswith("application/json") else ""
        if kinds == {"allowed"}:
            if r.status_code != 200:
                findings.add("(d) allowlisted edit refused", f"{desc} -> HTTP {r.status_code}: {msg[:500]}")
                return
            findings.counts["accepted"] += 1
            stored = r.json()["spec"]
            for _k, path, value, _f in changes:
                got = stored
                for k in path.split("."):
                    got = got.get(k) if isinstance(got, dict) else None
                final = next(v for _, p, v, _ in reversed(changes) if p == path)
                if got != final:
                    findings.add("(d) allowlisted edit not stored", f"{desc} -> {path}={got!r}")
            try:
                m.RLHFJobSpec.model_validate(stored)
            except ValidationError as e:
                findings.add("(b) edited spec refused by RLHFJobSpec", f"{desc} -> {e.errors()[0]}")
            return
        findings.counts["refused"] += 1
        if r.status_code not in (400, 422) or any(g in msg for g in GENERIC):
            findings.add("(d) refusal not specific", f"{desc} -> HTTP {r.status_code}: {msg[:500]}")
            return
        type_errors = any(k == "invalid" and _type_error(v, p) for k, p, v, _ in changes)
        named = [f for k, p, _v, f in changes if k != "allowed" and
                 (f"spec.{f} cannot change" in msg if k == "frozen" else p.split(".")[-1] in msg)]
        if not named:
            findings.add("(d) refusal names no changed field", f"{desc} -> {msg[:600]}")
        for kind, path, _v, field in changes:
            if kind == "frozen" and not type_errors and f"spec.{field} cannot change" not in msg:
                findings.add("(d) frozen field not named", f"{desc} -> missing 'spec.{field} cannot change' in: "
                             f"{msg[:600]}")
            if kind == "invalid" and path.split(".")[-1] not in msg:
                findings.add("(d) invalid value not named", f"{desc} -> missing {path} in: {msg[:600]}")

    check()
    return findings


def test_generated_edits_follow_the_allowlist(raw, fuzz_ns) -> None:
    started = time.monotonic()
    f = run_update_fuzz(raw, fuzz_ns)
    print(f"\n[fuzz edits] {dict(f.counts)} in {time.monotonic() - started:.1f}s")
    assert f.counts["sent"] >= UPDATE_EXAMPLES * 0.95 and f.counts["accepted"] >= 20 and f.counts["refused"] >= 20
    assert not f.by_kind, "edit allowlist disagreements:\n" + f.report()


# ------------------------------------------------------------------------------- (c) accepted, for real
def _pods(spec: m.RLHFJobSpec) -> int:
    workers = spec.trainer.replicas + (0 if spec.placement.mode == "colocated" else spec.rollout.engines)
    return 2 + workers  # head + submitter + workers


def _mutated(case: tuple) -> set[str]:
    return {".".join(map(str, p)) for kind, path, _ in case[1]
            for p in (path if kind == "layout" else (path,))}


def pick_sample(accepted: list[tuple[tuple, dict, dict]], n: int) -> list[tuple[tuple, dict]]:
    """Accepted specs small enough to run (few pods), chosen greedily to cover as many mutated fields as
    possible (deterministic: ties go to the earlier example)."""
    pool = [(case, obj) for case, obj, stored in accepted
            if _pods(m.RLHFJobSpec.model_validate(stored)) <= 6 and len(json.dumps(obj)) <= 200_000]
    covered: set[str] = set()
    out: list[tuple[tuple, dict]] = []
    while pool and len(out) < n:
        best = max(range(len(pool)), key=lambda i: (len(_mutated(pool[i][0]) - covered), -i))
        case, obj = pool.pop(best)
        covered |= _mutated(case)
        out.append((case, obj))
    return out


def test_accepted_sample_runs_with_the_operator(cluster, raw, fuzz_ns, tmp_path) -> None:
    res = run_create_fuzz(raw, fuzz_ns)
    sample = pick_sample(res["accepted"], REAL_SAMPLE)
    assert len(sample) >= 30, f"only {len(sample)} runnable accepted specs"
    ns = f"fzr-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    op = Operator(cluster, ["--namespace", ns], tmp_path / "op.log").start()
    try:
        names = {}
        for i, (case, obj) in enumerate(sample):
            body = copy.deepcopy(obj)
            body["metadata"] = {"name": f"s{i}"}
            r = raw.create(ns, body, dry=False, strict=case[2])
            assert r.status_code == 201, f"{describe(case)}: accepted in dry run, refused for real: {r.text[:400]}"
            names[f"s{i}"] = case

        def phases() -> dict[str, dict]:
            return {n: raw.get(ns, n).get("status") or {} for n in names}

        def settled(s: dict, suspend: bool) -> bool:
            """A phase that explains itself: the RayJob exists (Provisioning, Running), or Pending says why."""
            ready = next((c for c in s.get("conditions") or [] if c["type"] == "Ready"), {})
            if suspend:
                return s.get("phase") == "Suspended"
            if s.get("phase") == "Failed" and "activeDeadlineSeconds" in str(s.get("message")):
                return True  # a generated deadline of seconds passed (checked against the spec below)
            return s.get("phase") in ("Provisioning", "Running") or (
                s.get("phase") == "Pending" and ready.get("reason") not in (None, "CreatingRayJob"))

        suspended = {n: bool(raw.get(ns, n)["spec"].get("suspend")) for n in names}
        try:
            wait_for(lambda: not op.alive() or all(settled(s, suspended[n]) for n, s in phases().items()), 120,
                     "every sampled job to settle in a phase", interval=2)
        except AssertionError:
            pass  # each unsettled job is reported below, with its spec
        assert op.alive(), f"operator exited ({op.proc.returncode}); log {op.log}"
        st_ = phases()
        problems, reasons = [], collections.Counter()
        for n, s in st_.items():
            spec = m.RLHFJobSpec.model_validate(raw.get(ns, n)["spec"])
            want = {"Suspended"} if spec.suspend else SENSIBLE
            if spec.active_deadline_seconds and "activeDeadlineSeconds" in str(s.get("message")):
                want = want | {"Failed"}  # a generated deadline of seconds passed: KubeRay ends the job, as asked
            ready = next((c for c in s.get("conditions") or [] if c["type"] == "Ready"), {})
            reasons[f"{s.get('phase')}/{ready.get('reason')}"] += 1
            ended = s.get("phase") == "Failed"  # only where allowed above
            if s.get("phase") not in want or ready.get("reason") == "InvalidSpec" or not (
                    ended or settled(s, spec.suspend)):
                problems.append(f"{n} phase={s.get('phase')!r} reason={ready.get('reason')!r} "
                                f"message={str(s.get('message'))[:300]!r} <- {describe(names[n])}")
        print(f"\n[fuzz real] {len(names)} jobs, phase/reason: {dict(reasons)}")
        for n, s in st_.items():
            if s.get("phase") == "Pending":
                print(f"  {n}: {str(s.get('message'))[:200]} <- {describe(names[n])}")
        # The operator is alive and still reconciles: a fresh, plain job gets a phase.
        assert op.alive(), f"operator exited ({op.proc.returncode}); log {op.log}"
        fresh = job("fresh", copy.deepcopy(BASES["separate-tp2"]))
        assert raw.create(ns, fresh, dry=False).status_code == 201
        wait_for(lambda: settled(raw.get(ns, "fresh").get("status") or {}, False), 90,
                 "the operator to reconcile a fresh job after the fuzzed ones")
        assert op.alive()
        assert not problems, f"{len(problems)} of {len(names)} accepted jobs not in a sensible phase:\n" + \
            "\n".join(problems)
    finally:
        op.kill()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
