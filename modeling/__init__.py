from .cache_hybrid_indexpool import HybridIndexPoolCache, IndexPoolLayerCache, LinearAttentionLayerCache
from .modeling_hybrid_indexpool import (
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
    HybridIndexPoolPreTrainedModel,
)
from .modeling_hybrid_indexpool_multimodal import (
    HybridIndexPoolForConditionalGeneration,
    HybridIndexPoolMultimodalModel,
    HybridIndexPoolMultimodalPreTrainedModel,
)

__all__ = [
    "HybridIndexPoolCache",
    "IndexPoolLayerCache",
    "LinearAttentionLayerCache",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolModel",
    "HybridIndexPoolPreTrainedModel",
    "HybridIndexPoolForConditionalGeneration",
    "HybridIndexPoolMultimodalModel",
    "HybridIndexPoolMultimodalPreTrainedModel",
]
