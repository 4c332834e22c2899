"""The RLHFJob API (group ``rlhf.dev``, version ``v1alpha1``): one import for the typed models.

The models are the single source of truth for three things:

* the CRD schema (``rlhf_api.crdgen`` renders ``crds/rlhf.dev_rlhfjobs.yaml`` from them, with the CEL rules
  declared beside them, so admission and Python agree);
* the operator's view of a job (``RLHFJobSpec.model_validate(body["spec"])``);
* the contract with the in-pod runtime (``RuntimeConfig``, written by the operator into a ConfigMap and read
  by the Ray driver). No second schema exists.

They live in modules by part: ``training`` (model, trainer, head, algorithm), ``rollout`` (sampling, engines,
placement, weight sync), ``inputs`` (data, reward, separate roles, storage, tracking, scheduling, the pods'
environment variables), ``environment`` (multi-turn environments and tools), ``rules`` (CEL rules across fields),
``spec`` (``RLHFJobSpec``), ``status`` (``RLHFJobStatus``) and ``runtime_config`` (``RuntimeConfig``); this
module re-exports them. Field names are snake_case in Python and camelCase on the wire (``by_alias=True``). Only
pydantic is imported: the operator and the runtime both depend on it, neither drags the other in.
"""

from rlhf_api.base import (  # noqa: F401
    API_VERSION,
    CPU_PATTERN,
    GROUP,
    INT32_MAX,
    KIND,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_NAME_LENGTH,
    MEMORY_PATTERN,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    Model,
)
from rlhf_api.environment import (  # noqa: F401
    IMPORT_REF,
    JSON_SCHEMA,
    TOOL_NAME,
    TOOL_PARSERS,
    AgentStatus,
    Environment,
    EnvironmentServer,
    HttpEnvironment,
    PythonLimits,
    ServerResources,
    Tool,
    server_name,
    server_url,
)
from rlhf_api.inputs import (  # noqa: F401
    DATA_PATH,
    OBJECT_URI,
    VOLUME_SCHEMA,
    Checkpoint,
    ConfigMapKey,
    Critic,
    Data,
    EnvFromSource,
    EnvVar,
    EnvVarSource,
    EvalData,
    KeyRef,
    MLflowTracking,
    NameRef,
    ObjectStorage,
    Output,
    Reference,
    Reward,
    RewardEndpoint,
    RewardModel,
    RolePlacement,
    Scheduling,
    SecretKeySelector,
    TensorBoardTracking,
    Toleration,
    Tracking,
    VolumeMount,
    WandbTracking,
)
from rlhf_api.rollout import (  # noqa: F401
    Placement,
    Rollout,
    Sampling,
    WeightSync,
)
from rlhf_api.rules import (  # noqa: F401
    MUTABLE_FIELDS,
    SPEC_RULES,
    edit_rules,
)
from rlhf_api.runtime_config import (  # noqa: F401
    ADDED_AFTER_0_1,
    OPERATOR_ONLY_FIELDS,
    RuntimeConfig,
)
from rlhf_api.spec import (  # noqa: F401
    RLHFJobSpec,
)
from rlhf_api.status import (  # noqa: F401
    PHASES,
    Children,
    Condition,
    DataStatus,
    EvalStatus,
    MemoryStatus,
    OutputStatus,
    Phase,
    RLHFJobStatus,
    RuntimeReport,
    Throughput,
    TrackingStatus,
)
from rlhf_api.training import (  # noqa: F401
    ALGORITHM_NAMES,
    LORA_DEFAULT_TARGETS,
    PPO,
    Algorithm,
    Head,
    HeadResources,
    LoRA,
    ModelSource,
    Optimizer,
    Resources,
    RolloutCorrection,
    SubmitterResources,
    Trainer,
)
