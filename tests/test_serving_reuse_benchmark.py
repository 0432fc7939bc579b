"""`serving_reuse_benchmark`: reading vLLM's Prometheus counters (the measurements themselves start vLLM servers:
`tests/scripts/test_bench_serving_reuse.py`, marker `vllm`)."""

from hybrid_indexpool.serving_reuse_benchmark import DRAFTING_COUNTERS, PREFIX_CACHE_COUNTERS, counter_values

METRICS = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1240.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 3.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 2.0
"""


def test_counters_are_read_by_name_and_summed_over_their_labels():
    assert counter_values(METRICS, PREFIX_CACHE_COUNTERS) == {"vllm:prefix_cache_queries": 1240.0,
                                                              "vllm:prefix_cache_hits": 512.0}
    assert counter_values(METRICS, DRAFTING_COUNTERS) == {"vllm:spec_decode_num_drafts": 7.0,
                                                          "vllm:spec_decode_num_draft_tokens": 0.0,
                                                          "vllm:spec_decode_num_accepted_tokens": 5.0}
