"""Stand-in for transformers' `tests/utils/test_configuration_utils.py`, written for HybridIndexPool.

transformers' sdist does not ship its `tests/utils/` folder, but `test_configuration_common.py` imports
`config_common_kwargs` from it: keyword arguments every `PreTrainedConfig` accepts, each set to a value other than
its default, that `ConfigTester.check_config_arguments_init` passes to the config and reads back.
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",  # read back as torch.float16
    "chunk_size_feed_forward": 5,
    "is_encoder_decoder": True,
    "architectures": ["HybridIndexPoolForCausalLM"],
    "id2label": {0: "negative", 1: "neutral", 2: "positive"},
    "label2id": {"negative": 0, "neutral": 1, "positive": 2},
    "problem_type": "single_label_classification",
}
