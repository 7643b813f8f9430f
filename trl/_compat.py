"""The one place where this package adapts to the installed transformers release.

The supported range (`pyproject.toml`: transformers 4.56.2 up to the newest 5.x) spans renamed arguments, moved
functions and classes that appeared on the way. Every call whose name, signature or behaviour changed across that
range goes through a helper here, and each helper decides by *capability* (is the attribute there, does the signature
take the argument), never by comparing version strings, so a patched or backported release takes the path its API
supports.

What differs across the range:

- The KV cache argument and output field: `past_key_values` up to transformers 5.23, `cache` from 5.24
  ([`CACHE_KEYWORD`], [`cache_keyword`], [`output_cache`]).
- The attention-function registry lookup: `ALL_ATTENTION_FUNCTIONS.get_interface` from 5.1, item access before
  ([`attention_interface`]).
- Checkpoint rotation: `transformers.trainer_utils.rotate_checkpoints` from 5.2, `Trainer._rotate_checkpoints`
  before ([`rotate_checkpoints`]).
- Gradient checkpointing: `activation_checkpointing_enable` / `is_activation_checkpointing` from 5.23,
  `gradient_checkpointing_*` before ([`enable_activation_checkpointing`], [`is_activation_checkpointing`]).
- The repetition penalty of `generate`: left padding excluded from 5.0, penalized before
  ([`repetition_penalty_skips_prompt_padding`]).
- Where a decoder layer is checkpointed: around `__call__` before 5.0, around the class's `forward` after
  ([`layer_call_is_checkpointed`]).
- A fast tokenizer's default inputs: `token_type_ids` too in 4.x ([`decoder_tokenizer_kwargs`]).
- A loss already scaled for gradient accumulation: `Trainer.loss_is_scaled_for_ga` from 5.0; 4.x divides it again
  unless `compute_loss_func` is set ([`trainer_divides_scaled_loss`]).
- Label smoothing normalized by the accumulated batch's target tokens: `LabelSmoother(..., num_items_in_batch=)` in
  recent 5.x releases, by the micro-batch's own before ([`label_smoothed_loss`]).
- A tokenizer's extra special tokens: `extra_special_tokens=[...]` in 5.x, `additional_special_tokens=[...]` in 4.x
  (where `extra_special_tokens` means a dict of named tokens) ([`extra_special_tokens_kwargs`]).
- The format of saved tokenizers and configs (5.x files do not load in 4.x) ([`saved_files_suffix`]).
- The content types of transformers' response parser (5.x; more in each release) ([`response_content_parsers`]).
- Image lists given to a processor: nested per text in 5.x, flat for some 4.x processors ([`process_images`]).
- Classes that only exist in newer releases: `ContinuousBatchingConfig` (5.4) and the PIL image processors (5.4;
  4.x names them without the suffix) ([`require_transformers_attribute`], [`pil_image_processor`]).
"""

import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast


# The keyword under which transformers' models, their decoder layers and `generate` take (and return) the KV cache.
CACHE_KEYWORD: str = (
    "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)
# Every name transformers has given that argument, newest first.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")


@functools.lru_cache(maxsize=256)
def _cache_keyword_of(function: Callable) -> str:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return CACHE_KEYWORD
    return next((name for name in CACHE_KEYWORDS if name in parameters), CACHE_KEYWORD)


def cache_keyword(module: Any) -> str:
    """The name of the KV-cache argument of `module`'s forward (a model, a decoder layer or an attention module).

    Read from the class's own `forward` signature, so remote-code models keep whichever name they were written with;
    a signature that names none of them gets the installed transformers' name ([`CACHE_KEYWORD`]).
    """
    forward = getattr(type(module), "forward", None)
    return CACHE_KEYWORD if forward is None else _cache_keyword_of(forward)


def accepts_cache(module: Any) -> bool:
    """Whether `module`'s forward takes a KV cache argument under any of the names transformers has used."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return False
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in CACHE_KEYWORDS)


def output_cache(output: Any) -> Any:
    """The KV cache a model returned (`output.cache` or `output.past_key_values`), or None."""
    for name in CACHE_KEYWORDS[:2]:
        value = getattr(output, name, None) if not isinstance(output, dict) else output.get(name)
        if value is not None:
            return value
    return None


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for calling `module` (its forward, or `generate` when `module` is a model) with a KV cache."""
    return {cache_keyword(module): cache}


def attention_interface(implementation: str, default: Callable) -> Callable:
    """The attention function registered for `implementation` (`config._attn_implementation`), or `default`.

    `default` is what the model's own code falls back to (its eager function); it is used for `"eager"` and for any
    implementation the registry does not hold, as the modeling code of every supported release does.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get_interface is not None:
        return get_interface(implementation, default)
    if implementation == "eager" or implementation not in ALL_ATTENTION_FUNCTIONS:
        return default
    return ALL_ATTENTION_FUNCTIONS[implementation]


def rotate_checkpoints(trainer: Any, output_dir: str) -> None:
    """Delete the oldest checkpoints in `output_dir` beyond `save_total_limit`, keeping the best one (by mtime).

    Uses transformers' module-level `rotate_checkpoints` where it exists, the trainer's own `_rotate_checkpoints`
    (the same rule, reading `args.save_total_limit` and `state.best_model_checkpoint`) otherwise.
    """
    from transformers import trainer_utils

    rotate = getattr(trainer_utils, "rotate_checkpoints", None)
    if rotate is not None:
        rotate(
            output_dir=output_dir,
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
    else:
        trainer._rotate_checkpoints(use_mtime=True, output_dir=output_dir)


def is_activation_checkpointing(model: Any) -> bool:
    """Whether `model` has gradient (activation) checkpointing on: `is_activation_checkpointing` from transformers 5.23,
    `is_gradient_checkpointing` before (a model without either reads as off)."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            value = getattr(model, attr)
        except Exception:  # a wrapper may raise from the property
            continue
        if isinstance(value, bool):
            return value
    return False


def enable_activation_checkpointing(model: Any, kwargs: dict | None = None) -> None:
    """Turn gradient (activation) checkpointing on, with `kwargs` for `torch.utils.checkpoint.checkpoint`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_activation_checkpointing(model: Any) -> None:
    """Turn gradient (activation) checkpointing off."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


@functools.lru_cache(maxsize=1)
def repetition_penalty_skips_prompt_padding() -> bool:
    """Whether `generate`'s repetition penalty leaves each row's left padding out (transformers 5; 4.x penalizes the
    pad id like any other token of the prompt).

    Probed once on transformers' own processor: per-row padding lengths are taken, and a token seen only in a row's
    padding keeps its score.
    """
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    input_ids = torch.tensor([[0, 5], [5, 5]])
    scores = torch.ones(2, 6)
    try:
        processor = RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([1, 0]))
        result = processor(input_ids, scores.clone())
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(result[0, 0] == 1.0 and result[0, 5] == 0.5 and result[1, 0] == 1.0)


def layer_call_is_checkpointed() -> bool:
    """Whether transformers checkpoints a decoder layer around its whole `__call__` (before 5.0).

    Then a forward replaced on the instance already runs inside the checkpoint. From 5.0 the class's own `forward`
    is wrapped instead, and a forward replaced on the instance must checkpoint itself.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in vars(GradientCheckpointingLayer)


def trainer_divides_scaled_loss(trainer: Any) -> bool:
    """Whether `Trainer.training_step` would divide by the accumulation steps a loss that `trainer` already scaled
    for gradient accumulation (`loss_is_scaled_for_ga = True`).

    transformers 5 reads `loss_is_scaled_for_ga`; 4.x does not know it and divides unless `compute_loss_func` is set.
    """
    from transformers import Trainer

    return bool(getattr(trainer, "loss_is_scaled_for_ga", None)) and not hasattr(Trainer, "loss_is_scaled_for_ga")


def trainer_clips_in_a_method() -> bool:
    """Whether transformers' training loop clips the gradients through `Trainer._clip_grad_norm` (transformers 5),
    which a trainer may take over; 4.x clips inline."""
    from transformers import Trainer

    return hasattr(Trainer, "_clip_grad_norm")


def label_smoothed_loss(
    smoother: Any, outputs: Any, labels: Any, shift_labels: bool, num_items_in_batch: Any = None
) -> Any:
    """transformers' `LabelSmoother` called as `Trainer.compute_loss` calls it: with `num_items_in_batch` where the
    smoother takes it (it then divides by that count), without it before (it divides by the batch's own count)."""
    if "num_items_in_batch" in inspect.signature(type(smoother).__call__).parameters:
        return smoother(outputs, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
    return smoother(outputs, labels, shift_labels=shift_labels)


def extra_special_tokens_kwargs(tokens: list[str]) -> dict[str, Any]:
    """Tokenizer constructor keywords that register `tokens` as additional special tokens.

    transformers 5 takes them as `extra_special_tokens=[...]`; 4.x takes `additional_special_tokens=[...]` and
    reserves `extra_special_tokens` for a dict of named tokens.
    """
    from transformers import PreTrainedTokenizerBase

    if "additional_special_tokens" in getattr(PreTrainedTokenizerBase, "SPECIAL_TOKENS_ATTRIBUTES", ()):
        return {"additional_special_tokens": list(tokens)}
    return {"extra_special_tokens": list(tokens)}


def decoder_tokenizer_kwargs() -> dict[str, Any]:
    """Constructor keywords giving a `PreTrainedTokenizerFast` a decoder-only model's inputs (no `token_type_ids`).

    transformers 5's fast tokenizer returns `input_ids` and `attention_mask` by default; 4.x's also returns
    `token_type_ids`, which causal language models (and `generate`) refuse.
    """
    from transformers import PreTrainedTokenizerFast

    if "token_type_ids" in PreTrainedTokenizerFast.model_input_names:
        return {"model_input_names": ["input_ids", "attention_mask"]}
    return {}


def process_images(processor: Any, images: list[list], **kwargs: Any) -> Any:
    """Call a multimodal `processor` with one list of images per text (`images[i]` for `kwargs["text"][i]`).

    transformers 5's image processors take that nested list; some of 4.x's PIL image processors (LLaVA's) take only
    a flat list, in text order, which they split by the image tokens of the texts themselves.
    """
    try:
        return processor(images=images, **kwargs)
    except ValueError as error:
        if "Invalid image type" not in str(error):
            raise
        return processor(images=[image for row in images for image in row], **kwargs)


def require_transformers_attribute(name: str, feature: str, since: str) -> Any:
    """`transformers.<name>`, or an ImportError saying which `feature` needs it and from which release.

    Args:
        name: Attribute of the top-level `transformers` module.
        feature: What the user asked for, in their words (e.g. `use_transformers_continuous_batching=True`).
        since: The first transformers release that has it.
    """
    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError) as error:
        raise ImportError(
            f"{feature} needs `transformers.{name}`, which transformers {transformers.__version__} does not have "
            f"(it was added in transformers {since}). Upgrade with `pip install 'transformers>={since}'`, or turn "
            "the option off."
        ) from error


def saved_files_suffix() -> str:
    """`""` where models and tokenizers are saved in transformers 5's format, `"-transformers4"` before.

    transformers 5 writes tokenizers as `TokenizersBackend` and model configs with `rope_parameters`, which 4.x
    cannot read back; files saved by one generation are kept apart from the other's (`trl.assets`' cache).
    """
    return "" if hasattr(transformers, "TokenizersBackend") else "-transformers4"


def response_content_parsers() -> frozenset[str]:
    """The content types (`"json"`, `"python-call-list"`, ...) the installed transformers' response parser knows.

    Response parsing (`tokenizer.parse_response`) appeared in transformers 5; each release adds content types (LFM2's
    `python-call-list` in 5.24). Empty when there is no response parser at all.
    """
    try:
        from transformers.utils.chat_parsing.content_parsers import CONTENT_PARSERS
    except ImportError:
        return frozenset()
    return frozenset(CONTENT_PARSERS)


# `require_transformers_attribute` arguments for transformers' continuous batching (`generate_batch`).
CONTINUOUS_BATCHING_REQUIREMENT = (
    "ContinuousBatchingConfig",
    "`use_transformers_continuous_batching=True`",
    "5.4.0",
)


def pil_image_processor(model_type: str, class_prefix: str) -> type:
    """The PIL-backed (slow) image processor class of a model family.

    transformers 5.4 names it `<Prefix>ImageProcessorPil` in `image_processing_pil_<model_type>`; earlier releases
    name the same processor `<Prefix>ImageProcessor` in `image_processing_<model_type>`.
    """
    models = f"transformers.models.{model_type}"
    try:
        module = importlib.import_module(f"{models}.image_processing_pil_{model_type}")
        return getattr(module, f"{class_prefix}ImageProcessorPil")
    except (ImportError, AttributeError):
        module = importlib.import_module(f"{models}.image_processing_{model_type}")
        return getattr(module, f"{class_prefix}ImageProcessor")


def _has_string_content(messages: list[dict]) -> bool:
    return any(isinstance(message.get("content"), str) for message in messages)


_TEXT_CONTENT_PROBE = [{"role": "user", "content": "probe"}]


_STRING_CONTENT_SUPPORT: dict[type, bool] = {}


def _processor_tokenizes_string_content(processor: Any) -> bool:
    # transformers < 5 collects a message's images by iterating its content, so string content fails once
    # `tokenize=True`; 5.x renders it as the template sees it. Probed once per class with a template that only
    # echoes the content.
    if type(processor) not in _STRING_CONTENT_SUPPORT:
        try:
            processor.apply_chat_template(
                _TEXT_CONTENT_PROBE, tokenize=True, return_dict=True, chat_template="{{ messages[0]['content'] }}"
            )
            _STRING_CONTENT_SUPPORT[type(processor)] = True
        except (TypeError, KeyError, AttributeError):
            _STRING_CONTENT_SUPPORT[type(processor)] = False
    return _STRING_CONTENT_SUPPORT[type(processor)]


def processor_chat_template_target(processing_class: Any, messages: list[dict]) -> tuple[Any, dict[str, Any]]:
    """Who tokenizes `messages` with the chat template, and the extra keywords it needs.

    A processor tokenizes its own conversations, except text-only ones (string content) on releases whose processors
    cannot (transformers < 5): those go to the processor's tokenizer with the processor's chat template, which renders
    the same text.
    """
    tokenizer = getattr(processing_class, "tokenizer", None)
    if tokenizer is None or tokenizer is processing_class or not _has_string_content(messages):
        return processing_class, {}
    if _processor_tokenizes_string_content(processing_class):
        return processing_class, {}
    return tokenizer, {"chat_template": processing_class.chat_template}


def saved_weight_renamer(model: Any) -> Callable[[str], str] | None:
    """Maps a weight name `save_pretrained` wrote back to `model`'s own name; None when no weight is renamed.

    Models with a conversion mapping (vision-language models) are saved under their original checkpoint names.
    transformers 5 reverts its weight conversions (`revert_weight_conversion`), matched here by tensor identity so
    that pure renames are undone exactly; 4.x rewrites names with the model's `_checkpoint_conversion_mapping`
    (saved-name regex to model name, the first matching pattern wins), which is applied here as `from_pretrained`
    applies it.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
        if not mapping:
            return None

        def model_name_of(saved_name: str) -> str:
            for pattern, replacement in mapping.items():
                renamed, count = re.subn(pattern, replacement, saved_name)
                if count:
                    return renamed
            return saved_name

        return model_name_of
    current = dict(model.state_dict())
    saved = revert_weight_conversion(model, dict(current))
    name_of = {id(tensor): name for name, tensor in current.items()}
    renames = {
        saved_name: name_of[id(t)] for saved_name, t in saved.items() if name_of.get(id(t), saved_name) != saved_name
    }
    return (lambda saved_name: renames.get(saved_name, saved_name)) if renames else None
