"""A decode loop for rollouts that reproduces `model.generate` token for token, with less work per token.

`decode_rollouts` is what the online trainers run instead of transformers `generate` when
`rollout_decode_fallback_reason` finds nothing it cannot reproduce. It makes the same model calls as `generate` (same
inputs, positions, masks and cache contents, so bitwise the same logits), applies the same sampling processors in the
same order as tensor ops, and draws the whole batch's tokens at once per step as `torch.multinomial` does (finished
rows stay in the batch, as in `generate`, so the random stream is consumed identically). What it saves:

- the KV cache is preallocated once for the whole rollout instead of growing by concatenation at every token;
- no per-token bookkeeping of `generate` (logits-processor and stopping-criteria objects, model-input preparation,
  growing position ids);
- each distinct prompt is prefilled once and its cache shared by the rows of its group (as `generate` is given it by
  `generate_with_shared_prompts`).
- on the CPU, the draw itself takes half of `torch.multinomial`'s time (see [`sample_next_tokens`]);
- on the CPU in float32, the linear layers of a step with 2 to 4 rows in flight (8 at the LM head) compute `W @ xᵀ`,
  2 to 5 times faster there than `x @ Wᵀ` ([`small_row_linear`]); their logits equal `generate`'s to float rounding
  instead of bit for bit (`TRL_SMALL_ROW_LINEAR=0` restores the latter).

Anything else (beam search, other processors, stop strings, encoder-decoders, models with their own input preparation
or cache, extra `generate` arguments, ...) is reported by `rollout_decode_fallback_reason`, and the caller uses
`generate`.
"""

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers.cache_utils import DynamicLayer

from ..._compat import accepts_cache, cache_kwargs, repetition_penalty_skips_prompt_padding
from ..utils.distributed import parameters_sharded
from ..utils.forward_randomness import forward_is_deterministic
from ..utils.logprobs import model_accepts_argument
from .small_row_linear import small_row_linear


# Generation settings the loop reproduces; every other setting must keep its neutral value (see `_neutral_settings`).
_HANDLED_SETTINGS = frozenset(
    {
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "max_new_tokens",
        "max_length",  # derived from `max_new_tokens`, which is required
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",  # only used by `generate` without prompt ids
        "decoder_start_token_id",  # encoder-decoders, which are refused
        "use_cache",  # must be True, checked below
        "cache_implementation",  # None or "dynamic", checked below
        "disable_compile",  # the loop never compiles
        "compile_config",
        "transformers_version",
        "_from_model_config",
        # Settings that only beam search / assisted decoding read; both are refused through `num_beams` and the
        # assistant settings keeping their neutral values.
        "early_stopping",
        "length_penalty",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
    }
)

# Extra outputs `generate` returns only with `return_dict_in_generate`: off whether unset (None) or False, which
# `save_pretrained` writes into a model's `generation_config.json`.
_OFF_WHEN_FALSY = frozenset({"output_attentions", "output_hidden_states", "output_scores", "output_logits"})

# `generate` keyword arguments the loop accepts (anything else makes the caller use `generate`).
_ACCEPTED_GENERATE_KWARGS = frozenset({"disable_compile"})


@dataclass
class RolloutDecodeOutput:
    """Result of [`decode_rollouts`].

    Attributes:
        sequences: `(N, L + T)` prompt and completion ids, as `generate` returns them (rows that ended early are
            right-padded with the pad id).
        logps: `(N, T)` log-probabilities of the sampled tokens under the distribution they were drawn from (after
            the sampling processors; 0 after a row ended), or None when not asked for.
    """

    sequences: torch.Tensor
    logps: torch.Tensor | None = None


def _neutral_settings(model: nn.Module) -> dict[str, Any]:
    """Values of the generation settings under which they change nothing (the defaults `generate` fills in)."""
    from transformers import GenerationConfig

    neutral = GenerationConfig()
    defaults = getattr(getattr(model, "generation_config", None), "_get_default_generation_params", None)
    if defaults is not None:
        neutral.update(**defaults())
    return neutral.to_dict()


def _effective_generation_config(model: nn.Module, generation_config: Any) -> Any:
    """The settings `generate` would run with: the given ones, unset values filled from the model's own generation
    config and transformers' defaults."""
    effective, model_kwargs = model._prepare_generation_config(generation_config)
    if model_kwargs:
        raise ValueError(f"unexpected model arguments from the generation config: {sorted(model_kwargs)}")
    return effective


def decoding_model(model: nn.Module) -> nn.Module:
    """The model whose forward the loop calls to reproduce `model.generate`.

    A PEFT model whose adapters sit inside its transformers model's layers (LoRA and its kin) generates through that
    model: `PeftModel.generate` hands the call to it, and the loop does the same. Prompt learning (virtual tokens that
    `PeftModel` adds to the inputs) and aLoRA (offsets it computes per call) keep the PEFT model, which the loop
    declines."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is None or not callable(getattr(model, "get_base_model", None)):
        return model
    if peft_config.is_prompt_learning or getattr(peft_config, "alora_invocation_tokens", None):
        return model
    return model.get_base_model()


def rollout_decode_fallback_reason(
    model: nn.Module, generation_config: Any, generate_kwargs: dict[str, Any] | None = None
) -> str | None:
    """Why [`decode_rollouts`] cannot reproduce `model.generate` for these settings, or None when it can.

    This is the single place that decides between the rollout loop and `generate`: a model or a setting the loop does
    not know is a reason (never silently dropped).

    Args:
        model: The unwrapped causal LM.
        generation_config: The `GenerationConfig` given to `generate`.
        generate_kwargs: Other keyword arguments that would be given to `generate`.

    Returns:
        A short reason, or None.
    """
    from transformers import DynamicCache, GenerationMixin

    unknown = sorted(set(generate_kwargs or {}) - _ACCEPTED_GENERATE_KWARGS)
    if unknown:
        return f"generate arguments {unknown}"
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, GenerationMixin):
        return "not a transformers generative model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if parameters_sharded(model, across_ranks=True):
        # Every forward gathers parameters collectively, so all ranks must keep stepping until the last one is done
        # (generate's `synced_gpus`); the loop stops each rank on its own.
        return "parameters sharded across processes (DeepSpeed ZeRO-3 / FSDP)"
    if not forward_is_deterministic(model):
        return "the forward draws random numbers (dropout, NEFTune's noise), in other shapes than under generate"
    # Models that prepare their own inputs, caches or sampling steps (multimodal, recurrent, ...) go through generate.
    for hook in ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation", "_sample", "_prefill"):
        if getattr(type(model), hook, None) is not getattr(GenerationMixin, hook, None):
            return f"model overrides {hook}"
    if not model._supports_default_dynamic_cache():
        return "model does not use the default dynamic cache"
    parameters = inspect.signature(model.forward).parameters
    if not accepts_cache(model) or not {"position_ids", "logits_to_keep", "attention_mask"} <= set(parameters):
        return "model forward lacks cache / position_ids / logits_to_keep"
    if model.device.type != "cpu" and "grouped_mm" in str(getattr(model, "get_experts_implementation", dict)()):
        return "mixture-of-experts implementation switched by generate off CPU"
    try:
        effective = _effective_generation_config(model, generation_config)
    except (AttributeError, TypeError, ValueError) as error:
        return f"generation config not understood ({error})"
    neutral = _neutral_settings(model)
    for key, value in effective.to_dict().items():
        if key in _OFF_WHEN_FALSY and not value:
            continue
        if key not in _HANDLED_SETTINGS and value != neutral.get(key):
            return f"generation setting {key}={value!r}"
    if effective.max_new_tokens is None or effective.max_new_tokens < 1:
        return "max_new_tokens not set"
    if effective.pad_token_id is None:
        return "no pad token id"
    if effective.use_cache is not True:
        return "use_cache=False"
    if effective.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={effective.cache_implementation!r}"
    if not isinstance(effective.repetition_penalty, float) or effective.repetition_penalty <= 0:
        return "repetition_penalty is not a positive float"
    if effective.do_sample:
        if effective.temperature is not None and not effective.temperature > 0:
            return "temperature is not positive"
        if effective.top_k is not None and (not isinstance(effective.top_k, int) or effective.top_k < 0):
            return "top_k is not a non-negative integer"
        if effective.top_p is not None and not 0 <= effective.top_p <= 1:
            return "top_p outside [0, 1]"
        if effective.min_p is not None and not 0 <= effective.min_p <= 1:
            return "min_p outside [0, 1]"
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers):
        return "cache layers other than plain dynamic ones (sliding window, linear attention, ...)"
    return None


class _PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers sized for the whole rollout.

    The cache contents handed to attention are views of the filled part, the same shape and values `DynamicLayer`
    returns, so the model computes the same numbers without a concatenation per token.
    """

    def adopt(self, layer: Any, capacity: int) -> None:
        keys, values = layer.keys, layer.values
        length = keys.shape[-2]
        self._key_buffer = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self._value_buffer = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        self._key_buffer[..., :length, :].copy_(keys)
        self._value_buffer[..., :length, :].copy_(values)
        self._length = length
        self.device = keys.device
        self.is_initialized = True
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:  # never in `decode_rollouts`; kept correct regardless
            return super().update(key_states, value_states, *args, **kwargs)
        self._key_buffer[..., start:end, :].copy_(key_states)
        self._value_buffer[..., start:end, :].copy_(value_states)
        self._length = end
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values


def _preallocate(cache: Any, capacity: int) -> None:
    """Swap every filled layer of a `DynamicCache` for a preallocated one holding the same keys and values."""
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            new_layer = _PreallocatedLayer()
            new_layer.adopt(layer, capacity)
            cache.layers[i] = new_layer


class _SamplingProcessors:
    """`generate`'s logits processors for the handled settings, as tensor ops, in `generate`'s order: repetition
    penalty, then (sampling only) temperature, top-k, top-p, min-p. Each step's result equals transformers' own
    processors bitwise (same operations on the same values)."""

    def __init__(self, config: Any, sequences: torch.Tensor, prompt_mask: torch.Tensor | None, vocab_size: int):
        self.penalty = config.repetition_penalty if config.repetition_penalty != 1.0 else None
        sampling = bool(config.do_sample)
        self.temperature = config.temperature if sampling and config.temperature not in (None, 1.0) else None
        self.top_k = min(max(config.top_k, 1), vocab_size) if sampling and config.top_k else None
        self.top_p = config.top_p if sampling and config.top_p is not None and config.top_p < 1.0 else None
        self.min_p = config.min_p if sampling and config.min_p is not None else None
        self.seen = None
        if self.penalty is not None:
            # Tokens already in each row, its left padding excluded where `generate` does so (transformers 5).
            ids = sequences
            if prompt_mask is not None and repetition_penalty_skips_prompt_padding():
                padding = (prompt_mask != 0).int().argmax(dim=1)
                positions = torch.arange(ids.shape[1], device=ids.device)
                ids = ids.masked_fill(positions[None, :] < padding[:, None], vocab_size)
            self.seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
            self.seen.scatter_(1, ids.clamp(max=vocab_size), True)

    def add_tokens(self, tokens: torch.Tensor) -> None:
        if self.seen is not None:
            self.seen.scatter_(1, tokens.clamp(max=self.seen.shape[1] - 1)[:, None], True)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.penalty is not None:
            seen = self.seen[:, : scores.shape[-1]]
            penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
            scores = torch.where(seen, penalized, scores)
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.top_k is not None:
            kth = torch.topk(scores, self.top_k)[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p is not None:
            sorted_scores, order = torch.sort(scores, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= (1 - self.top_p)
            drop_sorted[..., -1:] = 0  # the most likely token always stays
            scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), -float("inf"))
        if self.min_p is not None:
            probs = torch.softmax(scores, dim=-1)
            drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
            scores = scores.masked_fill(drop, -float("inf"))
        return scores


_CPU_DRAW_MATCHES_MULTINOMIAL: bool | None = None


def _cpu_draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of float32 CPU probabilities, drawn as `torch.multinomial(probs, 1)` draws it.

    For one sample, `torch.multinomial` takes the argmax of `probs / q` with `q` from `exponential_`, which turns one
    float64 uniform per element into `-log1p(-u)` one element at a time (~20 ns each). The same uniforms from
    `uniform_` and a vectorized `log1p` give the same float32 variates in half the time.
    """
    noise = _exponential_variates(probs.shape, generator)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)


def _exponential_variates(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Float32 CPU `exponential_` variates as `-log1p(-u)` of float64 uniforms, vectorized."""
    uniform = torch.empty(shape, dtype=torch.float64).uniform_(generator=generator)
    return torch.log1p(uniform.neg_()).neg_().to(torch.float32)


def _cpu_draw_matches_multinomial() -> bool:
    """Whether [`_cpu_draw`] reproduces this torch build's `torch.multinomial` (checked once per process: the same
    tokens from the same seed, and the generator left in the same state)."""
    global _CPU_DRAW_MATCHES_MULTINOMIAL
    if _CPU_DRAW_MATCHES_MULTINOMIAL is None:
        generator = torch.Generator().manual_seed(20261128)
        logits = torch.randn(16, 512, generator=generator) * 4
        logits[::2, 100:] = -math.inf
        probs = torch.softmax(logits, dim=-1)
        generator.manual_seed(7)
        expected = torch.cat([torch.multinomial(probs, 1, generator=generator).squeeze(1) for _ in range(4)])
        expected_state = generator.get_state()
        generator.manual_seed(7)
        drawn = torch.cat([_cpu_draw(probs, generator=generator) for _ in range(4)])
        same_draws = torch.equal(expected, drawn) and torch.equal(expected_state, generator.get_state())
        # The variates themselves, not only the tokens they pick.
        generator.manual_seed(11)
        variates = torch.empty(4096).exponential_(generator=generator)
        generator.manual_seed(11)
        same_variates = torch.equal(variates, _exponential_variates((4096,), generator))
        _CPU_DRAW_MATCHES_MULTINOMIAL = same_draws and same_variates
    return _CPU_DRAW_MATCHES_MULTINOMIAL


def sample_next_tokens(probs: torch.Tensor) -> torch.Tensor:
    """`torch.multinomial(probs, num_samples=1).squeeze(1)` (the default generator), faster for float32 CPU tensors.

    The same tokens from the same random stream, and the stream advanced alike, whenever this torch build's
    `torch.multinomial` proves reproducible by [`_cpu_draw`] (checked once); invalid probabilities and every other
    device or dtype go to `torch.multinomial` itself, with its errors.

    Args:
        probs: `(N, V)` probabilities, as `softmax` returns them.

    Returns:
        `(N,)` sampled token ids.
    """
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and probs.shape[-1] > 0:
        if bool((probs.max() < math.inf) & (probs.min() >= 0)) and _cpu_draw_matches_multinomial():
            return _cpu_draw(probs)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def shares_prompt_prefill(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_to_prompt: torch.Tensor) -> bool:
    """Whether prefilling each distinct prompt once applies: some prompt is repeated and every prompt has at least two
    tokens (all but the last are prefilled; the last is the first decoding step's input)."""
    return (
        prompt_ids.shape[1] >= 2
        and row_to_prompt.numel() > prompt_ids.shape[0]
        and int(prompt_mask.sum(dim=1).min()) >= 2
    )


def prefill_shared_prompts(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_to_prompt: torch.Tensor
) -> Any:
    """KV cache of every distinct prompt but its last token, computed once and copied to the rows sharing it.

    Positions are those `generate` uses for left-padded prompts (counted from the first real token), so continuing
    from this cache gives the same numbers as prefilling the repeated prompts.

    Args:
        model: The unwrapped causal LM.
        prompt_ids: `(U, L)` left-padded ids of the distinct prompts.
        prompt_mask: `(U, L)` attention mask.
        row_to_prompt: `(N,)` index of the prompt of each output row.

    Returns:
        A `DynamicCache` with `N` rows of `L - 1` positions.
    """
    from transformers import DynamicCache

    positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    # Only the cache is kept: the LM head need not run over the prompts.
    head_kwargs = {"logits_to_keep": 1} if model_accepts_argument(model, "logits_to_keep") else {}
    model(
        input_ids=prompt_ids[:, :-1],
        attention_mask=prompt_mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        **cache_kwargs(model, cache),
        **head_kwargs,
    )
    cache.batch_select_indices(row_to_prompt)
    return cache


@torch.no_grad()
def decode_rollouts(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_to_prompt: torch.Tensor,
    generation_config: Any,
    share_prompt_cache: bool = True,
    return_logps: bool = False,
) -> RolloutDecodeOutput:
    """Sample one completion per row, exactly as `generate` on the repeated prompts would, with less work per token.

    Call only when [`rollout_decode_fallback_reason`] returns None. With `share_prompt_cache`, every distinct prompt
    but its last token is prefilled once and its cache copied to the rows of its group (as in
    `generate_with_shared_prompts`); without, the first call runs the whole repeated prompts (as plain `generate`).

    Args:
        model: The unwrapped causal LM.
        prompt_ids: `(U, L)` left-padded ids of the distinct prompts.
        prompt_mask: `(U, L)` attention mask.
        row_to_prompt: `(N,)` index of the prompt of each output row.
        generation_config: The `GenerationConfig` `generate` would be given.
        share_prompt_cache: Prefill each distinct prompt once (when a prompt is repeated and has at least 2 tokens).
        return_logps: Also return the log-probabilities of the sampled tokens.

    Returns:
        A [`RolloutDecodeOutput`].
    """
    from transformers import DynamicCache

    config = _effective_generation_config(model, generation_config)
    sequences = prompt_ids[row_to_prompt]
    mask = prompt_mask[row_to_prompt]
    num_rows, prompt_length = sequences.shape
    max_new_tokens = config.max_new_tokens
    # As `generate`: positions counted from each row's first real token; an all-ones mask is not passed at all.
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    attention_mask = None if bool((mask == 1).all()) else mask
    eos = config.eos_token_id
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=sequences.device)
    pad_id = config.pad_token_id
    vocab_size = None

    first_input = 0
    if share_prompt_cache and shares_prompt_prefill(prompt_ids, prompt_mask, row_to_prompt):
        cache = prefill_shared_prompts(model, prompt_ids, prompt_mask, row_to_prompt)
        first_input = prompt_length - 1
    else:
        cache = DynamicCache(config=model.config)

    # Token buffer for the whole rollout; `sequences[:, :length]` is what `generate` holds at each step.
    tokens = torch.full((num_rows, prompt_length + max_new_tokens), pad_id, dtype=sequences.dtype)
    tokens = tokens.to(sequences.device)
    tokens[:, :prompt_length] = sequences
    full_mask = None
    if attention_mask is not None:
        full_mask = torch.ones((num_rows, prompt_length + max_new_tokens), dtype=mask.dtype, device=mask.device)
        full_mask[:, :prompt_length] = mask
    unfinished = torch.ones(num_rows, dtype=torch.long, device=sequences.device)
    logps = [] if return_logps else None
    processors = None
    step_ids = sequences[:, first_input:]
    step_positions = positions[:, first_input:]
    length = prompt_length
    capacity = prompt_length + max_new_tokens
    few_rows = small_row_linear(model)
    for step in range(max_new_tokens):
        with few_rows:  # one token per sequence after the prefill: a linear layer of a few rows
            step_logits = model(
                input_ids=step_ids,
                attention_mask=None if full_mask is None else full_mask[:, :length],
                position_ids=step_positions,
                use_cache=True,
                **cache_kwargs(model, cache),
                logits_to_keep=1,
                return_dict=True,
            ).logits
        logits = step_logits[:, -1].to(copy=True, dtype=torch.float32)
        del step_logits
        if step == 0:
            vocab_size = logits.shape[-1]
            processors = _SamplingProcessors(config, sequences, attention_mask, vocab_size)
            _preallocate(cache, capacity)
        scores = processors(logits)
        if config.do_sample:
            next_tokens = sample_next_tokens(nn.functional.softmax(scores, dim=-1))
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if eos_ids.numel():
            next_tokens = next_tokens * unfinished + pad_id * (1 - unfinished)
        if logps is not None:
            picked = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)
            logps.append(picked * unfinished)
        tokens[:, length] = next_tokens
        length += 1
        processors.add_tokens(next_tokens)
        if eos_ids.numel():
            unfinished = unfinished & ~torch.isin(next_tokens, eos_ids)
            if not bool(unfinished.any()):
                break
        step_ids = next_tokens[:, None]
        step_positions = step_positions[:, -1:] + 1
    logps_tensor = torch.stack(logps, dim=1) if logps is not None else None
    return RolloutDecodeOutput(sequences=tokens[:, :length], logps=logps_tensor)
