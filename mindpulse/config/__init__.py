"""The typed run config, as every other part of mindpulse imports it: `from mindpulse.config
import RunConfig, load_config, ...`.

The modules behind it, one job each:

- `schema.py`: the sections as dataclasses, their enums, and every default (the anomaly
  rules' own defaults included); `describe_fields` for the README's config reference.
- `validation.py`: each YAML value typed against its field, and the checks across fields;
  every check raises `ConfigError` naming the dotted path of the field.
- `metric_names.py`: the metric names a rule or the best checkpoint may name.
- `loading.py`: reading a YAML file (the project's default config when none is given),
  `--set` overrides, a config from some of its sections.
- `derived.py`: what the config resolves to while the job runs (the `auto` hang limit, the
  schedule of special steps, a rank monitor's settings).

And what each part is told, built from it (imported by their own paths, not re-exported here):

- `settings.py`: the launcher -> aggregator and launcher -> node agent contracts
  (`AggregatorSettings`, `NodeSettings`).
- `rank_settings.py`: what a rank is told (`RankSettings`, in its run's job.json).
- `fault_specs.py`: the faults a run rehearses, as the config and the command line write them.
- `mindformers_yaml.py`: a MindFormers YAML read without MindFormers.
"""

from mindpulse.config.derived import (
    AUTO_HANG_EARLY_S,
    AUTO_HANG_FACTOR,
    AUTO_HANG_MIN_S,
    AUTO_HANG_STEPS,
    CPU_AUTO_HANG_S,
    auto_hang_timeout,
    monitor_settings_of,
    schedule_of,
)
from mindpulse.config.loading import (
    REMOVED_KEYS,
    apply_overrides,
    default_config_path,
    from_dict,
    load_config,
    parse_override,
    read_yaml,
    sections_of,
)
from mindpulse.config.metric_names import METRIC_ALIASES, RECIPE_METRICS, REDUCED_METRICS, known_metrics
from mindpulse.config.schema import (
    AUTO_GROUP_SIZE,
    CARD_LIMITS,
    DEFAULT_RULES,
    RULE_DEFAULTS,
    AnomalyRuleConfig,
    Backend,
    BestMode,
    CheckpointConfig,
    CkptFormat,
    Device,
    EvalConfig,
    ExportersConfig,
    FileMode,
    JobConfig,
    MindFormersJobConfig,
    MlflowConfig,
    Mode,
    MonitorConfig,
    MsrunConfig,
    OutputConfig,
    PreflightConfig,
    ProfileConfig,
    PrometheusConfig,
    RayConfig,
    RecipeConfig,
    RuleAction,
    RuleKind,
    RunConfig,
    SinksConfig,
    SwanLabConfig,
    SwanLabMode,
    TrainConfig,
    WorldConfig,
    describe_fields,
    resolve_rule,
)
from mindpulse.config.validation import (
    ENV_RESERVED,
    ENV_RESERVED_PREFIXES,
    RECIPES,
    ROLLBACK_RULES,
    ConfigError,
    check_rule,
    check_shell_safe_root,
    env_reserved,
    validate,
)

__all__ = [
    # schema
    "AUTO_GROUP_SIZE", "CARD_LIMITS", "DEFAULT_RULES", "RULE_DEFAULTS", "AnomalyRuleConfig", "Backend", "BestMode",
    "CheckpointConfig", "CkptFormat", "Device", "EvalConfig", "FileMode", "JobConfig", "MindFormersJobConfig", "Mode",
    "MonitorConfig", "MsrunConfig", "OutputConfig", "PreflightConfig", "ProfileConfig", "RayConfig", "RecipeConfig",
    "RuleAction", "RuleKind", "RunConfig", "TrainConfig", "WorldConfig", "describe_fields", "resolve_rule",
    "ExportersConfig", "MlflowConfig", "PrometheusConfig", "SinksConfig", "SwanLabConfig", "SwanLabMode",
    # validation
    "ENV_RESERVED", "ENV_RESERVED_PREFIXES", "RECIPES", "ROLLBACK_RULES", "ConfigError", "check_rule",
    "check_shell_safe_root", "env_reserved", "validate",
    # metric names
    "METRIC_ALIASES", "RECIPE_METRICS", "REDUCED_METRICS", "known_metrics",
    # loading
    "REMOVED_KEYS", "apply_overrides", "default_config_path", "from_dict", "load_config", "parse_override",
    "read_yaml", "sections_of",
    # derived
    "AUTO_HANG_EARLY_S", "AUTO_HANG_FACTOR", "AUTO_HANG_MIN_S", "AUTO_HANG_STEPS", "CPU_AUTO_HANG_S",
    "auto_hang_timeout", "monitor_settings_of", "schedule_of",
]
