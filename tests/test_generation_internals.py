"""The private transformers names that `vaswani.generation_vaswani`'s loops rely on, all behind its adapter
(`Upstream`), still exist and take what the adapter passes; a transformers release that changes one fails here,
naming it, instead of deep inside a decoding step."""

import ast
import functools
import inspect
import sys

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticCache
from transformers.generation import GenerationMixin

import vaswani.generation_vaswani as generation_vaswani
import vaswani.slots as slots
from vaswani.generation_vaswani import (
    UPSTREAM_CACHE_ATTRIBUTES,
    UPSTREAM_CONTRACT,
    UPSTREAM_SPECIAL_TOKENS,
    _signature_names,
    check_upstream_contract,
)
from vaswani.slots import SLOT_LAYER_OVERRIDES, _SlotLayer

from tiny_translation_model import build_model_and_tokenizer

# The private names of the Vaswani model itself that the loops call (modeling_vaswani.py, not transformers).
OWN_MODEL_NAMES = {"_reorder_cache"}


def test_the_installed_transformers_keeps_every_private_name_the_loops_use():
    problems = check_upstream_contract(overrides=SLOT_LAYER_OVERRIDES)
    assert not problems, "transformers changed what vaswani.generation_vaswani relies on:\n" + "\n".join(problems)


def test_a_missing_method_a_parameter_no_longer_taken_or_newly_required_or_a_changed_override_is_named():
    class Changed:
        def _update_finished_beams(self, sequences, beam_scores, decoder_prompt_len, new_argument):
            pass

        @staticmethod
        def _gather_beams(tensor, beam_indices):
            pass

        def _prepare_generation_config(self, generation_config):
            pass

        def get_mask_sizes(self, query_length, layer_index=0):
            pass

    problems = check_upstream_contract({
        (Changed, "_update_finished_beams"): ("sequences", "beam_scores", "cur_len", "decoder_prompt_len"),
        (Changed, "_gather_beams"): ("tensor", "beam_indices"),
        (Changed, "_prepare_generation_config"): ("generation_config", "**"),
        (Changed, "_check_early_stop_heuristic"): ("cur_len",),
    }, overrides={
        (Changed, "get_mask_sizes"): ("self", "query_length"),
        (Changed, "update"): ("self", "key_states", "value_states", "*args", "**kwargs"),
    }, special_tokens=())
    where = f"{Changed.__module__}.{Changed.__name__}"
    assert problems == [
        f"{where}._update_finished_beams no longer takes 'cur_len'",
        f"{where}._update_finished_beams now requires 'new_argument', which is not passed",
        f"{where}._prepare_generation_config no longer takes other keyword arguments",
        f"{where}._check_early_stop_heuristic no longer exists",
        f"{where}.get_mask_sizes now takes ('self', 'query_length', 'layer_index'), not ('self', 'query_length')",
        f"{where}.update no longer exists",
    ]


def test_a_special_token_tensor_that_is_no_longer_set_is_named():
    problems = check_upstream_contract({}, {}, special_tokens=("_eos_token_tensor", "_a_tensor_never_set"),
                                       cache_attributes={})
    assert problems == ["GenerationMixin._prepare_special_tokens no longer sets GenerationConfig._a_tensor_never_set"]


def test_a_cache_attribute_or_cache_method_the_loops_touch_that_changed_is_named():
    class Layer(DynamicLayer):  # a release whose layers select rows by another name, and keep no `values`
        def batch_select_indices(self, rows):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            self.is_initialized = True

    problems = check_upstream_contract({(Layer, "batch_select_indices"): ("indices",)}, {}, special_tokens=(),
                                       cache_attributes={Layer: ("keys", "values"),
                                                         EncoderDecoderCache: ("self_attention_cache",)})
    where = f"{Layer.__module__}.{Layer.__name__}"
    assert problems == [f"{where}.batch_select_indices no longer takes 'indices'",
                        f"{where}.batch_select_indices now requires 'rows', which is not passed",
                        f"{where}.keys no longer exists", f"{where}.values no longer exists"]


CACHE_CLASSES = (Cache, DynamicCache, StaticCache, EncoderDecoderCache, DynamicLayer)


@pytest.mark.parametrize("module", [generation_vaswani, slots])
def test_every_cache_method_and_cache_attribute_the_loops_touch_is_in_the_contract(module):
    """The caches' own methods the loops call (by name: those of transformers' cache classes; `update` only the model
    calls) and the cache classes they make are in UPSTREAM_CONTRACT; the tensors they read or write on a layer
    (`keys`, `values`) in UPSTREAM_CACHE_ATTRIBUTES."""
    tree = ast.parse(inspect.getsource(module))
    methods = {name for owner in CACHE_CLASSES for name, member in vars(owner).items()
               if callable(member) and not name.startswith("_")} - {"update"}
    contract = {(owner.__name__, name) for owner, name in UPSTREAM_CONTRACT}
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods}
    assert called <= {name for _, name in contract}, called - {name for _, name in contract}
    made = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in {owner.__name__ for owner in CACHE_CLASSES}}
    assert {(name, "__init__") for name in made} <= contract
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and node.attr in ("keys", "values", "layers", "self_attention_cache", "cross_attention_cache")}
    assert attributes <= {name for names in UPSTREAM_CACHE_ATTRIBUTES.values() for name in names}


@pytest.mark.parametrize("module", [generation_vaswani, slots])
def test_the_loops_reach_transformers_private_names_only_through_the_adapter(module):
    """Every `x._name` outside `Upstream` (and the contract's own check) names something of the loops' own (a
    function, class, method or attribute they define) or of the Vaswani model: none of transformers' private names;
    the slots reach them only through generation_vaswani's adapter too."""
    tree = ast.parse(inspect.getsource(generation_vaswani))
    if module is slots:
        tree.body += ast.parse(inspect.getsource(slots)).body
    adapter = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Upstream")
    check = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name == "check_upstream_contract")
    inside = {id(node) for part in (adapter, check) for node in ast.walk(part)}
    own = set(OWN_MODEL_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    reached = {(node.attr, node.lineno) for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and id(node) not in inside
               and node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own}
    assert not reached, f"private names used outside Upstream: {sorted(reached)}"
    # The names the contract checks are among those the adapter uses.
    used = {node.attr for node in ast.walk(adapter) if isinstance(node, ast.Attribute)}
    private = {name for owner, name in UPSTREAM_CONTRACT if owner is GenerationMixin}
    assert private | set(UPSTREAM_SPECIAL_TOKENS) <= used | {"_sample", "_beam_search"}
    # ... and every private transformers name the adapter uses is in the contract.
    assert {name for name in used if name.startswith("_") and not name.startswith("__")} <= \
        private | set(UPSTREAM_SPECIAL_TOKENS)


def test_the_slot_layer_overrides_only_what_the_contract_checks_with_its_signatures():
    """A new override of a transformers cache-layer method must be added to the contract, or it would go unchecked;
    each takes what transformers passes the method it overrides."""
    overridden = {name for name in vars(_SlotLayer) if callable(getattr(DynamicLayer, name, None))} - {"__init__"}
    assert overridden == {name for owner, name in SLOT_LAYER_OVERRIDES if owner is DynamicLayer}
    for (owner, name), parameters in SLOT_LAYER_OVERRIDES.items():
        assert _signature_names(getattr(_SlotLayer, name)) == parameters, name


def test_the_contract_lists_what_the_adapter_passes(monkeypatch):
    """Greedy and beam search through the lean loop, transformers' loop behind `decode` and the slots, with every
    private method recording what the adapter called it with: the parameters of the contract, all by keyword."""
    model, tokenizer = build_model_and_tokenizer()
    passed = {}
    for owner, name in UPSTREAM_CONTRACT:
        if owner is not GenerationMixin:
            continue
        original = inspect.getattr_static(GenerationMixin, name)
        static = isinstance(original, staticmethod)
        function = original.__func__ if static else original

        # With the method's own signature, which generate() reads (custom_generate's own arguments are the ones
        # `_sample` does not take).
        @functools.wraps(function)
        def recording(*args, _name=name, _function=function, _static=static, **kwargs):
            if sys._getframe(1).f_globals["__name__"] == generation_vaswani.__name__:  # generate() calls some too
                positional = len(args) - (0 if _static else 1)  # self
                passed.setdefault(_name, set()).update(kwargs, {f"positional argument {i}" for i in range(positional)})
            return _function(*args, **kwargs)

        monkeypatch.setattr(GenerationMixin, name, staticmethod(recording) if static else recording)
    batch = tokenizer(["the cat", "a tree under the bird"], return_tensors="pt", padding=True)
    sources = tokenizer(["the cat", "a bird"])["input_ids"]
    with torch.no_grad():
        for num_beams in (1, 4):
            model.generate(**batch, num_beams=num_beams, max_new_tokens=6, lean_decoding=True)
            # return_dict_in_generate is not the lean loop's: `decode` hands the call to transformers' own loop.
            model.generate(**batch, num_beams=num_beams, max_new_tokens=6, return_dict_in_generate=True,
                           custom_generate=generation_vaswani.decode)
            slots.decode_in_slots(model, sources, 6, slots=2, num_beams=num_beams)
    for (owner, name), parameters in UPSTREAM_CONTRACT.items():
        if owner is GenerationMixin:
            named = set(parameters) - {"**"}
            assert name in passed, f"the adapter never called {name}"
            assert passed[name] >= named if "**" in parameters else passed[name] == named, (name, passed[name])
