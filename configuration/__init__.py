from .configuration_hybrid_indexpool import HybridIndexPoolConfig, HybridIndexPoolMultimodalConfig

__all__ = ["HybridIndexPoolConfig", "HybridIndexPoolMultimodalConfig"]
