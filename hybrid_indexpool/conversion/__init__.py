"""Streaming conversion of pretrained checkpoints into HybridIndexPool checkpoints.

`engine` holds the declarative plans and the streaming `convert_checkpoint`, `checkpoint_io` the safetensors source
and the shard writer, `cli` the command line the converter scripts share, `qwen` what the Qwen hybrids map alike.
One module per source family holds its mapping (config, plan) and the function that converts a folder: `qwen4_exp`
(`convert_qwen4_exp`), `qwen3_next` (`convert_qwen3_next` for Qwen3-Next and Qwen3.5, its new indexer set by
`IndexerSettings`) and `glm5_next` (`convert_glm5_next`); `scripts/convert_<family>.py` is each one's command line.
`export` runs a family's plan backwards: `export_qwen4_exp` and `export_glm5_next` write a checkpoint of ours in the
source's format (`scripts/export_<family>.py`).
"""

from .checkpoint_io import CONVERTER_SCRIPTS, SourceCheckpoint
from .cli import conversion_argument_parser, run_conversion_command, run_export_command
from .engine import (
    CheckpointTarget,
    ConcatenatedWeight,
    ConversionPlan,
    ConversionReport,
    IgnoreRule,
    Terminated,
    WeightGroup,
    concatenated,
    convert_checkpoint,
    expected_weights,
    fresh_weights,
    fuse_experts,
    rename,
    to_multimodal_name,
)
from .errors import ConversionError
from .export import ExportWarning
from .glm5_next import convert_glm5_next, export_glm5_next
from .qwen import (
    qwen_attention_parts,
    qwen_hybrid_settings,
    qwen_moe_plan,
    qwen_outer_plan,
    qwen_source_configs,
    qwen_text_prefix,
)
from .qwen3_next import IndexerSettings, convert_qwen3_next
from .qwen4_exp import convert_qwen4_exp, export_qwen4_exp

__all__ = [
    "CONVERTER_SCRIPTS",
    "CheckpointTarget",
    "ConcatenatedWeight",
    "ConversionError",
    "ConversionPlan",
    "ConversionReport",
    "ExportWarning",
    "IgnoreRule",
    "IndexerSettings",
    "SourceCheckpoint",
    "Terminated",
    "WeightGroup",
    "conversion_argument_parser",
    "concatenated",
    "convert_checkpoint",
    "convert_glm5_next",
    "export_glm5_next",
    "export_qwen4_exp",
    "convert_qwen3_next",
    "convert_qwen4_exp",
    "expected_weights",
    "fresh_weights",
    "fuse_experts",
    "qwen_attention_parts",
    "qwen_hybrid_settings",
    "qwen_moe_plan",
    "qwen_outer_plan",
    "qwen_source_configs",
    "qwen_text_prefix",
    "rename",
    "run_conversion_command",
    "run_export_command",
    "to_multimodal_name",
]
