"""The runtime: the Ray driver that runs one RLHFJob inside its pods.

Layout (each package says what it holds):

* ``main``        the CLI: options, exit codes, signals, the watchdog's wiring
* ``controller``  the driver's control loop: the step as a pipeline of stages, actor groups, weight-sync
  coordination, experience (rollout, rewards, role passes), recovery, validation, deadlines
* ``roles``       what runs in the actors beside the engines: the policy trainer, critic, reference and reward
  scorer, on one FSDP worker base
* ``rollout``     the vLLM engine actors and their one interface
* ``weight_sync`` trainer -> engines transfer through vLLM's weight-transfer API (formats, fan-out, senders,
  the gloo and kernel-format backends)
* ``vllm``        the one place that knows vLLM versions (``compat``) and the vLLM plugin
* ``algo``        advantages, objectives (losses), rewards, prompts data: pure functions
* ``infra``       config, placement, checkpoints, reporting, LoRA, MoE, node files
"""
