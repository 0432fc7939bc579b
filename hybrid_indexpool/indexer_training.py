"""Indexer training in two stages (DeepSeek-V3.2's recipe) with `transformers.Trainer`: the library behind
`scripts/train_indexer.py`.

- Stage 1, dense warm-up (`"warmup"`): every parameter is frozen except the indexer's (`indexer.*`: query and key
  projections and norms, pooling gate and slot bias, head weights); the attention runs dense at any length and the
  loss is the indexer's KL divergence to the dense attention mass of every complete window.
- Stage 2, sparse training (`"sparse"`): every parameter trains; the attention runs over the selected windows and
  the loss is the language-model loss plus `indexer_loss_weight` times the KL over the selected windows. The indexer
  reads a detached input, so the language-model loss never reaches it.

With `freeze_pooling` neither stage trains the learned pooling weights (`pool_gate_proj`, `pool_slot_bias`): a model
converted from Qwen4-Exp keeps pooling by the mean, which is all Qwen4-Exp's format can express.

With `pool_distillation_weight` either stage also trains the learned pooling gate toward the attention each key
receives within its window (`pool_distillation`), weighted into the loss.

The KL is logged per logging step as `indexer_kl` (and the language-model part of the loss as `lm_loss`, the pool
distillation loss as `pool_distillation`).
"""

import copy
import inspect
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments
from transformers.utils import logging

from .kernels.fp8_index_keys import fp8_round_trip_unrotated, quantize_pooled_keys
from .kernels.pooled_index_topk import pooled_index_topk
from .modeling.attention_gqa import HybridIndexPoolAttention
from .pool_distillation import PoolDistillation
from .training import (
    ModelDataArguments,
    TrainingInputError,
    check_arguments,
    freeze_pooling,
    is_pooling_parameter,
    language_model_collator,
    load_datasets,
    load_model,
    load_tokenizer,
    save_tokenizer_and_processor,
    without_cache,
)

logger = logging.get_logger(__name__)

STAGES = ("warmup", "sparse")
STAGE_CHOICES = ("warmup", "sparse", "both")
# The forward's `indexer_loss` mode of each stage.
STAGE_LOSS = {"warmup": "dense", "sparse": "sparse"}


@dataclass
class IndexerTrainingArguments(ModelDataArguments):
    """Which stages to run, how long, and at which learning rates (besides the model and data options)."""

    stage: str = field(
        default="both",
        metadata={"help": "warmup (stage 1: dense warm-up of the indexer alone), sparse (stage 2: all parameters, "
                          "sparse attention) or both (warm-up, then sparse).", "choices": list(STAGE_CHOICES)},
    )
    dense_warmup_steps: int = field(default=200, metadata={"help": "Optimizer steps of the dense warm-up."})
    sparse_steps: int = field(default=200, metadata={"help": "Optimizer steps of the sparse stage."})
    dense_warmup_learning_rate: float = field(
        default=1e-3,
        metadata={"help": "Learning rate of the dense warm-up (only the small indexer trains, so it can be high; "
                          "the sparse stage uses --learning_rate)."},
    )
    indexer_loss_weight: float | None = field(
        default=None,
        metadata={"help": "Weight of the indexer KL in the sparse stage's loss (default: the model config's "
                          "indexer_loss_weight); saved into the config."},
    )
    pool_distillation_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of the pool distillation loss in both stages: the learned pooling gate also learns "
                          "the dense attention each key receives within its window (hybrid_indexpool."
                          "pool_distillation). 0 (the default) turns it off; needs index_pool_weighting 'learned' or "
                          "'learned_scalar'."},
    )


def is_indexer_parameter(name: str) -> bool:
    """Whether a parameter belongs to an IndexPool indexer (the only ones the dense warm-up trains)."""
    return ".indexer." in f".{name}"


def freeze_all_but_indexer(model: torch.nn.Module, keep_pooling: bool = False) -> list[str]:
    """Let only the indexer parameters train (without the learned pooling weights when `keep_pooling`); returns
    their names. Raises when the model has none."""
    trainable = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_indexer_parameter(name) and not (keep_pooling and is_pooling_parameter(name)))
        if parameter.requires_grad:
            trainable.append(name)
    if not trainable:
        raise TrainingInputError(
            "The model has no indexer parameters (no `indexpool_attention` layer in its layer_types): "
            "there is nothing to warm up."
        )
    return trainable


class IndexerTrainer(Trainer):
    """A `Trainer` whose forward asks for the indexer loss and whose logs carry its mean since the last log (over
    this process's batches).

    `indexer_loss="dense"` (warm-up): the loss is the KL alone. `"sparse"`: the model's loss, i.e. the language-model
    loss plus `config.indexer_loss_weight` times the KL. Both are means over the batch, so the Trainer divides them by
    the gradient-accumulation steps. A positive `pool_distillation_weight` adds that times the pool distillation loss
    (`PoolDistillation`) in either stage.
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args, indexer_loss: str, pool_distillation_weight: float = 0.0, **kwargs):
        if indexer_loss not in STAGE_LOSS.values():
            raise ValueError(f"indexer_loss is {indexer_loss!r}; use 'dense' (warm-up) or 'sparse'.")
        if pool_distillation_weight < 0:
            raise ValueError(f"pool_distillation_weight is {pool_distillation_weight}; use 0 (off) or a positive "
                             "weight.")
        super().__init__(*args, **kwargs)
        self.indexer_loss = indexer_loss
        self.pool_distillation_weight = pool_distillation_weight
        self.pool_distillation = PoolDistillation(self.model) if pool_distillation_weight else None
        self._logged_sums = {"indexer_kl": 0.0, "lm_loss": 0.0, "pool_distillation": 0.0}
        self._logged_count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        if self.indexer_loss == "dense":
            inputs.pop("labels", None)  # the warm-up trains on the KL alone
        with self.pool_distillation or nullcontext():
            outputs = model(**inputs, indexer_loss=self.indexer_loss)
        if outputs.indexer_loss is None:
            raise ValueError("The model returned no indexer loss: it needs at least one `indexpool_attention` layer.")
        loss = outputs.indexer_loss if self.indexer_loss == "dense" else outputs.loss
        distillation = None
        if self.pool_distillation is not None:
            distillation = self.pool_distillation.loss()
            loss = loss + self.pool_distillation_weight * distillation
        if model.training:
            self._logged_sums["indexer_kl"] += outputs.indexer_loss.item()
            if self.indexer_loss == "sparse":
                weight = self.accelerator.unwrap_model(model).config.get_text_config().indexer_loss_weight
                self._logged_sums["lm_loss"] += (outputs.loss - weight * outputs.indexer_loss).item()
            if distillation is not None:
                self._logged_sums["pool_distillation"] += distillation.item()
            self._logged_count += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._logged_count and "loss" in logs:
            logs["indexer_kl"] = round(self._logged_sums["indexer_kl"] / self._logged_count, 5)
            if self.indexer_loss == "sparse":
                logs["lm_loss"] = round(self._logged_sums["lm_loss"] / self._logged_count, 5)
            if self.pool_distillation is not None:
                logs["pool_distillation"] = round(self._logged_sums["pool_distillation"] / self._logged_count, 5)
            self._logged_sums = dict.fromkeys(self._logged_sums, 0.0)
            self._logged_count = 0
        super().log(logs, start_time)


def train_indexer_stage(model, stage: str, train_dataset, training_args: TrainingArguments, data_collator,
                        eval_dataset=None, processing_class=None, keep_pooling: bool = False,
                        pool_distillation_weight: float = 0.0) -> IndexerTrainer:
    """Run one stage (`"warmup"` or `"sparse"`) on `model` in place for `training_args.max_steps` steps.

    The warm-up freezes everything but the indexer for its duration, and `keep_pooling` the learned pooling weights
    in either stage; afterwards every parameter is trainable again. `pool_distillation_weight` adds the pool
    distillation loss (see `IndexerTrainer`). Returns the trainer (its `state.log_history` holds the logged
    `indexer_kl`).
    """
    if stage not in STAGES:
        raise ValueError(f"stage is {stage!r}; use one of {list(STAGES)}.")
    if keep_pooling and pool_distillation_weight:
        raise TrainingInputError("Pool distillation trains the pooling weights, which --freeze_pooling keeps as they "
                                 "are; drop one of the two.")
    if stage == "warmup":
        freeze_all_but_indexer(model, keep_pooling)
    elif keep_pooling:
        freeze_pooling(model)
    trainer = IndexerTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=data_collator, processing_class=processing_class, indexer_loss=STAGE_LOSS[stage],
        pool_distillation_weight=pool_distillation_weight,
    )
    try:
        trainer.train()
    finally:
        model.requires_grad_(True)
    return trainer


def stage_training_arguments(args: IndexerTrainingArguments, training_args: TrainingArguments,
                             stage: str) -> TrainingArguments:
    """The Trainer options of one stage: its step count and learning rate, its checkpoints in `output_dir/<stage>`."""
    stage_args = copy.deepcopy(training_args)
    stage_args.output_dir = os.path.join(training_args.output_dir, stage)
    if stage == "warmup":
        stage_args.max_steps, stage_args.learning_rate = args.dense_warmup_steps, args.dense_warmup_learning_rate
    else:
        stage_args.max_steps = args.sparse_steps
    return stage_args


def check_indexer_arguments(args: IndexerTrainingArguments, training_args: TrainingArguments) -> list[str]:
    """Validate the options; returns the stages to run, in order."""
    if args.stage not in STAGE_CHOICES:
        raise TrainingInputError(f"--stage is {args.stage!r}; use one of {list(STAGE_CHOICES)}.")
    stages = list(STAGES) if args.stage == "both" else [args.stage]
    for stage, steps, flag in (("warmup", args.dense_warmup_steps, "--dense_warmup_steps"),
                               ("sparse", args.sparse_steps, "--sparse_steps")):
        if stage in stages and steps <= 0:
            raise TrainingInputError(f"{flag} is {steps}; give a positive number of steps for the {stage} stage.")
    if args.pool_distillation_weight < 0:
        raise TrainingInputError(f"--pool_distillation_weight is {args.pool_distillation_weight}; use 0 (off) or a "
                                 "positive weight.")
    if args.pool_distillation_weight and args.freeze_pooling:
        raise TrainingInputError("--pool_distillation_weight trains the pooling weights, which --freeze_pooling keeps "
                                 "as they are; drop one of the two.")
    if training_args.max_steps > 0:
        raise TrainingInputError(
            "Set the length of each stage with --dense_warmup_steps and --sparse_steps, not --max_steps."
        )
    if training_args.resume_from_checkpoint:
        raise TrainingInputError(
            "train_indexer does not resume inside a stage; start the remaining stage from a saved model "
            "(--model_name_or_path <output_dir of the warm-up> --stage sparse)."
        )
    return stages


def kl_summary(log_history: list[dict]) -> tuple[float, float] | None:
    """First and last logged `indexer_kl` of a stage, or None when nothing was logged."""
    values = [entry["indexer_kl"] for entry in log_history if "indexer_kl" in entry]
    return (values[0], values[-1]) if values else None


def kl_summary_line(stage: str, steps: int, summary: tuple[float, float]) -> str:
    """The line a stage ends with: its first and last indexer KL to 4 significant figures, in scientific notation
    when small (a warmed-up KL is often below 1e-4, which fixed decimals would show as 0.0000)."""
    return f"train_indexer: {stage} stage, {steps} steps, indexer KL {summary[0]:.4g} -> {summary[1]:.4g}"


def run_indexer_training(args: IndexerTrainingArguments, training_args: TrainingArguments) -> dict:
    """Run the chosen stages, save the model (with its remote code), the tokenizer and the processor files, return
    per-stage metrics."""
    stages = check_indexer_arguments(args, training_args)
    check_arguments(args, training_args)
    if training_args.ddp_find_unused_parameters is None:
        # Within the token budget the sparse stage selects nothing, so the indexer's scores may go unused.
        training_args.ddp_find_unused_parameters = True
    tokenizer = load_tokenizer(args)
    model = load_model(args, tokenizer)
    text_config = model.config.get_text_config()  # a multimodal model's settings are its text model's
    if args.indexer_loss_weight is not None:
        text_config.indexer_loss_weight = args.indexer_loss_weight
    if args.pool_distillation_weight and text_config.index_pool_weighting not in ("learned", "learned_scalar"):
        raise TrainingInputError(
            f"--pool_distillation_weight trains a learned pooling gate, but the model pools with "
            f"index_pool_weighting={text_config.index_pool_weighting!r}; use a model with 'learned' or "
            "'learned_scalar' pooling (or drop --pool_distillation_weight).")
    if args.block_size <= text_config.index_topk + text_config.index_pool_size - 1:
        logger.warning(
            f"--block_size {args.block_size} is within the token budget ({text_config.index_topk}): every window is "
            "selected, so the sparse stage is dense attention. Use blocks longer than index_topk to train the "
            "selection."
        )
    train_dataset, eval_dataset = load_datasets(args, tokenizer)
    collator = language_model_collator(tokenizer, args.packing)

    metrics = {}
    with without_cache(model):
        for stage in stages:
            trainer = train_indexer_stage(
                model, stage, train_dataset, stage_training_arguments(args, training_args, stage), collator,
                eval_dataset=eval_dataset, processing_class=tokenizer, keep_pooling=args.freeze_pooling,
                pool_distillation_weight=args.pool_distillation_weight,
            )
            stage_metrics = {"steps": trainer.state.global_step, "log_history": trainer.state.log_history}
            if eval_dataset is not None:
                stage_metrics.update(trainer.evaluate())
            summary = kl_summary(trainer.state.log_history)
            if summary is not None and trainer.is_world_process_zero():
                print(kl_summary_line(stage, trainer.state.global_step, summary), flush=True)
            metrics[stage] = stage_metrics

    if trainer.is_world_process_zero():
        model.save_pretrained(training_args.output_dir)
        save_tokenizer_and_processor(args, tokenizer, training_args.output_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return metrics


@torch.no_grad()
def selection_attention_mass(model, input_ids: torch.Tensor) -> dict:
    """How much of the dense attention the indexer's selection keeps, with the model's own pieces.

    Runs `model` densely (`indexer_loss="dense"`, `output_attentions=True`), then recomputes each IndexPool layer's
    selection (full-precision pooled keys) from the hidden states that entered it, and sums the dense attention
    probability that falls on the selected windows plus the tail. Averaged over heads and over the queries whose
    visible windows exceed the budget (the others keep everything), per layer and over layers. Inputs must be
    unpadded `[batch, seq]` ids.

    Also the mass of the best selection any indexer could make at the same pool size and budget (`oracle_mass`):
    per query, the `topk` visible complete windows holding the most head-averaged dense attention, plus the tail. It
    bounds what training the indexer can reach, and tells the pool size's own cost (coarser windows) apart from the
    indexer's misses.

    Returns `{"mass": float, "per_layer": [float], "oracle_mass": float, "oracle_per_layer": [float],
    "dense_kl": float}`; the masses are 1.0 when no query is pruned.
    """
    outputs, layers = _dense_pass(model, input_ids)
    per_layer, oracle_per_layer = [], []
    for pieces in layers:
        if not pieces.pruned.any():
            per_layer.append(1.0)
            oracle_per_layer.append(1.0)
            continue
        captured, tail = _captured_mass(pieces, _select(pieces, pieces.pooled_keys))
        per_layer.append(captured[pieces.pruned].mean().item())
        oracle_per_layer.append(_best_selection_mass(pieces.weights, pieces.num_visible, tail, pieces.layer.pool_size,
                                                     pieces.pooled_keys.shape[1],
                                                     pieces.layer.topk_windows)[pieces.pruned].mean().item())
    return {"mass": sum(per_layer) / len(per_layer), "per_layer": per_layer,
            "oracle_mass": sum(oracle_per_layer) / len(oracle_per_layer), "oracle_per_layer": oracle_per_layer,
            "dense_kl": outputs.indexer_loss.item()}


# How a cache could store pooled index keys, as functions of the full-precision keys that `pooled_index_topk`
# scores: bfloat16 (what a bfloat16 model's cache holds), the packed fp8 keys of `index_key_cache_dtype=
# "float8_e4m3fn"`, and the same fp8 scheme without the Hadamard rotation (an ablation, not a cache format).
INDEX_KEY_FORMATS = {
    "bfloat16": lambda keys: keys.to(torch.bfloat16),
    "float8_e4m3fn": quantize_pooled_keys,
    "float8_e4m3fn_unrotated": fp8_round_trip_unrotated,
}


@torch.no_grad()
def index_key_format_measures(model, input_ids: torch.Tensor, formats=tuple(INDEX_KEY_FORMATS)) -> dict:
    """How storing the pooled index keys in each of `formats` (names of `INDEX_KEY_FORMATS`) changes the selection,
    against the full-precision keys of the model's own indexer on `input_ids` (unpadded `[batch, seq]`).

    One dense pass as `selection_attention_mass`; then, per IndexPool layer and over the queries that see more
    windows than the budget keeps: `overlap`, the fraction of the full-precision selection's windows that the
    format's selection also selects; `identical`, the fraction of queries whose selection is unchanged; `mass`, the
    dense attention mass the format's selection captures (with the tail). Averaged per layer, then over layers
    (as the masses of `selection_attention_mass`).

    Returns `{"mass": full-precision mass, format: {"overlap": float, "identical": float, "mass": float,
    "per_layer_overlap": [float]}}`; everything is 1.0 (or the full mass) where no query is pruned.
    """
    unknown = set(formats) - set(INDEX_KEY_FORMATS)
    if unknown:
        raise ValueError(f"Unknown index key formats {sorted(unknown)}; use some of {list(INDEX_KEY_FORMATS)}.")
    _, layers = _dense_pass(model, input_ids)
    reference_mass = []
    per_format = {name: {"overlap": [], "identical": [], "mass": []} for name in formats}
    for pieces in layers:
        if not pieces.pruned.any():
            reference_mass.append(1.0)
            for values in per_format.values():
                for measure in values.values():
                    measure.append(1.0)
            continue
        pruned = pieces.pruned
        reference = _select(pieces, pieces.pooled_keys)
        reference_mass.append(_captured_mass(pieces, reference)[0][pruned].mean().item())
        for name in formats:
            selected = _select(pieces, INDEX_KEY_FORMATS[name](pieces.pooled_keys))
            # A pruned query selects exactly topk windows (ascending ids, no -1) with either keys.
            shared = (reference[..., :, None] == selected[..., None, :]).any(dim=-1).float().mean(dim=-1)
            per_format[name]["overlap"].append(shared[pruned].mean().item())
            per_format[name]["identical"].append((reference == selected).all(dim=-1)[pruned].float().mean().item())
            per_format[name]["mass"].append(_captured_mass(pieces, selected)[0][pruned].mean().item())
    result = {"mass": sum(reference_mass) / len(reference_mass)}
    for name, values in per_format.items():
        result[name] = {measure: sum(per_layer) / len(per_layer) for measure, per_layer in values.items()}
        result[name]["per_layer_overlap"] = values["overlap"]
    return result


@dataclass
class _LayerPieces:
    """What one IndexPool layer saw in a dense pass: its dense attention and its indexer's queries and pooled keys."""

    layer: HybridIndexPoolAttention
    weights: torch.Tensor  # [batch, heads, queries, slots] dense attention
    index_queries: torch.Tensor
    pooled_keys: torch.Tensor  # [batch, windows, index_head_dim], full precision
    head_weights: torch.Tensor | None
    positions: torch.Tensor  # [batch, queries]
    num_visible: torch.Tensor  # [batch, queries]
    pruned: torch.Tensor  # [batch, queries]: sees more windows than the budget keeps


def _dense_pass(model, input_ids: torch.Tensor):
    """Run `model` densely with its attention weights; returns the outputs and each IndexPool layer's
    `_LayerPieces`, recomputed from the hidden states that entered it."""
    layers = [module for module in model.modules() if isinstance(module, HybridIndexPoolAttention)]
    if not layers:
        raise ValueError("The model has no IndexPool attention layer: there is no selection to measure.")
    entered = {}

    def keep_inputs(module, args, kwargs):
        entered[module] = inspect.signature(module.forward).bind(*args, **kwargs).arguments

    hooks = [layer.register_forward_pre_hook(keep_inputs, with_kwargs=True) for layer in layers]
    try:
        outputs = model(input_ids, output_attentions=True, indexer_loss="dense", use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()

    pieces = []
    for layer, weights in zip(layers, outputs.attentions):
        inputs = entered[layer]
        hidden_states, positions = inputs["hidden_states"], inputs["positions"]
        cos, sin = inputs["position_embeddings"]
        index_queries, raw_keys, gate_logits, head_weights = layer.indexer(hidden_states, cos, sin)
        # Unpadded rows: window c is tokens c * r .. c * r + r - 1 of every row.
        r = layer.pool_size
        num_windows = hidden_states.shape[1] // r
        # Rotated at each window's first token: positions c * r (the input is one unpadded text sequence per row).
        first_positions = inputs["rope_positions"][:, :, : num_windows * r: r]
        pooled_keys = layer.indexer.pool_windows(
            raw_keys[:, : num_windows * r].unflatten(1, (num_windows, r)),
            None if gate_logits is None else gate_logits[:, : num_windows * r].unflatten(1, (num_windows, r)),
            first_positions,
        )
        num_visible = (positions + 1) // r
        pieces.append(_LayerPieces(layer, weights, index_queries, pooled_keys, head_weights, positions, num_visible,
                                   num_visible > layer.topk_windows))
    return outputs, pieces


def _select(pieces: _LayerPieces, pooled_keys: torch.Tensor) -> torch.Tensor:
    """The layer's selection `[batch, queries, topk]` scored against `pooled_keys` (any format the kernels take)."""
    layer = pieces.layer
    return pooled_index_topk(pieces.index_queries, pooled_keys, pieces.num_visible, layer.topk_windows,
                             pieces.head_weights, sink_windows=layer.sink_windows, local_windows=layer.local_windows)


def _captured_mass(pieces: _LayerPieces, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-averaged dense attention `[batch, queries]` on the `selected` windows plus the tail, and the tail's slots
    `[batch, queries, slots]`."""
    weights, r = pieces.weights, pieces.layer.pool_size
    num_slots, num_windows = weights.shape[-1], pieces.pooled_keys.shape[1]
    chosen = torch.zeros(*selected.shape[:2], num_windows + 1, dtype=torch.bool, device=selected.device)
    chosen.scatter_(-1, selected.masked_fill(selected < 0, num_windows), True)
    chosen[..., num_windows] = False  # the column that absorbed the empty (-1) picks
    slots = torch.arange(num_slots, device=selected.device)
    window_of_slot = (slots // r).clamp(max=num_windows)  # slots past the last complete window: the tail
    tail_start = (pieces.num_visible * r)[..., None]
    kept = chosen.gather(-1, window_of_slot.expand(*selected.shape[:2], -1))
    tail = (slots >= tail_start) & (slots <= pieces.positions[..., None])
    captured = (weights * (kept | tail)[:, None]).sum(-1)  # [batch, heads, queries]
    return captured.mean(dim=1), tail


def _best_selection_mass(weights: torch.Tensor, num_visible: torch.Tensor, tail: torch.Tensor, pool_size: int,
                         num_windows: int, topk: int) -> torch.Tensor:
    """Head-averaged dense attention `weights` `[batch, heads, queries, slots]` kept by the best possible selection
    of `topk` visible complete windows of `pool_size` slots plus the `tail` slots `[batch, queries, slots]`:
    `[batch, queries]`."""
    averaged = weights.mean(dim=1)  # [batch, queries, slots]: one selection serves every head of a query
    window_mass = averaged[..., : num_windows * pool_size].unflatten(-1, (num_windows, pool_size)).sum(-1)
    visible = torch.arange(num_windows, device=weights.device) < num_visible[..., None]
    best = window_mass.masked_fill(~visible, 0.0).topk(min(topk, num_windows), dim=-1).values.sum(-1)
    return best + (averaged * tail).sum(-1)
