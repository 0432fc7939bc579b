"""How vLLM finds the plugin's MTP drafter (`vllm_mtp.HybridIndexPoolMTP`) for speculative method `mtp`.

vLLM builds an MTP drafter from the target checkpoint itself, with a config rewritten by
`SpeculativeConfig.hf_config_override`: a table from its own model types to their MTP architectures (`qwen3_next` ->
`Qwen3NextMTP`, ...). The plugin adds its model type to that table when vLLM loads it (`register_mtp_drafter`),
and registers the drafter's architecture. Nothing else of vLLM changes.
"""

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolConfig

MTP_ARCHITECTURE = "HybridIndexPoolMTP"
MTP_MODEL_CLASS = "hybrid_indexpool.serving.vllm_mtp:HybridIndexPoolMTP"
# vLLM accepts a drafter for method `mtp` by its model type, from a list of its own; "mtp" is its generic entry.
MTP_MODEL_TYPE = "mtp"


def mtp_draft_config(hf_config):
    """The draft config vLLM builds `HybridIndexPoolMTP` from: a HybridIndexPool checkpoint's config with the MTP
    architecture, vLLM's generic MTP model type and `n_predict` (its MTP layers); any other config unchanged.

    vLLM applies the rewrite to any drafter read from a checkpoint: a HybridIndexPool checkpoint drafts with its MTP
    layers, so one without them is refused here, with what to do."""
    if getattr(hf_config, "model_type", None) != HybridIndexPoolConfig.model_type:
        return hf_config
    if hf_config.num_mtp_layers == 0:
        raise ValueError("HybridIndexPool: speculative method 'mtp' drafts with the checkpoint's "
                         "multi-token-prediction layers, and this checkpoint has none (num_mtp_layers = 0): train "
                         "a head with scripts/train_mtp.py, or draft with speculative method 'ngram'.")
    hf_config.model_type = MTP_MODEL_TYPE
    hf_config.update({"n_predict": hf_config.num_mtp_layers, "architectures": [MTP_ARCHITECTURE]})
    return hf_config


def hf_config_override(hf_config):
    """vLLM's draft-config rewrite (`SpeculativeConfig.hf_config_override`), then `mtp_draft_config`. A module-level
    function: vLLM pickles it with the engine's config."""
    from vllm.config.speculative import SpeculativeConfig

    vllm_override = getattr(SpeculativeConfig, "vllm_hf_config_override", SpeculativeConfig.hf_config_override)
    return mtp_draft_config(vllm_override(hf_config))


def register_mtp_drafter() -> None:
    """Register the drafter's architecture with vLLM and add HybridIndexPool checkpoints to vLLM's MTP config rewrite
    (vLLM's own kept as `SpeculativeConfig.vllm_hf_config_override`). Idempotent."""
    from vllm import ModelRegistry
    from vllm.config.speculative import SpeculativeConfig

    if MTP_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MTP_ARCHITECTURE, MTP_MODEL_CLASS)
    if not hasattr(SpeculativeConfig, "vllm_hf_config_override"):
        SpeculativeConfig.vllm_hf_config_override = staticmethod(SpeculativeConfig.hf_config_override)
        SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)
