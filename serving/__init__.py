"""vLLM plugin serving HybridIndexPool checkpoints (`vllm serve CKPT` with this package installed).

vLLM calls `register()` in every process it starts, through the `vllm.general_plugins` entry point. It imports
nothing of vLLM's model code: the model module is named by a string and imported by vLLM when a checkpoint needs it.
Only the configuration is shared with the transformers model (vLLM pins an older transformers than the rest of the
package needs).
"""

ARCHITECTURE = "HybridIndexPoolForCausalLM"
MODEL_CLASS = "hybrid_indexpool.serving.vllm_model:HybridIndexPoolForCausalLM"
# A multimodal checkpoint, served for text (`multimodal_text.py`).
MULTIMODAL_ARCHITECTURE = "HybridIndexPoolForConditionalGeneration"
MULTIMODAL_MODEL_CLASS = "hybrid_indexpool.serving.multimodal_text:HybridIndexPoolForConditionalGeneration"


def register() -> None:
    """Register the config with transformers' `AutoConfig` and the model with vLLM. Idempotent."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig
    from .multimodal_config import MultimodalTextConfig
    from .vllm_config import HybridIndexPoolVllmConfig
    from .vllm_drafting import register_mtp_drafter

    AutoConfig.register(HybridIndexPoolConfig.model_type, HybridIndexPoolConfig, exist_ok=True)
    # In vLLM's processes a multimodal checkpoint's config is its text model's (vLLM serves it for text).
    AutoConfig.register(MultimodalTextConfig.model_type, MultimodalTextConfig, exist_ok=True)
    for architecture, model_class in ((ARCHITECTURE, MODEL_CLASS), (MULTIMODAL_ARCHITECTURE, MULTIMODAL_MODEL_CLASS)):
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, model_class)
        # vLLM runs this hook on the engine's settings before anything is built: refusals happen at engine start.
        MODELS_CONFIG_MAP[architecture] = HybridIndexPoolVllmConfig
    register_mtp_drafter()  # speculative method "mtp": the checkpoint's MTP layers draft
