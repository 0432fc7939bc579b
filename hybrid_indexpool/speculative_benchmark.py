"""What speculative decoding costs and gains, measured on one machine side by side: the time of a verify forward
(`k + 1` tokens over a cache) against a one-token decode step (`verify_cost`), MTP drafting with a random head at the
same widths (`draft_cost`), and `generate()` with plain greedy decoding, prompt lookup and the model's MTP layers
(`compare_methods`: tokens per second, tokens per verify forward, cache bytes) on a model trained for it
(`train_drafting_model`). `scripts/bench_speculative.py` is the command; `docs/speculative_decoding_benchmark.md`
the measurements.

`verify_cost` uses only the package's public classes and this module only `torch` besides, so that a benchmark can
run this very file (`runpy.run_path`) under another checkout's interpreter and time the code before a change in the
same run (`scripts/bench_speculative.py --baseline-python`).
"""

import copy
import statistics
import time

import torch

# Draft methods of `generation_row`: how each is asked of `generate()` for `k` drafted tokens per verify forward.
METHODS = ("greedy", "prompt_lookup", "mtp")


def bench_width_config(layers: int = 8, hidden_size: int = 2048, vocab_size: int = 16384, **overrides):
    """A `HybridIndexPoolConfig` at Qwen3.8-Flash-Next's layer widths (16 query heads of 256, 2 key/value heads, Gated
    DeltaNet of 16 key and 32 value heads of 128, an indexer of 4 heads of 128, budget 2048, r = 4), three Gated
    DeltaNet layers per IndexPool layer, a dense MLP of 1024 and a small vocabulary: a model whose decode step reads
    its weights (hundreds of MB in bfloat16), as the real one's does."""
    from hybrid_indexpool import HybridIndexPoolConfig

    if layers % 4:
        raise ValueError(f"layers is {layers}; give a multiple of 4 (three Gated DeltaNet layers per IndexPool one).")
    settings = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        index_n_heads=4, index_head_dim=128, index_topk=2048, index_pool_size=4, index_pool_weighting="mean",
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexpool_attention"] * (layers // 4),
    )
    settings.update(overrides)
    return HybridIndexPoolConfig(**settings)


def prefill(model, ids: torch.Tensor, cache) -> None:
    """Feed `ids [1, length]` into `cache`. In bfloat16 it goes 8 tokens at a time: CPUs without bfloat16 matrix
    instructions (AVX2 only) run a bfloat16 GEMM of a long prompt many times slower than the few-token path, which
    streams the weights through the package's decode product (minutes against seconds for 1K tokens at 2048 hidden)."""
    chunk = 8 if model.dtype == torch.bfloat16 else ids.shape[1]
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start:start + chunk], cache=cache, use_cache=True)


def verify_cost(config_kwargs: dict, dtype: str, context: int, widths=(1, 2, 4, 8), repeats: int = 5,
                threads: int | None = None, seed: int = 0) -> dict:
    """Median seconds of a forward of `w` tokens over a cache holding `context` tokens, for each `w` in `widths`, on a
    random model of `bench_width_config(**config_kwargs)` in `dtype`; the widths take turns within each repeat (so
    load on the machine reaches all alike). Each forward appends its tokens (the context grows by `sum(widths)` per
    repeat). Returns `{"seconds": {w: s}, "ratio": {w: s / s_1}}` (`1` must be among the widths)."""
    from hybrid_indexpool import HybridIndexPoolCache, HybridIndexPoolForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    config = bench_width_config(**config_kwargs)
    torch.manual_seed(seed)
    model = HybridIndexPoolForCausalLM(config).eval().to(getattr(torch, dtype))
    generator = torch.Generator().manual_seed(seed)
    cache = HybridIndexPoolCache(config, max_cache_len=context + (repeats + 1) * sum(widths))
    samples = {width: [] for width in widths}
    prefill(model, torch.randint(1, config.vocab_size, (1, context), generator=generator), cache)
    with torch.no_grad():
        for repeat in range(repeats + 1):  # the first round warms up (kernel builds, allocator)
            for width in widths:
                ids = torch.randint(1, config.vocab_size, (1, width), generator=generator)
                start = time.perf_counter()
                model(ids, cache=cache, use_cache=True)
                if repeat:
                    samples[width].append(time.perf_counter() - start)
    seconds = {width: statistics.median(values) for width, values in samples.items()}
    return {"seconds": seconds, "ratio": {width: value / seconds[1] for width, value in seconds.items()}}


def draft_cost(config_kwargs: dict, dtype: str, context: int, draft_lengths=(1, 2, 3), new_tokens: int = 16,
               repeats: int = 2, threads: int | None = None, seed: int = 0) -> list[dict]:
    """Plain greedy decoding against MTP drafting of `k` tokens per verify forward (each `k` of `draft_lengths`) on a
    random model of `bench_width_config(**config_kwargs)` with one random MTP layer, in `dtype`, after a prompt of
    `context` random tokens (prefilled once; each run continues a copy of that cache): `compare_methods` rows with the
    median seconds of a drafting round (`draft_round_seconds`). A random head almost never agrees with the model, so
    the rows measure what drafting costs when it gains nothing."""
    from hybrid_indexpool import HybridIndexPoolCache, HybridIndexPoolForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    config = bench_width_config(**{"num_mtp_layers": 1, **config_kwargs})
    torch.manual_seed(seed)
    model = HybridIndexPoolForCausalLM(config).eval().to(getattr(torch, dtype))
    prompt = torch.randint(1, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    cache = HybridIndexPoolCache(config, max_cache_len=context)
    prefill(model, prompt[:, :-1], cache)
    return compare_methods(model, prompt, new_tokens, draft_lengths, methods=("mtp",), repeats=repeats,
                           prefilled_cache=cache)


class _ForwardCounter:
    """Counts a model's forwards and the tokens each feeds, notes when the first one (the prefill) ended, and reads
    the rollback bytes (`memory_footprint()["rollback"]`) the cache holds after the second one (a verify forward while
    drafting: what rolling back costs; once, so that the reading adds no time per token)."""

    def __init__(self, model, clock=time.perf_counter):
        self.clock = clock
        self.widths: list[int] = []
        self.prefill_end: float | None = None
        self.rollback_bytes: int | None = None
        self.handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                        model.register_forward_hook(self._after)]

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.widths.append(0 if ids is None else ids.shape[-1])

    def _after(self, module, args, output):
        if self.prefill_end is None:
            self.prefill_end = self.clock()
        elif len(self.widths) == 2:
            cache = getattr(output, "past_key_values", None)
            if hasattr(cache, "memory_footprint"):
                self.rollback_bytes = cache.memory_footprint().get("rollback", 0)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _DraftTimer:
    """Times the drafting rounds of `generate()`: wraps the candidate generator that `model._get_candidate_generator`
    builds so that each `get_candidates` call that drafts adds its seconds. Keeps the generator (its counters)."""

    def __init__(self, model, clock=time.perf_counter):
        self.model, self.generator, self.round_seconds, self.clock = model, None, [], clock
        self.draft_cache_bytes: int | None = None  # the drafter's own cache (MTP layers' entries), read once
        self.build = model._get_candidate_generator
        model._get_candidate_generator = self._build

    def _build(self, *args, **kwargs):
        self.generator = generator = self.build(*args, **kwargs)
        get_candidates = generator.get_candidates

        def timed(input_ids, *rest, **options):
            start = self.clock()
            candidates = get_candidates(input_ids, *rest, **options)
            if candidates[0].shape[-1] > input_ids.shape[-1]:  # a round that drafted (not the prefill's empty one)
                self.round_seconds.append(self.clock() - start)
                if len(self.round_seconds) == 2 and hasattr(generator, "draft_cache_footprint"):
                    self.draft_cache_bytes = generator.draft_cache_footprint()["reserved"]
            return candidates

        generator.get_candidates = timed
        return generator

    def remove(self) -> None:
        del self.model._get_candidate_generator  # back to the class's method


def generate_kwargs(method: str, draft_tokens: int) -> dict:
    """The `generate()` arguments of a draft method drafting `draft_tokens` tokens per verify forward."""
    if method == "greedy":
        return {}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": draft_tokens}
    if method == "mtp":
        return {"use_mtp": True, "num_assistant_tokens": draft_tokens, "num_assistant_tokens_schedule": "constant"}
    raise ValueError(f"method is {method!r}; use one of {list(METHODS)}.")


def generation_row(model, prompt: torch.Tensor, new_tokens: int, method: str, draft_tokens: int = 0,
                   greedy_tokens: torch.Tensor | None = None, prefilled_cache=None, clock=time.perf_counter) -> dict:
    """`generate()` of exactly `new_tokens` tokens after `prompt [1, length]` with one draft method, greedy; with
    `prefilled_cache` (a cache holding all but the prompt's last token) it continues a copy of that cache instead of
    running the prefill again (for models whose prefill takes long). `clock` gives the seconds (wall clock by default;
    `time.thread_time`, the thread's CPU time, leaves out the time other work on a shared machine takes from it).

    Returns tokens per second after the prefill, the model's forwards after it (`verify_forwards`) and the tokens
    each of them yields on average (`mean_accepted_per_verify`: the tokens after the prefill's own one, over those
    forwards; 1 for plain greedy, `a + 1` for a verify forward that accepts `a` drafts), the cache's reserved bytes,
    and whether the tokens equal `greedy_tokens`; or `error`, the first line of what `generate()` raised (a method
    this model does not support)."""
    row = {"method": method, "draft_tokens": draft_tokens, "context": prompt.shape[1]}
    counter, timer = _ForwardCounter(model, clock), _DraftTimer(model, clock)
    try:
        options = {} if prefilled_cache is None else {"cache": copy.deepcopy(prefilled_cache)}
        start = clock()
        with torch.no_grad():
            output = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    return_dict_in_generate=True, **generate_kwargs(method, draft_tokens), **options)
        end = clock()
    except (ValueError, NotImplementedError, TypeError, RuntimeError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return row
    finally:
        counter.remove()
        timer.remove()
    tokens = output.sequences[0, prompt.shape[1]:]
    decode_seconds = end - (counter.prefill_end or start)
    verify_forwards = max(len(counter.widths) - 1, 1)
    cache = output.past_key_values
    row.update(
        tokens_per_second=len(tokens) / decode_seconds, decode_seconds=decode_seconds, generated=len(tokens),
        verify_forwards=verify_forwards, mean_accepted_per_verify=(len(tokens) - 1) / verify_forwards,
        mean_verify_width=statistics.mean(counter.widths[1:]) if len(counter.widths) > 1 else 1.0,
        cache_reserved_bytes=cache.memory_footprint()["reserved"] if hasattr(cache, "memory_footprint") else None,
        rollback_bytes=counter.rollback_bytes, draft_cache_bytes=timer.draft_cache_bytes,
    )
    if timer.round_seconds:
        row["draft_round_seconds"] = statistics.median(timer.round_seconds)
    if hasattr(timer.generator, "mean_accepted_per_verify"):  # the MTP drafter counts the drafts the model kept
        row["accepted_drafts_per_verify"] = timer.generator.mean_accepted_per_verify
    if greedy_tokens is not None:
        row["same_tokens_as_greedy"] = bool(torch.equal(tokens, greedy_tokens[: len(tokens)]))
    row["tokens"] = tokens.tolist()
    return row


def compare_methods(model, prompt: torch.Tensor, new_tokens: int, draft_lengths=(1, 2, 3),
                    prompt_lookup_tokens: int = 5, methods=METHODS, repeats: int = 1,
                    prefilled_cache=None, clock=time.perf_counter) -> list[dict]:
    """`generation_row` for plain greedy, prompt lookup (`prompt_lookup_tokens` drafts) and MTP at each draft length
    on the same prompt, the methods taking turns within each of `repeats` rounds (so that load on the machine reaches
    all alike); a row keeps its median tokens per second over the rounds (`tokens_per_second_runs`: all of them) and
    adds its speedup over greedy's and its extra cache bytes: reserved beyond greedy's cache, plus the rollback
    recording during a verify round, plus the drafter's own cache. `prefilled_cache`, `clock`: see
    `generation_row`."""
    variants = [("greedy", 0)]
    if "prompt_lookup" in methods:
        variants.append(("prompt_lookup", prompt_lookup_tokens))
    if "mtp" in methods:
        variants += [("mtp", k) for k in draft_lengths]
    runs: dict[tuple[str, int], list[dict]] = {variant: [] for variant in variants}
    reference = None
    for _ in range(repeats):
        for method, k in variants:
            row = generation_row(model, prompt, new_tokens, method, k, reference, prefilled_cache, clock)
            if method == "greedy":
                if "error" in row:
                    raise RuntimeError(f"plain greedy decoding failed: {row['error']}")
                reference = torch.tensor(row["tokens"]) if reference is None else reference
            runs[(method, k)].append(row)
    rows = []
    for variant in variants:
        row = runs[variant][-1]
        if "error" not in row:
            speeds = [run["tokens_per_second"] for run in runs[variant]]
            row.update(tokens_per_second=statistics.median(speeds), tokens_per_second_runs=speeds)
        rows.append(row)
    greedy = rows[0]
    for row in rows:
        if "error" not in row:
            row["speedup"] = row["tokens_per_second"] / greedy["tokens_per_second"]
            if row["cache_reserved_bytes"] is not None and greedy["cache_reserved_bytes"] is not None:
                row["extra_cache_bytes"] = (row["cache_reserved_bytes"] - greedy["cache_reserved_bytes"]
                                            + (row["rollback_bytes"] or 0) + (row["draft_cache_bytes"] or 0))
    return rows


def copying_prompt(passage: torch.Tensor, repeat_marker: torch.Tensor, copies: int = 2) -> torch.Tensor:
    """A copying task: `passage` `[length]` token ids `copies` times, each after `repeat_marker`, then the marker and
    the passage's first token, so that continuing it means repeating the passage (what prompt lookup drafts)."""
    pieces = []
    for _ in range(copies):
        pieces += [repeat_marker, passage]
    pieces += [repeat_marker, passage[:1]]
    return torch.cat(pieces)[None]


def drafting_model_config(hidden_size: int = 128, layers: int = 4, context: int = 256,
                          head_dim: int | None = None) -> dict:
    """`HybridIndexPoolConfig` settings of the byte-level model the drafting rows run on (as the quality benchmark's:
    linear-attention and IndexPool layers alternating, r = 4, a budget of a quarter of the training context). Heads
    of `head_dim` channels (default `hidden_size / 4`; vLLM's CPU Gated DeltaNet needs 64 or 128)."""
    head_dim = head_dim or max(16, hidden_size // 4)
    return dict(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        layer_types=["linear_attention" if i % 2 == 0 else "indexpool_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, index_n_heads=4, index_head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        index_pool_size=4, index_topk=max(16, context // 4),
    )


def training_text_file(path: str, characters: int) -> str:
    """Write the first `characters` of the standard library's training split (`retrieval_task.stdlib_texts`; held-out
    files are never included) to `path`, blank lines inside a file removed so that each file is one example of the
    training commands' paragraph-per-example `.txt` format (blocks of contiguous code, not single functions)."""
    import re

    from .retrieval_task import stdlib_texts

    train, _, _, _ = stdlib_texts()
    text = re.sub(r"\n\s*\n", "\n", train[:characters])
    with open(path, "w") as handle:
        handle.write(text)
    return path


def train_drafting_model(output_dir: str, base_steps: int = 600, mtp_steps: int = 300, hidden_size: int = 128,
                         layers: int = 4, block_size: int = 256, batch_size: int = 8, learning_rate: float = 2e-3,
                         mtp_learning_rate: float = 2e-3, seed: int = 0, head_dim: int | None = None) -> str:
    """Train the drafting rows' model with the project's own training commands: a fresh byte-level model on the
    standard library's training split (`training.run_finetune` with `init_config`), then one fresh MTP layer on the
    same text with the model frozen (`mtp_training.run_mtp_training`, MTP loss alone). Writes `output_dir/base` and
    `output_dir/mtp` (the checkpoint to pass to `--model`) and `output_dir/training.json` (settings and the losses and
    MTP accuracies logged); returns the MTP checkpoint's folder."""
    import json
    import os

    from transformers import TrainingArguments

    from .mtp_training import MTPTrainingArguments, run_mtp_training
    from .training import FinetuneArguments, run_finetune

    os.makedirs(output_dir, exist_ok=True)
    settings = dict(base_steps=base_steps, mtp_steps=mtp_steps, hidden_size=hidden_size, layers=layers,
                    block_size=block_size, batch_size=batch_size, learning_rate=learning_rate,
                    mtp_learning_rate=mtp_learning_rate, seed=seed, head_dim=head_dim)
    # Enough text that no block repeats (10% over, for what packing drops at file ends).
    text = training_text_file(os.path.join(output_dir, "train.txt"),
                              int(1.1 * max(base_steps, mtp_steps) * batch_size * block_size))

    def trainer_arguments(folder: str, steps: int, rate: float) -> TrainingArguments:
        return TrainingArguments(output_dir=folder, max_steps=steps, per_device_train_batch_size=batch_size,
                                 learning_rate=rate, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20),
                                 logging_steps=max(1, steps // 20), save_strategy="no", report_to="none",
                                 use_cpu=True, seed=seed, dataloader_num_workers=0)

    base, mtp = os.path.join(output_dir, "base"), os.path.join(output_dir, "mtp")
    base_metrics = run_finetune(
        FinetuneArguments(init_config=json.dumps(drafting_model_config(hidden_size, layers, block_size, head_dim)),
                          train_files=[text], block_size=block_size, overwrite_output_dir=True),
        trainer_arguments(base, base_steps, learning_rate))
    mtp_metrics = run_mtp_training(
        MTPTrainingArguments(model_name_or_path=base, train_files=[text], block_size=block_size, num_mtp_layers=1,
                             overwrite_output_dir=True),
        trainer_arguments(mtp, mtp_steps, mtp_learning_rate))
    with open(os.path.join(output_dir, "training.json"), "w") as handle:
        json.dump({"settings": settings, "base": base_metrics, "mtp": mtp_metrics}, handle, indent=1, default=str)
    return mtp
