"""transformers' own common tests (`ModelTesterMixin`, `ConfigTester`) run against every Vaswani class, wired as
transformers wires its in-library models (tests/models/marian, bart, llama): a tester that builds a tiny config and
inputs, and one `unittest.TestCase` per family of classes.

The suites come from the installed release's sdist (tests/upstream_suite.py); without network access to PyPI the
whole module is skipped. Every other skip below carries its reason: a feature the architecture lacks, hardware
this machine lacks, or a piece of the suite that the sdist does not ship.
"""

import unittest
from unittest import mock

import pytest
from transformers.models.auto import modeling_auto

from vaswani import (
    VaswaniConfig,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
    VaswaniModel,
)

import upstream_suite

try:
    STAND_IN_REASONS = upstream_suite.load()
except OSError as error:  # no route to PyPI: nothing to run against
    pytest.skip(f"cannot fetch transformers {upstream_suite.VERSION}'s sdist from PyPI: {error}", allow_module_level=True)

from transformers_tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402

pytestmark = pytest.mark.slow

# Special tokens (pad, eos) as `VaswaniConfig` lays them out; inputs draw ordinary tokens from above them.
PAD, EOS = 0, 1
FIRST_ORDINARY_ID = 4


class VaswaniModelTester:
    """Tiny configs and inputs for the mixins, after MarianModelTester: batch 13, length 7, width 16, 2 layers."""

    def __init__(
        self,
        parent,
        batch_size=13,
        seq_length=7,
        is_training=True,
        vocab_size=99,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4,
        num_labels=3,
        is_encoder_decoder=True,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_labels = num_labels
        # False for the decoder-only and the encoder-only models, which read one sequence and no decoder inputs.
        self.is_encoder_decoder = is_encoder_decoder
        # Decoder inputs are as long as the source here; the attention-shape tests read these.
        self.encoder_seq_length = self.decoder_seq_length = self.key_length = seq_length

    def get_config(self) -> VaswaniConfig:
        return VaswaniConfig(
            vocab_size=self.vocab_size,
            d_model=self.hidden_size,
            encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            d_ff=self.intermediate_size,
            max_position_embeddings=100,
            num_labels=self.num_labels,
            is_encoder_decoder=self.is_encoder_decoder,
        )

    def prepare_config_and_inputs(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(FIRST_ORDINARY_ID)
        input_ids[:, -1] = EOS
        inputs = {"input_ids": input_ids, "attention_mask": input_ids.ne(PAD)}
        if self.is_encoder_decoder:
            decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(FIRST_ORDINARY_ID)
            inputs.update(decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_input_ids.ne(PAD))
        return config, inputs

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


# Where transformers lists each in-library model's classes by task (models/auto/modeling_auto.py). The mixins read
# these tables to decide which class gets which labels, which is a base model without a loss, and so on; ours are
# registered with the Auto classes at runtime instead, so each test lists them here for its own duration.
IN_LIBRARY_MAPPINGS = (
    (modeling_auto.MODEL_MAPPING_NAMES, ("VaswaniModel", "VaswaniEncoderModel")),
    (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "VaswaniForConditionalGeneration"),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "VaswaniForCausalLM"),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "VaswaniForSequenceClassification"),
)


class InLibrary:
    # The mixin checks `_init_weights` against a load from an empty checkpoint only for models whose configuration file
    # carries a copyright year from 2023 on; ours carries none, and is held to the check.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        for names, classes in IN_LIBRARY_MAPPINGS:
            patcher = mock.patch.dict(names, {VaswaniConfig.model_type: classes})
            patcher.start()
            self.addCleanup(patcher.stop)


class ConfigTests:
    """`ConfigTester.run_common_tests`, one check per test so that the one the sdist cannot feed is skipped alone."""

    def _config_tester(self):
        return ConfigTester(self, config_class=VaswaniConfig, d_model=40, num_attention_heads=5)

    def test_config(self):
        tester = self._config_tester()
        for check in (
            "create_and_test_config_common_properties",
            "create_and_test_config_to_json_string",
            "create_and_test_config_to_json_file",
            "create_and_test_config_from_and_save_pretrained",
            "create_and_test_config_from_and_save_pretrained_subfolder",
            "create_and_test_config_from_and_save_pretrained_composite",
            "create_and_test_config_with_num_labels",
            "create_and_test_config_from_pretrained_custom_kwargs",
            "check_config_can_be_init_without_params",
        ):
            with self.subTest(check):
                getattr(tester, check)()

    def test_config_arguments_init(self):
        reason = STAND_IN_REASONS.get("utils/test_configuration_utils.py")
        if reason:
            self.skipTest(f"{reason}, which holds the common arguments this check sets")
        self._config_tester().check_config_arguments_init()


class VaswaniModelTest(InLibrary, ModelTesterMixin, GenerationTesterMixin, ConfigTests, unittest.TestCase):
    """The encoder-decoder: VaswaniModel and the translation model."""

    all_model_classes = (VaswaniModel, VaswaniForConditionalGeneration)
    is_encoder_decoder = True

    def setUp(self):
        super().setUp()
        self.model_tester = VaswaniModelTester(self)


class VaswaniForCausalLMTest(InLibrary, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """The decoder-only language model."""

    all_model_classes = (VaswaniForCausalLM,)

    def setUp(self):
        super().setUp()
        self.model_tester = VaswaniModelTester(self, is_encoder_decoder=False)


class VaswaniEncoderModelTest(InLibrary, ModelTesterMixin, unittest.TestCase):
    """The encoder-only models: VaswaniEncoderModel and the sequence classifier."""

    all_model_classes = (VaswaniEncoderModel, VaswaniForSequenceClassification)

    def setUp(self):
        super().setUp()
        self.model_tester = VaswaniModelTester(self, is_encoder_decoder=False)

    def test_load_with_mismatched_shapes(self):
        # The test reloads the classifier's checkpoint with AutoModel, and calls it as this test class is wired.
        # AutoModel opens every Vaswani checkpoint as the encoder-decoder VaswaniModel (the Auto table in
        # vaswani/__init__.py), so that call takes decoder inputs.
        self.is_encoder_decoder = True
        super().test_load_with_mismatched_shapes()
