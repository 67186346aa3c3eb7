"""transformers' own common model tests (``ModelTesterMixin``, ``GenerationTesterMixin``) on ``PlatModel`` and
``PlatForCausalLM``, in both shapes, as transformers runs them on its in-tree models.

transformers does not ship its test suite in the wheel: set ``PLAT_TRANSFORMERS_TESTS`` to the root of a transformers
checkout (the folder holding ``tests/``), ideally of the installed version, and install ``parameterized``. Without it
this module is skipped.
"""

import inspect
import os
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import pytest

TRANSFORMERS_TESTS = os.environ.get("PLAT_TRANSFORMERS_TESTS")
if not TRANSFORMERS_TESTS or not (Path(TRANSFORMERS_TESTS) / "tests" / "test_modeling_common.py").is_file():
    pytest.skip(
        "transformers' common model tests are not in its wheel: set PLAT_TRANSFORMERS_TESTS to the root of a "
        "transformers checkout (the folder holding tests/) to run them",
        allow_module_level=True,
    )
pytest.importorskip("parameterized", reason="transformers' common model tests need the parameterized package")

import torch  # noqa: E402
import transformers.integrations.tensor_parallel as tensor_parallel  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402


def _tp_plan_matcher_moved(*args, **kwargs):
    raise NotImplementedError("this transformers has no tensor_parallel._get_parameter_tp_plan")


# Only test_tp_plan_matches_params calls it, after skipping models without a tensor-parallel plan (plat has none); the
# tests' module imports it at the top, and later transformers moved it.
if not hasattr(tensor_parallel, "_get_parameter_tp_plan"):
    tensor_parallel._get_parameter_tp_plan = _tp_plan_matcher_moved

sys.path.insert(0, TRANSFORMERS_TESTS)
from tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from tests.test_configuration_common import ConfigTester  # noqa: E402
from tests.test_modeling_common import ModelTesterMixin, ids_tensor, torch_device  # noqa: E402

from modeling_plat import PlatConfig, PlatForCausalLM, PlatModel  # noqa: E402
from modeling_plat.modeling_plat import PlatLayer  # noqa: E402
from tiny import LLAMA_SHAPE  # noqa: E402


_CHECKPOINTS_FORWARD = hasattr(PlatLayer.forward, "__wrapped__")
_CHECKPOINT_REPLAY_UNSEEN = (
    "this transformers checkpoints a layer's forward inside its class wrapper, where the tests' mock on the instance "
    "does not see the replay (LlamaForCausalLM fails them alike)"
)


class PlatModelTester:
    """Tiny configs and inputs, in the form transformers' ``CausalLMModelTester`` gives its in-tree models."""

    def __init__(self, parent, shape, batch_size=13, seq_length=7, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=512,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2):
        self.parent = parent
        self.shape = shape
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.use_input_mask = True
        self.use_labels = True
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = shape.get("num_key_value_heads", num_attention_heads)
        self.head_dim = hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def get_config(self):
        return PlatConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings, pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, **self.shape,
        )  # fmt: skip

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = torch.tril(torch.ones_like(input_ids, device=torch_device))
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), input_ids, input_mask, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, input_mask, token_labels):
        model = PlatModel(config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_causal_lm(self, config, input_ids, input_mask, token_labels):
        model = PlatForCausalLM(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertEqual(result.loss.shape, ())


class PlatModelTestBase(ModelTesterMixin, GenerationTesterMixin):
    all_model_classes = (PlatModel, PlatForCausalLM)
    all_generative_model_classes = (PlatForCausalLM,)
    shape = None

    def setUp(self):
        # The mixins tell a base model from a head by its class name in transformers' auto mappings, where an
        # in-tree model is listed (models/auto/modeling_auto.py); without them they ask PlatForCausalLM for no loss.
        for names, class_name in ((modeling_auto.MODEL_MAPPING_NAMES, "PlatModel"),
                                  (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "PlatForCausalLM")):
            patcher = mock.patch.dict(names, {PlatConfig.model_type: class_name})
            patcher.start()
            self.addCleanup(patcher.stop)
        self.model_tester = PlatModelTester(self, self.shape)
        self.config_tester = ConfigTester(self, config_class=PlatConfig)

    def test_config(self):
        # ConfigTester reads has_no_defaults_at_init, a class attribute (False) of the base config in the transformers
        # these tests come from; some releases lack it. False demands that PlatConfig() builds with no arguments.
        with mock.patch.object(PlatConfig, "has_no_defaults_at_init",
                               getattr(PretrainedConfig, "has_no_defaults_at_init", False), create=True):
            self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_causal_lm(self):
        self.model_tester.create_and_check_causal_lm(*self.model_tester.prepare_config_and_inputs())

    def test_can_init_all_missing_weights(self):
        # The mixin runs this only for models whose configuration file opens with a copyright line of 2023 or later
        # (its newer in-tree models); plat's files carry none, so the check is shown one.
        getfile = inspect.getfile
        with tempfile.NamedTemporaryFile("w", suffix=".py") as header:
            header.write("# Copyright 2026\n")
            header.flush()
            with mock.patch.object(inspect, "getfile", lambda obj: header.name if obj is PlatConfig else getfile(obj)):
                super().test_can_init_all_missing_weights()

    # The mixin counts a checkpointed layer's forward calls through a mock on the instance. Where transformers wraps
    # the class's forward to checkpoint it (from 5.2x, instead of __call__), the replay bypasses that mock and even
    # LlamaForCausalLM counts one call. tests/models/test_modeling.py compares plat's checkpointed gradients instead.
    @unittest.skipIf(_CHECKPOINTS_FORWARD, _CHECKPOINT_REPLAY_UNSEEN)
    def test_training_gradient_checkpointing(self):
        super().test_training_gradient_checkpointing()

    @unittest.skipIf(_CHECKPOINTS_FORWARD, _CHECKPOINT_REPLAY_UNSEEN)
    def test_training_gradient_checkpointing_use_reentrant_false(self):
        super().test_training_gradient_checkpointing_use_reentrant_false()

    @unittest.skipIf(_CHECKPOINTS_FORWARD, _CHECKPOINT_REPLAY_UNSEEN)
    def test_training_gradient_checkpointing_use_reentrant_true(self):
        super().test_training_gradient_checkpointing_use_reentrant_true()


class PlatGPT2ShapeTest(PlatModelTestBase, unittest.TestCase):
    shape = {}


class PlatLlamaShapeTest(PlatModelTestBase, unittest.TestCase):
    shape = LLAMA_SHAPE
