"""transformers' own common model and configuration tests (`ModelTesterMixin`, `ConfigTester`) run on HybridIndexPool.

The mixins come from the sdist of the installed transformers, prepared into the git-ignored `.transformers_tests/`
by `python tests/transformers_common/prepare.py`; without it this module is skipped. The tester follows transformers'
causal-LM testers (Qwen3-Next's among them): a tiny config with one Gated DeltaNet and one IndexPool layer, whose
token budget is small enough that the test sequences are attended sparsely; a second class runs the same tests with
routed and shared experts.
"""

import inspect
import sys
import unittest
import unittest.mock
from pathlib import Path

import pytest
import transformers

PREPARED = Path(__file__).resolve().parents[2] / ".transformers_tests"
PREPARE_COMMAND = "python tests/transformers_common/prepare.py"


def prepared_version() -> str | None:
    stamp = PREPARED / "TRANSFORMERS_VERSION"
    return stamp.read_text().strip() if stamp.exists() else None


if prepared_version() is None:
    pytest.skip(f"transformers' common tests are not prepared; run `{PREPARE_COMMAND}`", allow_module_level=True)
if prepared_version() != transformers.__version__:
    pytest.skip(
        f"the prepared common tests are transformers {prepared_version()}'s but {transformers.__version__} is "
        f"installed; run `{PREPARE_COMMAND}` again", allow_module_level=True,
    )

sys.path.insert(0, str(PREPARED))
import torch  # noqa: E402
from transformers_tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402

from hybrid_indexpool import (  # noqa: E402
    HybridIndexPoolConfig,
    HybridIndexPoolForCausalLM,
    HybridIndexPoolForSequenceClassification,
    HybridIndexPoolModel,
)
from hybrid_indexpool.modeling import moe  # noqa: E402


class HybridIndexPoolModelTester:
    """Builds the tiny config and random inputs the common tests ask for (transformers' model-tester protocol)."""

    def __init__(self, parent, batch_size=3, seq_length=13, is_training=True, vocab_size=99, num_labels=3,
                 **config_overrides):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.num_labels = num_labels
        # Two layers, one of each mixer. Windows of 2 tokens and a budget of 2 windows: a 13-token row sees up to 6
        # complete windows, so the IndexPool layer selects.
        self.config_kwargs = dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            layer_types=["linear_attention", "indexpool_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            partial_rotary_factor=0.5,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=4,
            index_pool_size=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        self.config_kwargs.update(config_overrides)
        self.hidden_size = self.config_kwargs["hidden_size"]
        self.num_hidden_layers = self.config_kwargs["num_hidden_layers"]
        self.num_attention_heads = self.config_kwargs["num_attention_heads"]

    def get_config(self) -> HybridIndexPoolConfig:
        return HybridIndexPoolConfig(num_labels=self.num_labels, **self.config_kwargs)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class HybridIndexPoolConfigTest(unittest.TestCase):
    """transformers' configuration checks (JSON round trips, `save_pretrained`, common kwargs, num_labels)."""

    def test_config(self):
        self.model_tester = HybridIndexPoolModelTester(self)
        ConfigTester(self, config_class=HybridIndexPoolConfig, **self.model_tester.config_kwargs).run_common_tests()


class HybridIndexPoolModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """transformers' common model tests, dense MLP."""

    all_model_classes = (HybridIndexPoolModel, HybridIndexPoolForCausalLM, HybridIndexPoolForSequenceClassification)
    model_tester_overrides = {}
    # The indexer's parameters get no gradient from the language-model loss by design (its input is
    # detached, the top-k passes none; only the indexer loss trains it): test_parameters_get_gradients checks the rest.
    test_all_params_have_gradient = False
    # The test dates a model by a copyright line our files do not carry; the model is new, so run it.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = HybridIndexPoolModelTester(self, **self.model_tester_overrides)
        experts_test = self._testMethodName.startswith(("test_eager_matches_batched_and_grouped_inference",
                                                         "test_output_router_logits_from_config",
                                                         "test_moe_models_record_router_logits"))
        if experts_test and not self.model_tester.config_kwargs.get("num_experts"):
            self.skipTest("no experts in this config (HybridIndexPoolMoeModelTest runs it)")

    def test_moe_models_record_router_logits(self):
        """transformers' test looks for `@use_experts_implementation` in the model class's own module (single-file
        models); ours decorates the experts in `modeling/moe.py`: the same test, reading that module's source."""
        experts_source = inspect.getsource(moe)
        assert "@use_experts_implementation" in experts_source
        with unittest.mock.patch.object(inspect, "getsource", lambda module: experts_source):
            super().test_moe_models_record_router_logits()

    def test_attention_outputs(self):
        """Only the IndexPool layers return attention weights (Qwen3-Next's convention for its linear layers),
        `[batch, heads, queries, keys]` over every mask column, through the argument or the config."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config._attn_implementation = "eager"  # transformers refuses config.output_attentions under "sdpa"
        attention_layers = config.layer_types.count("indexpool_attention")
        expected = (self.model_tester.batch_size, self.model_tester.num_attention_heads,
                    self.model_tester.seq_length, self.model_tester.seq_length)
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with torch.no_grad():
                by_argument = model(**inputs, output_attentions=True).attentions
            config.output_attentions = True
            with torch.no_grad():
                by_config = model_class(config).eval()(**inputs).attentions
            config.output_attentions = False
            for attentions in (by_argument, by_config):
                self.assertEqual(len(attentions), attention_layers)
                self.assertEqual(tuple(attentions[0].shape), expected)
            # Nothing attends to padding, and each real query's weights sum to one.
            padding = inputs["attention_mask"] == 0
            self.assertTrue(bool((by_argument[0].permute(0, 3, 1, 2)[padding] == 0).all()))
            sums = by_argument[0].sum(-1).transpose(1, 2)[~padding]
            torch.testing.assert_close(sums, torch.ones_like(sums))

    def test_retain_grad_hidden_states_attentions(self):
        # Hidden states only: with padding, the attention weights (computed over each row's real tokens) are
        # returned laid out over the mask columns, a copy rather than the tensor the output was computed from.
        self.has_attentions = False
        super().test_retain_grad_hidden_states_attentions()

    def test_parameters_get_gradients(self):
        """The language-model loss reaches every parameter but the indexer's; the indexer loss reaches those."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = HybridIndexPoolForCausalLM(config).train()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        for name, parameter in model.named_parameters():
            self.assertEqual(parameter.grad is None, ".indexer." in name, name)
        model.zero_grad(set_to_none=True)
        model(**inputs, indexer_loss="sparse").loss.backward()
        for name, parameter in model.named_parameters():
            if ".indexer." in name:
                self.assertIsNotNone(parameter.grad, name)


class HybridIndexPoolMoeModelTest(HybridIndexPoolModelTest):
    """The same tests with a mixture of experts in every layer (routed top-2 of 4, plus a shared expert)."""

    model_tester_overrides = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    )
