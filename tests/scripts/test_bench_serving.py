"""`scripts/bench_serving.py` end to end at a small size (marker `vllm`: it starts vLLM engines from the vLLM
environment, this test's Python, and runs itself with the main environment's Python)."""

import json
import subprocess
import sys

import pytest
from vllm_reference import REFERENCE_PYTHON, REPO

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def test_bench_serving_compares_the_three_servers_and_the_caches(tmp_path):
    output = tmp_path / "bench.json"
    subprocess.run([REFERENCE_PYTHON, "-m", "hybrid_indexpool.scripts.bench_serving", "--vllm-python", sys.executable,
                    "--requests", "3", "--new-tokens", "4", "--min-prompt", "20", "--max-prompt", "40",
                    "--json", str(output)], check=True, cwd=REPO)
    results = json.loads(output.read_text())
    for name in ("vllm", "serve_py", "generate"):
        assert results[name]["generated_tokens"] == 3 * 4  # every request ran to its length
        assert results[name]["tokens_per_second"] > 0
    # r = 4 against r = 1: the pooled keys cost a quarter per token, so more tokens fit in the same KV space.
    pooled, unpooled = results["kv_bytes_per_token"], results["kv_bytes_per_token_r1"]
    assert pooled["pooled_keys"] * 4 == pytest.approx(unpooled["pooled_keys"])
    assert pooled["main"] == unpooled["main"]
    assert results["vllm"]["kv_cache_tokens"] > results["vllm_r1_kv_cache_tokens"]
    # One IndexPool layer's decode step of the 3 requests, at both prompt lengths: no host sync.
    assert [row["context"] for row in results["decode_step_operations"]] == [20, 40]
    assert all(row["operators"] > 0 and row["host_syncs"] == 0 for row in results["decode_step_operations"])


def test_bench_serving_against_vllms_own_qwen3_next(tmp_path):
    """`--against-qwen3-next`: vLLM's native Qwen3-Next and the plugin serve the same requests, the plugin on the
    conversion of that very Qwen3-Next checkpoint (prompts beyond the budget)."""
    output = tmp_path / "bench.json"
    subprocess.run([REFERENCE_PYTHON, "-m", "hybrid_indexpool.scripts.bench_serving", "--vllm-python", sys.executable,
                    "--requests", "2", "--new-tokens", "3", "--min-prompt", "40", "--max-prompt", "60",
                    "--budget", "16", "--against-qwen3-next", "--skip-transformers", "--json", str(output)],
                   check=True, cwd=REPO)
    results = json.loads(output.read_text())
    for name in ("vllm", "vllm_qwen3_next"):
        assert results[name]["generated_tokens"] == 2 * 3
        assert results[name]["tokens_per_second"] > 0
    assert results["model"]["index_topk"] == 16 and results["machine"]["cores"] >= 1
