"""Quality benchmark of the indexers on real text: pooling r = 4 with each weighting (learned per channel, learned
per token, normed-then-mean, mean), unpooled r = 1, and dense.

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
2. From those weights, build each indexer (learned r = 4, mean r = 4, mean r = 1) with the sparse budget, measure it
   untrained (as a conversion leaves it: does the model collapse past the budget?), and run the
   same number of dense warm-up steps on each (DeepSeek-V3.2 stage 1: only the indexer trains, KL to the dense
   attention) through `hybrid_indexpool.indexer_training`.
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

    python -m hybrid_indexpool.scripts.bench_quality --quick
    python -m hybrid_indexpool.scripts.bench_quality --json docs/results/bench_quality.json \\
        --plot docs/results/bench_quality.png
"""

import argparse
import copy
import json
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

SETTINGS = ("learned_r4", "learned_scalar_r4", "prenorm_mean_r4", "mean_r4", "unpooled_r1", "dense")
LABELS = {"learned_r4": "learned pooling r=4", "learned_scalar_r4": "learned scalar pooling r=4",
          "prenorm_mean_r4": "prenorm mean pooling r=4", "mean_r4": "mean pooling r=4", "unpooled_r1": "unpooled r=1",
          "dense": "dense"}
# (pool size, index_pool_weighting) of each setting.
POOLING = {"learned_r4": (4, "learned"), "learned_scalar_r4": (4, "learned_scalar"),
           "prenorm_mean_r4": (4, "prenorm_mean"), "mean_r4": (4, "mean"), "unpooled_r1": (1, "mean"),
           "dense": (4, "learned")}
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

    pool_size, weighting = POOLING[setting]
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
    # A query is pruned (for r = 4 and r = 1 alike) from position budget + 3 on.
    beyond = torch.arange(args.context - 1) >= args.budget + 3
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


def run(args) -> dict:
    from transformers import DataCollatorForLanguageModeling, Trainer

    from hybrid_indexpool import HybridIndexPoolForCausalLM
    from hybrid_indexpool.indexer_training import kl_summary, train_indexer_stage
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    torch.set_num_threads(args.threads)
    started = time.time()
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

    results, warmup_curves, sparse_results, sparse_curves, fresh_results = {}, {}, {}, {}, {}
    key_cache_results = {"warmup": [], "sparse": []}  # rows of `key_cache_rows` after each stage
    with tempfile.TemporaryDirectory() as scratch:
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
        base_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        base_seconds = time.time() - started
        base_state = copy.deepcopy(base.state_dict())  # the dense setting trains `base` further in the sparse stage

        print("2/3 dense warm-up of each indexer, 3/3 evaluation on held-out text"
              + (f", then {args.sparse_steps} sparse-stage steps and evaluation again" if args.sparse_steps else ""),
              flush=True)
        for setting in tqdm(args.settings, desc="indexers"):
            if setting == "dense":
                model = base
            else:
                model = HybridIndexPoolForCausalLM(model_config(setting, args, tokenizer))
                # The pooling gates stay as built (zero: the mean); the dense base never trained its own.
                missing, unexpected = model.load_state_dict(
                    {name: value for name, value in base_state.items() if "pool_" not in name}, strict=False)
                if any("pool_" not in name for name in missing) or unexpected:
                    raise RuntimeError(f"{setting}: the base weights do not fit ({missing}, {unexpected}).")
                # The untrained indexer, as a conversion leaves it: does the model collapse past the budget?
                fresh_results[setting] = evaluated_row(setting, model, blocks, passkeys, args)
                warmup = train_indexer_stage(
                    model, "warmup", warmup_data,
                    trainer_arguments(scratch, args.warmup_steps, args.warmup_learning_rate, args), collator,
                )
                warmup_curves[setting] = [(entry["step"], entry["indexer_kl"])
                                          for entry in warmup.state.log_history if "indexer_kl" in entry]
            results[setting] = evaluated_row(setting, model, blocks, passkeys, args)
            if setting in args.key_cache_settings:
                key_cache_results["warmup"] += key_cache_rows(setting, model, blocks, passkeys, args)
            if setting != "dense":
                results[setting]["warmup_kl_first"], results[setting]["warmup_kl_last"] = \
                    kl_summary(warmup.state.log_history)
            if not args.sparse_steps:
                continue
            stage_arguments = trainer_arguments(scratch, args.sparse_steps, args.sparse_learning_rate, args)
            if setting == "dense":
                sparse = Trainer(model=model, args=stage_arguments, train_dataset=sparse_data, data_collator=collator)
                sparse.train()
            else:
                sparse = train_indexer_stage(model, "sparse", sparse_data, stage_arguments, collator)
            # The language-model part of the loss (all of it for dense) and, for the indexers, the KL.
            sparse_curves[setting] = [(entry["step"], entry.get("lm_loss", entry["loss"]), entry.get("indexer_kl"))
                                      for entry in sparse.state.log_history if "loss" in entry]
            sparse_results[setting] = evaluated_row(setting, model, blocks, passkeys, args)
            if setting in args.key_cache_settings:
                key_cache_results["sparse"] += key_cache_rows(setting, model, blocks, passkeys, args)
            if setting != "dense":
                sparse_results[setting]["sparse_kl_first"], sparse_results[setting]["sparse_kl_last"] = \
                    kl_summary(sparse.state.log_history)

    fresh_results["dense"] = results["dense"]
    for rows in (fresh_results, results, sparse_results):
        for row in rows.values():
            row["ppl_vs_dense"] = row["ppl"] / rows["dense"]["ppl"] - 1
            row["ppl_beyond_budget_vs_dense"] = row["ppl_beyond_budget"] / rows["dense"]["ppl_beyond_budget"] - 1
    for stage, rows in (("warmup", results), ("sparse", sparse_results)):
        full_precision = {row["setting"]: row for row in key_cache_results[stage] if row["index_keys"] == "auto"}
        for row in key_cache_results[stage]:
            if "ppl" not in row:
                continue  # not a cache format: selection measures only
            row["ppl_beyond_budget_vs_dense"] = row["ppl_beyond_budget"] / rows["dense"]["ppl_beyond_budget"] - 1
            row["ppl_beyond_budget_vs_full_precision"] = \
                row["ppl_beyond_budget"] / full_precision[row["setting"]]["ppl_beyond_budget"] - 1
    return {
        "machine": machine(),
        "settings": {**vars(args), "train_files": train_files, "held_out_files": held_out_files,
                     "train_chars": len(train_text), "held_out_chars": len(held_out_text),
                     "passkey_depths": [round(depth, 3) for depth in depths]},
        "base_training": {"losses": base_losses, "seconds": round(base_seconds, 1),
                          "recall_curriculum": [{"context": context, "steps": steps, "batch_size": 2 * args.batch_size}
                                                for context, steps, _ in recall_stages],
                          "passkey_accuracy_after_recall_curriculum": recall_accuracy},
        "results_fresh": [fresh_results[setting] for setting in args.settings if setting != "dense"],
        "results": [results[setting] for setting in args.settings],
        "warmup_kl": warmup_curves,
        "results_after_sparse": [sparse_results[setting] for setting in args.settings if setting in sparse_results],
        "sparse_curves": sparse_curves,
        "key_cache_results": key_cache_results["warmup"],
        "key_cache_results_after_sparse": key_cache_results["sparse"],
        "seconds": round(time.time() - started, 1),
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
                f"| {LABELS[row['setting']]} | {dense_after if row['setting'] == 'dense' else after} | "
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
                f"| {LABELS[row['setting']]} | {after} | {KEY_CACHE_LABELS[row['index_keys']]} | "
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
        curves.plot(steps, values, marker=".", label=LABELS[setting])
    curves.set(title="dense warm-up: indexer KL", xlabel="step", ylabel="KL(attention || indexer)")
    curves.legend()
    groups = [("after warm-up", rows)]
    if report.get("results_after_sparse"):
        groups.append((f"+ stage 2 ({report['settings']['sparse_steps']} steps)", report["results_after_sparse"]))
    width = 0.8 / len(groups)
    for index, (label, group) in enumerate(groups):
        positions = [position + (index - (len(groups) - 1) / 2) * width for position in range(len(group))]
        masses.bar(positions, [row["attention_mass"] for row in group], width, label=label)
        ppls.bar(positions, [100 * row["ppl_beyond_budget_vs_dense"] for row in group], width, label=label)
    masses.set(title=f"attention mass captured (budget {report['settings']['budget']})", ylim=(0, 1.05))
    ppls.set(title="perplexity beyond the budget vs dense", ylabel="%")
    for axis in (masses, ppls):
        axis.set_xticks(range(len(rows)), [LABELS[row["setting"]] for row in rows], rotation=15)
        axis.legend()
    figure.suptitle(f"held-out stdlib source, context {report['settings']['context']} tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


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
                        help="Comma-separated indexers to compare, dense included "
                             f"(default all: {', '.join(SETTINGS)}).")
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
    parser.add_argument("--plot", metavar="FILE", help="Draw warm-up KL, attention mass and perplexity (matplotlib).")
    args = parser.parse_args(argv)
    for name, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.budget % 4 or args.budget <= 0:
        parser.error(f"--budget {args.budget} must be a positive multiple of 4 (the pool size of the r=4 settings).")
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
    if args.sink_windows < 0 or args.local_windows < 0 or args.sink_windows + args.local_windows > args.budget // 4:
        parser.error(f"--sink-windows and --local-windows must be >= 0 and fit in the r=4 budget of "
                     f"{args.budget // 4} windows together.")
    args.settings = args.settings.split(",")
    unknown = set(args.settings) - set(SETTINGS)
    if unknown:
        parser.error(f"--settings takes {', '.join(SETTINGS)}, not {sorted(unknown)}.")
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
