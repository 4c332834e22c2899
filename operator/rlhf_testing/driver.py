"""The runtime's driver with test hooks, outside the runtime package.

    python -m rlhf_testing.driver [--skip-tensor NAME] [--pause-after-tokens N] <rlhf_runtime.driver arguments>

Runs ``rlhf_runtime.main.main`` with actor classes of its own (``controller.actors.ActorClasses``, the runtime's
extension point), subclasses of the runtime's:

* ``--skip-tensor NAME``: the trainer leaves this tensor out of every weight sync (LoRA: every adapter tensor
  whose name contains it), which the validation mode must catch;
* ``--pause-after-tokens N`` (async mode): before a sync, the engine waits until a live sample has ``N`` tokens,
  so that the sync pauses requests mid-generation;
* ``--turn-script PATH`` (multi-turn jobs, ``spec.environment``): a JSON object {user prompt: [the text of each
  assistant turn]}; the engine generates that text, character by character under vLLM's structured outputs (a
  regular expression matching only it), so a random tiny model makes exactly the tool calls a test needs.

The settings reach the actors inside the classes: ``classes`` makes them per run, in a function, so that they
are not importable by name and Ray ships them to the workers by value, settings included (the workers of a Ray
cluster the driver joins do not share its environment; only a local Ray's inherit it).
"""

from __future__ import annotations

import argparse
import os

from rlhf_runtime.controller.actors import ActorClasses
from rlhf_runtime.roles.policy import Trainer
from rlhf_runtime.rollout.engines import AsyncEngine
from rlhf_runtime.rollout.stepped import SteppedEngine


def literal_regex(text: str) -> str:
    """A regular expression matching exactly ``text``."""
    return "".join("\\" + c if c in "\\.^$*+?()[]{}|" else c for c in text)


def scripted_turn(script: dict[str, list[str]], prompt: str) -> str | None:
    """The text the script gives the turn whose engine prompt (decoded, ChatML) is ``prompt``: the user
    prompt's list, at the index of this assistant turn (its last item for later turns); None if unscripted."""
    if "<|im_start|>user\n" not in prompt:
        return None
    user = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    turns = script.get(user)
    if not turns:
        return None
    return turns[min(prompt.count("<|im_start|>assistant") - 1, len(turns) - 1)]


def scripted(base: type, script: dict[str, list[str]]) -> type:
    """``base`` (an async engine class) generating ``script``'s turns (``--turn-script``)."""

    class ScriptedEngine(base):  # type: ignore[valid-type, misc]
        def __init__(self, options, build=True):  # type: ignore[no-untyped-def]
            from transformers import AutoTokenizer

            self.script_tokenizer = AutoTokenizer.from_pretrained(options.kwargs["model"])
            super().__init__(options.with_args(skip_tokenizer_init=False), build)  # structured outputs need it

        async def generate(self, prompts, sampling):  # type: ignore[no-untyped-def]
            from vllm.sampling_params import StructuredOutputsParams

            text = scripted_turn(script, self.script_tokenizer.decode(prompts[0], skip_special_tokens=False))
            if text is not None:
                sampling = {**sampling, "structured_outputs": StructuredOutputsParams(regex=literal_regex(text))}
            return await super().generate(prompts, sampling)

    return ScriptedEngine


def classes(config: str | None, skip_tensor: str | None = None, pause_after_tokens: int = 0,
            turn_script: str | None = None) -> ActorClasses:
    """The hooked classes for the job at ``config`` (its engine class depends on the spec)."""
    import json

    from rlhf_runtime.infra import config as rc

    skipped = [skip_tensor] if skip_tensor else None

    class SkippingTrainer(Trainer):
        def init_weight_sync(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().init_weight_sync(*args, **kwargs, skip=skipped)

        def adapter_payload(self, skip: list[str] | None = None):  # type: ignore[no-untyped-def]
            return super().adapter_payload(skipped)

    class LatePauseAsyncEngine(AsyncEngine):
        async def pause(self, after_tokens: int = 0) -> None:
            await super().pause(pause_after_tokens)

    class LatePauseSteppedEngine(SteppedEngine):
        async def pause(self, after_tokens: int = 0) -> None:
            await super().pause(pause_after_tokens)

    try:
        spec = rc.load_config(config).spec
    except Exception:  # noqa: BLE001 - a bad job.json: the runtime's main reports it
        return ActorClasses(trainer=SkippingTrainer)
    engine = None
    if spec.weight_sync.mode == "async":
        engine = LatePauseSteppedEngine if spec.rollout.async_engine == "stepped" else LatePauseAsyncEngine
    if turn_script:
        with open(turn_script) as f:
            base = SteppedEngine if spec.rollout.async_engine == "stepped" else AsyncEngine
            engine = scripted(base, json.load(f))
    return ActorClasses(trainer=SkippingTrainer, engine=engine)


def main(argv: list[str] | None = None) -> int:
    from rlhf_runtime import main as runtime_main

    p = argparse.ArgumentParser(prog="rlhf_testing.driver", add_help=False)
    p.add_argument("--skip-tensor")
    p.add_argument("--pause-after-tokens", type=int, default=0)
    p.add_argument("--turn-script")
    p.add_argument("--config", default=os.environ.get("RLHF_JOB_CONFIG"))
    a, rest = p.parse_known_args(argv)
    hooked = classes(a.config, a.skip_tensor, a.pause_after_tokens, a.turn_script)
    return runtime_main.main([*rest, *(["--config", a.config] if a.config else [])], classes=hooked)


if __name__ == "__main__":
    from rlhf_runtime.main import exit_process

    exit_process(main())
