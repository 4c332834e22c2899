"""The trainer's options (``roles.options``): resolved once from the job's spec, frozen, one per worker by rank; the
roles read them and nothing else of the spec. Pure: no torch."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from rlhf_api.models import RLHFJobSpec, RuntimeConfig
from rlhf_runtime.roles.options import Rank, TrainerOptions

ROLES = Path(__file__).resolve().parents[2] / "operator" / "rlhf_runtime" / "roles"


def _spec(**over) -> RLHFJobSpec:
    base = {"model": {"name": "m", "dtype": "bfloat16"}, "image": "i", "data": {"prompts": ["a"]},
            "reward": {"rule": "length", "targetLength": 4}}
    return RLHFJobSpec.model_validate({**base, **over})


def test_the_spec_resolves_to_what_the_workers_read() -> None:
    o = TrainerOptions.resolve(_spec())
    assert (o.model.name, o.model.dtype, o.checkpoint, o.critic) == ("m", "bfloat16", None, None)
    assert (o.temperature, o.colocated, o.own_reference) == (1.0, False, False)
    assert o.timeout_s == 600.0 and o.rank == Rank()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.colocated = True  # type: ignore[misc]


def test_derived_settings_are_decided_once() -> None:
    """The temperature (unset: 1.0), the placement, the collectives' deadline, the in-trainer reference (KL on,
    placement trainer) and PPO's critic (its defaults where ``spec.critic`` is unset)."""
    o = TrainerOptions.resolve(_spec(rollout={"sampling": {"temperature": 0.7}}, placement={"mode": "colocated"},
                                     weightSync={"backend": "ipc", "timeoutSeconds": 30},
                                     algorithm={"klCoef": 0.1}, reference={"placement": "trainer"}))
    assert (o.temperature, o.colocated, o.timeout_s, o.own_reference) == (0.7, True, 30.0, True)
    assert not TrainerOptions.resolve(_spec(algorithm={"klCoef": 0.1}, reference={"placement": "separate"})
                                      ).own_reference
    ppo = TrainerOptions.resolve(_spec(algorithm={"name": "ppo"}))
    assert ppo.critic is not None and ppo.critic.model is None


def test_each_worker_gets_the_same_options_at_its_rank() -> None:
    o = TrainerOptions.resolve(_spec())
    r1 = o.at(Rank(1, 2, "10.0.0.1", 29500))
    assert r1.rank == Rank(1, 2, "10.0.0.1", 29500) and dataclasses.replace(r1, rank=Rank()) == o
    cfg = RuntimeConfig(name="j", namespace="n", uid="u", spec=_spec()).model_dump_json(by_alias=True)
    assert TrainerOptions.from_config(cfg, 1, 2, "10.0.0.1", 29500) == r1


def test_no_role_reads_the_spec() -> None:
    """No module of ``roles/`` parses a job config or reads a ``spec`` attribute: the options are their input."""
    for path in sorted(ROLES.glob("*.py")):
        if path.name == "options.py":
            continue
        tree = ast.parse(path.read_text())
        spec = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "spec"]
        parsed = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "RuntimeConfig"]
        assert not spec and not parsed, (path.name, spec, parsed)
