"""Export a HybridIndexPool checkpoint back to the format of a source family, for engines that serve that format.

An export runs a family's conversion plan backwards: the plan is built for the source checkpoint that the exported
config describes (its weight names as transformers' `save_pretrained` of that family writes them), then inverted
([`ConversionPlan.inverted`]) and streamed through the same engine as a conversion. The same tables map both ways,
so a converted checkpoint exported unchanged gives back the source's tensors bit for bit.
"""

import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from .checkpoint_io import SourceCheckpoint
from .engine import (
    COPIED_FILES,
    CheckpointTarget,
    ConversionPlan,
    ConversionReport,
    convert_checkpoint,
    expected_weights,
)
from .errors import ConversionError

OUR_MODEL_TYPES = ("hybrid_indexpool", "hybrid_indexpool_multimodal")


@dataclass(frozen=True)
class SourceLayout:
    """The weights a checkpoint of a source family holds (what a conversion plan is built from), without the file."""

    weight_names: list[str]
    model_type: str


def saved_weight_shapes(model_class, config: PretrainedConfig) -> dict[str, torch.Size]:
    """`{name: shape}` of the weights `save_pretrained` of transformers' `model_class` writes for `config`: the names
    on disk (transformers' load-time renames and fusions reverted), tied weights once. Nothing is allocated."""
    with torch.device("meta"):
        model = model_class(config)
    tied = set(model.all_tied_weights_keys)
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    return {name: tensor.shape for name, tensor in revert_weight_conversion(model, state).items()}


def weights_beyond_the_class(plan: ConversionPlan, expected: Mapping[str, torch.Size], our_config) -> dict:
    """`{name: shape}` of the source weights `plan` reads that transformers' class does not hold (`expected` lacks
    them: the MTP layers, which the engines load but transformers leaves out), from running the groups that read
    them backwards on meta tensors of our shapes."""
    ours, _ = expected_weights(our_config)
    shapes = {}
    for group in plan.groups:
        if all(name in expected for name in group.sources) or group.inverse is None:
            continue
        meta = {name: torch.empty(ours[name], device="meta") for name in group.targets}
        shapes.update({name: tensor.shape for name, tensor in group.inverse(meta).items() if name not in expected})
    return shapes


def open_our_checkpoint(folder) -> tuple[SourceCheckpoint, PretrainedConfig]:
    """Our checkpoint in `folder` and its config; ConversionError for LoRA adapters and for other architectures."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        raise ConversionError(
            f"{folder} holds LoRA adapters, not a model. Merge them into the base model first: "
            "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, trust_remote_code=True), "
            f"'{folder}').merge_and_unload().save_pretrained(merged)` (the fine-tune script merges by default, "
            "--merge_lora True), then export the merged folder."
        )
    checkpoint = SourceCheckpoint.open(folder)
    if checkpoint.model_type not in OUR_MODEL_TYPES:
        raise ConversionError(
            f"{folder} holds a model_type {checkpoint.model_type!r} checkpoint; the export reads HybridIndexPool "
            f"checkpoints ({list(OUR_MODEL_TYPES)}), such as a converter's output or a model fine-tuned from one."
        )
    return checkpoint, AutoConfig.from_pretrained(folder)


def export_checkpoint(
    checkpoint: SourceCheckpoint,
    our_config: PretrainedConfig,
    source_config: PretrainedConfig,
    source_model_class,
    build_plan: Callable[[SourceLayout, PretrainedConfig], ConversionPlan],
    output_dir,
    *,
    checks: Iterable = (),
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConversionReport:
    """Write `checkpoint` (ours, of `our_config`) as a checkpoint of `source_model_class` with `source_config`.

    `build_plan(layout, our_config)` is the family's conversion plan; it runs backwards. `checks` are weight groups
    that read our weights the source format has no place for and write nothing: each raises ConversionError unless
    its weights are neutral (e.g. learned pooling still at the mean). Output safety is the conversion's: an existing
    folder is refused unless `overwrite`, and the result appears only once complete.
    """
    expected = saved_weight_shapes(source_model_class, source_config)
    layout = SourceLayout(list(expected), source_config.model_type)
    forward_plan = build_plan(layout, our_config)
    expected.update(weights_beyond_the_class(forward_plan, expected, our_config))
    plan = forward_plan.inverted(expected)
    # A group that reads nothing of ours (values the source stores and ours computes) is written up front.
    computed = {name: tensor for group in plan.groups if not group.sources for name, tensor in group.build({}).items()}
    plan.groups = [group for group in plan.groups if group.sources] + list(checks)
    architecture = source_model_class.__name__

    def write_metadata(folder: Path) -> None:
        source_config.architectures = [architecture]
        source_config.save_pretrained(folder)
        for file_name in COPIED_FILES:
            if (checkpoint.folder / file_name).is_file():
                shutil.copyfile(checkpoint.folder / file_name, folder / file_name)
        if not (folder / "generation_config.json").exists():
            GenerationConfig.from_model_config(source_config).save_pretrained(folder)

    return convert_checkpoint(
        checkpoint, plan, source_config, output_dir, overwrite=overwrite, max_shard_size=max_shard_size,
        extra_tensors=computed, target=CheckpointTarget(expected, write_metadata), progress=progress, log=log,
    )
