"""`scripts/bench_serving.py --prefix-cache --drafting` end to end at a small size (marker `vllm`: it starts vLLM
servers from the vLLM environment, this test's Python, and runs itself with the main environment's Python)."""

import json
import subprocess
import sys

import pytest
from vllm_reference import REFERENCE_PYTHON, REPO, tiny_checkpoint

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def test_bench_serving_measures_prefix_caching_and_drafting(tmp_path):
    """The second request of a shared 600-token prefix finds two blocks in the cache (none with caching off), and
    n-gram drafting serves the copying prompt with plain decoding's text, drafts counted."""
    checkpoint = tiny_checkpoint(tmp_path / "tiny-indexpool-mtp", mtp=True)
    output = tmp_path / "bench.json"
    subprocess.run([REFERENCE_PYTHON, "-m", "hybrid_indexpool.scripts.bench_serving", "--vllm-python", sys.executable,
                    "--prefix-cache", "--prefix-tokens", "600", "--suffix-tokens", "16", "--budget", "16",
                    "--drafting", str(checkpoint), "--drafting-methods", "ngram", "--copy-length", "40",
                    "--threads", "1", "--json", str(output)], check=True, cwd=REPO)
    results = json.loads(output.read_text())
    cached, uncached = results["prefix_cache"]
    assert cached["prefix_caching"] and not uncached["prefix_caching"]
    assert cached["prefix_cache_hits"] >= 256 and uncached["prefix_cache_hits"] == 0
    for row in (cached, uncached):
        assert row["first_request_first_token_seconds"] > 0 and row["second_request_first_token_seconds"] > 0
    greedy, ngram = results["drafting"]
    assert (greedy["method"], ngram["method"]) == ("greedy", "ngram")
    assert greedy["num_drafts"] == 0 and ngram["num_drafts"] > 0
    assert ngram["same_text_as_greedy"] and greedy["generated_tokens"] == ngram["generated_tokens"] >= 39
