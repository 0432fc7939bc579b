"""Registers the pytest marks transformers' common tests carry, so that they do not warn as unknown."""

TRANSFORMERS_MARKS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                      "torch_compile_test")


def pytest_configure(config):
    for mark in TRANSFORMERS_MARKS:
        config.addinivalue_line("markers", f"{mark}: a transformers common-test mark")
