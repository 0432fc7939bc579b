from .cache_hybrid_indexpool import HybridIndexPoolCache, IndexPoolLayerCache, LinearAttentionLayerCache
from .modeling_hybrid_indexpool import (
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
    HybridIndexPoolPreTrainedModel,
)

__all__ = [
    "HybridIndexPoolCache",
    "IndexPoolLayerCache",
    "LinearAttentionLayerCache",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolModel",
    "HybridIndexPoolPreTrainedModel",
]
