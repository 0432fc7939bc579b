"""Stand-in for transformers' `tests/exporters/test_export.py`, written for HybridIndexPool.

transformers' sdist does not ship its `tests/exporters/` folder, but `test_modeling_common.py` imports
`ExportTesterMixin` from it as the base of `ModelTesterMixin`. This stand-in provides the name only and runs no
tests: `torch.export` of this model is not covered by transformers' common tests here (the project's own
`tests/modeling/test_compile.py` covers `torch.compile`).
"""


class ExportTesterMixin:
    """Empty: the export tests are not shipped in the sdist."""
