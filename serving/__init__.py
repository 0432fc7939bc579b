"""vLLM plugin serving HybridIndexPool checkpoints (`vllm serve CKPT` with this package installed).

vLLM calls `register()` in every process it starts, through the `vllm.general_plugins` entry point. It imports
nothing of vLLM's model code: the model module is named by a string and imported by vLLM when a checkpoint needs it.
Only the configuration is shared with the transformers model (vLLM pins an older transformers than the rest of the
package needs).
"""

ARCHITECTURE = "HybridIndexPoolForCausalLM"
MODEL_CLASS = "hybrid_indexpool.serving.vllm_model:HybridIndexPoolForCausalLM"


def register() -> None:
    """Register the config with transformers' `AutoConfig` and the model with vLLM. Idempotent."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
    from .vllm_config import HybridIndexPoolVllmConfig
    from .vllm_drafting import register_mtp_drafter

    AutoConfig.register(HybridIndexPoolConfig.model_type, HybridIndexPoolConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # vLLM runs this hook on the engine's settings before anything is built: refusals happen at engine start.
    MODELS_CONFIG_MAP[ARCHITECTURE] = HybridIndexPoolVllmConfig
    register_mtp_drafter()  # speculative method "mtp": the checkpoint's MTP layers draft
