"""HybridIndexPool: Gated DeltaNet layers interleaved with IndexPool sparse attention, for very long contexts.

Importing the package registers the model with the transformers Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from transformers.models.auto import modeling_auto

from .configuration import HybridIndexPoolConfig
from .modeling import (
    HybridIndexPoolCache,
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
    HybridIndexPoolPreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(HybridIndexPoolConfig.model_type, HybridIndexPoolConfig, exist_ok=True)
AutoModel.register(HybridIndexPoolConfig, HybridIndexPoolModel, exist_ok=True)
AutoModelForCausalLM.register(HybridIndexPoolConfig, HybridIndexPoolForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(
    HybridIndexPoolConfig, HybridIndexPoolForSequenceClassification, exist_ok=True
)
# The class names too: transformers' pipelines and common tests look a model's task up by class name there.
for names, model_class in (
    (modeling_auto.MODEL_MAPPING_NAMES, HybridIndexPoolModel),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, HybridIndexPoolForCausalLM),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, HybridIndexPoolForSequenceClassification),
):
    names.setdefault(HybridIndexPoolConfig.model_type, model_class.__name__)

__all__ = [
    "HybridIndexPoolConfig",
    "HybridIndexPoolCache",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolPreTrainedModel",
]
