"""What ``benchmarks/`` may touch of the runtime: the names it imports from ``rlhf_runtime`` (``ALLOWED_IMPORTS``),
the parts of a started ``Runtime`` it reads (``RUNTIME_SURFACE``; a benchmark's runtime is called ``rt``), and
no private attribute (``._x``) of a runtime object: not of a runtime class a benchmark subclasses unless the
subclass defines it itself, and on other objects only the third-party ones in ``FOREIGN_PRIVATE``.

Each entry says why. An entry no benchmark uses any more fails too, so the lists only shrink: a benchmark that
needs more of the runtime asks for a public way in, named here. Read with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

_START = "the runtime started by its named stages (Runtime.run_stages), as the driver starts it"
_SUBCLASS = "benchmark-only hooks on the runtime's actors, through its extension point (controller.actors.ActorClasses)"
_BATCH = "the batches as the driver cuts and renders them, so a timed rollout is the driver's"

#: ``module.name`` (or ``module`` for ``import module``) a benchmark may import from ``rlhf_runtime``, with why.
ALLOWED_IMPORTS: dict[str, str] = {
    "rlhf_runtime.controller.loop.Runtime": _START,
    "rlhf_runtime.infra.report.Metrics": "the Reporter's metrics, which a Runtime reports into",
    "rlhf_runtime.infra.report.Reporter": "the progress file a Runtime writes (its startup and actors records)",
    "rlhf_runtime.controller.validation.ValidationError": "the first sync's validation failing is a result",
    "rlhf_runtime.controller.actors.ActorClasses": _SUBCLASS,
    "rlhf_runtime.rollout.api.engine_class": "which engine class a job's engines are, to subclass the right one",
    "rlhf_runtime.roles.policy.Trainer": _SUBCLASS + "; train_step times the trainer's step alone",
    "rlhf_runtime.roles.options.TrainerOptions": "train_step builds its trainer from a spec as the driver does "
                                                 "(TrainerOptions.from_config)",
    "rlhf_runtime.rollout.engines.Engine": _SUBCLASS,
    "rlhf_runtime.rollout.engines.AsyncEngine": _SUBCLASS,
    "rlhf_runtime.rollout.stepped.SteppedEngine": _SUBCLASS,
    "rlhf_runtime.rollout.base.llm_args": "a bare vllm.LLM built with the engine actor's own arguments",
    "rlhf_runtime.algo.data.render_prompt": _BATCH,
    "rlhf_runtime.algo.data.step_batch": _BATCH,
    "rlhf_runtime.algo.data.Sample": "gpu_learning's task prompts as the runtime's samples",
    "rlhf_runtime.infra.config.ACTOR_ENV": "the bare engine's process gets the engine actor's environment",
    "rlhf_runtime.infra.config.CPU_ENV": "flat_logprobs' engine on CPU gets the CPU actors' environment",
    "rlhf_runtime.infra.placement.compute_layout": "rendered_cluster checks the layout the driver computes",
    "rlhf_runtime.controller.agent_experience.AgentExperience": "agent_rollout runs each arm's multi-turn rollout "
                                                                "the way a step does",
    "rlhf_runtime.controller.agent_experience.build_rollout": "agent_rollout builds each arm's rollout as the "
                                                              "runtime builds the job's",
    "rlhf_runtime.roles.batches": "train_arms sets the output layer's logits per chunk for an arm's turn",
    "rlhf_runtime.roles.batches.pack": "train_step's padding check packs as the trainer does",
    "rlhf_runtime.roles.batches.token_logprobs": "train_step's output-layer check calls the trainer's own",
    "rlhf_runtime.roles.batches.plan": "train_step's length mix is planned into micro-batches as the trainer does",
    "rlhf_runtime.agent.tools.Tools": "sandbox_claims calls the builtin tools in sandboxes as a rollout does; "
                                      "tool_learning asks the python tool for its answer's format",
    "rlhf_runtime.agent.calls.Call": "sandbox_claims' and tool_learning's tool calls, as the rollout's parser "
                                     "makes them",
    "rlhf_runtime.agent.sandbox.SandboxPool": "sandbox_claims claims with the runtime's own claim code, its "
                                              "client given the benchmark's identity (it runs outside a pod)",
    "rlhf_runtime.weight_sync.direct": "bench_actors' timeline of the direct NCCL sync hooks its groups; "
                                       "wire_layouts cuts its groups as the direct sync does",
}

#: What a benchmark reads of a started ``Runtime`` (``rt.<name>``), with why.
RUNTIME_SURFACE: dict[str, str] = {
    "run_stages": _START,
    "startup": "the seconds of each start-up stage (Stages.seconds), in the result",
    "job": "what every step reads (tokenizer, samples, sampling), from the inputs stage",
    "validation": "the first sync's validation record",
    "weights": "the weight sync: sync, sleep, wake, and a group with a variant's options (init_group, resolve)",
    "experience": "a rollout launched and collected as a step does",
    "validator": "the fresh-engine validation again after a variant",
    "actors": "the engine and trainer actors, for benchmark-only calls on them (ACTORS_SURFACE)",
    "layout": "the placement the driver computed (engines, DP group)",
    "cfg": "the job's spec, as the driver read it (RuntimeConfig)",
    "sleeps": "whether colocated engines sleep while the trainer trains, as the driver does before a sync",
    "agent": "the multi-turn rollout the runtime built for the job",
    "deadlines": "the runtime's bounded calls, for a rollout run outside a step",
    "watchdog": "progress marked between rollouts run outside steps",
    "shutdown": "the actors and Ray stopped",
}
#: What a benchmark reads of ``rt.actors`` (``controller.job_actors.JobActors``), with why.
ACTORS_SURFACE: dict[str, str] = {
    "engines": "the engine actors (benchmark-only calls: timers, scrambled weights, greedy tokens)",
    "trainers": "the trainer ranks (benchmark-only calls: timelines, memory, a training step)",
    "env": "the actors' environment, for a bare engine's process",
    "engine_kwargs": "the engine's vLLM arguments, for a bare engine",
    "actor_env": "one engine's environment as placed, for a bare engine's process",
}

#: Private attributes of third-party objects a benchmark touches, with why (runtime objects get none).
FOREIGN_PRIVATE: dict[str, str] = {
    "_from_config": "transformers: a random-initialised model built in its dtype, without loading weights",
    "_compiled_call_impl": "torch: what nn.Module.compile installs, put aside for an eager arm's turn",
    "_attn_implementation": "transformers: the attention kernel a model config chose, recorded with the result",
    "_post_send_sync": "vLLM's IPC trainer engine: a step no RPC times, timed by bench_actors",
}

#: Private attributes of runtime classes that a benchmark's subclass touches (``file::Class._x``), with why.
SUBCLASS_PRIVATE: dict[str, str] = {
    "bench_actors.py::BenchEngine._stale_cache": "timed_generate resets a stale prefix cache as generate does",
    "bench_actors.py::BenchAsyncEngine._stale_cache": "reset_prefix_cache clears the runtime's stale mark with it",
    "bench_actors.py::BenchSteppedEngine._stale_cache": "reset_prefix_cache clears the runtime's stale mark with it",
    "bench_actors.py::BenchSteppedEngine._call": "calls run on the stepped engine's own thread, as its methods do",
}


def _scripts() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def runtime_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, ``module.name``) of every import from ``rlhf_runtime``, at module level and inside functions."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "rlhf_runtime")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rlhf_runtime":
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def runtime_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, ``rt.name`` or ``rt.actors.name``) of every attribute read on a name or attribute called ``rt``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "rt") or (isinstance(base, ast.Attribute) and base.attr == "rt"):
            yield node.lineno, f"rt.{node.attr}"
        elif isinstance(base, ast.Attribute) and base.attr == "actors" and (
                (isinstance(base.value, ast.Name) and base.value.id == "rt")
                or (isinstance(base.value, ast.Attribute) and base.value.attr == "rt")):
            yield node.lineno, f"rt.actors.{node.attr}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _runtime_classes(tree: ast.Module) -> set[str]:
    """Names bound in the file to runtime classes: imported from ``rlhf_runtime``, or classes of the file with such
    a base."""
    names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").split(".")[0] == "rlhf_runtime" for a in node.names}
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name not in names and any(
                    isinstance(b, ast.Name) and b.id in names for b in node.bases):
                names.add(node.name)
                changed = True
    return names


def _own(cls: ast.ClassDef) -> set[str]:
    """Names a class defines itself: its methods and class attributes (not what it inherits)."""
    out = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def private_reads(path: Path) -> Iterator[tuple[int, str]]:
    """(line, key) of every private attribute a benchmark touches that is not its own: ``self._x`` in a subclass of
    a runtime class that the subclass does not define (key ``file::Class._x``), and ``obj._x`` on anything else but
    ``self`` / ``cls`` of a class of its own (key ``_x``)."""
    tree = _tree(path)
    runtime = _runtime_classes(tree)
    in_runtime_class: dict[int, tuple[str, set[str]]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            in_runtime_class.setdefault(id(node), (cls.name, _own(cls)) if cls.name in runtime else ("", set()))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        own_obj = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        cls_name, own = in_runtime_class.get(id(node), ("", set()))
        if own_obj and cls_name and node.attr not in own:
            yield node.lineno, f"{path.name}::{cls_name}.{node.attr}"
        elif not own_obj:
            yield node.lineno, node.attr


def _found() -> dict[str, dict[str, list[str]]]:
    """Per check, what every benchmark uses: key -> the places (``file:line``)."""
    out: dict[str, dict[str, list[str]]] = {"imports": {}, "reads": {}, "private": {}}
    for path in _scripts():
        tree = _tree(path)
        for kind, found in (("imports", runtime_imports(tree)), ("reads", runtime_reads(tree)),
                            ("private", private_reads(path))):
            for line, key in found:
                out[kind].setdefault(key, []).append(f"{path.name}:{line}")
    return out


FOUND = _found()
READS_ALLOWED = {f"rt.{k}" for k in RUNTIME_SURFACE} | {f"rt.actors.{k}" for k in ACTORS_SURFACE}
PRIVATE_ALLOWED = set(FOREIGN_PRIVATE) | set(SUBCLASS_PRIVATE)


def _unlisted(kind: str, allowed: set[str]) -> list[str]:
    return [f"{k}: {', '.join(v)}" for k, v in sorted(FOUND[kind].items()) if k not in allowed]


def test_benchmarks_import_only_the_listed_runtime_names() -> None:
    bad = _unlisted("imports", set(ALLOWED_IMPORTS))
    assert not bad, "runtime names benchmarks import without an entry in ALLOWED_IMPORTS:\n" + "\n".join(bad)


def test_benchmarks_read_only_the_runtimes_listed_surface() -> None:
    bad = _unlisted("reads", READS_ALLOWED)
    assert not bad, "parts of Runtime benchmarks read outside RUNTIME_SURFACE / ACTORS_SURFACE:\n" + "\n".join(bad)


def test_benchmarks_touch_no_private_attribute_of_the_runtime() -> None:
    bad = _unlisted("private", PRIVATE_ALLOWED)
    assert not bad, "private attributes benchmarks touch:\n" + "\n".join(bad)


def test_every_entry_is_used_and_says_why() -> None:
    stale = sorted(set(ALLOWED_IMPORTS) - set(FOUND["imports"])) + sorted(READS_ALLOWED - set(FOUND["reads"]))
    stale += sorted(PRIVATE_ALLOWED - set(FOUND["private"]))
    assert not stale, "no benchmark uses these any more: remove them from the lists:\n" + "\n".join(stale)
    entries = [*ALLOWED_IMPORTS.values(), *RUNTIME_SURFACE.values(), *ACTORS_SURFACE.values(),
               *FOREIGN_PRIVATE.values(), *SUBCLASS_PRIVATE.values()]
    assert all(len(why) > 20 for why in entries)


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The readers on a made-up benchmark: imports at module level and in functions, reads on ``rt`` and
    ``self.rt``, and private attributes: a runtime subclass's inherited one is caught, its own and a plain
    class's own are not, another object's is."""
    src = tmp_path / "b.py"
    src.write_text(
        "import rlhf_runtime.algo\nfrom rlhf_runtime.x import Base, f\nimport os\n"
        "class Sub(Base):\n    def m(self):\n        self._own = 1\n        return self._inherited\n"
        "    def _own_method(self):\n        return self._own_method\n"
        "class Mine:\n    def m(self):\n        return self._mine\n"
        "class Deeper(Sub):\n    def m(self):\n        return self._also\n"
        "def g(rt, obj):\n    from rlhf_runtime.y import h\n    rt.weights.sync(0)\n    rt.actors.placement.place()\n"
        "    obj.rt.job\n    return obj._x\n")
    tree = _tree(src)
    assert [k for _, k in runtime_imports(tree)] == ["rlhf_runtime.algo", "rlhf_runtime.x.Base", "rlhf_runtime.x.f",
                                                     "rlhf_runtime.y.h"]
    assert sorted(k for _, k in runtime_reads(tree)) == ["rt.actors", "rt.actors.placement", "rt.job", "rt.weights"]
    # Sub's own ``_own`` is assigned in a method, not defined in its body: still the runtime class's attribute
    assert sorted(k for _, k in private_reads(src)) == ["_x", "b.py::Deeper._also", "b.py::Sub._inherited",
                                                        "b.py::Sub._own"]
