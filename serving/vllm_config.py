"""Engine-start checks of a HybridIndexPool checkpoint and of the engine settings it is served with.

Anything the vLLM model does not implement is refused here, with the option named, before weights are read: an
unsupported setting must never produce wrong tokens.
"""

import os

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from .gated_deltanet_kernel import gdn_kernel, gdn_kernel_problems
from .glm_options import glm_unsupported_options, serves_glm

logger = init_logger(__name__)

# The IndexPool layer's step, a custom op (`indexpool_attention.py`); named here, where the compilation settings are.
ATTENTION_OP = "vllm::hybrid_indexpool_attention"
# The project's Gated DeltaNet core, where it runs in place of vLLM's kernels (`gated_deltanet.py`).
GDN_CORE_OP = "vllm::hybrid_indexpool_gdn_core"
# The steps of GLM-5.3-Flash's layers (`vllm_kda.py`, `vllm_mla.py`), custom ops too.
GLM_OPS = ("vllm::hybrid_indexpool_kda", "vllm::hybrid_indexpool_latent_attention")
# A per-layer n-gram embedding's step (`per_layer_embedding.py`).
PLE_OP = "vllm::hybrid_indexpool_ple"


# Settings whose other values (GLM-5.3-Flash's MLA, Kimi Delta Attention, indexer, Sinkhorn streams and MoE) the vLLM
# model does not implement: the value it serves.
SERVED_VARIANTS = {
    "attention_type": "gqa",
    "linear_attention_type": "gated_deltanet",
    "index_query_source": "hidden",
    "index_key_norm": "rms_after_pool",
    "index_rope": True,
    "hc_type": "qwen4_exp",
    "moe_router_type": "softmax",
    "shared_expert_gate": True,
    "swiglu_limit": None,
    "rms_norm_unit_offset": True,
}


def unsupported_options(config) -> list[str]:
    """Why this checkpoint config cannot be served by the vLLM model (empty when it can)."""
    if serves_glm(config):  # GLM-5.3-Flash's decoder (`vllm_glm.py`)
        return glm_unsupported_options(config)
    problems = []
    for name, served in SERVED_VARIANTS.items():
        if getattr(config, name) != served:
            problems.append(f"{name} = {getattr(config, name)!r} (a GLM-5.3-Flash variant; the vLLM model serves "
                            f"{name} = {served!r})")
    if config.indexer_types is not None and "shared" in config.indexer_types:
        problems.append("shared indexer layers (indexer_types has 'shared'; the vLLM model runs every indexer)")
    if config.num_experts > 0 and "dense" in config.mlp_types:
        problems.append("dense layers among MoE layers (mlp_layer_types; the vLLM model gives every layer experts)")
    if "linear_attention" not in config.layer_types:
        problems.append("a model without Gated DeltaNet layers (layer_types has no 'linear_attention')")
    return problems


class HybridIndexPoolVllmConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture hook (`MODELS_CONFIG_MAP`): refuse what the model cannot serve, split piecewise
    graphs at the IndexPool step, and on vLLM's CPU build turn prefix caching off when drafting (which vLLM cannot
    combine there) and keep n-gram drafting's numba pool to the one thread it uses."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        config = vllm_config.model_config.hf_text_config
        problems = unsupported_options(config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            problems.append(f"pipeline_parallel_size = {parallel.pipeline_parallel_size} (use tensor parallelism)")
        try:  # every rank holds whole heads
            config.check_tensor_parallel_size(parallel.tensor_parallel_size)
        except ValueError as error:
            problems.append(str(error).removeprefix("HybridIndexPoolConfig: "))
        cache = vllm_config.cache_config
        if cache.cache_dtype not in ("auto", "bfloat16", "float16"):
            problems.append(f"kv_cache_dtype = {cache.cache_dtype!r} (use 'auto')")
        problems += gdn_kernel_problems(vllm_config)
        glm = serves_glm(config)
        if glm and vllm_config.speculative_config is not None:
            problems.append("speculative decoding with GLM-5.3-Flash's layers (Kimi Delta Attention keeps no state per "
                            "draft position)")
        if config.ple_layers and vllm_config.model_config.enable_prompt_embeds:
            problems.append(f"enable_prompt_embeds with per-layer n-gram embeddings (ple_layers = {config.ple_layers}: "
                            "they hash the token ids, which prompt embeddings do not give)")
        if problems:
            raise ValueError("HybridIndexPool in vLLM does not support: " + "; ".join(problems) + ".")
        compilation = vllm_config.compilation_config
        if compilation.splitting_ops is None:  # vLLM fills in its own attention ops later: ours go with them
            compilation.splitting_ops = list(compilation._attention_ops)
        # Piecewise CUDA graphs run between the IndexPool steps (a mixed batch's tiles change their shapes), the
        # project's Gated DeltaNet cores, the n-gram embeddings and GLM's layers' steps (these read the step's prefill
        # lengths or KDA's chunk offsets on the host).
        host_ops = [ATTENTION_OP, *([GDN_CORE_OP] if gdn_kernel(vllm_config) == "project" else []),
                    *([PLE_OP] if config.ple_layers else []), *GLM_OPS]
        for op in host_ops:
            if op not in compilation.splitting_ops:
                compilation.splitting_ops.append(op)
        if cache.mamba_ssm_cache_dtype == "auto":
            cache.mamba_ssm_cache_dtype = "float32"  # our model keeps the Gated DeltaNet recurrent state in float32
        # Prefix caching stays on (vLLM's default): its hits land on block boundaries, multiples of r, where the open
        # window is empty, and vLLM's hybrid "align" mode keeps the Gated DeltaNet states there (vLLM switches it on).
        if cache.enable_prefix_caching and glm:
            # Kimi Delta Attention's states are not kept at block boundaries: a cached prefix would resume wrongly.
            logger.warning("HybridIndexPool: prefix caching is not supported with GLM-5.3-Flash's layers (Kimi Delta "
                           "Attention's states are not kept per block); it is disabled for this engine.")
            cache.enable_prefix_caching = False
        elif cache.enable_prefix_caching and vllm_config.speculative_config is not None and current_platform.is_cpu():
            # "align" mode with drafts copies the Gated DeltaNet states with Triton kernels vLLM's CPU build lacks.
            logger.warning("HybridIndexPool: vLLM's CPU build cannot combine prefix caching with speculative "
                           "decoding (its 'align' state copies for drafts are Triton kernels); prefix caching is "
                           "disabled for this engine.")
            cache.enable_prefix_caching = False
        speculative = vllm_config.speculative_config
        if (speculative is not None and speculative.method == "ngram" and current_platform.is_cpu()
                and "NUMBA_NUM_THREADS" not in os.environ):
            # vLLM's n-gram proposer runs its numba kernel on one thread whatever the pool holds, while numba launches
            # one worker per core whose OpenMP spin-wait between steps takes a core from the model (measured: as much
            # CPU as the engine itself, and the engine's own steps 40% slower, docs/serving.md). Read when numba's
            # pool starts, after this hook, in this process and the engine's.
            os.environ["NUMBA_NUM_THREADS"] = "1"
            logger.info("HybridIndexPool: NUMBA_NUM_THREADS=1 for vLLM's n-gram proposer on CPU (set it to keep "
                        "another value).")
