"""Training the multi-token-prediction (MTP) layers of an otherwise frozen model with `transformers.Trainer`: the
library behind `scripts/train_mtp.py`.

Two uses: a fresh head for a model that has none (`add_mtp_layers`: a model trained here, or one converted from a
source that shipped none), and realigning a head after the model under it was fine-tuned (the head reads the main
model's final hidden states, which fine-tuning moves). Either way every parameter outside the MTP layers is frozen
(the embedding and the language-model head they share included), and the loss is the MTP loss alone: the mean over
depths of the cross-entropy of depth `k`'s prediction at position `i` against the token at `i + k + 2`, on entries
whose tokens `i .. i + k + 2` belong to one sequence (a packed block's next example is not predicted from the one
before). The frozen main pass builds no autograd graph, so a step costs little more than a forward of the model.

Logged per logging step: `mtp_loss` (the training loss) and `mtp_accuracy_k`, the fraction of depth `k`'s top-1
predictions that equal the token: under greedy decoding, the rate at which a draft of that depth is accepted (given
the drafts before it were). An evaluation on `--validation_files` reports `eval_mtp_loss` and `eval_mtp_accuracy_k`.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from .configuration.configuration_hybrid_indexpool import CHOICES
from .modeling.modeling_hybrid_indexpool import HybridIndexPoolModel
from .modeling.multi_token_prediction import MTP_CLASSES
from .training import (
    ModelDataArguments,
    TrainingInputError,
    check_output_dir,
    language_model_collator,
    load_datasets,
    load_model,
    load_tokenizer,
    save_tokenizer_and_processor,
    without_cache,
)

MTP_TYPES = CHOICES["mtp_type"]


@dataclass
class MTPTrainingArguments(ModelDataArguments):
    """Which MTP head to train (besides the model and data options; the Trainer's own come from
    `TrainingArguments`)."""

    num_mtp_layers: int | None = field(
        default=None,
        metadata={"help": "A model without MTP layers gets this many fresh ones (required then). A model that has "
                          "them keeps and trains its own; giving their number there is a check."},
    )
    mtp_type: str | None = field(
        default=None,
        metadata={"help": "Kind of the fresh MTP layers (see HybridIndexPoolConfig.mtp_type). Default: qwen4_exp "
                          "for a model with Qwen4-Exp's residual streams, else deepseek (the kind GLM-5.3-Flash's "
                          "export writes; qwen3_next differs only at position 0).", "choices": list(MTP_TYPES)},
    )
    reinitialize_mtp: bool = field(
        default=False,
        metadata={"help": "Start the model's existing MTP layers afresh instead of from their weights."},
    )


def text_model_of(model: torch.nn.Module) -> HybridIndexPoolModel:
    """The decoder stack (with its `mtp`) of a causal or multimodal HybridIndexPool model."""
    found = [module for module in model.modules() if isinstance(module, HybridIndexPoolModel)]
    if len(found) != 1:
        raise TrainingInputError(f"Expected one HybridIndexPool decoder in {type(model).__name__}, found {len(found)}.")
    return found[0]


def default_mtp_type(config) -> str:
    """The MTP kind a fresh head gets: Qwen4-Exp's where the model has its residual streams (its export writes that
    kind), else DeepSeek's."""
    return "qwen4_exp" if config.hc_type == "qwen4_exp" and config.hc_count > 1 else "deepseek"


def add_mtp_layers(model: torch.nn.Module, num_mtp_layers: int, mtp_type: str | None = None) -> None:
    """Give `model` `num_mtp_layers` freshly initialised MTP layers of `mtp_type` (default `default_mtp_type`), in
    the dtype and on the device of its embedding, replacing any it had; the config records them, so the saved model
    loads with them."""
    config = model.config.get_text_config()
    mtp_type = mtp_type or default_mtp_type(config)
    if num_mtp_layers < 1:
        raise TrainingInputError(f"--num_mtp_layers is {num_mtp_layers}; a head needs at least 1 MTP layer.")
    if mtp_type not in MTP_TYPES:
        raise TrainingInputError(f"--mtp_type is {mtp_type!r}; use one of {list(MTP_TYPES)}.")
    previous = config.num_mtp_layers, config.mtp_type
    config.num_mtp_layers, config.mtp_type = num_mtp_layers, mtp_type
    try:
        config.check_settings()
    except ValueError as error:
        config.num_mtp_layers, config.mtp_type = previous
        raise TrainingInputError(str(error)) from error
    text_model = text_model_of(model)
    embedding = text_model.embed_tokens.weight
    mtp = MTP_CLASSES[mtp_type](config)
    mtp.apply(model._init_weights)
    mtp.to(device=embedding.device, dtype=embedding.dtype)
    # The parameters the model keeps in float32 at load (a grouped router's, the decay parameters) stay float32 here
    # too, so the head trains as it will run once saved and loaded.
    with torch.no_grad():
        for name, parameter in mtp.named_parameters():
            if any(kept in name for kept in text_model._keep_in_fp32_modules_strict):
                parameter.data = parameter.data.float()
    text_model.mtp = mtp


def is_mtp_parameter(name: str) -> bool:
    """Whether a parameter belongs to the MTP layers (`model.mtp.`, or `model.language_model.mtp.`)."""
    return ".mtp." in f".{name}"


def freeze_all_but_mtp(model: torch.nn.Module) -> list[str]:
    """Let only the MTP layers' parameters train; returns their names. Raises when the model has none."""
    trainable = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_mtp_parameter(name))
        if parameter.requires_grad:
            trainable.append(name)
    if not trainable:
        raise TrainingInputError("The model has no MTP layers to train; give it fresh ones with --num_mtp_layers N.")
    return trainable


def mtp_targets(labels: torch.Tensor, position_ids: torch.Tensor | None, depth: int) -> torch.Tensor:
    """`[batch, seq]` target of depth `depth`'s entry at each position: the label of the token `depth + 1` places
    after the next (the one-place shift of `labels` included), or -100 where there is none, where a label is -100,
    or where positions `i .. i + depth + 2` are not one run of a sequence (a packed block's example boundary)."""
    shift = depth + 2
    targets = F.pad(labels[:, shift:], (0, shift), value=-100)
    if position_ids is not None:
        reach = F.pad(position_ids[:, shift:], (0, shift), value=-1)
        targets = targets.masked_fill(reach != position_ids + shift, -100)
    return targets


def mtp_loss_and_accuracy(mtp_logits: tuple[torch.Tensor, ...], labels: torch.Tensor,
                          position_ids: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The MTP loss (the mean over depths of each depth's mean cross-entropy on its targets, `mtp_targets`) and each
    depth's top-1 accuracy on them; `mtp_logits` holds one `[batch, seq, vocab]` per depth. A depth without targets
    in the batch (rows shorter than `depth + 3` tokens) adds a zero loss and a NaN accuracy."""
    losses, accuracies = [], []
    for depth, logits in enumerate(mtp_logits):
        targets = mtp_targets(labels.to(logits.device), None if position_ids is None else
                              position_ids.to(logits.device), depth)
        real = targets != -100
        if not real.any():  # a zero that keeps the graph, so every process's backward reaches the same parameters
            losses.append(logits.sum() * 0.0)
            accuracies.append(torch.tensor(float("nan")))
            continue
        losses.append(F.cross_entropy(logits[real].float(), targets[real]))
        accuracies.append((logits[real].argmax(-1) == targets[real]).float().mean())
    return torch.stack(losses).mean(), accuracies


class MTPTrainer(Trainer):
    """A `Trainer` whose loss is the MTP loss alone (`mtp_loss_and_accuracy`) and whose logs carry each depth's
    top-1 accuracy, averaged over this process's batches since the last log (`mtp_accuracy_k`) or over an evaluation
    (`eval_mtp_accuracy_k`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accuracies = {"train": [], "eval": []}  # per batch since the last log: one value per depth

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs, output_mtp_logits=True)
        if outputs.mtp_logits is None:
            raise TrainingInputError("The model returned no MTP logits: it has no MTP layers.")
        loss, accuracies = mtp_loss_and_accuracy(outputs.mtp_logits, labels, inputs.get("position_ids"))
        self._accuracies["train" if model.training else "eval"].append([value.item() for value in accuracies])
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for kind, prefix, loss_key in (("train", "", "loss"), ("eval", "eval_", "eval_loss")):
            batches = self._accuracies[kind]
            if batches and loss_key in logs:
                logs[f"{prefix}mtp_loss"] = logs[loss_key]
                for depth, values in enumerate(zip(*batches)):
                    counted = [value for value in values if not math.isnan(value)]  # batches with targets
                    if counted:
                        logs[f"{prefix}mtp_accuracy_{depth}"] = round(sum(counted) / len(counted), 5)
                self._accuracies[kind] = []
        super().log(logs, start_time)


def prepare_mtp_model(model: torch.nn.Module, args: MTPTrainingArguments) -> list[str]:
    """Give the model its fresh head where asked or needed (checking `--num_mtp_layers` against a head it has) and
    freeze everything else; returns the trainable parameters' names."""
    config = model.config.get_text_config()
    if config.num_mtp_layers == 0 or args.reinitialize_mtp:
        if args.num_mtp_layers is None and config.num_mtp_layers == 0:
            raise TrainingInputError("The model has no MTP layers: give it fresh ones with --num_mtp_layers N "
                                     "(1 is what the released models ship and what drafting reuses at every depth).")
        add_mtp_layers(model, args.num_mtp_layers or config.num_mtp_layers, args.mtp_type or (
            config.mtp_type if config.num_mtp_layers else None))
    else:
        if args.num_mtp_layers is not None and args.num_mtp_layers != config.num_mtp_layers:
            raise TrainingInputError(
                f"The model has {config.num_mtp_layers} MTP layers, not --num_mtp_layers {args.num_mtp_layers}; "
                "leave the option out to train its own, or pass --reinitialize_mtp to replace them."
            )
        if args.mtp_type is not None and args.mtp_type != config.mtp_type:
            raise TrainingInputError(
                f"The model's MTP layers are of type {config.mtp_type!r}, not --mtp_type {args.mtp_type!r}; pass "
                "--reinitialize_mtp to replace them with fresh ones of that type."
            )
    return freeze_all_but_mtp(model)


def run_mtp_training(args: MTPTrainingArguments, training_args: TrainingArguments) -> dict:
    """Train the MTP layers alone, save the whole model (with its remote code), the tokenizer and the processor
    files, return the metrics (with `log_history`)."""
    check_output_dir(args, training_args)
    if training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = True  # the frozen model's parameters get no gradient
    tokenizer = load_tokenizer(args)
    model = load_model(args, tokenizer)
    prepare_mtp_model(model, args)
    deepest = model.config.get_text_config().num_mtp_layers + 2  # the shift of the last depth's targets
    if args.block_size <= deepest:
        raise TrainingInputError(f"--block_size {args.block_size} leaves the deepest MTP layer no target (it predicts "
                                 f"{deepest} tokens ahead); use blocks of more than {deepest} tokens.")
    train_dataset, eval_dataset = load_datasets(args, tokenizer)
    trainer = MTPTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=language_model_collator(tokenizer, args.packing), processing_class=tokenizer,
    )
    with without_cache(model):
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = dict(result.metrics)
        metrics["log_history"] = trainer.state.log_history
        if eval_dataset is not None:
            metrics.update(trainer.evaluate())
    model.requires_grad_(True)
    accuracies = [entry for entry in trainer.state.log_history if "mtp_accuracy_0" in entry]
    if trainer.is_world_process_zero():
        model.save_pretrained(training_args.output_dir)
        save_tokenizer_and_processor(args, tokenizer, training_args.output_dir)
        if accuracies:
            first, last = accuracies[0], accuracies[-1]
            print(f"train_mtp: {trainer.state.global_step} steps, MTP loss {first['mtp_loss']:.4f} -> "
                  f"{last['mtp_loss']:.4f}, depth-0 top-1 accuracy {first['mtp_accuracy_0']:.3f} -> "
                  f"{last['mtp_accuracy_0']:.3f}", flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return metrics
