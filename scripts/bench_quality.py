"""Quality benchmark of the indexers on real text: pooling with each weighting (learned per channel, learned per
token, normed-then-mean, mean, and learned per token with pool distillation) at pool sizes r = 4 (the default), 8 or
16 and the same token budget, unpooled r = 1, and dense.

The text is the Python standard library's source on this machine (`sysconfig.get_paths()["stdlib"]`, every `*.py`
file, non-ASCII characters replaced by `?`), split by file: a file is held out when the CRC-32 of its relative path
is 0 mod 10. Steps, all on CPU with the byte-level tokenizer:

1. Train a small hybrid model (Gated DeltaNet and IndexPool layers alternating) with dense attention (budget >= the
   context). First the recall curriculum (`--recall-steps`): pure passkey lists (49 characters: three needle lines
   `$K12345` and their questions, `hybrid_indexpool.retrieval_task`), then half as many steps of 128-character
   passkey samples with 1 to 7 needles, at a constant learning rate: the model learns to look a label up while the
   sequences are short (associative recall forms in a few hundred steps there; at the full context, between code,
   it did not form in 1,500). Then random windows of the training files at the full context, a fraction of them
   turned into passkey samples with 1 to `--max-needles` needles at random depths, all asked again at the end.
2. From those weights, build each indexer (`--settings`: `<weighting>_r<r>` such as `mean_r16` or
   `distilled_scalar_r8`, `unpooled_r1`) with the sparse budget, measure it untrained (as a conversion leaves it:
   does the model collapse past the budget?; `--no-untrained` skips it), and run the same number of dense warm-up
   steps on each (DeepSeek-V3.2 stage 1: only the indexer trains, KL to the dense attention) through
   `hybrid_indexpool.indexer_training`. The `distilled_scalar` settings' pooling gates also learn the attention each
   key receives within its window (`hybrid_indexpool.pool_distillation`, `--pool-distillation-weight`), in both
   stages. Each indexer's cache bytes per token come from the cache's `memory_footprint()` after a prefill.
3. On held-out text at the full context measure (a) the fraction of the dense attention mass that the selection
   (selected windows + tail) captures, averaged over heads, layers and the queries that see more windows than the
   budget keeps, and the mass of the best selection any indexer could make at that pool size and budget (the windows
   holding the most head-averaged attention): its bound; (b) perplexity with the sparse attention, over all tokens
   and over the tokens beyond the budget, relative to dense; (c) passkey accuracy (all five digits right,
   teacher-forced, i.e. what greedy decoding gives) of samples with one needle, at depths spread evenly over the
   context (also reported per depth quarter), and the fraction of single digits right (chance: 10%).
4. Unless `--sparse-steps 0`: continue each indexer's model with the sparse stage (DeepSeek-V3.2 stage 2: every
   parameter trains, sparse attention, language-model loss plus `indexer_loss_weight` times the KL over the selected
   windows), and the dense model with the same number of plain language-model steps on the same data, so that every
   setting gets the same extra training; then measure everything again.
5. After each stage, each setting of `--key-cache-settings` (default: every sparse one) again with each storage of
   its pooled index keys (`KEY_CACHES`): full precision, fp8 as the cache stores it (`index_key_cache_dtype=
   "float8_e4m3fn"`: Hadamard-rotated, a power-of-two scale per key), the same fp8 without the rotation (an
   ablation) and bfloat16: the fraction of the full-precision selection's windows each one's selection keeps
   (averaged over the pruned queries), the fraction of identical selections and the captured attention mass, from
   the model's own index queries and pooled keys on the held-out blocks; perplexity and passkey accuracy through a
   cache (`use_cache=True`) for full precision and fp8, the cache formats.

`--results-dir DIR` keeps the trained base model and each finished setting there: a rerun with the same options
skips them (and may add settings). `--summarize` puts the reports of several seeds side by side per pool size and
weighting (a table, and with `--plot` quality against the indexer's cache bytes per token).

    python -m hybrid_indexpool.scripts.bench_quality --quick
    python -m hybrid_indexpool.scripts.bench_quality --json docs/results/bench_quality.json \\
        --plot docs/results/bench_quality.png
    python -m hybrid_indexpool.scripts.bench_quality --summarize seed0.json seed1.json --plot study.png
"""

import argparse
import json
import math
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybrid_indexpool.retrieval_task import (
    NEEDLE_AND_QUESTION_CHARACTERS,
    NEEDLE_LABELS,
    PASSKEY_DIGITS,
    needles_that_fit,
    passkey_sample,
    stdlib_texts,
    text_window,
)

# Pooling weightings a setting `<name>_r<r>` can name: (its `index_pool_weighting`, whether its pooling gate is
# also trained toward the attention each key receives within its window, `hybrid_indexpool.pool_distillation`).
WEIGHTINGS = {"learned": ("learned", False), "learned_scalar": ("learned_scalar", False),
              "prenorm_mean": ("prenorm_mean", False), "mean": ("mean", False),
              "distilled_scalar": ("learned_scalar", True)}
WEIGHTING_LABELS = {"learned": "learned", "learned_scalar": "learned scalar", "prenorm_mean": "prenorm mean",
                    "mean": "mean", "distilled_scalar": "distilled scalar"}
# Pool sizes a setting can name (r = 1 is `unpooled_r1`).
POOL_SIZES = (2, 4, 8, 16, 32)
# The default comparison: every weighting at r = 4, unpooled r = 1 and dense.
SETTINGS = tuple(f"{name}_r4" for name in WEIGHTINGS) + ("unpooled_r1", "dense")


def parse_setting(setting: str) -> tuple[int, str, bool] | None:
    """`(pool size, index_pool_weighting, pool distillation)` of a sparse setting (`unpooled_r1`, `<weighting>_r<r>`),
    None for an unknown name or `dense`."""
    if setting == "unpooled_r1":
        return 1, "mean", False
    name, _, size = setting.rpartition("_r")
    if name in WEIGHTINGS and size.isdigit() and int(size) in POOL_SIZES:
        return (int(size), *WEIGHTINGS[name])
    return None


def label(setting: str) -> str:
    """What tables and plots call a setting, e.g. `learned pooling r=4`."""
    if setting in ("dense", "unpooled_r1"):
        return {"dense": "dense", "unpooled_r1": "unpooled r=1"}[setting]
    name, _, size = setting.rpartition("_r")
    return f"{WEIGHTING_LABELS[name]} pooling r={size}"


# The recall curriculum: (context, share of --recall-steps, lists only); the batches are twice --batch-size. 49
# characters hold three needle lines and their questions with one character to spare: pure recall, no filler (with
# 10-16 characters of code between the needles the lookup did not form within 500 steps).
RECALL_STAGES = ((49, 1.0, True), (128, 0.5, False))
# Storages of the pooled index keys compared for each sparse setting (names of
# `indexer_training.INDEX_KEY_FORMATS`, "auto" the model's own precision), with the `index_key_cache_dtype` that a
# cache holding them has; None: not a cache format (selection measures only, no perplexity or passkey accuracy).
KEY_CACHES = {"auto": "auto", "float8_e4m3fn": "float8_e4m3fn", "float8_e4m3fn_unrotated": None, "bfloat16": None}
KEY_CACHE_LABELS = {"auto": "full precision", "float8_e4m3fn": "fp8 e4m3, Hadamard-rotated (the cache's)",
                    "float8_e4m3fn_unrotated": "fp8 e4m3 without rotation", "bfloat16": "bfloat16"}
# Needle depth quarters that passkey accuracy is reported for.
DEPTH_BINS = 4
# Sizes of the full run and of `--quick` (any of them can be set on the command line).
PRESETS = {
    "full": dict(context=512, budget=64, hidden_size=128, layers=4, batch_size=8, recall_steps=800, train_steps=600,
                 warmup_steps=100, sparse_steps=100, eval_blocks=32, passkey_samples=64),
    "quick": dict(context=256, budget=32, hidden_size=64, layers=4, batch_size=8, recall_steps=100, train_steps=150,
                  warmup_steps=30, sparse_steps=20, eval_blocks=16, passkey_samples=32),
}


def training_samples(text: str, count: int, context: int, passkey_fraction: float, max_needles: int,
                     list_fraction: float, seed: int) -> list[str]:
    """Windows of `text`, a `passkey_fraction` of them passkey samples with 1 to `max_needles` needles, or, for a
    `list_fraction` of those, as many needles as the context holds (a list of keys to recall, little filler)."""
    rng = random.Random(seed)
    most = needles_that_fit(context)
    samples = []
    for _ in range(count):
        if rng.random() >= passkey_fraction:
            samples.append(text_window(text, context, rng))
            continue
        needles = most if rng.random() < list_fraction else rng.randint(1, max_needles)
        samples.append(passkey_sample(text, context, rng, needles=needles)[0])
    return samples


def token_dataset(samples: list[str], tokenizer, context: int):
    from datasets import Dataset

    ids = tokenizer(samples, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if any(len(row) != context for row in ids):
        raise RuntimeError("A sample does not tokenize to exactly one token per character; the benchmark needs the "
                           "byte-level tokenizer and ASCII text.")
    return Dataset.from_dict({"input_ids": ids})


def model_config(setting: str, args, tokenizer):
    from hybrid_indexpool import HybridIndexPoolConfig

    # The dense model's indexer is never used (its budget covers the context) nor trained.
    pool_size, weighting, _ = parse_setting(setting) if setting != "dense" else (4, "learned", False)
    head_dim = max(16, args.hidden_size // 4)  # `parse_arguments` checks it against fp8 keys
    return HybridIndexPoolConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        layer_types=["linear_attention" if i % 2 == 0 else "indexpool_attention" for i in range(args.layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, index_n_heads=4, index_head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        index_pool_size=pool_size, index_pool_weighting=weighting,
        index_topk=-(-args.context // 4) * 4 if setting == "dense" else args.budget,
        index_sink_windows=0 if setting == "dense" else args.sink_windows,
        index_local_windows=0 if setting == "dense" else args.local_windows,
    )


def trainer_arguments(output_dir: str, steps: int, learning_rate: float, args, batch_size: int | None = None,
                      schedule: str = "cosine"):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size or args.batch_size,
        learning_rate=learning_rate, lr_scheduler_type=schedule, warmup_steps=max(1, steps // 10),
        logging_steps=max(1, steps // 20), save_strategy="no", report_to="none", use_cpu=True, seed=args.seed,
        dataloader_num_workers=0,
    )


@torch.no_grad()
def passkey_digits_right(model, passkeys: torch.Tensor, args, use_cache: bool = False) -> torch.Tensor:
    """[samples, digits]: whether the greedy (teacher-forced) prediction of each passkey digit is right."""
    model.eval()
    rights = []
    for batch in passkeys.split(args.eval_batch_size):
        logits = model(batch, use_cache=use_cache).logits
        rights.append(logits[:, -PASSKEY_DIGITS - 1:-1].argmax(-1) == batch[:, -PASSKEY_DIGITS:])
    return torch.cat(rights)


def passkey_accuracy(model, passkeys: torch.Tensor, args) -> float:
    """The fraction of passkey samples with every digit right."""
    return float(passkey_digits_right(model, passkeys, args).all(dim=-1).float().mean())


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, passkeys: torch.Tensor, args, use_cache: bool = False,
             attention_mass: bool = True) -> dict:
    """Perplexity (all tokens, tokens beyond the budget), captured attention mass (unless `attention_mass=False`),
    passkey accuracy. `use_cache=True` runs the forwards through a fresh cache (built from the model's config, so
    its `index_key_cache_dtype` applies, also to the prefill's selection)."""
    from hybrid_indexpool.indexer_training import selection_attention_mass

    model.eval()
    # The tokens beyond the budget: where every sparse setting of the run prunes (`parse_arguments`), the same for all.
    beyond = torch.arange(args.context - 1) >= args.beyond_budget_from
    nll_sum = nll_beyond = 0.0
    masses, oracle_masses, kls = [], [], []
    for batch in blocks.split(args.eval_batch_size):
        logits = model(batch, use_cache=use_cache).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        nll_sum += nll.sum().item()
        nll_beyond += nll[:, beyond].sum().item()
        if not attention_mass:
            continue
        mass = selection_attention_mass(model, batch)
        masses.append(mass["mass"])
        oracle_masses.append(mass["oracle_mass"])
        kls.append(mass["dense_kl"])
    # [samples, digits]; needle depths rise evenly over [0, 1)
    right = passkey_digits_right(model, passkeys, args, use_cache=use_cache)
    correct = right.all(dim=-1).float()
    tokens = blocks.shape[0] * (args.context - 1)
    metrics = {
        "ppl": float(torch.tensor(nll_sum / tokens).exp()),
        "ppl_beyond_budget": float(torch.tensor(nll_beyond / (blocks.shape[0] * int(beyond.sum()))).exp()),
        "passkey_accuracy": float(correct.mean()),
        "passkey_digit_accuracy": float(right.float().mean()),
        "passkey_accuracy_by_depth": [float(part.mean()) for part in correct.tensor_split(DEPTH_BINS)],
    }
    if attention_mass:
        metrics.update({"attention_mass": sum(masses) / len(masses),
                        "best_selection_mass": sum(oracle_masses) / len(oracle_masses),
                        "dense_kl": sum(kls) / len(kls)})
    return metrics


def evaluated_row(setting: str, model, blocks: torch.Tensor, passkeys: torch.Tensor, args) -> dict:
    """A result row: the setting's indexer, then `evaluate`'s metrics (no held-out KL for dense)."""
    row = {"setting": setting, "pool_size": model.config.index_pool_size,
           "weighting": model.config.index_pool_weighting, "budget": model.config.index_topk}
    row.update(evaluate(model, blocks, passkeys, args))
    if setting == "dense":
        row["dense_kl"] = None  # no selection, and its indexer was never trained
    return row


@torch.no_grad()
def key_cache_rows(setting: str, model, blocks: torch.Tensor, passkeys: torch.Tensor, args) -> list[dict]:
    """The setting measured with each storage of the pooled index keys, side by side (`KEY_CACHES`).

    Selection overlap, identical selections and captured attention mass come from the model's own index queries and
    pooled keys on the held-out blocks (`index_key_format_measures`, against the full-precision selection).
    Perplexity and passkey accuracy are measured for the two formats a cache can hold, both through a cache
    (`use_cache=True`, `index_key_cache_dtype` set for the run), so that they differ only in the stored keys.
    """
    from hybrid_indexpool.indexer_training import index_key_format_measures

    model.eval()
    measured = [index_key_format_measures(model, batch, formats=[name for name in KEY_CACHES if name != "auto"])
                for batch in blocks.split(args.eval_batch_size)]
    rows = []
    for name, dtype in KEY_CACHES.items():
        row = {"setting": setting, "pool_size": model.config.index_pool_size, "index_keys": name,
               "model_dtype": str(model.dtype).removeprefix("torch.")}
        if name == "auto":
            row.update(selection_overlap=1.0, identical_selections=1.0,
                       attention_mass=sum(part["mass"] for part in measured) / len(measured))
        else:
            row.update({f"{key}": sum(part[name][measure] for part in measured) / len(measured)
                        for key, measure in (("selection_overlap", "overlap"), ("identical_selections", "identical"),
                                             ("attention_mass", "mass"))})
            row["selection_overlap_per_layer"] = [
                sum(values) / len(values) for values in zip(*(part[name]["per_layer_overlap"] for part in measured))]
        if dtype is not None:
            model.config.index_key_cache_dtype = dtype
            try:
                row.update(evaluate(model, blocks, passkeys, args, use_cache=True, attention_mass=False))
            finally:
                model.config.index_key_cache_dtype = "auto"
        rows.append(row)
    return rows


@torch.no_grad()
def index_cache_bytes(model, block: torch.Tensor) -> dict:
    """The indexer's cache per token after a prefill of one held-out `block` `[1, context]`, from the cache's
    `memory_footprint()` (all IndexPool layers): pooled keys in use, the open window's raw keys and gate logits in
    use, and what a per-token (r = 1) indexer key cache of the same storage would hold."""
    model.eval()
    cache = model(block, use_cache=True).past_key_values
    footprint, tokens = cache.memory_footprint(), block.shape[-1]
    return {"tokens": tokens, "pooled_index_keys": footprint["pooled_index_keys"] / tokens,
            "open_window": footprint["open_window"] / tokens,
            "per_token": (footprint["pooled_index_keys"] + footprint["open_window"]) / tokens,
            "unpooled": footprint["unpooled_index_keys"] / tokens}


class ResultStore:
    """A run's finished work in a folder, so that a killed run resumes where it stopped: the trained base model
    (`base.pt`) and one JSON file per finished setting. `options.json` holds the options the results depend on; a
    folder holding results of other options is refused."""

    # Options that do not change any result (which settings run, outputs, threads).
    FREE = ("settings", "key_cache_settings", "json", "plot", "results_dir", "threads", "summarize", "base_model")
    # Options the base model depends on (its data, sizes, training, and the held-out samples of its recall check).
    BASE = ("seed", "context", "hidden_size", "layers", "batch_size", "recall_steps", "train_steps", "learning_rate",
            "recall_learning_rate", "passkey_fraction", "max_needles", "list_fraction", "eval_blocks",
            "passkey_samples", "eval_batch_size")

    def __init__(self, folder: str | None, args):
        self.folder = None if folder is None else Path(folder)
        self.args = args
        if self.folder is None:
            return
        options = {name: value for name, value in vars(args).items() if name not in self.FREE}
        self.folder.mkdir(parents=True, exist_ok=True)
        stored = self.folder / "options.json"
        if stored.exists():
            held = json.loads(stored.read_text())
            differing = sorted(name for name in set(held) | set(options) if held.get(name) != options.get(name))
            if differing:
                raise SystemExit(f"--results-dir {folder} holds results of other options (differing: "
                                 f"{', '.join(differing)}); rerun with the same options or use another folder.")
        else:
            self._write(stored, json.dumps(options, indent=1))

    @staticmethod
    def _write(path: Path, text_or_object) -> None:
        """Write whole or not at all (a run killed while writing leaves the previous file)."""
        partial = path.with_name(path.name + ".partial")
        if isinstance(text_or_object, str):
            partial.write_text(text_or_object)
        else:
            torch.save(text_or_object, partial)
        os.replace(partial, path)

    @classmethod
    def base_options(cls, args) -> dict:
        return {name: getattr(args, name) for name in cls.BASE}

    @classmethod
    def load_base(cls, path: Path, args) -> dict:
        """A base model written by a run (`base.pt`), refused unless its base options are this run's."""
        base = torch.load(path, weights_only=True)
        held = base.get("options")
        if held is None:  # written before base.pt kept its options: those of the run folder it is in
            held = {name: value for name, value in json.loads((path.parent / "options.json").read_text()).items()
                    if name in cls.BASE}
        wanted = cls.base_options(args)
        differing = sorted(name for name in wanted if held.get(name) != wanted[name])
        if differing:
            raise SystemExit(f"The base model {path} was trained with other options (differing: "
                             f"{', '.join(differing)}); use the same options or train a new one.")
        return base

    def base(self, base_model: str | None = None) -> dict | None:
        """The run's base model: from `base_model` (another run's `base.pt`) or this folder's, or None."""
        if base_model is not None:
            return self.load_base(Path(base_model), self.args)
        if self.folder is None or not (self.folder / "base.pt").exists():
            return None
        return self.load_base(self.folder / "base.pt", self.args)

    def save_base(self, base: dict) -> None:
        if self.folder is not None:
            self._write(self.folder / "base.pt", {**base, "options": self.base_options(self.args)})

    def setting(self, setting: str) -> dict | None:
        path = None if self.folder is None else self.folder / f"{setting}.json"
        return json.loads(path.read_text()) if path is not None and path.exists() else None

    def save_setting(self, record: dict) -> None:
        if self.folder is not None:
            self._write(self.folder / f"{record['setting']}.json", json.dumps(record, indent=1))


def train_base(args, tokenizer, collator, base_data, recall_stages, passkeys, scratch: str) -> dict:
    """The dense base model: the recall curriculum, then the base training. Returns its state dict, losses, time."""
    from transformers import Trainer

    from hybrid_indexpool import HybridIndexPoolForCausalLM

    started = time.time()
    print(f"1/3 training the dense base model: {args.train_steps} steps of {args.batch_size} x {args.context} "
          "tokens", flush=True)
    torch.manual_seed(args.seed)
    base = HybridIndexPoolForCausalLM(model_config("dense", args, tokenizer))
    recall_accuracy = None  # no curriculum ran
    if recall_stages:
        for stage, (context, steps, data) in enumerate(recall_stages):
            print(f"  recall curriculum {stage + 1}/{len(recall_stages)}: {steps} steps of "
                  f"{2 * args.batch_size} x {context} tokens", flush=True)
            Trainer(model=base, args=trainer_arguments(scratch, steps, args.recall_learning_rate, args,
                                                       batch_size=2 * args.batch_size,
                                                       schedule="constant_with_warmup"),
                    train_dataset=data, data_collator=collator).train()
        recall_accuracy = passkey_accuracy(base, passkeys, args)
        print(f"  passkey accuracy at {args.context} tokens after the recall curriculum: {recall_accuracy:.1%}",
              flush=True)
    trainer = Trainer(model=base, args=trainer_arguments(scratch, args.train_steps, args.learning_rate, args),
                      train_dataset=base_data, data_collator=collator)
    trainer.train()
    return {"state": base.state_dict(), "losses": [entry["loss"] for entry in trainer.state.log_history
                                                   if "loss" in entry],
            "seconds": round(time.time() - started, 1), "recall_accuracy": recall_accuracy}


def run_setting(setting: str, base_state: dict, tokenizer, collator, warmup_data, sparse_data, blocks, passkeys,
                args, scratch: str) -> dict:
    """One setting from the base weights: its untrained indexer (unless `--no-untrained`), the indexer warm-up,
    the sparse stage (dense: as many language-model steps), measured after each; returns its record."""
    from transformers import Trainer

    from hybrid_indexpool import HybridIndexPoolForCausalLM
    from hybrid_indexpool.indexer_training import kl_summary, train_indexer_stage

    started, load_at_start = time.time(), os.getloadavg()
    model = HybridIndexPoolForCausalLM(model_config(setting, args, tokenizer))
    distillation = 0.0
    if setting == "dense":
        model.load_state_dict(base_state)
    else:
        distillation = args.pool_distillation_weight if parse_setting(setting)[2] else 0.0
        # The pooling gates stay as built (zero: the mean); the dense base never trained its own.
        missing, unexpected = model.load_state_dict(
            {name: value for name, value in base_state.items() if "pool_" not in name}, strict=False)
        if any("pool_" not in name for name in missing) or unexpected:
            raise RuntimeError(f"{setting}: the base weights do not fit ({missing}, {unexpected}).")
    record = {"setting": setting, "fresh": None, "warmup_kl": None, "sparse": None, "sparse_curve": None,
              "key_cache_warmup": [], "key_cache_sparse": []}
    if setting != "dense":
        if args.untrained:  # as a conversion leaves it: does the model collapse past the budget?
            record["fresh"] = evaluated_row(setting, model, blocks, passkeys, args)
        warmup = train_indexer_stage(
            model, "warmup", warmup_data,
            trainer_arguments(scratch, args.warmup_steps, args.warmup_learning_rate, args), collator,
            pool_distillation_weight=distillation,
        )
        record["warmup_kl"] = [(entry["step"], entry["indexer_kl"]) for entry in warmup.state.log_history
                               if "indexer_kl" in entry]
    record["warmup"] = evaluated_row(setting, model, blocks, passkeys, args)
    if setting != "dense":
        record["warmup"]["warmup_kl_first"], record["warmup"]["warmup_kl_last"] = kl_summary(warmup.state.log_history)
        record["warmup"].update(distillation_summary("warmup", warmup.state.log_history))
        record["index_cache_bytes"] = index_cache_bytes(model, blocks[:1])
    if setting in args.key_cache_settings:
        record["key_cache_warmup"] = key_cache_rows(setting, model, blocks, passkeys, args)
    if args.sparse_steps:
        stage_arguments = trainer_arguments(scratch, args.sparse_steps, args.sparse_learning_rate, args)
        if setting == "dense":
            sparse = Trainer(model=model, args=stage_arguments, train_dataset=sparse_data, data_collator=collator)
            sparse.train()
        else:
            sparse = train_indexer_stage(model, "sparse", sparse_data, stage_arguments, collator,
                                         pool_distillation_weight=distillation)
        # The language-model part of the loss (all of it for dense) and, for the indexers, the KL.
        record["sparse_curve"] = [(entry["step"], entry.get("lm_loss", entry["loss"]), entry.get("indexer_kl"))
                                  for entry in sparse.state.log_history if "loss" in entry]
        record["sparse"] = evaluated_row(setting, model, blocks, passkeys, args)
        if setting in args.key_cache_settings:
            record["key_cache_sparse"] = key_cache_rows(setting, model, blocks, passkeys, args)
        if setting != "dense":
            record["sparse"]["sparse_kl_first"], record["sparse"]["sparse_kl_last"] = \
                kl_summary(sparse.state.log_history)
            record["sparse"].update(distillation_summary("sparse", sparse.state.log_history))
    record["seconds"] = round(time.time() - started, 1)
    record["load_average"] = {"start": list(load_at_start), "end": list(os.getloadavg())}
    return record


def distillation_summary(stage: str, log_history: list[dict]) -> dict:
    """First and last logged pool distillation loss of a stage (nothing when it did not run)."""
    values = [entry["pool_distillation"] for entry in log_history if "pool_distillation" in entry]
    return {f"{stage}_pool_distillation_first": values[0], f"{stage}_pool_distillation_last": values[-1]} \
        if values else {}


@torch.no_grad()
def window_concentration(base_state: dict, args, tokenizer, blocks: torch.Tensor) -> dict:
    """How far the base model's attention inside windows of each pool size of the sparse settings is from uniform
    (`hybrid_indexpool.pool_distillation.within_window_concentration`: per query, and shared by the queries), in nats,
    averaged over the IndexPool layers and the held-out blocks. The warm-up trains only the indexer, so this is the
    attention every setting's indexer learns from."""
    from hybrid_indexpool import HybridIndexPoolForCausalLM
    from hybrid_indexpool.pool_distillation import layer_dense_attentions, within_window_concentration

    sizes = sorted({parse_setting(setting)[0] for setting in args.settings if setting != "dense"} - {1})
    model = HybridIndexPoolForCausalLM(model_config("dense", args, tokenizer))
    model.load_state_dict(base_state)
    model.eval()
    sums = {size: {"per_query": 0.0, "shared": 0.0} for size in sizes}
    count = 0
    for batch in blocks.split(args.eval_batch_size):
        for attention, positions, token_is_real in layer_dense_attentions(model, batch):
            for size in sizes:
                for name, value in within_window_concentration(attention, positions, token_is_real, size).items():
                    sums[size][name] += value
            count += 1
    return {str(size): {name: value / count for name, value in values.items()} for size, values in sums.items()}


def run(args) -> dict:
    from transformers import DataCollatorForLanguageModeling

    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.set_num_threads(args.threads)
    started = time.time()
    store = ResultStore(args.results_dir, args)
    tokenizer = byte_level_tokenizer()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    train_text, held_out_text, train_files, held_out_files = stdlib_texts()
    base_data = token_dataset(
        training_samples(train_text, args.train_steps * args.batch_size, args.context, args.passkey_fraction,
                         args.max_needles, args.list_fraction, args.seed), tokenizer, args.context)
    warmup_data = token_dataset(
        training_samples(train_text, args.warmup_steps * args.batch_size, args.context, args.passkey_fraction,
                         args.max_needles, args.list_fraction, args.seed + 1), tokenizer, args.context)
    # The extra training after the warm-up: the same sequences, in the same order, for every setting.
    sparse_data = token_dataset(
        training_samples(train_text, args.sparse_steps * args.batch_size, args.context, args.passkey_fraction,
                         args.max_needles, args.list_fraction, args.seed + 3),
        tokenizer, args.context) if args.sparse_steps else None
    # The recall curriculum's samples have seeds of their own: the base, warm-up and sparse samples stay as they were.
    recall_stages = []
    for index, (context, share, lists) in enumerate(RECALL_STAGES):
        steps = int(args.recall_steps * share)
        if context >= args.context or steps == 0:
            continue
        samples = training_samples(train_text, steps * 2 * args.batch_size, context, 1.0, needles_that_fit(context),
                                   1.0 if lists else 0.0, args.seed + 10 + index)
        recall_stages.append((context, steps, token_dataset(samples, tokenizer, context)))
    rng = random.Random(args.seed + 2)
    # `split_special_tokens`: the source holds strings such as "<s>", which are text here, not special tokens.
    blocks = torch.tensor(tokenizer([text_window(held_out_text, args.context, rng) for _ in range(args.eval_blocks)],
                                    add_special_tokens=False, split_special_tokens=True)["input_ids"])
    # One needle each, at depths spread evenly over the context (reported by quarter).
    passkey_texts, depths = zip(*(passkey_sample(held_out_text, args.context, rng, depth=index / args.passkey_samples)
                                  for index in range(args.passkey_samples)))
    passkeys = torch.tensor(tokenizer(list(passkey_texts), add_special_tokens=False,
                                      split_special_tokens=True)["input_ids"])

    records = {}
    with tempfile.TemporaryDirectory() as scratch:
        base = store.base(args.base_model)
        if base is None:
            base = train_base(args, tokenizer, collator, base_data, recall_stages, passkeys, scratch)
            store.save_base(base)
        else:
            print(f"1/3 the dense base model from {args.base_model or f'{args.results_dir}/base.pt'}", flush=True)
        print("2/3 dense warm-up of each indexer, 3/3 evaluation on held-out text"
              + (f", then {args.sparse_steps} sparse-stage steps and evaluation again" if args.sparse_steps else ""),
              flush=True)
        for setting in tqdm(args.settings, desc="indexers"):
            records[setting] = store.setting(setting)
            if records[setting] is None:
                records[setting] = run_setting(setting, base["state"], tokenizer, collator, warmup_data,
                                               sparse_data, blocks, passkeys, args, scratch)
                store.save_setting(records[setting])
            else:
                tqdm.write(f"  {setting}: finished in an earlier run ({args.results_dir}/{setting}.json)")
    report = assemble_report(args, records, base, recall_stages, depths, started,
                             {"train_files": train_files, "held_out_files": held_out_files,
                              "train_chars": len(train_text), "held_out_chars": len(held_out_text)})
    report["window_concentration"] = window_concentration(base["state"], args, tokenizer, blocks)
    return report


def assemble_report(args, records: dict, base: dict, recall_stages, depths, started: float, text: dict) -> dict:
    """The report of the run from each setting's record: rows per stage, compared with dense's of the same stage."""
    fresh = {setting: record["fresh"] for setting, record in records.items() if record["fresh"] is not None}
    warmup = {setting: record["warmup"] for setting, record in records.items()}
    sparse = {setting: record["sparse"] for setting, record in records.items() if record["sparse"] is not None}
    for setting, record in records.items():
        if "index_cache_bytes" in record:
            for row in (fresh.get(setting), warmup[setting], sparse.get(setting)):
                if row is not None:
                    row["index_cache_bytes_per_token"] = record["index_cache_bytes"]["per_token"]
    fresh["dense"] = warmup["dense"]
    for rows in (fresh, warmup, sparse):
        for row in rows.values():
            row["ppl_vs_dense"] = row["ppl"] / rows["dense"]["ppl"] - 1
            row["ppl_beyond_budget_vs_dense"] = row["ppl_beyond_budget"] / rows["dense"]["ppl_beyond_budget"] - 1
    key_cache = {"warmup": [row for record in records.values() for row in record["key_cache_warmup"]],
                 "sparse": [row for record in records.values() for row in record["key_cache_sparse"]]}
    for stage, rows in (("warmup", warmup), ("sparse", sparse)):
        full_precision = {row["setting"]: row for row in key_cache[stage] if row["index_keys"] == "auto"}
        for row in key_cache[stage]:
            if "ppl" not in row:
                continue  # not a cache format: selection measures only
            row["ppl_beyond_budget_vs_dense"] = row["ppl_beyond_budget"] / rows["dense"]["ppl_beyond_budget"] - 1
            row["ppl_beyond_budget_vs_full_precision"] = \
                row["ppl_beyond_budget"] / full_precision[row["setting"]]["ppl_beyond_budget"] - 1
    return {
        "machine": machine(),
        "settings": {**vars(args), **text, "passkey_depths": [round(depth, 3) for depth in depths]},
        "base_training": {"losses": base["losses"], "seconds": base["seconds"],
                          "recall_curriculum": [{"context": context, "steps": steps, "batch_size": 2 * args.batch_size}
                                                for context, steps, _ in recall_stages],
                          "passkey_accuracy_after_recall_curriculum": base["recall_accuracy"]},
        "results_fresh": [fresh[setting] for setting in args.settings if setting in fresh and setting != "dense"],
        "results": [warmup[setting] for setting in args.settings],
        "warmup_kl": {setting: record["warmup_kl"] for setting, record in records.items()
                      if record["warmup_kl"] is not None},
        "results_after_sparse": [sparse[setting] for setting in args.settings if setting in sparse],
        "sparse_curves": {setting: record["sparse_curve"] for setting, record in records.items()
                          if record["sparse_curve"] is not None},
        "key_cache_results": key_cache["warmup"],
        "key_cache_results_after_sparse": key_cache["sparse"],
        "index_cache_bytes": {setting: record["index_cache_bytes"] for setting, record in records.items()
                              if "index_cache_bytes" in record},
        "setting_seconds": {setting: record["seconds"] for setting, record in records.items()},
        "setting_load_average": {setting: record["load_average"] for setting, record in records.items()},
        # The work of the whole run (its base and every setting, also those of earlier, resumed invocations), and
        # this invocation's wall clock.
        "seconds": round(base["seconds"] + sum(record["seconds"] for record in records.values()), 1),
        "wall_seconds_this_invocation": round(time.time() - started, 1),
    }


def machine() -> dict:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def recall_curriculum_text(base_training: dict) -> str:
    """The recall stages that ran, e.g. `recall curriculum 800 x 16 x 49 + 400 x 16 x 128 tokens (...)`."""
    stages = " + ".join(f"{stage['steps']} x {stage['batch_size']} x {stage['context']}"
                        for stage in base_training["recall_curriculum"])
    return (f"recall curriculum {stages} tokens (passkey accuracy after it "
            f"{base_training['passkey_accuracy_after_recall_curriculum']:.0%}); ")


def format_table(report: dict) -> str:
    """The machine, the settings and a Markdown table of the results."""
    settings, machine_info = report["settings"], report["machine"]
    sparse_steps = settings.get("sparse_steps", 0)  # reports from before the sparse stage have none
    lines = [
        f"machine: {machine_info['platform']}, {machine_info['processor']}, {machine_info['cpu_count']} CPUs "
        f"({machine_info['torch_threads']} torch threads), "
        f"python {machine_info['python']}, torch {machine_info['torch']}, transformers {machine_info['transformers']}",
        f"text: standard library *.py, {settings['train_files']} training files ({settings['train_chars']:,} chars), "
        f"{settings['held_out_files']} held-out files ({settings['held_out_chars']:,} chars)",
        f"model: {settings['layers']} layers (Gated DeltaNet / IndexPool alternating), hidden "
        f"{settings['hidden_size']}, byte-level; context {settings['context']}, budget {settings['budget']} tokens; "
        + (recall_curriculum_text(report["base_training"])
           if report["base_training"].get("recall_curriculum") else "") +
        f"base {settings['train_steps']} steps x {settings['batch_size']} (final loss "
        f"{report['base_training']['losses'][-1]:.3f}, {report['base_training']['seconds']:.0f} s); "
        f"warm-up {settings['warmup_steps']} steps per indexer; "
        f"always-kept windows: {settings.get('sink_windows', 0)} sink, {settings.get('local_windows', 0)} local; "
        + (f"sparse stage {sparse_steps} steps per setting (lr {settings['sparse_learning_rate']:g}; dense: "
           "language-model steps); " if sparse_steps else "") +
        f"{settings['eval_blocks']} held-out blocks, {settings['passkey_samples']} passkey samples; "
        f"{report['seconds']:.0f} s in all",
        "",
        "| indexer | after | attention mass captured | best selection's mass | training KL first -> last | "
        "held-out KL | ppl | ppl vs dense | "
        "ppl beyond budget | vs dense | passkey accuracy | by needle depth quarter | passkey digits right |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # What each row comes after: the indexer's warm-up (for dense: the base model), then the sparse stage (for dense:
    # as many language-model steps).
    stages = [("untrained indexer", "base", "fresh", report.get("results_fresh", [])),
              ("warm-up", "base", "warmup", report["results"]),
              (f"+ stage 2 ({sparse_steps} steps)", f"+ {sparse_steps} LM steps", "sparse",
               report.get("results_after_sparse", []))]
    for after, dense_after, stage, rows in stages:
        for row in rows:
            kl = "-"
            if row.get(f"{stage}_kl_first") is not None:
                kl = f"{row[f'{stage}_kl_first']:.3f} -> {row[f'{stage}_kl_last']:.3f}"
            held_out_kl = "-" if row["dense_kl"] is None else f"{row['dense_kl']:.3f}"
            best_mass = f"{row['best_selection_mass']:.3f}" if "best_selection_mass" in row else "-"
            lines.append(
                f"| {label(row['setting'])} | {dense_after if row['setting'] == 'dense' else after} | "
                f"{row['attention_mass']:.3f} | {best_mass} | {kl} | {held_out_kl} | "
                f"{row['ppl']:.3f} | {row['ppl_vs_dense']:+.2%} | {row['ppl_beyond_budget']:.3f} | "
                f"{row['ppl_beyond_budget_vs_dense']:+.2%} | {row['passkey_accuracy']:.1%} | "
                f"{' / '.join(f'{value:.0%}' for value in row.get('passkey_accuracy_by_depth', [])) or '-'} | "
                f"{row['passkey_digit_accuracy']:.1%} |"
            )
    lines += key_cache_table(report)
    return "\n".join(lines)


def key_cache_table(report: dict) -> list[str]:
    """Lines of a Markdown table of each setting with each storage of its pooled index keys (none when not run)."""
    stages = [("warm-up", report.get("key_cache_results", [])),
              (f"+ stage 2 ({report['settings'].get('sparse_steps', 0)} steps)",
               report.get("key_cache_results_after_sparse", []))]
    if not any(rows for _, rows in stages):
        return []
    lines = [
        "",
        "Pooled index keys stored in each format (selection measures against the full-precision selection, over the "
        "queries that see more windows than the budget; perplexity and passkey accuracy through a cache of that "
        "format, `use_cache=True`; '-': not a cache format, selection measures only):",
        "",
        "| indexer | after | index keys | selection overlap | identical selections | attention mass captured | ppl | "
        "ppl beyond budget | vs dense | vs full-precision keys | passkey accuracy | passkey digits right |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for after, rows in stages:
        for row in rows:
            cached = "ppl" in row
            lines.append(
                f"| {label(row['setting'])} | {after} | {KEY_CACHE_LABELS[row['index_keys']]} | "
                f"{row['selection_overlap']:.2%} | {row['identical_selections']:.1%} | {row['attention_mass']:.4f} | "
                + (f"{row['ppl']:.4f} | {row['ppl_beyond_budget']:.4f} | {row['ppl_beyond_budget_vs_dense']:+.2%} | "
                   f"{row['ppl_beyond_budget_vs_full_precision']:+.3%} | {row['passkey_accuracy']:.1%} | "
                   f"{row['passkey_digit_accuracy']:.1%} |" if cached else "- | - | - | - | - | - |")
            )
    return lines


def plot(report: dict, path: str) -> None:
    """Warm-up KL per step, captured attention mass and perplexity beyond the budget relative to dense, after the
    warm-up and (when it ran) after the sparse stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    figure, (curves, masses, ppls) = plt.subplots(1, 3, figsize=(15, 4.2))
    for setting, points in report["warmup_kl"].items():
        steps, values = zip(*points)
        curves.plot(steps, values, marker=".", label=label(setting))
    curves.set(title="dense warm-up: indexer KL", xlabel="step", ylabel="KL(attention || indexer)")
    curves.legend()
    groups = [("after warm-up", rows)]
    if report.get("results_after_sparse"):
        groups.append((f"+ stage 2 ({report['settings']['sparse_steps']} steps)", report["results_after_sparse"]))
    width = 0.8 / len(groups)
    for index, (stage, group) in enumerate(groups):
        positions = [position + (index - (len(groups) - 1) / 2) * width for position in range(len(group))]
        masses.bar(positions, [row["attention_mass"] for row in group], width, label=stage)
        ppls.bar(positions, [100 * row["ppl_beyond_budget_vs_dense"] for row in group], width, label=stage)
    masses.set(title=f"attention mass captured (budget {report['settings']['budget']})", ylim=(0, 1.05))
    ppls.set(title="perplexity beyond the budget vs dense", ylabel="%")
    for axis in (masses, ppls):
        axis.set_xticks(range(len(rows)), [label(row["setting"]) for row in rows], rotation=15)
        axis.legend()
    figure.suptitle(f"held-out stdlib source, context {report['settings']['context']} tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


STUDY_STAGES = (("results", "warm-up"), ("results_after_sparse", "+ stage 2"))


def pool_size_study(reports: list[dict]) -> list[dict]:
    """The pool-size study from runs that differ only in their seed: per stage, pool size and weighting, each seed's
    attention mass, best selection's mass, retrieval and perplexity beyond the budget, and the indexer cache per
    token. Also each seed's captured share of the best selection's mass, and its difference from mean pooling's at the
    same pool size in points."""
    rows = []
    for key, stage in STUDY_STAGES:
        by_setting: dict = {}
        for report in reports:
            for row in report.get(key, []):
                by_setting.setdefault(row["setting"], []).append(row)
        for setting, seeds in by_setting.items():
            sparse = setting != "dense"
            entry = {"stage": stage, "setting": setting, "label": label(setting),
                     "pool_size": parse_setting(setting)[0] if sparse else None,
                     "weighting": setting.rpartition("_r")[0] if sparse else "dense",
                     "seeds": [report["settings"]["seed"] for report in reports
                               if any(row["setting"] == setting for row in report.get(key, []))],
                     "index_cache_bytes_per_token": seeds[0].get("index_cache_bytes_per_token")}
            for name in ("attention_mass", "best_selection_mass", "passkey_accuracy", "ppl_beyond_budget_vs_dense"):
                entry[name] = [row[name] for row in seeds]
            entry["share_of_best"] = [row["attention_mass"] / row["best_selection_mass"] for row in seeds]
            rows.append(entry)
    for entry in rows:
        mean = next((other for other in rows if other["stage"] == entry["stage"] and other["weighting"] == "mean"
                     and other["pool_size"] == entry["pool_size"] and entry["pool_size"] is not None), None)
        entry["share_vs_mean_points"] = None if mean is None else [
            100 * (share - mean_share) for share, mean_share in zip(entry["share_of_best"], mean["share_of_best"])]
    return rows


def study_table(rows: list[dict]) -> str:
    """The study as a Markdown table (values per seed, separated by ' / ')."""
    def each(values, form):
        return " / ".join(form.format(value) for value in values) if values is not None else "-"

    lines = ["| after | r | indexer cache bytes/token | weighting | attention mass | best selection's mass | "
             "share of the best | vs mean (points) | passkey accuracy | ppl beyond budget vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: index for index, name in enumerate(list(WEIGHTINGS) + ["dense"])}
    for entry in sorted(rows, key=lambda entry: ([stage for _, stage in STUDY_STAGES].index(entry["stage"]),
                                                 -(entry["pool_size"] or 1e9), order.get(entry["weighting"], -1))):
        sparse = entry["pool_size"] is not None
        cache = entry["index_cache_bytes_per_token"]
        lines.append(
            f"| {entry['stage']} | {entry['pool_size'] or '-'} | {'-' if cache is None else f'{cache:g}'} | "
            f"{WEIGHTING_LABELS.get(entry['weighting'], entry['label'])} | "
            + (f"{each(entry['attention_mass'], '{:.3f}')} | {each(entry['best_selection_mass'], '{:.3f}')} | "
               f"{each(entry['share_of_best'], '{:.1%}')} | {each(entry['share_vs_mean_points'], '{:+.1f}')} | "
               if sparse else "1 | 1 | - | - | ")
            + f"{each(entry['passkey_accuracy'], '{:.1%}')} | {each(entry['ppl_beyond_budget_vs_dense'], '{:+.2%}')} |")
    return "\n".join(lines)


def study_plot(rows: list[dict], path: str, title: str = "") -> None:
    """Quality against the indexer's cache bytes per token, one line per weighting (the mean over seeds, each seed a
    dot; unpooled r = 1 a black point), after the warm-up (top) and after stage 2 (bottom): captured attention mass
    with the best selection's mass as a band (its range over seeds), the captured share of the best selection's mass
    (each seed against its own best), passkey accuracy with dense's as a band, perplexity beyond the budget vs
    dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [stage for _, stage in STUDY_STAGES if any(entry["stage"] == stage for entry in rows)]
    figure, axes = plt.subplots(len(stages), 4, figsize=(20, 4.6 * len(stages)), squeeze=False)
    colors = dict(zip(WEIGHTINGS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    panels = (("attention_mass", 1, "attention mass captured"),
              ("share_of_best", 100, "share of the best selection's mass (%)"),
              ("passkey_accuracy", 100, "passkey accuracy (%)"),
              ("ppl_beyond_budget_vs_dense", 100, "perplexity beyond the budget vs dense (%)"))
    for stage, stage_axes in zip(stages, axes):
        entries = [entry for entry in rows if entry["stage"] == stage]
        sparse = sorted((entry for entry in entries if entry["pool_size"] is not None),
                        key=lambda entry: entry["index_cache_bytes_per_token"])
        sizes = sorted({entry["pool_size"] for entry in sparse}, reverse=True)
        cache = {entry["pool_size"]: entry["index_cache_bytes_per_token"] for entry in sparse}
        best = [[value for entry in sparse if entry["pool_size"] == size for value in entry["best_selection_mass"]]
                for size in sizes]
        stage_axes[0].fill_between([cache[size] for size in sizes], [min(values) for values in best],
                                   [max(values) for values in best], color="0.85", label="best selection (oracle)")
        dense = next((entry for entry in entries if entry["weighting"] == "dense"), None)
        if dense is not None:
            stage_axes[2].axhspan(100 * min(dense["passkey_accuracy"]), 100 * max(dense["passkey_accuracy"]),
                                  color="0.85", label="dense")
        lines = [(WEIGHTING_LABELS[weighting], colors[weighting], "o-",
                  [entry for entry in sparse if entry["weighting"] == weighting]) for weighting in WEIGHTINGS]
        lines.append(("unpooled r=1", "black", "s", [entry for entry in sparse if entry["pool_size"] == 1]))
        for name, color, style, line in lines:
            if not line:
                continue
            x = [entry["index_cache_bytes_per_token"] for entry in line]
            for axis, (measure, scale, _) in zip(stage_axes, panels):
                values = [[scale * value for value in entry[measure]] for entry in line]
                axis.plot(x, [sum(seed) / len(seed) for seed in values], style, color=color, label=name)
                axis.scatter([point for point, seed in zip(x, values) for _ in seed],
                             [value for seed in values for value in seed], s=9, color=color, alpha=0.5)
        for axis, (_, _, ylabel) in zip(stage_axes, panels):
            axis.set_xscale("log", base=2)
            axis.set_xticks([cache[size] for size in sizes], [f"{cache[size]:g}\n(r={size})" for size in sizes])
            axis.minorticks_off()
            axis.set(xlabel="indexer cache bytes per token", ylabel=ylabel, title=f"after {stage}")
            axis.grid(alpha=0.3)
        for axis in stage_axes[:3]:
            axis.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summarize(paths: list[str], plot_path: str | None) -> str:
    """The pool-size study of the reports at `paths` (one per seed) as a table; the plot at `plot_path`."""
    reports = [json.loads(Path(path).read_text()) for path in paths]
    rows = pool_size_study(reports)
    if plot_path:
        settings = reports[0]["settings"]
        study_plot(rows, plot_path, f"held-out stdlib source, context {settings['context']} tokens, budget "
                                    f"{settings['budget']} tokens, seeds "
                                    f"{', '.join(str(report['settings']['seed']) for report in reports)}")
    lines = [study_table(rows)]
    concentrations = [report.get("window_concentration") for report in reports]
    if all(concentrations):
        lines += ["", "Attention inside the windows (the base model's, nats from uniform, at most log r; per seed): "
                      "per query, and shared by the queries that see the window",
                  "", "| r | log r | per query | shared |", "|---|---|---|---|"]
        for size in sorted(concentrations[0], key=int, reverse=True):
            lines.append(f"| {size} | {math.log(int(size)):.3f} | "
                         + " / ".join(f"{values[size]['per_query']:.3f}" for values in concentrations) + " | "
                         + " / ".join(f"{values[size]['shared']:.3f}" for values in concentrations) + " |")
    return "\n".join(lines)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Small sizes: about 2 minutes on 2 CPU cores.")
    for name, help_text in (("context", "Tokens per sequence (training and evaluation)."),
                            ("budget", "Token budget index_topk of the sparse settings (a multiple of 4)."),
                            ("hidden-size", "Model width."),
                            ("layers", "Layers, Gated DeltaNet and IndexPool alternating."),
                            ("batch-size", "Sequences per training step."),
                            ("recall-steps", "Steps of the recall curriculum before the base training (49-character "
                                             "lists, then half as many at 128 characters); 0 skips it."),
                            ("train-steps", "Training steps of the dense base model."),
                            ("warmup-steps", "Dense warm-up steps of each indexer."),
                            ("sparse-steps", "Sparse-stage steps after the warm-up (dense: as many language-model "
                                             "steps); 0 skips the stage."),
                            ("eval-blocks", "Held-out sequences for perplexity and attention mass."),
                            ("passkey-samples", "Held-out passkey samples.")):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"{help_text} Default: full / --quick preset.")
    parser.add_argument("--sink-windows", type=int, default=0,
                        help="index_sink_windows of the sparse settings: first windows always selected (default 0)")
    parser.add_argument("--local-windows", type=int, default=0,
                        help="index_local_windows of the sparse settings: latest windows always selected (default 0)")
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--list-fraction", type=float, default=0.0,
                        help="Fraction of the training passkey samples that are lists: as many needles as the context "
                             "holds, all asked at the end (many answers per sequence: retrieval is learned sooner).")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="Comma-separated indexers to compare, dense included: dense, unpooled_r1 or "
                             f"<weighting>_r<r> with a weighting of {', '.join(WEIGHTINGS)} and r one of "
                             f"{', '.join(map(str, POOL_SIZES))} (distilled_scalar: learned_scalar pooling whose gate "
                             "also learns the attention each key receives in its window). Default: "
                             f"{', '.join(SETTINGS)}.")
    parser.add_argument("--pool-distillation-weight", type=float, default=1.0,
                        help="Weight of the pool distillation loss of the distilled settings, in both stages "
                             "(default 1.0).")
    parser.add_argument("--untrained", action=argparse.BooleanOptionalAction, default=True,
                        help="Measure each indexer untrained too, before its warm-up (default: yes).")
    parser.add_argument("--base-model", metavar="FILE",
                        help="Start from the base model an earlier run kept (its --results-dir's base.pt) instead of "
                             "training one; refused unless it was trained with the same options.")
    parser.add_argument("--results-dir", metavar="DIR",
                        help="Keep the trained base model and each finished setting's results here, so that a rerun "
                             "with the same options skips what is finished (a killed run loses at most the setting "
                             "it was in).")
    parser.add_argument("--key-cache-settings", default=None,
                        help="Comma-separated sparse settings also measured with each storage of the pooled index "
                             "keys (full precision, fp8 as the cache stores it, fp8 without the rotation, bfloat16) "
                             "after each stage; '' for none. Default: every sparse setting of --settings.")
    parser.add_argument("--passkey-fraction", type=float, default=0.5,
                        help="Fraction of training sequences that are passkey samples.")
    parser.add_argument("--max-needles", type=int, default=None,
                        help="A training passkey sample has 1 to this many labelled needles, all asked at its end "
                             "(evaluation samples have one). Default: 6, or as many as fit in half the context.")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="Of the base model.")
    parser.add_argument("--recall-learning-rate", type=float, default=5e-4,
                        help="Of the recall curriculum (constant after a warm-up; associative recall did not form at "
                             "1e-3 or 2e-3).")
    parser.add_argument("--warmup-learning-rate", type=float, default=2e-3, help="Of the indexer warm-up.")
    parser.add_argument("--sparse-learning-rate", type=float, default=5e-4,
                        help="Of the sparse stage (all parameters) and of dense's matching language-model steps.")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: the matrices are small, and on a shared CPU more "
                             "threads oversubscribe the cores and slow everything down many times).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="Write the report (settings, table, curves) as JSON.")
    parser.add_argument("--summarize", nargs="+", metavar="REPORT",
                        help="Run nothing: print the pool-size study (each pool size and weighting, per seed) of "
                             "these --json reports, one per seed, and draw it with --plot.")
    parser.add_argument("--plot", metavar="FILE", help="Draw warm-up KL, attention mass and perplexity (matplotlib).")
    args = parser.parse_args(argv)
    for name, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.settings = args.settings.split(",")
    unknown = [setting for setting in args.settings if setting != "dense" and parse_setting(setting) is None]
    if unknown:
        parser.error(f"--settings takes dense, unpooled_r1 or <weighting>_r<r> with a weighting of "
                     f"{', '.join(WEIGHTINGS)} and r one of {', '.join(map(str, POOL_SIZES))}, not {unknown}.")
    # The largest pool size: the budget must hold whole windows of it, and its queries are pruned last.
    largest = max([4] + [parse_setting(setting)[0] for setting in args.settings if setting != "dense"])
    if args.budget % largest or args.budget <= 0:
        parser.error(f"--budget {args.budget} must be a positive multiple of {largest} (the largest pool size of "
                     "--settings).")
    # Perplexity "beyond the budget" counts the tokens every setting prunes: from the first position whose query
    # sees more windows of the largest size than the budget keeps, (p + 1) // r > budget // r.
    args.beyond_budget_from = args.budget + largest - 1
    if args.context < 2 * args.budget:
        parser.error(f"--context {args.context} must be at least twice --budget {args.budget}, or nothing is pruned.")
    if args.context < 64:
        parser.error(f"--context {args.context} is too short for a passkey sample; use at least 64.")
    if args.layers < 2:
        parser.error("--layers must be at least 2 (one Gated DeltaNet and one IndexPool layer).")
    if not 0.0 <= args.list_fraction <= 1.0:
        parser.error(f"--list-fraction {args.list_fraction} must lie between 0 and 1.")
    if not 0.0 <= args.passkey_fraction <= 1.0:
        parser.error(f"--passkey-fraction {args.passkey_fraction} must lie between 0 and 1.")
    for name in ("threads", "hidden_size", "batch_size", "train_steps", "warmup_steps", "eval_blocks",
                 "passkey_samples", "eval_batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive.")
    if (args.sink_windows < 0 or args.local_windows < 0
            or args.sink_windows + args.local_windows > args.budget // largest):
        parser.error(f"--sink-windows and --local-windows must be >= 0 and fit in the r={largest} budget of "
                     f"{args.budget // largest} windows together.")
    if args.pool_distillation_weight < 0:
        parser.error(f"--pool-distillation-weight {args.pool_distillation_weight} must not be negative.")
    if args.key_cache_settings is None:
        args.key_cache_settings = [setting for setting in args.settings if setting != "dense"]
    else:
        args.key_cache_settings = [setting for setting in args.key_cache_settings.split(",") if setting]
        if set(args.key_cache_settings) - (set(args.settings) - {"dense"}):
            parser.error(f"--key-cache-settings takes sparse settings of --settings, not "
                         f"{sorted(set(args.key_cache_settings) - (set(args.settings) - {'dense'}))}.")
    head_dim = max(16, args.hidden_size // 4)  # as `model_config` sets it
    if args.key_cache_settings and head_dim & (head_dim - 1):
        parser.error(f"--hidden-size {args.hidden_size} gives an index head dim of {head_dim}; fp8 index keys need a "
                     "power of two (the Hadamard rotation): use a multiple of 4 whose quarter is one, or "
                     "--key-cache-settings ''.")
    if "dense" not in args.settings:
        parser.error(f"--settings must include dense: every other setting is compared with it (add ',dense' to "
                     f"{','.join(args.settings)}).")
    needle_characters = NEEDLE_AND_QUESTION_CHARACTERS
    if args.max_needles is None:
        args.max_needles = max(1, min(6, args.context // 2 // needle_characters))
    if not 1 <= args.max_needles <= len(NEEDLE_LABELS):
        parser.error(f"--max-needles {args.max_needles} must lie between 1 and {len(NEEDLE_LABELS)} (one-letter "
                     "labels).")
    if args.max_needles * needle_characters > args.context // 2:
        parser.error(f"--max-needles {args.max_needles} needles take {args.max_needles * needle_characters} "
                     f"characters, more than half of --context {args.context}; use at most "
                     f"{max(1, args.context // 2 // needle_characters)}.")
    if args.recall_steps < 0:
        parser.error(f"--recall-steps {args.recall_steps} must not be negative (0 skips the recall curriculum).")
    if args.sparse_steps < 0:
        parser.error(f"--sparse-steps {args.sparse_steps} must not be negative (0 skips the sparse stage).")
    return args


def main(argv=None) -> dict:
    from transformers.utils import logging as transformers_logging

    args = parse_arguments(argv)
    if args.summarize:
        table = summarize(args.summarize, args.plot)
        print(table, flush=True)
        return {"table": table}
    verbosity, threads = transformers_logging.get_verbosity(), torch.get_num_threads()
    transformers_logging.set_verbosity_error()  # the Trainer's per-run notices would bury the progress bars
    try:
        report = run(args)
    finally:  # the caller's logging and threads as they were (tests call main in-process)
        transformers_logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
    print(format_table(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
