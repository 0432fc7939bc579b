"""HybridIndexPool: Gated DeltaNet layers interleaved with IndexPool sparse attention, for very long contexts.

Importing the package registers the model with the transformers Auto classes.
"""

from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoModelForSequenceClassification,
)
from transformers.models.auto import modeling_auto

# In a checkout that is not installed, `configuration/`, `modeling/`, `kernels/`, ... sit next to this folder (setup.py
# maps them into the package when it installs). Let the import system find them there, so that
# `python -m hybrid_indexpool.scripts.NAME` runs from the checkout's root with nothing installed; an installed copy has
# no such siblings and is left as it is.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "setup.py").is_file() and (_CHECKOUT / "configuration" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

from .configuration import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig  # noqa: E402
from .modeling import (  # noqa: E402
    HybridIndexPoolCache,
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForConditionalGeneration,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
    HybridIndexPoolMultimodalModel,
    HybridIndexPoolPreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(HybridIndexPoolConfig.model_type, HybridIndexPoolConfig, exist_ok=True)
AutoModel.register(HybridIndexPoolConfig, HybridIndexPoolModel, exist_ok=True)
AutoModelForCausalLM.register(HybridIndexPoolConfig, HybridIndexPoolForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(
    HybridIndexPoolConfig, HybridIndexPoolForSequenceClassification, exist_ok=True
)
AutoConfig.register(HybridIndexPoolMultimodalConfig.model_type, HybridIndexPoolMultimodalConfig, exist_ok=True)
AutoModel.register(HybridIndexPoolMultimodalConfig, HybridIndexPoolMultimodalModel, exist_ok=True)
AutoModelForImageTextToText.register(HybridIndexPoolMultimodalConfig, HybridIndexPoolForConditionalGeneration,
                                     exist_ok=True)
AutoModelForMultimodalLM.register(HybridIndexPoolMultimodalConfig, HybridIndexPoolForConditionalGeneration,
                                  exist_ok=True)
# The class names too: transformers' pipelines and common tests look a model's task up by class name there.
for names, config_class, model_class in (
    (modeling_auto.MODEL_MAPPING_NAMES, HybridIndexPoolConfig, HybridIndexPoolModel),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, HybridIndexPoolConfig, HybridIndexPoolForCausalLM),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, HybridIndexPoolConfig,
     HybridIndexPoolForSequenceClassification),
    (modeling_auto.MODEL_MAPPING_NAMES, HybridIndexPoolMultimodalConfig, HybridIndexPoolMultimodalModel),
    (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, HybridIndexPoolMultimodalConfig,
     HybridIndexPoolForConditionalGeneration),
    (modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, HybridIndexPoolMultimodalConfig,
     HybridIndexPoolForConditionalGeneration),
):
    names.setdefault(config_class.model_type, model_class.__name__)

__all__ = [
    "HybridIndexPoolConfig",
    "HybridIndexPoolMultimodalConfig",
    "HybridIndexPoolForConditionalGeneration",
    "HybridIndexPoolMultimodalModel",
    "HybridIndexPoolCache",
    "HybridIndexPoolModel",
    "HybridIndexPoolForCausalLM",
    "HybridIndexPoolForSequenceClassification",
    "HybridIndexPoolPreTrainedModel",
]
