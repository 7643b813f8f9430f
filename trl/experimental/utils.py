"""Helpers used by the experimental trainers: reference models, PEFT preparation, padding/truncation of token tensors
and reward-model scoring."""

import gc
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..data_utils import truncate_dataset
from ..models.utils import LAYER_PATTERNS, _create_reference_model
from ..trainer.utils import peft_module_casting_to_bf16, prepare_peft_model
from ._chatml_collator import DataCollatorForChatML


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """Create a frozen copy of `model`, in eval mode, to serve as a reference model.

    With `num_shared_layers`, every parameter before layer `num_shared_layers` (embeddings and the first layers) is
    shared with `model`: the reference points at the very same tensors, which are frozen in both models. The
    remaining parameters are copied and frozen in the reference only. The layer is located with `pattern` (a string
    with a `{layer}` placeholder) or the first of `LAYER_PATTERNS` present in the model.

    Args:
        model: Model to copy.
        num_shared_layers: Number of leading layers to share; None copies everything.
        pattern: Layer-name pattern, e.g. `"model.layers.{layer}"`.

    Returns:
        The reference model.

    Raises:
        ValueError: Under DeepSpeed ZeRO-3, or when the layer cannot be found.
    """
    return _create_reference_model(model, num_shared_layers=num_shared_layers, pattern=pattern)


def pad_to_length(tensor: torch.Tensor, length: int, pad_value: int | float, dim: int = -1) -> torch.Tensor:
    """Pad `tensor` with `pad_value` at the end of dimension `dim` up to `length` (longer tensors are returned as is).

    Example:
        >>> pad_to_length(torch.tensor([[1, 2]]), 4, pad_value=0)
        tensor([[1, 2, 0, 0]])
    """
    current = tensor.size(dim)
    if current >= length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length - current
    padding = torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, padding], dim=dim)


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Index of the first True along the last dimension of `bools`, or its length for rows without any True.

    Example:
        >>> first_true_indices(torch.tensor([[False, True, True], [False, False, False]]))
        tensor([1, 3])
    """
    length = bools.size(-1)
    positions = torch.arange(length, dtype=dtype, device=bools.device)
    # False entries are pushed to `length + position` so that the minimum picks the first True.
    candidates = positions + length * (~bools).to(dtype)
    return torch.min(candidates, dim=-1).values


def truncate_right(
    input_ids: torch.Tensor, stop_token_ids: int | list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut every sequence after its first stop token (which is kept) and pad the rest.

    Args:
        input_ids: Tensor of shape `(batch, length)`.
        stop_token_ids: Stop token id (or several).
        pad_token_id: Id written after the stop token.

    Returns:
        `(truncated_ids, attention_mask)`, the mask being 1 up to and including the stop token.

    Example:
        >>> truncate_right(torch.tensor([[5, 2, 7, 8]]), stop_token_ids=2, pad_token_id=0)
        (tensor([[5, 2, 0, 0]]), tensor([[1, 1, 0, 0]]))
    """
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    stops = torch.tensor(stop_token_ids, device=input_ids.device)
    is_stop = torch.isin(input_ids, stops)
    first_stop = first_true_indices(is_stop).unsqueeze(-1)
    positions = torch.arange(input_ids.size(-1), device=input_ids.device).unsqueeze(0)
    after = positions > first_stop
    truncated = input_ids.masked_fill(after, pad_token_id)
    return truncated, (~after).long()


def get_reward(
    model: nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score query+response sequences with a sequence-classification reward model.

    Runs the backbone (`getattr(model, model.base_model_prefix)`) on the non-padded tokens, applies `model.score`
    to every position and reads the score at the last non-pad token of each response.

    Args:
        model: Reward model with a `score` head (e.g. `AutoModelForSequenceClassification`).
        query_responses: Tensor `(batch, length)` of query tokens followed by response tokens, right-padded.
        pad_token_id: Padding id.
        context_length: Length of the query part.

    Returns:
        `(reward_logits, final_scores, sequence_lengths)`: scores at every position `(batch, length, num_labels)`,
        the score of each sequence `(batch,)` (or `(batch, num_labels)`), and the index of its last response token.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(dim=1) - attention_mask.long()
    backbone = getattr(model, model.base_model_prefix)
    input_ids = query_responses.masked_fill(~attention_mask, 0)
    embeddings = backbone.get_input_embeddings() if hasattr(backbone, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and input_ids.numel() and int(input_ids.max()) >= rows:
        raise ValueError(
            f"Token id {int(input_ids.max())} is out of range for {type(model).__name__}, which embeds {rows} ids: the "
            "reward/value model must use the policy's tokenizer (no mapping between vocabularies is done)."
        )
    output = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
        use_cache=False,
    )
    reward_logits = model.score(output.hidden_states[-1])
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    batch = torch.arange(reward_logits.size(0), device=reward_logits.device)
    return reward_logits, reward_logits[batch, sequence_lengths].squeeze(-1), sequence_lengths


def add_bos_token_if_needed(
    bos_token_id: int | None,
    prompt_len_input_ids: int,
    prompt_tokens: dict[str, list[int]],
    chosen_prompt_len_input_ids: int,
    chosen_tokens: dict[str, list[int]],
    rejected_prompt_len_input_ids: int,
    rejected_tokens: dict[str, list[int]],
) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
    """Prepend the BOS token to the `prompt_input_ids` (and mask) of the three token dicts when missing.

    Returns:
        `(prompt_tokens, chosen_tokens, rejected_tokens)`, modified in place.
    """
    if bos_token_id is None:
        return prompt_tokens, chosen_tokens, rejected_tokens
    for length, tokens in (
        (prompt_len_input_ids, prompt_tokens),
        (chosen_prompt_len_input_ids, chosen_tokens),
        (rejected_prompt_len_input_ids, rejected_tokens),
    ):
        if length == 0 or tokens["prompt_input_ids"][0] != bos_token_id:
            tokens["prompt_input_ids"] = [bos_token_id] + list(tokens["prompt_input_ids"])
            tokens["prompt_attention_mask"] = [1] + list(tokens["prompt_attention_mask"])
    return prompt_tokens, chosen_tokens, rejected_tokens


def add_eos_token_if_needed(
    eos_token_id: int, chosen_tokens: dict[str, list[int]], rejected_tokens: dict[str, list[int]]
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Append the EOS token to the `input_ids` (and mask) of the chosen and rejected token dicts when missing.

    Returns:
        `(chosen_tokens, rejected_tokens)`, modified in place.
    """
    for tokens in (chosen_tokens, rejected_tokens):
        ids = tokens["input_ids"]
        if len(ids) == 0 or ids[-1] != eos_token_id:
            tokens["input_ids"] = list(ids) + [eos_token_id]
            tokens["attention_mask"] = list(tokens["attention_mask"]) + [1]
    return chosen_tokens, rejected_tokens


def empty_cache() -> None:
    """Run the garbage collector and release cached accelerator memory (CUDA, XPU, MPS, NPU when present)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.empty_cache()


__all__ = [
    "LAYER_PATTERNS",
    "DataCollatorForChatML",
    "add_bos_token_if_needed",
    "add_eos_token_if_needed",
    "create_reference_model",
    "empty_cache",
    "first_true_indices",
    "get_reward",
    "pad_to_length",
    "peft_module_casting_to_bf16",
    "prepare_peft_model",
    "truncate_dataset",
    "truncate_right",
]


def load_causal_lm(model: Any, args: Any, trainer_name: str, encoder_decoder: bool = False) -> nn.Module:
    """Load a string `model` with `AutoModelForCausalLM.from_pretrained(model, **args.model_init_kwargs)`.

    The loading of the experimental trainers (BCO, CPO, ORPO): no float32 default, a string `dtype` turned into
    the `torch.dtype` (`"auto"` kept); encoder-decoder checkpoints are loaded with `AutoModelForSeq2SeqLM` when
    `encoder_decoder` is True and refused otherwise. An instance is returned as is.
    """
    init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if not isinstance(model, str):
        if init_kwargs:
            warnings.warn(
                "args.model_init_kwargs is only used when `model` is a string; the model you passed is already "
                "instantiated, so these kwargs are ignored.",
                UserWarning,
                stacklevel=4,
            )
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    trust_remote_code = getattr(args, "trust_remote_code", False)
    config = AutoConfig.from_pretrained(
        model, revision=init_kwargs.get("revision"), trust_remote_code=trust_remote_code
    )
    loader = AutoModelForCausalLM
    if getattr(config, "is_encoder_decoder", False) and encoder_decoder:
        from transformers import AutoModelForSeq2SeqLM

        loader = AutoModelForSeq2SeqLM
    elif getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{trainer_name} trains decoder-only causal language models, but {model!r} is an encoder-decoder "
            f"model ({type(config).__name__}). Use a causal LM."
        )
    dtype = init_kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(
                f"model_init_kwargs['dtype']={dtype!r} is not a torch dtype; use e.g. 'bfloat16', 'float16', "
                "'float32' or 'auto'."
            )
        init_kwargs["dtype"] = getattr(torch, dtype)
    if trust_remote_code:
        init_kwargs.setdefault("trust_remote_code", True)
    return loader.from_pretrained(model, **init_kwargs)
