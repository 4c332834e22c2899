"""Multi-turn rollouts (``spec.environment``): chat tokens in and out (``chat``), tool calls parsed by vLLM
(``calls``), tools (``tools``; the builtin python tool's isolation: ``isolation``), environments
(``environments``), the rollout of trajectories (``rollout``) and its counters (``metrics``)."""
