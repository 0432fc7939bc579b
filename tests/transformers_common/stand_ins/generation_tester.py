"""Stand-in for transformers' `tests/generation/test_utils.py`, written for HybridIndexPool.

transformers' sdist does not ship its `tests/generation/` folder, but `test_modeling_common.py` imports
`GenerationTesterMixin` from it (and requires testers of generative models to inherit it). This stand-in provides
the name only and runs no tests: our generation behaviour is covered by `tests/modeling/test_generation_common.py`.
"""


class GenerationTesterMixin:
    """Empty: see tests/modeling/test_generation_common.py for the generation tests."""
