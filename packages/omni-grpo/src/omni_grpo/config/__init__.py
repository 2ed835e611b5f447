"""The one configuration tree of omni-grpo: pydantic v2 models loaded from YAML.

Every model forbids unknown keys so that a typo (``rollout.n_sample``) fails loudly with the dotted
path of the bad field instead of being silently ignored. Each component receives only ITS
sub-model (``cfg.algo``, ``cfg.data``, ...), never the whole tree.

Relative paths in a YAML file are resolved against the directory of that file (not the current
working directory), so a config can be run from anywhere; ``load_config`` does this.

One module per section of the YAML, so a field is found where its key says: ``run.py``,
``model.py``, ``data.py``, ``rollout.py``, ``algo.py``, ``trainer.py``, ``ray.py``,
``rewards.py``, ``evaluation.py`` (``eval:``). ``root.py`` holds the whole tree and the rules that
span sections, ``load.py`` the YAML files and overrides, ``preflight.py`` the check that the
inputs exist, ``base.py`` what every section is built from, ``errors.py`` and ``secrets.py`` how
a problem is told without printing a secret. Every public name is importable from here.

The config is the ground floor of omni-grpo: of the project it imports only ``omni_grpo.types``,
``omni_grpo.plugins``, omni-extract's tiny-size check and ``omni_grpo.dataset_spec`` (the row's
field names, the tables' headers); none of them imports the config, and nothing of
``omni_grpo.data`` is imported here (the data loader reaches the rewards, which take their section).
"""

from omni_grpo.config.algo import AdvantageConfig, AlgoConfig, TISConfig
from omni_grpo.config.base import DatasetSpec, PathField
from omni_grpo.config.data import DataConfig, SyntheticDataConfig, default_media_root
from omni_grpo.config.errors import ConfigError, format_validation_error
from omni_grpo.config.evaluation import AblationName, EvalConfig
from omni_grpo.config.load import (
    PATH_FIELDS,
    REMOVED_FIELDS,
    apply_overrides,
    build_config,
    dump_config,
    load_config,
    path_fields,
)
from omni_grpo.config.model import ModelConfig, TinyModelConfig
from omni_grpo.config.preflight import check_paths
from omni_grpo.config.ray import RayConfig
from omni_grpo.config.rewards import RewardsConfig
from omni_grpo.config.rollout import (
    EmbeddedRolloutConfig,
    RolloutConfig,
    SamplingParams,
    SglangLaunchConfig,
    SglangOmniConfig,
)
from omni_grpo.config.root import (
    MEGATRON_DTYPES,
    OmniGRPOConfig,
    contradictions,
    exact_logprobs_refusals,
    exact_obstacles,
    megatron_refusals,
)
from omni_grpo.config.run import RunConfig
from omni_grpo.config.secrets import (
    SECRET_KEY,
    URL_PASSWORD,
    is_secret_key,
    mask_url_passwords,
    redact,
)
from omni_grpo.config.trainer import (
    LoraConfig,
    LrScheduleConfig,
    MegatronConfig,
    TrainerConfig,
    WarmupConfig,
)

__all__ = [
    "MEGATRON_DTYPES",
    "PATH_FIELDS",
    "REMOVED_FIELDS",
    "SECRET_KEY",
    "URL_PASSWORD",
    "AblationName",
    "AdvantageConfig",
    "AlgoConfig",
    "ConfigError",
    "DataConfig",
    "DatasetSpec",
    "EmbeddedRolloutConfig",
    "EvalConfig",
    "LoraConfig",
    "LrScheduleConfig",
    "MegatronConfig",
    "ModelConfig",
    "OmniGRPOConfig",
    "PathField",
    "RayConfig",
    "RewardsConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingParams",
    "SglangLaunchConfig",
    "SglangOmniConfig",
    "SyntheticDataConfig",
    "TISConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "WarmupConfig",
    "apply_overrides",
    "build_config",
    "check_paths",
    "contradictions",
    "default_media_root",
    "dump_config",
    "exact_logprobs_refusals",
    "exact_obstacles",
    "format_validation_error",
    "is_secret_key",
    "load_config",
    "mask_url_passwords",
    "megatron_refusals",
    "path_fields",
    "redact",
]
