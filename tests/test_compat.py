"""`trl._compat`: each helper on the installed transformers, and with the capability it looks for taken away (the path
an older release takes); a fast path whose capability is missing steps aside and the run is unchanged.

`make test-compat` runs the whole default suite again at the floor of the supported range and at transformers 5.23;
these tests make the other branch of each helper run in every environment.
"""

import dataclasses
import inspect
import types
import warnings

import pytest
import torch
from trainer_utils import GROUP_ARGS, args_builder, low_id_reward, train_logs
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, trainer_utils
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trl import GRPOConfig, GRPOTrainer, _compat
from trl.assets import get_tokenizer_path
from trl.trainer.fast_paths import rollout_decode


pytestmark = pytest.mark.usefixtures("single_thread")


def test_cache_keyword_is_the_installed_models_argument(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    forward = inspect.signature(type(model).forward).parameters
    assert _compat.CACHE_KEYWORD in forward
    assert _compat.CACHE_KEYWORD in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    assert _compat.cache_keyword(model) == _compat.CACHE_KEYWORD
    assert (
        _compat.cache_keyword(model.model.layers[0])
        in inspect.signature(type(model.model.layers[0]).forward).parameters
    )
    assert _compat.accepts_cache(model)


def test_cache_keyword_follows_each_modules_own_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class Older(torch.nn.Module):
        def forward(self, hidden_states, past_key_value=None):
            return past_key_value

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return cache

    class Wrapper(torch.nn.Module):  # e.g. a PEFT model: everything in **kwargs
        def forward(self, *args, **kwargs):
            return kwargs

    assert _compat.cache_keyword(Old()) == "past_key_values"
    assert _compat.cache_keyword(Older()) == "past_key_value"
    assert _compat.cache_keyword(New()) == "cache"
    assert _compat.cache_keyword(Wrapper()) == _compat.CACHE_KEYWORD
    assert not _compat.accepts_cache(Wrapper())
    assert Old()(0, **_compat.cache_kwargs(Old(), "kv")) == "kv"
    assert New()(0, **_compat.cache_kwargs(New(), "kv")) == "kv"


def test_output_cache_reads_either_field():
    assert _compat.output_cache(CausalLMOutputWithPast(**{_compat.CACHE_KEYWORD: "kv"})) == "kv"
    assert _compat.output_cache({"past_key_values": "kv"}) == "kv"
    assert _compat.output_cache({"cache": "kv"}) == "kv"
    assert _compat.output_cache(CausalLMOutputWithPast()) is None


def test_attention_interface_without_get_interface(monkeypatch):
    """Before transformers 5.1 the registry has no `get_interface`: eager means the model's own function, any other
    registered name the registry's entry."""
    default = object()
    expected_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert _compat.attention_interface("eager", default) is default
    assert _compat.attention_interface("sdpa", default) is expected_sdpa
    if hasattr(type(ALL_ATTENTION_FUNCTIONS), "get_interface"):
        monkeypatch.delattr(type(ALL_ATTENTION_FUNCTIONS), "get_interface")
    assert _compat.attention_interface("eager", default) is default
    assert _compat.attention_interface("sdpa", default) is expected_sdpa
    assert _compat.attention_interface("not-registered", default) is default


def test_rotate_checkpoints_without_the_module_function(monkeypatch):
    calls = []

    class Trainer:
        args = type("Args", (), {"save_total_limit": 2})()
        state = type("State", (), {"best_model_checkpoint": "out/checkpoint-1"})()

        def _rotate_checkpoints(self, use_mtime=False, output_dir=None):
            calls.append((use_mtime, output_dir))

    if hasattr(trainer_utils, "rotate_checkpoints"):
        seen = []
        monkeypatch.setattr(trainer_utils, "rotate_checkpoints", lambda **kwargs: seen.append(kwargs))
        _compat.rotate_checkpoints(Trainer(), "out")
        assert seen == [
            {
                "output_dir": "out",
                "save_total_limit": 2,
                "best_model_checkpoint": "out/checkpoint-1",
                "use_mtime": True,
            }
        ]
        monkeypatch.delattr(trainer_utils, "rotate_checkpoints")
    _compat.rotate_checkpoints(Trainer(), "out")
    assert calls == [(True, "out")]


def test_extra_special_tokens_kwargs(monkeypatch):
    tokens = ["<a>", "<b>"]
    installed = _compat.extra_special_tokens_kwargs(tokens)
    v4 = "additional_special_tokens" in getattr(PreTrainedTokenizerBase, "SPECIAL_TOKENS_ATTRIBUTES", ())
    assert installed == ({"additional_special_tokens": tokens} if v4 else {"extra_special_tokens": tokens})
    monkeypatch.setattr(
        PreTrainedTokenizerBase, "SPECIAL_TOKENS_ATTRIBUTES", ["bos_token", "additional_special_tokens"], raising=False
    )
    assert _compat.extra_special_tokens_kwargs(tokens) == {"additional_special_tokens": tokens}
    monkeypatch.setattr(PreTrainedTokenizerBase, "SPECIAL_TOKENS_ATTRIBUTES", ["bos_token"], raising=False)
    assert _compat.extra_special_tokens_kwargs(tokens) == {"extra_special_tokens": tokens}


def _without_transformers_classes(monkeypatch):
    """An older transformers as `_compat` sees it: a top-level module without the newer classes."""
    monkeypatch.setattr(_compat, "transformers", types.SimpleNamespace(__version__="4.56.2"))


def test_missing_transformers_class_names_the_release(monkeypatch):
    _without_transformers_classes(monkeypatch)
    with pytest.raises(ImportError, match=r"use_transformers_continuous_batching=True.*transformers 5\.4\.0"):
        _compat.require_transformers_attribute(*_compat.CONTINUOUS_BATCHING_REQUIREMENT)


def test_continuous_batching_on_an_older_transformers_fails_at_the_config(tmp_path, monkeypatch):
    _without_transformers_classes(monkeypatch)
    with pytest.raises(ImportError, match="ContinuousBatchingConfig"):
        GRPOConfig(str(tmp_path), use_transformers_continuous_batching=True, report_to="none")


def test_response_schema_fields_the_installed_parser_cannot_read_warn(monkeypatch):
    from trl import chat_template_utils

    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
    tokenizer.chat_template = chat_template_utils.lfm2_v2_chat_template
    monkeypatch.setattr(chat_template_utils, "response_content_parsers", lambda: frozenset({"text", "json"}))
    with pytest.warns(UserWarning, match=r"cannot parse these fields of LFM2.*tool_calls \('python-call-list'\)"):
        chat_template_utils.add_response_schema(tokenizer)
    monkeypatch.setattr(chat_template_utils, "response_content_parsers", lambda: frozenset())
    with pytest.warns(UserWarning, match="has no response parser"):
        chat_template_utils.add_response_schema(tokenizer)
    monkeypatch.setattr(
        chat_template_utils, "response_content_parsers", lambda: frozenset({"text", "json", "python-call-list"})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chat_template_utils.add_response_schema(tokenizer)


def test_repetition_penalty_padding_probe_matches_generate(model_path):
    """The decode loop's repetition penalty leaves a row's left padding out exactly when the probe says `generate`
    does (that the two then sample the same tokens is `test_rollout_decode.py::test_rollouts_of_each_family_equal_generate`, which
    `make test-compat` runs at transformers 4.56 and 5.x)."""
    from transformers import GenerationConfig

    from trl.trainer.fast_paths.rollout_decode import _SamplingProcessors

    config = GenerationConfig(repetition_penalty=1e6, do_sample=False, pad_token_id=0, max_new_tokens=1)
    sequences = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])
    mask = (sequences != 0).long()
    mask[1] = 1
    processors = _SamplingProcessors(config, sequences, mask, vocab_size=16)
    scores = processors(torch.ones(2, 16))
    skips = _compat.repetition_penalty_skips_prompt_padding()
    assert bool(scores[0, 0] == 1.0) == skips  # the pad id: only in row 0's padding
    assert scores[0, 7] < 1.0 and scores[1, 5] < 1.0  # real prompt tokens are always penalized


def test_pil_image_processor_on_either_naming():
    processor = _compat.pil_image_processor("llava", "Llava")
    assert processor.__name__ in ("LlavaImageProcessorPil", "LlavaImageProcessor")
    assert "Fast" not in processor.__name__


def test_rollout_decode_steps_aside_when_the_model_takes_no_cache_and_the_run_is_unchanged(
    tmp_path, model_path, prompts, monkeypatch
):
    """The decode loop needs a forward that takes a KV cache; without that capability generation goes through
    `generate` and the completions, rewards and losses are the same."""
    make_args = args_builder(GRPOConfig, **GROUP_ARGS)
    dataset = prompts.select(range(4))
    decode_calls = []
    original = rollout_decode.decode_rollouts
    monkeypatch.setattr(
        "trl.trainer.online_generation.decode_rollouts",
        lambda *args, **kwargs: decode_calls.append(1) or original(*args, **kwargs),
    )
    fast = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=make_args(tmp_path / "a"), train_dataset=dataset)
    fast.train()
    assert decode_calls, "the decode loop should run when the capability is there"

    decode_calls.clear()
    monkeypatch.setattr(rollout_decode, "accepts_cache", lambda model: False)
    plain = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=make_args(tmp_path / "b"), train_dataset=dataset)
    assert "cache" in rollout_decode.rollout_decode_fallback_reason(plain.model, plain.generation_config)
    plain.train()
    assert not decode_calls
    keys = ("loss", "reward", "completions/mean_length", "num_tokens")
    assert [[log[k] for k in keys] for log in train_logs(plain)] == [
        [log[k] for k in keys] for log in train_logs(fast)
    ]


def test_mixed_precision_left_by_an_earlier_accelerator_is_never_silent(tmp_path, model_path):
    """accelerate keeps the first Accelerator's mixed precision for the process; transformers 5 gives a later trainer
    the precision its config asks for, and where the installed versions do not, the trainer warns."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from datasets import Dataset

    from trl import SFTConfig, SFTTrainer

    AcceleratorState._reset_state()  # an earlier test's trainer may have set it up already
    Accelerator(mixed_precision="bf16", cpu=True)
    args = SFTConfig(str(tmp_path), bf16=False, use_cpu=True, max_steps=1, report_to="none", save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SFTTrainer(model_path, args=args, train_dataset=Dataset.from_dict({"text": ["a b c"] * 4}))
    in_force = [str(w.message) for w in caught if "is in force" in str(w.message)]
    assert trainer.accelerator.mixed_precision == "no" or in_force, trainer.accelerator.mixed_precision


def test_tools_without_a_response_parser_fail_before_training(tmp_path, model_path, prompts, monkeypatch):
    """Before transformers 5 there is no `tokenizer.parse_response`: tool calls could never be read from the
    completions, so the trainer refuses tools at construction instead of training without ever calling them."""
    from trl.trainer import tool_calling

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    monkeypatch.setattr(tool_calling, "response_content_parsers", lambda: frozenset())
    with pytest.raises(ImportError, match=r"response parser.*transformers>=5"):
        GRPOTrainer(
            model_path,
            reward_funcs=low_id_reward,
            args=args_builder(GRPOConfig, **GROUP_ARGS)(tmp_path),
            train_dataset=prompts,
            tools=[multiply],
        )


def test_saved_weight_renamer_applies_a_4x_conversion_mapping(monkeypatch):
    try:  # transformers 5; 4.x has no weight conversions to revert and takes this branch anyway
        import transformers.core_model_loading as core_model_loading

        monkeypatch.delattr(core_model_loading, "revert_weight_conversion", raising=False)
    except ImportError:
        pass
    model = torch.nn.Module()
    model._checkpoint_conversion_mapping = {
        "^language_model.model": "model.language_model",
        "^language_model.lm_head": "lm_head",
    }
    rename = _compat.saved_weight_renamer(model)
    assert (
        rename("language_model.model.layers.0.mlp.up_proj.weight")
        == "model.language_model.layers.0.mlp.up_proj.weight"
    )
    assert rename("language_model.lm_head.weight") == "lm_head.weight"
    assert rename("vision_tower.weight") == "vision_tower.weight"
    model._checkpoint_conversion_mapping = {}
    assert _compat.saved_weight_renamer(model) is None


def test_text_only_chat_on_a_processor_that_cannot_tokenize_string_content(monkeypatch):
    from transformers import AutoProcessor

    from trl.assets import get_model_path

    processor = AutoProcessor.from_pretrained(get_model_path("tiny-LlavaForConditionalGeneration"))
    messages = [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": "Blue."}]
    native, native_kwargs = _compat.processor_chat_template_target(processor, messages)
    # List content always goes to the processor.
    listed = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _compat.processor_chat_template_target(processor, listed) == (processor, {})
    monkeypatch.setitem(_compat._STRING_CONTENT_SUPPORT, type(processor), False)
    target, kwargs = _compat.processor_chat_template_target(processor, messages)
    assert target is processor.tokenizer and kwargs == {"chat_template": processor.chat_template}
    ids = target.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    if native is processor:  # this transformers tokenizes string content itself: the detour gives the same ids
        expected = native.apply_chat_template(messages, tokenize=True, return_dict=True, **native_kwargs)["input_ids"]
        expected = expected[0] if expected and isinstance(expected[0], list) else expected
        assert list(ids) == list(expected)


def test_label_smoothed_loss_on_either_smoother_signature():
    """The smoother is called as `Trainer.compute_loss` calls it: with `num_items_in_batch` where it takes it."""
    from trl._compat import label_smoothed_loss

    calls = []

    class Recent:
        def __call__(self, outputs, labels, shift_labels=False, num_items_in_batch=None):
            calls.append(num_items_in_batch)
            return 1.0

    class Older:
        def __call__(self, outputs, labels, shift_labels=False):
            calls.append("older")
            return 2.0

    assert label_smoothed_loss(Recent(), None, None, True, num_items_in_batch=7) == 1.0
    assert label_smoothed_loss(Older(), None, None, True, num_items_in_batch=7) == 2.0
    assert calls == [7, "older"]
