from .cache_hybrid_indexpool import (
    HybridIndexPoolCache,
    IndexPoolLayerCache,
    LinearAttentionLayerCache,
)
from .export import HybridIndexPoolDecodeStep
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
from .mtp_drafting import HybridIndexPoolMTPCandidateGenerator

__all__ = [
    "HybridIndexPoolCache",
    "IndexPoolLayerCache",
    "LinearAttentionLayerCache",
    "HybridIndexPoolMTPCandidateGenerator",
    "HybridIndexPoolDecodeStep",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolModel",
    "HybridIndexPoolPreTrainedModel",
    "HybridIndexPoolForConditionalGeneration",
    "HybridIndexPoolMultimodalModel",
    "HybridIndexPoolMultimodalPreTrainedModel",
]
