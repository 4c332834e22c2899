"""The runtime's plumbing: job config, placement, checkpoints, status reporting, LoRA, MoE layouts, node files."""
