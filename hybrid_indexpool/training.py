"""Causal-LM fine-tuning with `transformers.Trainer` on local text or JSON files (the library behind
`scripts/finetune.py`). A multimodal checkpoint (vision tower kept) trains on text and is saved whole.

Works on one process or under `accelerate launch` (DDP, FSDP, DeepSpeed: the Trainer reads the launcher's setup),
with packing or padding, gradient checkpointing, resuming, and LoRA through `peft`.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.utils import CONFIG_NAME, cached_file

from .command_line import exit_with_error
from .configuration import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig
from .configuration.configuration_hybrid_indexpool import misspelled_fields
from .modeling import HybridIndexPoolForCausalLM, HybridIndexPoolForConditionalGeneration
from .tokenization import byte_level_tokenizer

# Linear layers LoRA adapts by default. IndexPool attention: q/k/v/o projections (the indexer's q_proj/k_proj match
# too); Gated DeltaNet: the fused q/k/v input projection, the output-gate projection and the output projection;
# MLP and shared expert: gate/up/down projections. Routed experts are fused tensors, not Linear layers.
LORA_TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj", "down_proj",
]


class TrainingInputError(ValueError):
    """Bad input to a training command (its arguments, data files or model); the message says what is wrong and how
    to fix it."""


def run_training_command(run, args, training_args):
    """Run a training command's `run(args, training_args)`; bad input ends it the way argparse ends a bad command line:
    `error: ...` on standard error and exit status 2, no traceback."""
    try:
        return run(args, training_args)
    except TrainingInputError as error:
        exit_with_error(str(error))


@dataclass
class ModelDataArguments:
    """Which model to start from and which local data to train on (shared by fine-tuning and indexer training; the
    Trainer's own options come from `TrainingArguments`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint folder or Hub id of a HybridIndexPool model to fine-tune."}
    )
    init_config: str | None = field(
        default=None,
        metadata={"help": "Instead of a checkpoint: a JSON file or JSON string of HybridIndexPoolConfig settings; "
                          "trains a freshly initialised model."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Any Hugging Face tokenizer folder or Hub id. Default: the model's own, else the offline "
                          "byte-level tokenizer."},
    )
    train_files: list[str] = field(
        default_factory=list,
        metadata={"help": "Local training files: .txt (one example per paragraph) or .json/.jsonl "
                          "(one example per record, see --text_field)."}
    )
    validation_files: list[str] = field(default_factory=list, metadata={"help": "Local validation files."})
    text_field: str = field(default="text", metadata={"help": "Field holding the text in JSON files."})
    block_size: int = field(default=512, metadata={"help": "Tokens per training sequence."})
    packing: bool = field(
        default=True,
        metadata={"help": "Concatenate examples (separated by EOS) into full blocks, each example attending only to "
                          "itself (positions restart at 0 per example); --packing False pads each example to the "
                          "batch's longest instead."},
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a non-empty --output_dir (never needed to resume)."}
    )
    freeze_pooling: bool = field(
        default=False,
        metadata={"help": "Keep the indexers' learned pooling weights (pool_gate_proj, pool_slot_bias) as they are: "
                          "a model converted from Qwen4-Exp then still pools by the mean and exports back to "
                          "Qwen4-Exp's format (scripts/export_qwen4_exp.py), whose QSA cannot express other pooling."},
    )


@dataclass
class FinetuneArguments(ModelDataArguments):
    """What to fine-tune, on which data, and whether through LoRA adapters."""

    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of all weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        metadata={"help": "Linear layers to adapt (names or suffixes)."},
    )
    merge_lora: bool = field(
        default=True, metadata={"help": "Merge the adapters into the weights for the final checkpoint."}
    )
    router_aux_loss: bool = field(
        default=True,
        metadata={"help": "Mixture-of-experts models: add the routers' load-balancing loss, weighted by the config's "
                          "router_aux_loss_coef, to the training loss (config.output_router_logits during training, as "
                          "transformers' MoE models do); False trains on the language-model loss alone."},
    )
    fsdp_size: int | None = field(
        default=None,
        metadata={"help": "Shard parameters, gradients and optimizer state over this many processes with FSDP2, "
                          "applied by transformers as it loads the model (DistributedConfig(fsdp_size=N)); start that "
                          "many processes with `accelerate launch` or `torchrun`. The FSDP route on CPUs (gloo), where "
                          "accelerate's --use_fsdp is unavailable; on GPUs either works. Weights stay float32 (--bf16 "
                          "autocasts); checkpoints hold the model only (--save_only_model): the Trainer cannot resume "
                          "such a model."},
    )


def parse_training_command_line(arguments_class, argv=None, description=None, default_options=()):
    """Parse `arguments_class` and `TrainingArguments` from the command line (or a single .json file of arguments).

    On a machine without CUDA `--use_cpu` is added (without it the Trainer ignores a CPU launch by
    `accelerate launch`, and each process would train alone); `default_options` are `(flag, value)` pairs added when
    the flag is absent; bf16 is turned on where the GPU supports it unless `--bf16` was given.
    """
    # The description's examples are command lines: shown as written, not reflowed into one paragraph.
    parser = HfArgumentParser((arguments_class, TrainingArguments), description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    if not torch.cuda.is_available() and "--use_cpu" not in argv:
        argv.append("--use_cpu")
    for flag, value in default_options:
        if not any(option.startswith(flag) for option in argv):
            argv += [flag, value]
    args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if training_args.bf16 is False and "--bf16" not in argv and torch.cuda.is_available() \
            and torch.cuda.is_bf16_supported():
        training_args.bf16 = True
    return args, training_args


def load_tokenizer(args: ModelDataArguments) -> PreTrainedTokenizerBase:
    """The tokenizer asked for, else the checkpoint's own, else (for a new model) the offline byte-level one."""
    if args.tokenizer_name_or_path is not None:
        return AutoTokenizer.from_pretrained(args.tokenizer_name_or_path)
    if args.model_name_or_path is not None:
        try:
            return AutoTokenizer.from_pretrained(args.model_name_or_path)
        except (OSError, ValueError) as error:
            raise TrainingInputError(
                f"{args.model_name_or_path} has no tokenizer; pass --tokenizer_name_or_path."
            ) from error
    return byte_level_tokenizer()


def check_data_files(files: list[str]) -> None:
    """Refuse data files that are missing, empty or not UTF-8 text, naming each one."""
    if not files:
        raise TrainingInputError("No data files given: pass --train_files with local .txt, .json or .jsonl files.")
    missing = [name for name in files if not Path(name).is_file()]
    if missing:
        raise TrainingInputError(f"Data files not found: {missing}.")
    for name in files:
        raw = Path(name).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TrainingInputError(
                f"Data file {name} is not UTF-8 text (byte {error.start} cannot be decoded); convert "
                "it, e.g. with iconv -t utf-8."
            ) from error
        if not text.strip():
            raise TrainingInputError(f"Data file {name} is empty; remove it from the file list or give it text.")


def build_lm_dataset(files: list[str], tokenizer, block_size: int, packing: bool, text_field: str = "text"):
    """A `datasets.Dataset` of token blocks from local .txt / .json / .jsonl files.

    Packing: every text plus EOS is concatenated and cut into `block_size` blocks (the remainder is dropped); each
    block carries `position_ids` that restart at 0 where an example starts (and at the block's start), so the model
    runs every example on its own, and `labels` that never ask a block to predict an example's first token from the
    one before. Padding: each text is truncated to `block_size` and the collator pads the batch.
    """
    from datasets import load_dataset

    check_data_files(files)
    suffixes = {Path(name).suffix for name in files}
    if suffixes <= {".txt", ".text", ".md", ".py"}:
        dataset = load_dataset("text", data_files=files, split="train", sample_by="paragraph")
        text_field = "text"
    elif suffixes <= {".json", ".jsonl"}:
        dataset = load_dataset("json", data_files=files, split="train")
        if text_field not in dataset.column_names:
            raise TrainingInputError(f"The JSON files have no field {text_field!r} (fields: {dataset.column_names}); "
                                     "choose it with --text_field.")
    else:
        raise TrainingInputError(f"Unsupported data file types {sorted(suffixes)}: use .txt or .json/.jsonl files.")
    dataset = dataset.filter(lambda example: bool(example[text_field] and example[text_field].strip()))

    if not packing:
        return dataset.map(
            lambda batch: tokenizer(batch[text_field], truncation=True, max_length=block_size),
            batched=True, remove_columns=dataset.column_names,
        )

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def pack(batch):
        examples = [ids + eos for ids in tokenizer(batch[text_field])["input_ids"]]
        stream = [token for ids in examples for token in ids]
        within = [index for ids in examples for index in range(len(ids))]  # position inside its example
        usable = len(stream) // block_size * block_size
        blocks = {"input_ids": [], "attention_mask": [], "position_ids": [], "labels": []}
        for start in range(0, usable, block_size):
            ids = stream[start:start + block_size]
            # A block that starts inside an example restarts that example's positions at 0.
            positions, offset = [], within[start]
            for column, index in enumerate(within[start:start + block_size]):
                if column > 0 and index == 0:
                    offset = 0
                positions.append(index - offset)
            blocks["input_ids"].append(ids)
            blocks["attention_mask"].append([1] * block_size)
            blocks["position_ids"].append(positions)
            blocks["labels"].append([-100 if column > 0 and position == 0 else token
                                     for column, (token, position) in enumerate(zip(ids, positions))])
        return blocks

    packed = dataset.map(pack, batched=True, batch_size=1000, remove_columns=dataset.column_names)
    if len(packed) == 0:
        raise TrainingInputError(f"The data holds fewer than --block_size ({block_size}) tokens; give more text or a "
                                 "smaller block size.")
    return packed


def language_model_collator(tokenizer, packing: bool):
    """The collator of `build_lm_dataset`'s blocks: packed blocks carry their own positions and labels and all have
    the same length, so stacking them is the whole collation; unpacked examples are padded."""
    return default_data_collator if packing else DataCollatorForLanguageModeling(tokenizer, mlm=False)


def load_datasets(args: ModelDataArguments, tokenizer):
    """The training dataset and the validation dataset (None without `--validation_files`) of token blocks."""
    train_dataset = build_lm_dataset(args.train_files, tokenizer, args.block_size, args.packing, args.text_field)
    eval_dataset = None
    if args.validation_files:
        eval_dataset = build_lm_dataset(args.validation_files, tokenizer, args.block_size, args.packing,
                                        args.text_field)
    return train_dataset, eval_dataset


def is_pooling_parameter(name: str) -> bool:
    """Whether a parameter is an indexer's learned pooling weight (its gate projection or slot bias), which
    `--freeze_pooling` keeps as it is."""
    return ".indexer.pool_" in f".{name}"


def freeze_pooling(model: torch.nn.Module) -> list[str]:
    """Stop the indexers' learned pooling weights from training; returns their names (none without learned
    pooling)."""
    frozen = []
    for name, parameter in model.named_parameters():
        if is_pooling_parameter(name):
            parameter.requires_grad_(False)
            frozen.append(name)
    return frozen


def pretrained_model_class(name_or_path: str, **options):
    """The Auto class that loads the checkpoint `name_or_path` of ours: `AutoModelForImageTextToText` for a
    multimodal one (a GLM-5.3-Flash or multimodal Qwen4-Exp conversion with its vision tower, which
    `AutoModelForCausalLM` does not know), else `AutoModelForCausalLM`."""
    config = AutoConfig.from_pretrained(name_or_path, **options)
    return AutoModelForImageTextToText if isinstance(config, HybridIndexPoolMultimodalConfig) else AutoModelForCausalLM


def init_config_settings(text: str) -> dict:
    """The settings of `--init_config` (a JSON object of config fields, or a file of one). Refuses a key that is not a
    `HybridIndexPoolConfig` field, naming the field it resembles: the config itself would keep it as an attribute
    nobody reads (checkpoints carry such keys) and the model would be built at the default."""
    what = "--init_config (a JSON object of config fields, or a file of one)"
    try:
        settings = json.loads(text if text.lstrip()[:1] in ("{", "[") else Path(text).read_text())
    except (OSError, ValueError) as error:  # no such file, not JSON
        raise TrainingInputError(f"{what}: {error}") from error
    if not isinstance(settings, dict):
        raise TrainingInputError(f"{what}: it holds a {type(settings).__name__}, not an object of fields.")
    unknown = misspelled_fields(HybridIndexPoolConfig, settings)
    if unknown:
        listed = "; ".join(f"`{key}`" + (f" (did you mean `{field}`?)" if field else "")
                           for key, field in unknown.items())
        raise TrainingInputError(f"{what}: {listed} is not a field of HybridIndexPoolConfig; use the field names of "
                                 "its documentation.")
    return settings


def load_model(args: ModelDataArguments, tokenizer, distributed_config=None) \
        -> HybridIndexPoolForCausalLM | HybridIndexPoolForConditionalGeneration:
    """Load the checkpoint, or build a fresh model from `--init_config` sized for the tokenizer.

    A multimodal checkpoint loads with its vision tower (`HybridIndexPoolForConditionalGeneration`): training reads
    text only, and the saved result keeps the tower, so that it exports back to its source's format. With a
    transformers `DistributedConfig`, the model is sharded by transformers (its TP/FSDP plans) as it loads; a fresh
    model is built on every process from the same seed and then sharded the same way.
    """
    if (args.model_name_or_path is None) == (args.init_config is None):
        raise TrainingInputError("Give exactly one of --model_name_or_path (fine-tune a checkpoint) or --init_config "
                                 "(train a new model).")
    if args.model_name_or_path is not None:
        # Sharded, the weights stay float32 (`--bf16` then autocasts): FSDP2 needs one dtype per group, and the Gated
        # DeltaNet's `A_log`/`dt_bias` are float32 next to half-precision projections in a half-precision model.
        dtype = {} if distributed_config is None else {"dtype": torch.float32}
        try:
            auto_class = pretrained_model_class(args.model_name_or_path)
            model = auto_class.from_pretrained(args.model_name_or_path, distributed_config=distributed_config,
                                               **dtype)
        except (OSError, ValueError) as error:  # no such folder, no weights, an architecture not ours
            raise TrainingInputError(f"--model_name_or_path {args.model_name_or_path}: {error}") from error
    else:
        settings = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                    "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        settings.update(init_config_settings(args.init_config))
        try:
            config = HybridIndexPoolConfig(**settings)
        except (ValueError, TypeError) as error:  # a value invalid or of the wrong type
            raise TrainingInputError(f"--init_config (a JSON object of config fields, or a file of one): {error}") \
                from error
        model = HybridIndexPoolForCausalLM(config)
        if distributed_config is not None:
            distributed_config, _, mesh_manager = model.prepare_distribute_model(distributed_config)
            model = model.maybe_distribute_model(model, distributed_config, mesh_manager)
    text_config = model.config.get_text_config()
    if text_config.vocab_size < len(tokenizer):
        raise TrainingInputError(
            f"The tokenizer has {len(tokenizer)} tokens but the model only {text_config.vocab_size} "
            "embeddings; use the checkpoint's tokenizer."
        )
    if args.block_size > text_config.max_position_embeddings:
        warnings.warn(
            f"--block_size {args.block_size} is beyond the model's max_position_embeddings "
            f"({text_config.max_position_embeddings}): positions past it were never trained; lower --block_size or "
            "use a scaled rope_type.", stacklevel=2,
        )
    return model


@contextlib.contextmanager
def without_cache(model):
    """Within the block, forwards of `model` build no cache (`use_cache` False in its text config), as training
    wants: the multimodal model builds its cache up front (it keeps the images' position offsets) and would then
    refuse the packed blocks, whose positions restart inside a row. The setting is restored for saving."""
    text_config = model.config.get_text_config()
    use_cache, text_config.use_cache = text_config.use_cache, False
    try:
        yield
    finally:
        text_config.use_cache = use_cache


# A multimodal checkpoint's processor files (images and video), which the tokenizer's `save_pretrained` does not
# write: carried from the checkpoint trained to the trained one, so that AutoProcessor reads it there and the export
# ships it.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def save_tokenizer_and_processor(args: ModelDataArguments, tokenizer, output_dir: str) -> None:
    """Save the tokenizer into `output_dir`, and copy the processor files of the checkpoint trained
    (`--model_name_or_path`, a folder or a Hub id) that are not there yet."""
    tokenizer.save_pretrained(output_dir)
    if args.model_name_or_path is None:
        return
    for file_name in PROCESSOR_FILES:
        target = Path(output_dir) / file_name
        if target.exists():  # written by the tokenizer (its chat template): that one is current
            continue
        found = cached_file(args.model_name_or_path, file_name, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
        if found is not None:
            shutil.copyfile(found, target)


def build_model(args: FinetuneArguments, tokenizer):
    """The model of `load_model` (sharded with FSDP2 when `--fsdp_size` is set), wrapped with LoRA adapters when
    `--lora` is set."""
    distributed_config = None
    if args.fsdp_size is not None:
        from transformers.distributed import DistributedConfig

        world_size = int(os.environ.get("WORLD_SIZE", 1))
        if args.fsdp_size < 2 or world_size != args.fsdp_size:
            raise TrainingInputError(
                f"--fsdp_size {args.fsdp_size} needs that many processes (this run has {world_size}); start them "
                f"with `accelerate launch --num_processes {max(args.fsdp_size, 2)}` or `torchrun --nproc_per_node "
                f"{max(args.fsdp_size, 2)}`, or leave --fsdp_size out."
            )
        if args.lora:
            raise TrainingInputError(
                "--lora with --fsdp_size is not supported: train LoRA adapters with DDP, or on GPUs "
                "with accelerate's FSDP (`accelerate launch --use_fsdp ...`)."
            )
        distributed_config = DistributedConfig(fsdp_size=args.fsdp_size)
    model = load_model(args, tokenizer, distributed_config)
    if args.freeze_pooling:
        freeze_pooling(model)
    if args.lora:
        from peft import LoraConfig

        # A multimodal model trains on text here: adapters in its vision tower (GLM's has gate/up/down projections
        # too) would get no gradient, so they go on the language model only.
        multimodal = isinstance(model.config, HybridIndexPoolMultimodalConfig)
        lora_config = LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules, task_type="CAUSAL_LM",
            exclude_modules=r".*\bvisual\b.*" if multimodal else None,
        )
        model = add_lora_adapters(model, lora_config)
    return model


def add_lora_adapters(model, lora_config):
    """`peft.get_peft_model(model, lora_config)` without transformers' deprecation warning: peft reads the deprecated
    `is_gradient_checkpointing` alias of `is_activation_checkpointing` (transformers >= 5.25 warns, "removed in v6")."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, lora_config)


def last_complete_checkpoint(output_dir: str) -> str:
    """The newest `checkpoint-N` folder that holds its trainer state (written last, so an interrupted save is
    skipped)."""
    pattern = re.compile(r"^checkpoint-(\d+)$")
    complete = [
        (int(match.group(1)), path) for path in Path(output_dir).glob("checkpoint-*")
        if (match := pattern.match(path.name)) and (path / "trainer_state.json").is_file()
    ]
    if not complete:
        raise TrainingInputError(f"--resume_from_checkpoint last: {output_dir} holds no complete checkpoint (a folder "
                                 "checkpoint-N with trainer_state.json); start without --resume_from_checkpoint.")
    return str(max(complete)[1])


def check_arguments(args: ModelDataArguments, training_args: TrainingArguments) -> None:
    """Refuse, before anything is loaded or written, a `--block_size` that is not positive, a
    `--model_name_or_path` that is neither a folder nor a Hub model id, and an output folder in use
    ([`check_output_dir`])."""
    if args.block_size <= 0:
        raise TrainingInputError(f"--block_size is {args.block_size}; give the number of tokens per training sequence, "
                                 "a positive number (default 512).")
    if args.init_config is not None:
        init_config_settings(args.init_config)
    name = args.model_name_or_path
    if name is not None and not Path(name).is_dir():
        try:
            validate_repo_id(name)
        except HFValidationError:
            raise TrainingInputError(f"--model_name_or_path {name}: no such folder (nor a Hub model id); give the "
                                     "folder of a checkpoint of ours, or --init_config to train a new model.") from None
        check_hub_model(name)
    check_output_dir(args, training_args)


def check_hub_model(name: str) -> None:
    """Refuse at once a `--model_name_or_path` that is no local folder and that the Hub cannot give: not downloaded
    before and offline (or the Hub out of reach), or a model the Hub does not have. One short request instead of
    transformers' retries, which take over a minute offline and end in a message about the tokenizer."""
    if isinstance(try_to_load_from_cache(name, CONFIG_NAME), str):  # downloaded before: it loads from the cache
        return
    fix = "give the folder of a checkpoint of ours, or --init_config to train a new model"
    if huggingface_hub.is_offline_mode():
        raise TrainingInputError(f"--model_name_or_path {name}: no such folder, and no download of it in the Hub "
                                 f"cache while offline (HF_HUB_OFFLINE); {fix}.")
    try:
        huggingface_hub.model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise TrainingInputError(f"--model_name_or_path {name}: no such folder, and the Hub has no model {name} (if "
                                 f"it is private, log in with `hf auth login`); {fix}.") from None
    except HfHubHTTPError:  # gated, rate limited, ...: the download itself says what is wrong
        return
    except Exception as error:  # no connection at all (name resolution, refused, timeout): the Hub is out of reach
        raise TrainingInputError(f"--model_name_or_path {name}: no such folder, and the Hub cannot be reached to "
                                 f"download it ({type(error).__name__}: {error}); {fix}.") from None


def check_output_dir(args: ModelDataArguments, training_args: TrainingArguments) -> None:
    """Refuse to write into a non-empty output folder unless resuming from it or told to overwrite."""
    output_dir = Path(training_args.output_dir)
    if output_dir.is_dir() and any(output_dir.iterdir()) and not training_args.resume_from_checkpoint \
            and not args.overwrite_output_dir:
        raise TrainingInputError(
            f"Output folder {output_dir} exists and is not empty. Choose a new --output_dir, resume with "
            "--resume_from_checkpoint last (or a checkpoint path), or pass --overwrite_output_dir."
        )


def run_finetune(args: FinetuneArguments, training_args: TrainingArguments) -> dict:
    """Train, save the final model (LoRA merged unless `--merge_lora False`), the tokenizer and the processor files,
    return the metrics."""
    check_arguments(args, training_args)
    if training_args.ddp_find_unused_parameters is None:
        # Within the token budget the indexer's scores are not needed, so its parameters get no gradient.
        training_args.ddp_find_unused_parameters = True
    if args.fsdp_size is not None and training_args.save_strategy != "no" and not training_args.save_only_model:
        # The Trainer cannot checkpoint the optimizer of a model sharded as it loads, so it saves the model only.
        training_args.save_only_model = True
    tokenizer = load_tokenizer(args)
    # A fresh model starts from the run's seed: the same weights in every process and in a one-process run.
    set_seed(training_args.seed)
    model = build_model(args, tokenizer)
    text_config = model.config.get_text_config()
    output_router_logits = text_config.output_router_logits
    if text_config.num_experts > 0:
        # Without router logits a MoE model trains with no load-balancing loss, and its routing may collapse.
        text_config.output_router_logits = args.router_aux_loss
    train_dataset, eval_dataset = load_datasets(args, tokenizer)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=language_model_collator(tokenizer, args.packing), processing_class=tokenizer,
    )
    resume = training_args.resume_from_checkpoint
    if resume == "last":
        resume = last_complete_checkpoint(training_args.output_dir)
    with without_cache(model):
        result = trainer.train(resume_from_checkpoint=resume)
        metrics = dict(result.metrics)
        metrics["log_history"] = trainer.state.log_history
        if eval_dataset is not None:
            metrics.update(trainer.evaluate())
    # The router logits were for the loss: the final model returns them only when the model it started from did.
    text_config.output_router_logits = output_router_logits

    sharding = sharding_name(trainer)
    if sharding is not None and not (args.lora and args.merge_lora):
        # Sharded weights: every process joins the gather of the full weights, the main one writes them.
        if trainer.is_fsdp_enabled:
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(training_args.output_dir)
    else:
        final = trainer.model
        if args.lora and args.merge_lora:
            final = final.merge_and_unload()
        if trainer.is_world_process_zero():
            final.save_pretrained(training_args.output_dir)
    if trainer.is_world_process_zero():
        save_tokenizer_and_processor(args, tokenizer, training_args.output_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    print(f"finetune: process {rank} of {world} finished after {trainer.state.global_step} steps "
          f"(trainer world size {trainer.args.world_size}, {trainer.args.parallel_mode}"
          f"{'' if sharding is None else ', ' + sharding})", flush=True)
    return metrics


def sharding_name(trainer: Trainer) -> str | None:
    """How the model's weights are sharded over the processes: "FSDP2 (transformers)", "FSDP<version> (accelerate)",
    "DeepSpeed ZeRO-<stage>", or None when every process holds them whole (one process, DDP)."""
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        config = trainer.model.config.distributed_config
        return "FSDP2 (transformers)" if config.dp_size > 1 else "tensor parallel (transformers)"
    if trainer.is_fsdp_enabled:
        return f"FSDP{trainer.accelerator.state.fsdp_plugin.fsdp_version} (accelerate)"
    if trainer.is_deepspeed_enabled:
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        return f"DeepSpeed ZeRO-{stage}"
    return None
