"""`scripts/bench_serving.py`: its decode-step timing and decode-phase throughput (fast, no vLLM), and the script end
to end at a small size (marker `vllm`: it starts vLLM engines from the vLLM environment, this test's Python, and runs
itself with the main environment's Python)."""

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import torch
from vllm_reference import REFERENCE_PYTHON, REPO

from hybrid_indexpool.scripts.bench_serving import decode_phase, decode_step_timing, drafting_methods
from hybrid_indexpool.serving.synthetic_step import StepSizes

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_decode_phase_counts_the_tokens_after_every_request_started():
    """Request 0's first token at 1 s, request 1's at 4 s (its prefill): the decode phase runs from 4 s to the last
    token at 6 s and holds the tokens that came after 4 s."""
    phase = decode_phase([[1.0, 2.0, 3.0, 4.5, 5.0], [4.0, 5.5, 6.0]])
    assert phase["decode_seconds"] == 2.0 and phase["decode_tokens"] == 4
    assert phase["decode_tokens_per_second"] == 2.0 and phase["first_token_seconds"] == [1.0, 4.0]


def test_drafting_methods_name_their_speculative_configs():
    """'ngram' is 5 drafts looked up from 2 to 5 tokens; 'ngram:K:MIN:MAX' and 'mtp:K' set theirs; anything else is
    refused with the forms it takes."""
    assert drafting_methods("ngram,ngram:8:1:4,mtp:2") == {
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "ngram:8:1:4": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 4},
        "mtp:2": {"method": "mtp", "num_speculative_tokens": 2}}
    for wrong in ("ngram:8", "mtp", "eagle:1"):
        with pytest.raises(ValueError, match="ngram:K:MIN:MAX"):
            drafting_methods(wrong)


def test_decode_step_timing_reports_both_paths_against_the_bytes(monkeypatch):
    """Two contexts of a tiny layer: each path's step, selection and attention times, the bytes (the budget's keys and
    values once the context exceeds it, the pooled keys) and the ratios to their time at the copy bandwidth."""
    from hybrid_indexpool.scripts import bench_serving

    monkeypatch.setattr("hybrid_indexpool.benchmarking.copy_bandwidth",
                        lambda clock=None: 2e10 if clock is time.process_time else 1e10)
    sizes = StepSizes(heads=4, kv_heads=2, head_dim=16, index_heads=2, index_head_dim=16, topk=32, block_size=16,
                      weighting="mean")
    timing = decode_step_timing(sizes, requests=3, contexts=[20, 100], repeats=1)
    assert timing["copy_bandwidth"] == 1e10 and timing["copy_bandwidth_cpu"] == 2e10
    assert timing["threads"] == torch.get_num_threads()
    short, long = timing["rows"]
    assert short["attention_bytes"] == 3 * 2 * (20 + 3) * 2 * 16 * 2  # every complete window and the tail, bf16
    assert long["attention_bytes"] == 3 * 2 * (32 + 3) * 2 * 16 * 2  # the budget and the tail
    assert long["index_bytes"] == 3 * 25 * 16 * 2
    for row in timing["rows"]:
        for path in ("kernel", "torch"):
            assert row[f"step_{path}_ms"] > 0 and row[f"attention_{path}_ms"] > 0 and row[f"selection_{path}_ms"] > 0
            assert row[f"attention_{path}_over_bytes"] == pytest.approx(
                row[f"attention_{path}_ms"] / (1e3 * row["attention_bytes"] / 1e10))
            assert row[f"selection_{path}_over_bytes"] == pytest.approx(
                row[f"selection_{path}_ms"] / (1e3 * row["index_bytes"] / 1e10))
            assert row[f"step_{path}_cpu_over_bytes"] == pytest.approx(
                row[f"step_{path}_cpu_ms"] / (1e3 * (row["index_bytes"] + row["attention_bytes"]) / 2e10))
        # The tiny caches hold no whole huge page: the advice says so.
        assert set(row["cache_bytes"]) == set(row["cache_huge_page_bytes"]) == {"main", "pooled_keys"}
        assert set(row["huge_pages_declined"]) == {"main", "pooled_keys"}
        assert all("no whole huge page" in reason for reason in row["huge_pages_declined"].values())
    bench_serving.print_decode_step_timing(timing)


@pytest.mark.vllm
@requires_vllm
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


@pytest.mark.vllm
@requires_vllm
def test_bench_serving_against_vllms_own_qwen3_next(tmp_path):
    """`--against-qwen3-next`: vLLM's native Qwen3-Next and the plugin serve the same requests, the plugin on the
    conversion of that very Qwen3-Next checkpoint (prompts beyond the budget), streamed: the decode phase too."""
    output = tmp_path / "bench.json"
    subprocess.run([REFERENCE_PYTHON, "-m", "hybrid_indexpool.scripts.bench_serving", "--vllm-python", sys.executable,
                    "--requests", "2", "--new-tokens", "3", "--min-prompt", "40", "--max-prompt", "60",
                    "--budget", "16", "--against-qwen3-next", "--skip-transformers", "--skip-r1", "--stream",
                    "--decode-step-requests", "2", "--json", str(output)],
                   check=True, cwd=REPO)
    results = json.loads(output.read_text())
    for name in ("vllm", "vllm_qwen3_next"):
        assert results[name]["generated_tokens"] == 2 * 3
        assert results[name]["tokens_per_second"] > 0
        assert 0 < results[name]["decode_tokens"] < 2 * 3 and len(results[name]["first_token_seconds"]) == 2
    assert results["model"]["index_topk"] == 16 and results["machine"]["cores"] >= 1
