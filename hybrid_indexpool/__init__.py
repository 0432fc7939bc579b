"""HybridIndexPool: Gated DeltaNet layers interleaved with IndexPool sparse attention, for very long contexts.

Importing the package registers the model with the transformers Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

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

__all__ = [
    "HybridIndexPoolConfig",
    "HybridIndexPoolCache",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolPreTrainedModel",
]
