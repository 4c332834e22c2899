"""The weight-sync benchmark's layouts (``gpu_sync.py``): each a job spec's overrides on top of
``harness.base_spec`` (placement, backend, trainer and engine shapes), and an ``_env`` key for the runtime's actors'
extra environment (``layout_parts``); ``MODEL_TRAINER``: trainer settings a model's step needs beside them."""

from __future__ import annotations

from typing import Any

from harness import merge

#: Spec overrides per layout (on top of ``base_spec``).
LAYOUTS: dict[str, dict[str, Any]] = {
    "separate-nccl": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                      "rollout": {"gpuMemoryUtilization": 0.5}},
    "colocated-ipc": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                      "rollout": {"gpuMemoryUtilization": 0.3}},
    # weightSync.packed false: in the kernel format the direct sync (weight_sync.direct: each tensor broadcast
    # straight into the engine's parameter, one NCCL group per bucket). Packed unset means this for TP=1 engines,
    # so separate-nccl is the same sync and separate-nccl-packed (vLLM's packed path) the comparison
    "separate-nccl-unpacked": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": False},
                               "rollout": {"gpuMemoryUtilization": 0.5}},
    "separate-nccl-packed": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": True},
                             "rollout": {"gpuMemoryUtilization": 0.5}},
    "separate-nccl-omp16": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                            "rollout": {"gpuMemoryUtilization": 0.5}, "_env": {"OMP_NUM_THREADS": "16"}},
    "colocated-ipc-resident": {"placement": {"mode": "colocated", "colocatedSleep": False},
                               "weightSync": {"backend": "ipc"}, "rollout": {"gpuMemoryUtilization": 0.3}},
    # the whole model in one IPC chunk (3 RPCs per sync instead of 2 + chunks; 4 GiB for a 1.7B in bf16)
    "colocated-ipc-resident-1chunk": {"placement": {"mode": "colocated", "colocatedSleep": False},
                                      "weightSync": {"backend": "ipc", "bucketSizeMB": 4096},
                                      "rollout": {"gpuMemoryUtilization": 0.3}},
    "colocated-ipc-fsdp2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                            "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                            "rollout": {"engines": 2, "gpuMemoryUtilization": 0.3}},
    # one TP=2 engine colocated with FSDP2x2 (issue 16's TP>1 kernel format: each trainer rank sends its GPU's shard)
    "colocated-ipc-fsdp2-tp2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 1, "tensorParallelSize": 2, "gpuMemoryUtilization": 0.3}},
    "separate-nccl-tp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-tp2-unpacked": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": False},
                                   "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-dp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"engines": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-dp3": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"engines": 3, "gpuMemoryUtilization": 0.5}},
    # an FSDP2 trainer on GPUs 0-1 into two TP=1 engines (4 GPUs): packed unset stays packed from FSDP2 trainers
    # until the direct sync (variant direct-sync: FSDP2 gathers between its groups) is validated here
    "separate-nccl-fsdp2-dp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 2, "gpuMemoryUtilization": 0.5}},
    "colocated-ipc-fsdp2-ep2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 2, "expertParallel": True, "gpuMemoryUtilization": 0.3}},
    # the 30B-A3B step with the trainer's memory options: its forward without them (16k-token micro-batches, every
    # layer's activations kept) does not fit an H200's memory
    "colocated-ipc-fsdp4-ep4": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2",
                                            "gradientCheckpointing": True, "maxTokensPerMicroBatch": 4096},
                                "rollout": {"engines": 4, "expertParallel": True, "gpuMemoryUtilization": 0.3}},
    "separate-nccl-async": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "mode": "async"},
                            "rollout": {"gpuMemoryUtilization": 0.5}},
    "cpu-gloo": {"placement": {"mode": "separate"}, "trainer": {"replicas": 1, "gpusPerReplica": 0},
                 "rollout": {"gpuMemoryUtilization": 0.05}},
    "cpu-gloo-dp2": {"placement": {"mode": "separate"}, "trainer": {"replicas": 1, "gpusPerReplica": 0},
                     "rollout": {"engines": 2, "gpuMemoryUtilization": 0.05}},
}


def layout_parts(layout: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A layout's spec overrides and the extra environment of the runtime's actors (its ``_env`` key)."""
    over = dict(LAYOUTS[layout])
    return over, over.pop("_env", {})


# The three FSDP2x2 layouts with the kernel format as the job's own (``weightSync.format: kernel``), so the first
# sync's validation checks it (no variant, no revalidation engine: one engine start less per layout). The TP=2
# engine without FlashInfer's allreduce (VLLM_ALLREDUCE_USE_FLASHINFER=0): on 0.33 each fresh TP>1 engine
# otherwise JIT-builds that module (~60 s); the sync does not use it.
# The same for NCCL into one TP=2 engine (the kernel format's pieces of both ranks in one broadcast).
for _base, _env in (("colocated-ipc", None), ("colocated-ipc-resident", None), ("colocated-ipc-fsdp2", None), ("colocated-ipc-fsdp2-tp2", {"VLLM_ALLREDUCE_USE_FLASHINFER": "0"}),
                    ("colocated-ipc-fsdp2-ep2", None), ("separate-nccl-tp2", {"VLLM_ALLREDUCE_USE_FLASHINFER": "0"})):
    LAYOUTS[f"{_base}-kernel"] = merge(LAYOUTS[_base], {"weightSync": {"format": "kernel"}}
                                       | ({"_env": _env} if _env else {}))


#: Trainer settings a model's GRPO step needs beside the layout's: Qwen3-8B in FSDP2x2 colocated with its engines
#: does not fit an H200's memory in its forward without checkpointing (16k-token micro-batches); train_step.py fits
#: its 16k-token sequences with checkpointing.
MODEL_TRAINER: dict[str, dict[str, Any]] = {"qwen3-8b": {"gradientCheckpointing": True},
                                           "qwen3-1.7b": {"gradientCheckpointing": True}}
