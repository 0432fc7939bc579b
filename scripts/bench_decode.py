"""Decode benchmark at long contexts: pooled r = 4 against unpooled r = 1, dense attention, and transformers'
Qwen4-Exp, side by side in one run; with `--preset glm-flash`, pooled r = 16 against unpooled r = 1, dense attention,
and transformers' GLM-5.3-Flash (`glm5_next`).

The HybridIndexPool settings share one model's weights (mean pooling, so r changes nothing else) and one prompt;
"dense" is the same model with a budget beyond the context. Qwen4-Exp (`Qwen4ExpForCausalLM`, the mean-pooled QSA
indexer this design modifies) gets the same widths and runs at the contexts it can finish (`--reference-max-context`).
Each measurement runs in its own process (started from a fork server that has already imported everything); one
that raises or dies ends the benchmark with its traceback or cause of death and a non-zero exit status. The
HybridIndexPool settings decode from a cache reserved the way `generate()` reserves it (prompt + new tokens). Per
setting and context: prefill seconds, milliseconds per decoded token (median) in eager mode and, with `--compile`,
compiled whole (`torch.compile(fullgraph=True)`, inductor; compile time reported apart), the aten operator calls of one
decode step (from `torch.profiler`, nested calls included), and the cache's bytes reserved and in use per component
(what a GPU would hold, not resident-set growth), the measuring process's peak resident memory (`peak_rss_bytes`,
the fork server's share included); for the HybridIndexPool settings also the decode indexer step (top-k
over the pooled keys) and the fraction of the machine's memory bandwidth it reaches, the bandwidth measured by a
large copy in the same process right after the step was timed; and the roofline, the bytes a step must move (weights,
selected keys/values, pooled keys, states) over that copy bandwidth, and over the read bandwidth of a large sum (most
of a step's bytes are reads, which this CPU streams faster than a copy: the stricter bound).

From `--synthetic-from` tokens on (default 256K) the prompt is not run through the model: the prefill on the PyTorch
path costs O(N^2 / r) indexer work (a real 1M-token prefill of the default model takes about 22 minutes on 2 CPU
cores; r = 1 and dense take hours). Instead a short real prefill is followed by filling each IndexPool layer's
cache to the context with random keys, values and pooled keys, so that the cache has exactly the shapes, counts and
bytes of a real one and a decode step does exactly the work it does after a real prefill (its cost does not depend
on the values). Those rows say `synthetic` in the prefill column.

`--preset glm-flash` builds GLM-5.3-Flash's layer shapes (MLA attention, Kimi Delta Attention, GLM's indexer options,
see PRESETS) for our settings `pooled_r16`, `unpooled_r1` and `dense`, and the same widths as transformers'
`Glm5NextForConditionalGeneration` (setting `glm5_next`, random weights of its own; a tiny vision tower that text
prompts never run), at the contexts up to `--reference-max-context`: its indexer keeps every token's packed state and
builds a dense [queries, context] mask. Every row also reports the cache right after the prompt (`context_cache_bytes`,
exactly `context` tokens, before any decoded token): the per-token numbers of `docs/glm5_next_comparison.md`.

With `--index-key-dtypes auto,float8_e4m3fn` each HybridIndexPool setting runs once per storage of its pooled index
keys (`index_key_cache_dtype`: the model's dtype, or packed fp8 values and a scale per key), side by side.

    python -m hybrid_indexpool.scripts.bench_decode --quick
    python -m hybrid_indexpool.scripts.bench_decode --contexts 8192,131072 --settings pooled_r4,unpooled_r1,dense \\
        --compile --threads 1
    python -m hybrid_indexpool.scripts.bench_decode --contexts 8192,16384,32768,65536 \\
        --json docs/results/bench_decode.json --plot docs/results/bench_decode.png
    python -m hybrid_indexpool.scripts.bench_decode --preset glm-flash --layers 1 --dtype bfloat16 --contexts 8192 \\
        --json docs/results/bench_decode_glm_flash_8k.json
"""

import argparse
import json
import platform
import resource
import statistics
import sys
import time

import torch
from tqdm import tqdm

from hybrid_indexpool.benchmarking import (
    MeasurementFailed,
    MeasuringProcesses,
    copy_bandwidth,
    read_bandwidth,
)
from hybrid_indexpool.command_line import exit_with_error

SETTINGS = ("pooled_r4", "unpooled_r1", "dense", "qwen4_exp")
GLM_SETTINGS = ("pooled_r16", "unpooled_r1", "dense", "glm5_next")
ALL_SETTINGS = tuple(dict.fromkeys(SETTINGS + GLM_SETTINGS))
REFERENCES = ("qwen4_exp", "glm5_next")  # transformers' implementations
DENSE_BUDGET = 1 << 22
# Layer widths. flash-next: Qwen3.8-Flash-Next's attention (16 query heads of 256, 2 key/value heads, a quarter of
# each head rotated by RoPE of base 10^7), Gated DeltaNet (16 key heads and 32 value heads of 128) and indexer (4 heads
# of 128, budget 2048) in 4 layers (3 Gated DeltaNet + 1 IndexPool); unlike the real model it has 4 layers instead of
# 48, a dense MLP of 1024 instead of 512 experts, a 16K vocabulary instead of 248K, and no hyper-connections or n-gram
# embeddings. The rotated channels must fit the indexer head, which shares them: Qwen4-Exp's config rejects 256 of 128.
# glm-flash: GLM-5.3-Flash's MLA attention (64 heads, q_lora_rank 1536, kv_lora_rank 512, 256-wide NoPE query/key and
# value heads), Kimi Delta Attention (64 heads of 128) and indexer (32 heads of 128, learned pools of r = 16, budget
# 2048, queries from q_lora, LayerNorm before pooling, no RoPE, head weights) in 4 layers (3 KDA + 1 MLA); unlike the
# real model it has 4 layers instead of 45, a dense MLP of 1024 instead of 288 routed experts (and 3 dense layers of
# 12288), a 16K vocabulary instead of 154,880, one residual stream instead of 4 Sinkhorn hyper-connections, and
# random weights (transformers' model its own: timings and bytes do not depend on the values).
PRESETS = {
    "tiny": {},
    "flash-next": dict(hidden_size=2048, intermediate_size=1024, layers=4, heads=16, kv_heads=2, head_dim=256,
                       partial_rotary_factor=0.25, rope_theta=1e7, index_heads=4, index_head_dim=128, topk=2048,
                       linear_key_heads=16, linear_value_heads=32, linear_head_dim=128, vocab_size=16384),
    "glm-flash": dict(hidden_size=4096, intermediate_size=1024, layers=4, heads=64, q_lora_rank=1536,
                      kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_heads=32, index_head_dim=128,
                      topk=2048, linear_key_heads=64, linear_value_heads=64, linear_head_dim=128, vocab_size=16384),
}
# Presets with GLM-5.3-Flash's layer kinds (the others have Qwen3-Next's: GQA attention, Gated DeltaNet).
GLM_PRESETS = ("glm-flash",)
GLM_POOL_SIZE = 16  # GLM-5.3-Flash's index_kpool


def is_glm(args) -> bool:
    return args.preset in GLM_PRESETS


def pool_size(setting: str, args) -> int:
    """Pool size r of one of our settings: from its name, or the preset's for dense (the budget covers everything)."""
    if setting.startswith("pooled_r") or setting.startswith("unpooled_r"):
        return int(setting.rsplit("_r", 1)[1])
    return GLM_POOL_SIZE if is_glm(args) else 4


# torch.compile options for inference on CPU: inductor folds the weights into the graph (and prepacks them for the
# CPU's matrix libraries), and dynamo checks no guards on the model's modules at each call (their attributes and
# weights must then not change after compiling).
FROZEN_OPTIONS = {"freezing": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def glm_model_config(setting: str, args, index_key_dtype: str = "auto"):
    """Config of one setting of the glm-flash family: ours with GLM-5.3-Flash's variants, or transformers'
    `Glm5NextConfig` of the same widths (a tiny vision tower, never run on text prompts)."""
    if setting == "glm5_next":
        from transformers import Glm5NextConfig

        text = dict(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=0, v_head_dim=args.v_head_dim, index_n_heads=args.index_heads,
            index_head_dim=args.index_head_dim, index_topk=args.topk, index_kpool=GLM_POOL_SIZE,
            linear_num_heads=args.linear_value_heads, linear_head_dim=args.linear_head_dim,
            layer_types=["linear_attention"] * (args.layers - 1) + ["indexed_attention"],
            indexer_types=["full"] * args.layers,
            mlp_layer_types=["dense"] * args.layers, hc_mult=1, rms_norm_eps=1e-5, pad_token_id=0)
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=args.hidden_size,
                      projection_intermediate_size=32)
        return Glm5NextConfig(text_config=text, vision_config=vision)
    from hybrid_indexpool import HybridIndexPoolConfig

    if args.linear_key_heads != args.linear_value_heads:
        exit_with_error("Kimi Delta Attention (glm-flash) needs --linear-key-heads equal to --linear-value-heads; "
                        "give both the same count.")
    return HybridIndexPoolConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.qk_nope_head_dim, attention_type="mla", q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=0, v_head_dim=args.v_head_dim,
        linear_attention_type="kimi_delta", linear_gate_lower_bound=-5.0,
        linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
        linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
        index_n_heads=args.index_heads, index_head_dim=args.index_head_dim,
        index_topk=DENSE_BUDGET if setting == "dense" else args.topk, index_pool_size=pool_size(setting, args),
        index_pool_weighting="learned", index_head_weights=True, index_query_source="q_lora",
        index_key_norm="layer_norm_before_pool", index_rope=False,
        layer_types=["linear_attention"] * (args.layers - 1) + ["indexpool_attention"],
        swiglu_limit=10.0, rms_norm_eps=1e-5, index_key_cache_dtype=index_key_dtype,
    )


def model_config(setting: str, args, index_key_dtype: str = "auto"):
    """Config of one setting; every HybridIndexPool setting of the Qwen presets has the same weights (whatever
    `index_key_dtype`, the config's `index_key_cache_dtype`), and Qwen4-Exp the same RoPE."""
    if is_glm(args):
        return glm_model_config(setting, args, index_key_dtype)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
    if setting == "qwen4_exp":
        from transformers import Qwen4ExpTextConfig

        return Qwen4ExpTextConfig(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
            rope_parameters=rope, linear_num_key_heads=args.linear_key_heads,
            linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
            linear_value_head_dim=args.linear_head_dim,
            num_experts=1, num_experts_per_tok=1, moe_intermediate_size=args.intermediate_size,
            shared_expert_intermediate_size=args.intermediate_size, hc_count=2, hc_lowrank=16, ple_layer_ids=[],
            indexer_n_heads=args.index_heads, indexer_kv_heads=1, indexer_head_dim=args.index_head_dim,
            indexer_budget=args.topk, indexer_compress_ratio=4,
            layer_types=["linear_attention"] * (args.layers - 1) + ["indexed_attention"],
        )
    from hybrid_indexpool import HybridIndexPoolConfig

    return HybridIndexPoolConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, partial_rotary_factor=args.partial_rotary_factor, rope_parameters=rope,
        linear_num_key_heads=args.linear_key_heads,
        linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim, index_n_heads=args.index_heads, index_head_dim=args.index_head_dim,
        index_topk=DENSE_BUDGET if setting == "dense" else args.topk,
        index_pool_size=pool_size(setting, args), index_pool_weighting="mean",
        layer_types=["linear_attention"] * (args.layers - 1) + ["indexpool_attention"],
        index_key_cache_dtype=index_key_dtype,
    )


def build_model(setting: str, args, index_key_dtype: str = "auto"):
    dtype = getattr(torch, args.dtype)
    if setting == "qwen4_exp":
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

        torch.manual_seed(args.seed)
        return Qwen4ExpForCausalLM(model_config(setting, args)).eval().to(dtype)
    if setting == "glm5_next":
        from transformers import Glm5NextForConditionalGeneration

        torch.manual_seed(args.seed)
        return Glm5NextForConditionalGeneration(model_config(setting, args)).eval().to(dtype)
    from hybrid_indexpool import HybridIndexPoolForCausalLM

    torch.manual_seed(args.seed)
    return HybridIndexPoolForCausalLM(model_config(setting, args, index_key_dtype)).eval().to(dtype)


def roofline_bytes(model, cache, context: int) -> int:
    """Bytes a decode step must move at the least: every weight read once (one embedding row), the keys and values
    it attends (the selected windows and the open tail, or all of them for dense attention) and the pooled keys it
    scores, read once, and the recurrent and convolution states read and written once."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name)
    embedding = model.get_input_embeddings().weight
    total = weights + embedding[0].numel() * embedding.element_size()
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            total += 2 * sum(t.numel() * t.element_size() for t in (layer.recurrent_states[0], layer.conv_states[0]))
            continue
        r = layer.pool_size
        attended = min(context, config.index_topk + r - 1)
        # Keys and values of a token as stored (MLA: one latent, read once for both).
        total += attended * sum(storage[0, 0].numel() * storage.element_size()
                                for storage in (layer.key_storage, layer.value_storage) if storage is not None)
        if config.index_topk < context:
            pooled = layer.pooled_storage  # a key as stored: index_head_dim elements, or packed fp8 values and scale
            total += (context // r) * pooled.shape[-1] * pooled.element_size()  # every pooled key, once
    return total


def transformers_cache_bytes(cache) -> dict:
    """Bytes per component of a transformers cache of Qwen4-Exp or GLM-5.3-Flash: keys and values (GLM's MLA
    latents), the indexer's per-token keys (GLM's packed key, gate and validity), the linear layers' states."""
    sizes = {"key_value": 0, "index_keys": 0, "linear_states": 0}
    for layer in cache.layers:
        for name, component in (("keys", "key_value"), ("values", "key_value"), ("indexer_keys", "index_keys")):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                sizes[component] += tensor.numel() * tensor.element_size()
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for tensor in (states or {}).values():
                if isinstance(tensor, torch.Tensor):
                    sizes["linear_states"] += tensor.numel() * tensor.element_size()
    sizes["total"] = sum(sizes.values())
    sizes["reserved"] = sizes["total"]  # its tensors hold exactly what they store
    return sizes


def indexer_step(model, cache, args) -> dict:
    """Time the decode indexer step alone: one query scored against the pooled keys of each IndexPool layer, as a
    decode step does (the whole reserved store, windows beyond each row's count masked)."""
    from hybrid_indexpool.kernels.fp8_index_keys import is_packed
    from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk

    layers = cache.index_layers
    query = torch.randn(1, 1, args.index_heads, args.index_head_dim)
    head_weights = torch.randn(1, 1, args.index_heads) if model.config.index_head_weights else None
    topk = model.config.index_topk_windows

    def run():
        for layer in layers:
            pooled = layer.pooled_storage
            # Packed fp8 keys take float queries (rotated inside).
            pooled_index_topk(query if is_packed(pooled) else query.to(pooled.dtype), pooled,
                              (layer.lengths // layer.pool_size)[:, None], topk, head_weights)

    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    read = sum(layer.pooled_storage.numel() * layer.pooled_storage.element_size() for layer in layers)
    return {"indexer_ms": seconds * 1e3, "indexer_bytes": read, "indexer_bytes_per_second": read / seconds}


def fill_cache_synthetically(cache, context: int, seed: int) -> None:
    """Bring every IndexPool layer of a prefilled cache to `context` tokens with random keys, values and pooled keys:
    the counts and bytes of a real prefill of `context` tokens (the linear layers' states are fixed-size). The cache
    must have been reserved for at least `context` tokens."""
    from hybrid_indexpool.kernels.fp8_index_keys import SCALE_BYTES, is_packed, quantize_pooled_keys

    generator = torch.Generator().manual_seed(seed)
    for layer in cache.index_layers:
        start, r = int(layer.lengths.max()), layer.pool_size
        if context > layer.capacity:
            raise ValueError(f"the cache holds {layer.capacity} tokens per row, fewer than {context}")
        for storage in (layer.key_storage, layer.value_storage):
            if storage is None:  # MLA: latents only
                continue
            storage[:, start:context] = torch.randn(storage[:, start:context].shape, generator=generator,
                                                    dtype=storage.dtype)
        pooled = layer.pooled_storage[:, start // r: context // r]
        if is_packed(pooled):  # random keys quantised, in chunks (the quantisation's float32 temporaries)
            for chunk in pooled.split(1 << 16, dim=1):
                chunk.copy_(quantize_pooled_keys(torch.randn(*chunk.shape[:-1], chunk.shape[-1] - SCALE_BYTES,
                                                             generator=generator)))
        else:
            pooled.copy_(torch.randn(pooled.shape, generator=generator, dtype=pooled.dtype))
    # Count the synthetic tokens as held (every row, no padding); reserve() then re-reads the lengths for growth.
    for layer in cache.index_layers:
        layer.lengths.fill_(context)
    cache.seen_tokens.fill_(context)
    cache.reserve(cache.max_cache_len)


def aten_calls(step) -> int:
    """aten operator calls `torch.profiler` records while `step()` runs (nested calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return sum(1 for event in profiler.events() if event.name.startswith("aten::"))


def measure(setting: str, context: int, args, index_key_dtype: str = "auto") -> dict:
    """One run, in a fresh process: prefill, eager (and compiled) decode, operator counts and cache size."""
    from hybrid_indexpool import HybridIndexPoolCache

    torch.set_num_threads(args.threads)
    model = build_model(setting, args, index_key_dtype)
    ours = setting not in REFERENCES
    compile_step = args.compile and ours
    synthetic = ours and context >= args.synthetic_from
    prompt_length = min(context, args.topk * 2) if synthetic else context
    prompt = torch.randint(1, args.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(args.seed))
    # Tokens decoded after the prompt: the timed eager steps and one profiled, then the same compiled after two
    # warm-up steps (the first one compiles).
    compilations = (1 + args.compile_frozen) if compile_step else 0
    decoded = (args.new_tokens + 1) * (1 + compilations) + 2 * compilations
    result = {"setting": setting, "context": context, "index_key_dtype": index_key_dtype}
    with torch.no_grad():
        cache = HybridIndexPoolCache(model.config, max_cache_len=context + decoded) if ours else None
        start = time.perf_counter()
        output = model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
        result["prefill_s"] = None if synthetic else time.perf_counter() - start
        cache, token = output.cache, output.logits[:, -1:].argmax(-1)
        if synthetic:
            fill_cache_synthetically(cache, context, args.seed)
        result["context_cache_bytes"] = cache.memory_footprint() if ours else transformers_cache_bytes(cache)
        result["per_token"] = per_token(result)

        def decode(forward):
            nonlocal token
            token = forward(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

        def timed_steps(forward) -> float:
            steps = []
            for _ in range(args.new_tokens):
                start = time.perf_counter()
                decode(forward)
                steps.append(time.perf_counter() - start)
            return statistics.median(steps) * 1e3

        result["decode_ms"] = timed_steps(model)
        result["aten_calls"] = aten_calls(lambda: decode(model))
        def compiled_step(options=None):
            """Compile the step, time the first call (the compilation) apart, warm up once: the compiled step."""
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend=args.compile_backend, options=options)
            start = time.perf_counter()
            decode(compiled)
            seconds = time.perf_counter() - start
            decode(compiled)
            return compiled, seconds

        if compile_step:
            compiled, result["compile_s"] = compiled_step()
            result["compiled_decode_ms"] = timed_steps(compiled)
            result["compiled_aten_calls"] = aten_calls(lambda: decode(compiled))
            if args.compile_frozen:
                frozen, result["frozen_compile_s"] = compiled_step(FROZEN_OPTIONS)
                result["frozen_decode_ms"] = timed_steps(frozen)
        if ours:
            result["cache_bytes"] = cache.memory_footprint()
            result.update(indexer_step(model, cache, args))
            result["roofline_bytes"] = roofline_bytes(model, cache, context)
            # The bandwidths again beside this measurement: another tenant's load moves them by tens of percent
            # between runs, and the roofline should use what the machine gave while the step was timed.
            result["copy_bandwidth"], result["read_bandwidth"] = copy_bandwidth(), read_bandwidth()
        else:
            result["cache_bytes"] = transformers_cache_bytes(cache)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def per_token(result: dict) -> dict:
    """The cache after the prompt (exactly `context` tokens) and the prefill, per prompt token: indexer bytes (ours:
    pooled keys and the open window; transformers': its per-token indexer state), key/value bytes (MLA: latents),
    all bytes in use (the linear layers' fixed-size states included), and prefill milliseconds."""
    cache, context = result["context_cache_bytes"], result["context"]
    index = cache.get("index_keys", cache.get("pooled_index_keys", 0) + cache.get("open_window", 0))
    prefill = result["prefill_s"]
    return {"index_bytes": index / context, "key_value_bytes": cache["key_value"] / context,
            "total_bytes": cache["total"] / context, "prefill_ms": None if prefill is None else prefill / context * 1e3}


def machine_copy_bandwidth(args) -> float:
    """`copy_bandwidth` with the benchmark's thread count (run in a fresh worker process)."""
    torch.set_num_threads(args.threads)
    return copy_bandwidth()


# The table's names of the `index_key_cache_dtype` values.
KEY_DTYPE_NAMES = {"auto": "model dtype", "float8_e4m3fn": "fp8"}


def print_table(results: list[dict], bandwidth: float) -> None:
    print(f"\nmemory bandwidth (copy): {bandwidth / 1e9:.1f} GB/s")
    header = ("setting", "index keys", "context", "prefill s", "eager ms", "compiled ms", "speedup", "frozen ms",
              "speedup",
              "roofline ms", "best/roofline", "best/read roof",
              "aten calls", "compiled aten", "reserved MiB", "in use MiB", "index keys KiB", "indexer ms",
              "indexer % bw")
    print("".join(f"{h:>15}" for h in header))
    for row in results:
        cache = row.get("cache_bytes", {})
        index_bytes = cache.get("pooled_index_keys", cache.get("index_keys", 0))
        fraction = row.get("indexer_bytes_per_second", 0) / row.get("copy_bandwidth", bandwidth)
        prefill = "synthetic" if row["prefill_s"] is None else f"{row['prefill_s']:.2f}"
        compiled = row.get("compiled_decode_ms")
        row_bandwidth = row.get("copy_bandwidth", bandwidth)
        roofline = row["roofline_bytes"] / row_bandwidth * 1e3 if "roofline_bytes" in row else None
        read_roofline = row["roofline_bytes"] / row["read_bandwidth"] * 1e3 if "read_bandwidth" in row else None
        frozen = row.get("frozen_decode_ms")
        best = min(row["decode_ms"], compiled or float("inf"), frozen or float("inf"))
        cells = (row["setting"], KEY_DTYPE_NAMES[row.get("index_key_dtype", "auto")], f"{row['context']:,}", prefill,
                 f"{row['decode_ms']:.2f}",
                 "-" if compiled is None else f"{compiled:.2f}",
                 "-" if compiled is None else f"{row['decode_ms'] / compiled:.1f}x",
                 "-" if frozen is None else f"{frozen:.2f}",
                 "-" if frozen is None else f"{row['decode_ms'] / frozen:.1f}x",
                 "-" if roofline is None else f"{roofline:.2f}", "-" if roofline is None else f"{best / roofline:.2f}x",
                 "-" if read_roofline is None else f"{best / read_roofline:.2f}x",
                 f"{row['aten_calls']:,}",
                 f"{row['compiled_aten_calls']:,}" if "compiled_aten_calls" in row else "-",
                 f"{cache.get('reserved', 0) / 2**20:.1f}", f"{cache.get('total', 0) / 2**20:.1f}",
                 f"{index_bytes / 2**10:.1f}", f"{row['indexer_ms']:.3f}" if "indexer_ms" in row else "-",
                 f"{100 * fraction:.1f}%" if "indexer_ms" in row else "-")
        print("".join(f"{c:>15}" for c in cells))


def print_per_token_table(results: list[dict]) -> None:
    """The per-token numbers of every row (`per_token`), and each against transformers' implementation at the same
    context where it ran ("x ref": ours over theirs)."""
    references = {row["context"]: row for row in results if row["setting"] in REFERENCES}
    header = ("setting", "index keys", "context", "index B/tok", "x ref", "KV B/tok", "total B/tok", "x ref",
              "prefill ms/tok", "x ref", "decode ms/tok", "x ref")
    print("\nper prompt token (cache right after the prompt):")
    print("".join(f"{h:>15}" for h in header))

    def ratio(value, key, reference):
        if reference is None or value is None or not reference[key]:
            return "-"
        return f"{value / reference[key]:.3f}x"

    for row in results:
        numbers, reference = row["per_token"], references.get(row["context"])
        theirs = None if reference is None else {**reference["per_token"], "decode_ms": reference["decode_ms"]}
        prefill = numbers["prefill_ms"]
        cells = (row["setting"], KEY_DTYPE_NAMES[row.get("index_key_dtype", "auto")], f"{row['context']:,}",
                 f"{numbers['index_bytes']:.1f}", ratio(numbers["index_bytes"], "index_bytes", theirs),
                 f"{numbers['key_value_bytes']:.1f}", f"{numbers['total_bytes']:.1f}",
                 ratio(numbers["total_bytes"], "total_bytes", theirs),
                 "synthetic" if prefill is None else f"{prefill:.3f}", ratio(prefill, "prefill_ms", theirs),
                 f"{row['decode_ms']:.1f}", ratio(row["decode_ms"], "decode_ms", theirs))
        print("".join(f"{c:>15}" for c in cells))


def plot(results: list[dict], path: str) -> None:
    """Decode latency (eager, and compiled where measured) and reserved cache bytes against context, log axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        exit_with_error(f"--plot needs matplotlib ({error}): pip install matplotlib, or leave out --plot.")
    figure, (latency, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for setting, key_dtype in ((s, d) for s in ALL_SETTINGS for d in KEY_DTYPE_NAMES):
        rows = [row for row in results if row["setting"] == setting and row.get("index_key_dtype", "auto") == key_dtype]
        if not rows:
            continue
        label = setting if key_dtype == "auto" else f"{setting} {KEY_DTYPE_NAMES[key_dtype]} keys"
        contexts = [row["context"] for row in rows]
        latency.plot(contexts, [row["decode_ms"] for row in rows], marker="o", label=f"{label} eager")
        compiled = [row for row in rows if "compiled_decode_ms" in row]
        if compiled:
            latency.plot([row["context"] for row in compiled], [row["compiled_decode_ms"] for row in compiled],
                         marker="s", linestyle="--", label=f"{label} compiled")
        memory.plot(contexts, [max(row["cache_bytes"]["reserved"] / 2**20, 1e-3) for row in rows], marker="o",
                    label=label)
    for axis, label in ((latency, "ms per decoded token"), (memory, "cache reserved (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle("HybridIndexPool decode on CPU: " + " vs ".join(dict.fromkeys(row["setting"] for row in results)))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", help="comma-separated prompt lengths (default 8K to 1M; --quick: 2K,4K)")
    parser.add_argument("--settings", help=f"any of {', '.join(ALL_SETTINGS)} (default: {', '.join(SETTINGS)}; "
                        f"glm-flash: {', '.join(GLM_SETTINGS)}); qwen4_exp goes with the Qwen presets, glm5_next "
                        "with glm-flash")
    parser.add_argument("--reference-max-context", type=int, default=16384,
                        help="longest context given to transformers' implementation (Qwen4-Exp's indexer loops over "
                             "queries in Python; GLM-5.3-Flash's builds a dense [queries, context] mask)")
    parser.add_argument("--dense-max-context", type=int, default=1 << 20, help="longest context for dense")
    parser.add_argument("--synthetic-from", type=int, default=262144,
                        help="contexts from this length on get a synthetic cache instead of a real prefill (see above)")
    parser.add_argument("--topk", type=int, default=512, help="token budget (default 512)")
    parser.add_argument("--new-tokens", type=int, default=8, help="decoded tokens per run (median reported)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of the indexer-step timing")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="layer widths: tiny (the benchmark model of docs/), flash-next (Qwen3.8-Flash-Next's "
                             "per-layer widths) or glm-flash (GLM-5.3-Flash's: MLA, Kimi Delta Attention, GLM's "
                             "indexer; see PRESETS); explicit width options override it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--index-key-dtypes", default="auto",
                        help="comma-separated index_key_cache_dtype values, each HybridIndexPool setting run once per "
                             "value: auto (the model's dtype), float8_e4m3fn (packed fp8 pooled keys)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="layers (the last one IndexPool, the rest linear)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--partial-rotary-factor", type=float, default=0.25,
                        help="fraction of each attention head (and indexer head) rotated by RoPE, for every setting")
    parser.add_argument("--rope-theta", type=float, default=1e7, help="RoPE base, for every setting")
    parser.add_argument("--index-heads", type=int, default=2)
    parser.add_argument("--index-head-dim", type=int, default=32)
    parser.add_argument("--linear-key-heads", type=int, default=2,
                        help="linear-attention key heads (Gated DeltaNet; KDA: equal to the value heads)")
    parser.add_argument("--linear-value-heads", type=int, default=4, help="linear-attention value heads")
    parser.add_argument("--linear-head-dim", type=int, default=32, help="linear-attention key and value head width")
    parser.add_argument("--q-lora-rank", type=int, default=32, help="MLA query rank (glm-flash)")
    parser.add_argument("--kv-lora-rank", type=int, default=32, help="MLA latent width, cached per token (glm-flash)")
    parser.add_argument("--qk-nope-head-dim", type=int, default=16, help="MLA query/key head width (glm-flash)")
    parser.add_argument("--v-head-dim", type=int, default=16, help="MLA value head width (glm-flash)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="also time the decode step compiled whole (inductor; minutes of compilation per run)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend for --compile "
                             "(aot_eager checks the capture without code generation)")
    parser.add_argument("--compile-frozen", action="store_true",
                        help="with --compile, also time the step compiled for inference: weights frozen into the graph "
                             "(inductor's freezing) and no guards on the modules (FROZEN_OPTIONS)")
    parser.add_argument("--quick", action="store_true", help="two short contexts (about 2-3 minutes on 2 cores)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--plot", help="draw latency and memory against context to this image file")
    args = parser.parse_args(argv)
    given_options = sys.argv[1:] if argv is None else argv
    given = {action.dest for action in parser._actions
             if any(word == option or word.startswith(option + "=") for word in given_options
                    for option in action.option_strings)}
    for name, value in PRESETS[args.preset].items():
        if name not in given:
            setattr(args, name, value)
    if args.quick:
        args.contexts = args.contexts or "2048,4096"
        args.new_tokens, args.repeats = 4, 3
        args.reference_max_context = min(args.reference_max_context, 4096)
    args.contexts = args.contexts or "8192,16384,32768,65536,131072,262144,524288,1048576"
    lengths = [entry.strip() for entry in args.contexts.split(",")]
    if not all(entry.isdigit() and int(entry) > 0 for entry in lengths):
        parser.error(f"--contexts {args.contexts!r}: give prompt lengths in tokens, positive whole numbers separated "
                     "by commas (e.g. 8192,131072).")
    args.contexts = ",".join(lengths)
    for name in ("new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(args, name)}; give a positive number.")
    args.settings = args.settings or ",".join(GLM_SETTINGS if is_glm(args) else SETTINGS)
    unknown = set(args.settings.split(",")) - set(ALL_SETTINGS)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)}; choose from {', '.join(ALL_SETTINGS)}")
    wrong_reference = "qwen4_exp" if is_glm(args) else "glm5_next"
    if wrong_reference in args.settings.split(","):
        parser.error(f"{wrong_reference} does not have the {args.preset} preset's layers; use "
                     f"{'glm5_next' if is_glm(args) else 'qwen4_exp'}")
    unknown = set(args.index_key_dtypes.split(",")) - set(KEY_DTYPE_NAMES)
    if unknown:
        parser.error(f"unknown --index-key-dtypes {sorted(unknown)}; choose from {', '.join(KEY_DTYPE_NAMES)}")
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    processes = MeasuringProcesses(["torch", "transformers", "hybrid_indexpool", __name__])
    runs = [
        (setting, length, key_dtype) for length in (int(c) for c in args.contexts.split(","))
        for setting in args.settings.split(",")
        for key_dtype in (["auto"] if setting in REFERENCES else args.index_key_dtypes.split(","))
        if not (setting in REFERENCES and length > args.reference_max_context)
        and not (setting == "dense" and length > args.dense_max_context)
    ]
    try:
        bandwidth = processes.run(machine_copy_bandwidth, args)
        results = [processes.run(measure, setting, length, args, key_dtype,
                                 label=f"{setting} at {length:,} tokens"
                                 + ("" if key_dtype == "auto" else f" with {key_dtype} index keys"))
                   for setting, length, key_dtype in tqdm(runs, desc="bench_decode", unit="run")]
    except MeasurementFailed as error:
        exit_with_error(str(error))
    print_table(results, bandwidth)
    print_per_token_table(results)
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads,
                    "torch": torch.__version__, "copy_bandwidth_bytes_per_second": bandwidth},
        "settings": {key: value for key, value in vars(args).items() if key not in ("json", "plot")},
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    if args.plot:
        plot(results, args.plot)
    return report


if __name__ == "__main__":
    main()
