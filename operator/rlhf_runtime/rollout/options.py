"""The engine's options: what an engine actor reads, passed whole to it by the driver (``JobActors.make_engine``):
the job's engine arguments, resolved once from its spec (``infra.config.engine_kwargs``), and the actor's
environment. Frozen; imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class EngineOptions:
    """An engine actor's options."""

    #: the runtime's engine arguments (``infra.config.engine_kwargs``): vLLM's, and ``weight_transfer_backend``,
    #: the backend whose runtime worker engine it loads (``rollout.base.llm_args`` makes vLLM's config of it)
    kwargs: dict[str, Any]
    #: the actor's environment, set in its process before vLLM is imported
    env: dict[str, str] = field(default_factory=dict)

    def with_args(self, **kwargs: Any) -> EngineOptions:
        """These options with the engine arguments ``kwargs`` replaced (a fresh engine of other weights:
        ``model``, ``load_format``)."""
        return replace(self, kwargs={**self.kwargs, **kwargs})
