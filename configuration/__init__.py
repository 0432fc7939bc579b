from .configuration_hybrid_indexpool import HybridIndexPoolConfig

__all__ = ["HybridIndexPoolConfig"]
