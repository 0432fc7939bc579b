"""The config of a multimodal checkpoint (`model_type = "hybrid_indexpool_multimodal"`) as vLLM reads it, registered
by the plugin in vLLM's processes only: vLLM serves the text model (`multimodal_text.py`)."""

from transformers import PretrainedConfig

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig


class MultimodalTextConfig(PretrainedConfig):
    """A `hybrid_indexpool_multimodal` config as vLLM reads it: the text model's `HybridIndexPoolConfig`
    (`text_config`) and the rest kept as it is stored (the vision tower's settings as a dict, never built: vLLM's
    transformers may lack the tower's config class, and nothing served reads it)."""

    model_type = "hybrid_indexpool_multimodal"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if not isinstance(text_config, HybridIndexPoolConfig):
            text_config = HybridIndexPoolConfig(**(text_config or {}))
        self.text_config = text_config
        self.vision_config = vision_config.to_dict() if isinstance(vision_config, PretrainedConfig) else vision_config
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs) -> HybridIndexPoolConfig:
        return self.text_config
