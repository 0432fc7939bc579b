"""Export a HybridIndexPool checkpoint back to the format of a source family, for engines that serve that format.

An export runs a family's conversion plan backwards: the plan is built for the source checkpoint that the exported
config describes (its weight names as transformers' `save_pretrained` of that family writes them), then inverted
([`ConversionPlan.inverted`]) and streamed through the same engine as a conversion. The same tables map both ways,
so a converted checkpoint exported unchanged gives back the source's tensors bit for bit.
"""

import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from .checkpoint_io import EXPORTED, SourceCheckpoint
from .engine import (
    COPIED_FILES,
    CheckpointTarget,
    ConversionPlan,
    ConversionReport,
    convert_checkpoint,
    expected_weights,
    shard_size_bytes,
)
from .errors import ConversionError, names_preview

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


# Weight names of PEFT's LoRA layers (`q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`, ...): a model saved
# with them in place (`peft_model.base_model.model.save_pretrained`) holds each adapted weight split in parts.
LORA_WEIGHT = re.compile(r"\.(base_layer|lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")


def auto_class_name(model_type: str | None) -> str | None:
    """The transformers Auto class that loads a checkpoint of ours of `model_type` (None for another type)."""
    return {"hybrid_indexpool": "AutoModelForCausalLM",
            "hybrid_indexpool_multimodal": "AutoModelForImageTextToText"}.get(model_type)


def merge_command(base: str, adapters: str, model_type: str | None) -> str:
    """The Python line that merges LoRA `adapters` into the model `base` (of `model_type`, when known) and saves the
    merged model: what a refusal tells the user to run."""
    auto_class = auto_class_name(model_type)
    command = (f"`PeftModel.from_pretrained({auto_class or 'AutoModelForCausalLM'}.from_pretrained('{base}', "
               f"trust_remote_code=True), '{adapters}').merge_and_unload().save_pretrained(merged)`")
    if auto_class is None:  # the base is not at hand: both of our classes, and when each applies
        command += (" (with AutoModelForImageTextToText for a multimodal base: every GLM-5.3-Flash conversion and a "
                    "Qwen4-Exp one converted with its vision tower)")
    return command


def local_model_type(folder) -> str | None:
    """The `model_type` of the checkpoint in a local `folder`, or None when there is none there (a Hub id, a folder
    gone): only read to name the right class in a message."""
    try:
        return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, TypeError):
        return None


def open_our_checkpoint(folder) -> tuple[SourceCheckpoint, PretrainedConfig]:
    """Our checkpoint in `folder` and its config; ConversionError for LoRA adapters (alone or still in a saved
    model: they must be merged) and for other architectures."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        try:
            base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
        except (OSError, ValueError, TypeError, KeyError):
            base = None
        raise ConversionError(
            f"{folder} holds LoRA adapters, not a model. Merge them into their base model first: "
            f"{merge_command(base or 'base', str(folder), local_model_type(base) if base else None)} (the fine-tune "
            "script merges by default, --merge_lora True), then export the merged folder."
        )
    checkpoint = SourceCheckpoint.open(folder, role=EXPORTED)
    if checkpoint.model_type not in OUR_MODEL_TYPES:
        raise ConversionError(
            f"{folder} holds a model_type {checkpoint.model_type!r} checkpoint; the export reads HybridIndexPool "
            f"checkpoints ({list(OUR_MODEL_TYPES)}), such as a converter's output or a model fine-tuned from one."
        )
    lora = [name for name in checkpoint.weight_names if LORA_WEIGHT.search(name)]
    if lora:
        raise ConversionError(
            f"{folder} holds a model saved with its LoRA layers in place ({names_preview(lora, 3)}); the export needs "
            "them merged into the weights. Save the merged model from the training session "
            "(`peft_model.merge_and_unload().save_pretrained(merged)`; the fine-tune script does, --merge_lora "
            "True), or save the adapters alone (`peft_model.save_pretrained(adapters)`) and merge them into the "
            f"base: {merge_command('base', 'adapters', checkpoint.model_type)}; then export the merged folder."
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except ValueError as error:  # our config's checks name the setting
        raise ConversionError(f"The config.json of {folder} is not a valid model config: {error}") from error
    return checkpoint, config


# The source families by the `model_type` a conversion stores in `source_config`: (family, its export's script).
SOURCE_FAMILIES = {
    "qwen4_exp": ("Qwen4-Exp", "export_qwen4_exp"),
    "qwen4_exp_text": ("Qwen4-Exp", "export_qwen4_exp"),
    "glm5_next": ("GLM-5.3-Flash", "export_glm5_next"),
    "qwen3_next": ("Qwen3-Next", None),
    "qwen3_5": ("Qwen3.5", None),
    "qwen3_5_text": ("Qwen3.5", None),
    "qwen3_5_moe": ("Qwen3.5", None),
    "qwen3_5_moe_text": ("Qwen3.5", None),
}


def check_converted_from(folder, config: PretrainedConfig, family: str) -> None:
    """ConversionError when the checkpoint in `folder` was converted from another family than `family` (as its
    stored `source_config` says), naming the family it came from and the export that writes it back. A model without
    a stored source (built here) is left to the format checks."""
    source_type = (config.get_text_config().source_config or {}).get("model_type")
    if source_type is None or SOURCE_FAMILIES.get(source_type, (None,))[0] == family:
        return
    source_family, script = SOURCE_FAMILIES.get(source_type, (f"a {source_type!r} checkpoint", None))
    fix = (f"export it with {script} (python -m hybrid_indexpool.scripts.{script})" if script else
           f"{source_family} conversions have no export (their indexers are new): keep the model in our format")
    raise ConversionError(f"{folder} was converted from {source_family}, not {family}; {fix}.")


class ExportWarning(UserWarning):
    """An export that goes ahead without something the target format ships (its tokenizer or processor files)."""


# Files a checkpoint of the source families ships besides its weights: the tokenizer (its settings, and its
# vocabulary in one of the other files) and, for a multimodal one, the processor that turns images and video into
# patches. The export copies them from our checkpoint, where the converter put them.
TOKENIZER_SETTINGS = "tokenizer_config.json"
TOKENIZER_VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PROCESSOR_SETTINGS = ("preprocessor_config.json", "processor_config.json")


def missing_shipped_files(folder: Path, multimodal: bool) -> list[str]:
    """What the export of `folder` would lack of the files the target format ships: one message per missing kind
    (the tokenizer, the processor of a `multimodal` target)."""
    missing = []
    if not (folder / TOKENIZER_SETTINGS).is_file() or not any((folder / name).is_file()
                                                               for name in TOKENIZER_VOCABULARIES):
        missing.append(f"tokenizer files ({TOKENIZER_SETTINGS} with one of {', '.join(TOKENIZER_VOCABULARIES)})")
    if multimodal and not any((folder / name).is_file() for name in PROCESSOR_SETTINGS):
        missing.append(f"processor files ({' or '.join(PROCESSOR_SETTINGS)}), which images and video need")
    return missing


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
    folder is refused unless `overwrite`, and the result appears only once complete. A folder without the tokenizer
    files, or without the processor files of a multimodal model, exports with an `ExportWarning`.
    """
    max_shard_size = shard_size_bytes(max_shard_size)  # refused before any warning about the files
    for missing in missing_shipped_files(checkpoint.folder, hasattr(source_config, "vision_config")):
        # Not an error: the weights export all the same, and the files can be added afterwards.
        warnings.warn(
            f"{checkpoint.folder} has no {missing}; the export is written without them, and the engines serving it "
            f"need them: add them to {output_dir} (a converter carries them over from a source that has them, as the "
            "released checkpoints do).",
            ExportWarning, stacklevel=3,
        )
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
        computed_tensors=computed, target=CheckpointTarget(expected, write_metadata), progress=progress, log=log,
    )
