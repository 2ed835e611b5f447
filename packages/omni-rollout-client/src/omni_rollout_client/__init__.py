"""omni-rollout-client: sglang-omni's RL contract (0.1.9), fast and fail-loud.

Imports without torch; accepts numpy arrays and torch tensors alike. See ``client`` for the retry
policy and ``payload`` for encode-once wire handling. ``omni_rollout_client.testing`` (extra
``testing``) holds a fake server enforcing the same contract.
"""

from .admin import DEFAULT_STAGES, AdminReply, RankPlan, StageResult, plan_weight_sync_ranks
from .client import HealthStatus, ModelInfo, OmniRolloutClient, Timeouts, init_weights_update_groups
from .errors import (
    ActiveRequestsError,
    AdminAuthError,
    ClientValidationError,
    ConflictError,
    ContractError,
    EnginePausedError,
    GenerationAbortedError,
    NotSupportedError,
    OmniClientError,
    ResponseContractError,
    RouteNotFoundError,
    ServerResponseError,
    TransientServerError,
    WeightUpdateError,
)
from .payload import (
    MM_TENSOR_NAMES,
    QWEN3_OMNI_MEDIA_IDS,
    RESERVED_METADATA_KEYS,
    MediaTokenIds,
    PreparedPrompt,
    build_generate_body,
)
from .result import GenerateResult, parse_generate_response
from .retry import RetryPolicy
from .sampling import filter_sampling_params
from .tensors import EncodedTensor

__all__ = [
    "ActiveRequestsError",
    "AdminAuthError",
    "AdminReply",
    "ClientValidationError",
    "ConflictError",
    "ContractError",
    "DEFAULT_STAGES",
    "EncodedTensor",
    "EnginePausedError",
    "GenerateResult",
    "GenerationAbortedError",
    "HealthStatus",
    "MM_TENSOR_NAMES",
    "MediaTokenIds",
    "ModelInfo",
    "NotSupportedError",
    "OmniClientError",
    "OmniRolloutClient",
    "PreparedPrompt",
    "QWEN3_OMNI_MEDIA_IDS",
    "RESERVED_METADATA_KEYS",
    "RankPlan",
    "ResponseContractError",
    "RetryPolicy",
    "RouteNotFoundError",
    "ServerResponseError",
    "StageResult",
    "Timeouts",
    "TransientServerError",
    "WeightUpdateError",
    "build_generate_body",
    "filter_sampling_params",
    "init_weights_update_groups",
    "parse_generate_response",
    "plan_weight_sync_ranks",
]
