"""Generation for the online RL trainers: prompts to completion token ids, through one of four back-ends.

[`_OnlineGenerationMixin`] is inherited by `_OnlineTrainer` (see `online_base.py`). `_rollout(prompts)` produces a
round: TRL's hooks `_tokenize_prompts(prompts)` (chat template, per-row tools and template arguments, images) then
`_generate_single_turn(prompt_ids, images, multimodal_fields, ...)`, which samples one completion per row with

- vLLM when `use_vllm=True` (`_generate_with_vllm`, a server client or an in-process engine);
- transformers `generate` on the whole batch for prompts with images (`_generate_with_images`);
- transformers continuous batching when `use_transformers_continuous_batching=True`;
- otherwise transformers `generate`, prefilling each distinct prompt once ([`generate_with_shared_prompts`]), through
  the rollout decode loop (`fast_paths/rollout_decode.py`: the same tokens, less work per token) whenever
  `rollout_decode_fallback_reason` finds nothing it cannot reproduce.

A user `rollout_func(prompts, trainer)` replaces both hooks. `_rollout` is the method multi-turn rollouts (tool
calling, see `tool_calling.py`) override. The settings are read once at construction (`_eos_token_ids`,
`_build_generation_config`).
"""

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from .._compat import (
    CONTINUOUS_BATCHING_REQUIREMENT,
    cache_kwargs,
    process_images,
    require_transformers_attribute,
)
from ..data_utils import apply_chat_template, is_conversational
from ..models.utils import unwrap_model_for_generation
from .fast_paths.rollout_decode import (
    decode_rollouts,
    decoding_model,
    prefill_shared_prompts,
    rollout_decode_fallback_reason,
    shares_prompt_prefill,
)
from .fast_paths.small_row_linear import small_row_linear
from .online_math import completion_mask_from_ids
from .utils import pad
from .utils.forward_randomness import forward_is_deterministic
from .utils.packing import plain_sdpa_attention
from .utils.vision import vision_forward_inputs, vision_rows_from_batch


# ---------------------------------------------------------------------------------------------------------------------
# Generation with one prompt prefill per group
# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_with_shared_prompts(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_to_prompt: torch.Tensor,
    generation_config: GenerationConfig,
    share_prompt_cache: bool = True,
    rollout_decode: bool = False,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """Sample one completion per row, computing each distinct prompt's KV cache only once.

    `generate` on a batch where every prompt is repeated `G` times would run the prompt through the model `G` times.
    Here the unique prompts (all tokens but the last) are prefilled once, the cache rows are copied to the rows that
    share a prompt, and `generate` continues from that cache. The result is identical to calling `generate` on the
    repeated prompts (same positions, same masks), only the redundant prefill is skipped.

    Args:
        model: Unwrapped causal LM.
        prompt_ids: `(U, L)` left-padded ids of the distinct prompts.
        prompt_mask: `(U, L)` attention mask.
        row_to_prompt: `(N,)` index of the prompt of each output row.
        generation_config: Sampling settings (`max_new_tokens`, eos/pad ids, ...).
        share_prompt_cache: Prefill once per prompt. Falls back to plain `generate` when False, when a prompt has
            fewer than 2 tokens, when no prompt is repeated, with a non-default `cache_implementation`, or with beam
            search / `num_return_sequences > 1`.
        rollout_decode: Run the rollout decode loop (`fast_paths/rollout_decode.py`, the same tokens with less work per
            token) instead of `generate` when it supports the model and settings.
        **generate_kwargs: Extra arguments for `generate`.

    Returns:
        `(N, L + T)` prompt and completion ids (completions right-padded with the pad id).
    """
    decoder = decoding_model(model) if rollout_decode else None
    if decoder is not None and rollout_decode_fallback_reason(decoder, generation_config, generate_kwargs) is None:
        return decode_rollouts(
            decoder, prompt_ids, prompt_mask, row_to_prompt, generation_config, share_prompt_cache
        ).sequences
    share = (
        share_prompt_cache
        and shares_prompt_prefill(prompt_ids, prompt_mask, row_to_prompt)
        and getattr(generation_config, "cache_implementation", None) in (None, "dynamic")
        # Beam search and several sequences per row expand the batch inside `generate`: the prefilled cache rows
        # would no longer line up, so such settings generate plainly.
        and (getattr(generation_config, "num_beams", None) or 1) == 1
        and (getattr(generation_config, "num_return_sequences", None) or 1) == 1
        and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        # A forward that draws random numbers (NEFTune's noise, dropout) sees the repeated prompts, as under `generate`.
        and forward_is_deterministic(model)
    )
    if share:
        generate_kwargs.update(
            cache_kwargs(model, prefill_shared_prompts(model, prompt_ids, prompt_mask, row_to_prompt))
        )
    ids = prompt_ids[row_to_prompt]
    mask = prompt_mask[row_to_prompt]
    with small_row_linear(model):
        return model.generate(
            input_ids=ids, attention_mask=mask, generation_config=generation_config, **generate_kwargs
        )


@contextlib.contextmanager
def _router_logits_off(model: nn.Module):
    """Mixture-of-experts models: no router logits / load-balancing loss while generating (they are not trained on
    there, and the loss computation does not support cached decoding)."""
    config = getattr(model, "config", None)
    enabled = bool(getattr(config, "output_router_logits", False))
    if enabled:
        config.output_router_logits = False
    try:
        yield
    finally:
        if enabled:
            config.output_router_logits = True


# ---------------------------------------------------------------------------------------------------------------------
# The generation back-ends of the trainer
# ---------------------------------------------------------------------------------------------------------------------
class _OnlineGenerationMixin:
    """Prompt rendering and the generation back-ends of [`_OnlineTrainer`] (not usable on its own).

    Reads from the trainer: `args`, `processing_class`, `model`, `model_wrapped`, `accelerator`, `state`,
    `rollout_func`, `vllm_generation`, `chat_template_kwargs`, `max_completion_length`, `eos_token_ids`,
    `pad_token_id`, `generation_config` and `_timing`.
    """

    # Prefill each distinct prompt once and share its KV cache across its group (see generate_with_shared_prompts).
    _share_prompt_cache = True
    # Decode with the rollout loop (same tokens as `generate`, less work per token) when it supports the settings.
    _use_rollout_decode = True
    # Rows (dataset examples) of the round being generated, set by the caller of `_rollout`: their `tools` and
    # `chat_template_kwargs` columns shape each rendered prompt (see `_prompt_rows_of`).
    _prompt_rows: list[dict[str, Any]] | None = None
    # The vLLM back-end (None without `use_vllm`) and the image token suppressed in generation (None for text).
    vllm_generation = None
    _image_token_id: int | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @property
    def _last_loaded_step(self) -> Any:
        """TRL's attribute (with vLLM only): the training step whose weights vLLM holds. A plugin that pushes the
        weights itself (`vllm_generation.sync_weights()`) sets it, and generation then skips its own push."""
        if self.vllm_generation is None:
            raise AttributeError("_last_loaded_step exists only with use_vllm=True")
        return self.vllm_generation._synced_version

    @_last_loaded_step.setter
    def _last_loaded_step(self, step: Any) -> None:
        if self.vllm_generation is None:
            raise AttributeError("_last_loaded_step exists only with use_vllm=True")
        self.vllm_generation._synced_version = step

    def _check_generation_backend(self, args: Any, rollout_func: Callable | None) -> None:
        if args.use_vllm and rollout_func is None:
            from ..import_utils import is_vllm_available

            if not is_vllm_available():
                raise ImportError(
                    "vLLM is not available and `use_vllm` is set to True. Please install vLLM with `pip install "
                    "trl[vllm]` to use it. Alternatively, set use_vllm=False to generate with transformers."
                )

    @staticmethod
    def _eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        ids = []
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        generation_config = getattr(model, "generation_config", None)
        extra = getattr(generation_config, "eos_token_id", None)
        if extra is not None:
            ids.extend([extra] if isinstance(extra, int) else list(extra))
        return list(dict.fromkeys(ids))

    def _build_generation_config(self, args: Any, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        kwargs = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "cache_implementation": args.cache_implementation,
        }
        image_token_id = self._image_token_id
        if image_token_id is not None:
            # A sampled image token would have no image features behind it in the training forward (as TRL does).
            kwargs["suppress_tokens"] = [image_token_id]
        kwargs.update(args.generation_kwargs or {})
        return GenerationConfig(**kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Prompts and generation back-ends
    # ------------------------------------------------------------------------------------------------------------
    def _render_prompts(self, inputs: list[dict[str, Any]]) -> tuple[list[str], bool]:
        """Prompt texts (chat template applied to conversational prompts) and whether the data is conversational."""
        conversational = is_conversational({"prompt": inputs[0]["prompt"]})
        if not conversational:
            return [example["prompt"] for example in inputs], False
        texts = []
        for example in inputs:
            row = {"prompt": example["prompt"]}
            if example.get("tools") is not None:
                row["tools"] = example["tools"]
            template_kwargs = {**self.chat_template_kwargs, **(example.get("chat_template_kwargs") or {})}
            texts.append(apply_chat_template(row, self.processing_class, **template_kwargs)["prompt"])
        return texts, True

    def _prompt_rows_of(self, prompts: list[Any]) -> list[dict[str, Any]]:
        """The dataset rows of `prompts` (their per-row `tools` and `chat_template_kwargs` columns shape the rendered
        prompt), with each row's prompt replaced by the given one; bare rows when the prompts are not those of the
        round being generated."""
        rows = self._prompt_rows
        if rows is None or len(rows) != len(prompts):
            rows = [{} for _ in prompts]
        return [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)]

    def _tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], list | None, dict[str, Any]]:
        """TRL's hook: the prompts of a round as generation receives them.

        `prompts` holds one entry per completion (consecutive copies of a prompt form its group). Conversational
        prompts are rendered with the chat template (with the row's tools and template arguments), plain strings
        are tokenized as they are.

        Returns:
            `(prompt_ids, images, multimodal_fields)`: unpadded token ids per row; the images of each row, or None for
            text prompts; and the processor outputs other than ids and mask (pixel values, ...; `{}` for text).
        """
        rows = self._prompt_rows_of(prompts)
        if self._is_vision_dataset:
            texts, images, encoded, conversational = self._encode_image_prompts(rows)
            self._image_prompts = {"texts": texts, "conversational": conversational, "encoded": encoded}
            prompt_ids = [
                ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])
            ]
            return prompt_ids, images, vision_forward_inputs(encoded)
        texts, conversational = self._render_prompts(rows)
        unique_texts = list(dict.fromkeys(texts))
        encoded = self.processing_class(text=unique_texts, add_special_tokens=not conversational)["input_ids"]
        by_text = dict(zip(unique_texts, encoded))
        return [list(by_text[text]) for text in texts], None, {}

    def _sample_completions(
        self, prompt_ids: list[list[int]], images: list | None, multimodal_fields: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion per row of `prompt_ids` from the configured back-end (what every trainer's
        `_generate_single_turn` runs): vLLM, transformers `generate` with images, continuous batching, or
        transformers `generate` prefilling each distinct prompt once. Returns the completion ids (cut after the first
        end-of-sequence token, included) and, from vLLM, the sampled tokens' log-probabilities (else None)."""
        start = time.perf_counter()
        try:
            if self.vllm_generation is not None:
                return self._generate_with_vllm(prompt_ids, images)
            if images is not None:
                return self._generate_with_images(prompt_ids, multimodal_fields), None
            return self._generate_text(prompt_ids), None
        finally:
            self._timing["generation"] += time.perf_counter() - start

    def _generate_text(self, row_ids: list[list[int]]) -> list[list[int]]:
        """transformers generation of text prompts: each distinct prompt is prefilled once, its rows share it."""
        unique = list(dict.fromkeys(tuple(ids) for ids in row_ids))
        position = {ids: i for i, ids in enumerate(unique)}
        encoded = [list(ids) for ids in unique]
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in encoded]
        prompt_ids = pad(prompt_tensors, padding_value=self.pad_token_id, padding_side="left")
        prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, padding_side="left")
        row_to_prompt = torch.tensor([position[tuple(ids)] for ids in row_ids], device=device)

        args = self.args
        was_training = self.model.training
        with self._policy_for_generation() as unwrapped:
            try:
                if getattr(args, "use_transformers_continuous_batching", False):
                    return self._generate_continuous_batching(unwrapped, [list(ids) for ids in row_ids])
                output = generate_with_shared_prompts(
                    unwrapped,
                    prompt_ids,
                    prompt_mask,
                    row_to_prompt,
                    self.generation_config,
                    share_prompt_cache=self._share_prompt_cache,
                    rollout_decode=self._use_rollout_decode,
                    disable_compile=True,
                )
            finally:
                self.model.train(was_training)  # some backends (continuous batching) switch to eval mode
        completion_ids = output[:, prompt_ids.shape[1] :]
        completion_mask, _ = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        return [ids[: int(n)].tolist() for ids, n in zip(completion_ids, completion_mask.sum(dim=1))]

    def _rollout(self, prompts: list[Any]) -> dict[str, Any]:
        """Produce the completions of one round (what TRL's `_generate` returns, as a dict).

        A `rollout_func` replaces the two hooks; otherwise `_tokenize_prompts` then `_generate_single_turn` (TRL's
        hooks, which a subclass may override). Multi-turn rollouts (tool calling) override this method.

        Returns a dict with `prompt_ids` and `completion_ids` (token id lists), `completions` (decoded: text, or an
        assistant message for conversational prompts), `sampling_logps` (the sampler's per-token log-probabilities
        when importance-sampling correction uses them, else None), `extra_fields` (rollout_func's extra keys, one
        value per row), `images` and, for image prompts, `vision_rows` (each row's image inputs for the forward).
        """
        if self.rollout_func is not None:
            rollout = self._generate_with_rollout_func(prompts)
        else:
            prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)
            extra = (self._group_size(),) if self._single_turn_takes_num_generations else ()
            completion_ids, logprobs = self._single_turn_result(
                self._generate_single_turn(prompt_ids, images, multimodal_fields, *extra)
            )
            rollout = {
                "prompt_ids": [list(ids) for ids in prompt_ids],
                "completion_ids": [list(ids) for ids in completion_ids],
                "sampling_logps": logprobs if self._uses_sampling_logps() else None,
                "extra_fields": {},
                "images": images,
            }
            image_prompts = self.__dict__.pop("_image_prompts", None)
            if images is not None and image_prompts is not None:
                rollout["vision_rows"] = vision_rows_from_batch(image_prompts["encoded"], [len(row) for row in images])
        rollout["completions"] = self._decode_completions(prompts, rollout["completion_ids"])
        return rollout

    # Whether this trainer's `_generate_single_turn` takes the group size (TRL's GRPO does, RLOO and distillation not).
    _single_turn_takes_num_generations = False

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        """TRL's hook: one completion per row of `prompt_ids` (unpadded token ids); returns the completion ids."""
        return self._sample_completions(prompt_ids, images, multimodal_fields)[0]

    @staticmethod
    def _single_turn_result(result: Any) -> tuple[list[list[int]], list[list[float]] | None]:
        """`(completion_ids, logprobs)` from what `_generate_single_turn` returned (GRPO's form is a pair, RLOO's
        and distillation's the ids alone)."""
        if isinstance(result, tuple) and len(result) == 2:
            return result[0], result[1]
        return result, None

    @contextlib.contextmanager
    def _policy_for_generation(self):
        """The policy ready for `generate`: unwrapped (DeepSpeed ZeRO-3 parameters gathered when asked), without
        gradients, MoE router logits off."""
        args = self.args
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            _router_logits_off(unwrapped),
        ):
            yield unwrapped

    def _encode_image_prompts(self, inputs: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], Any, bool]:
        """Prompt texts, images per row, the processor's left-padded batch (image tokens expanded, pixel values) and
        whether the data is conversational."""
        from .utils.vision import example_images

        texts, conversational = self._render_prompts(inputs)
        images = [example_images(example) for example in inputs]
        encoded = process_images(
            self.processing_class, images, text=texts, padding=True, padding_side="left", return_tensors="pt"
        )
        return texts, images, encoded, conversational

    def _generate_with_images(self, prompt_ids: list[list[int]], multimodal_fields: dict[str, Any]) -> list[list[int]]:
        """transformers generation from prompts with images: the prompts (image tokens already expanded by the
        processor, see `_tokenize_prompts`) are left-padded and `generate` runs on the whole batch with the pixel
        values."""
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompt_ids]
        input_ids = pad(prompt_tensors, padding_value=self.pad_token_id, padding_side="left")
        attention_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, padding_side="left")
        image_inputs = {key: value.to(device) for key, value in multimodal_fields.items()}
        with self._policy_for_generation() as unwrapped, small_row_linear(unwrapped):
            output = unwrapped.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self.generation_config,
                disable_compile=True,
                **image_inputs,
            )
        completion_ids = output[:, input_ids.shape[1] :]
        completion_mask, _ = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        return [ids[: int(n)].tolist() for ids, n in zip(completion_ids, completion_mask.sum(dim=1))]

    def _create_vllm_generation(self, args: Any, rollout_func: Callable | None) -> Any:
        """The vLLM back-end when `use_vllm=True` (and no `rollout_func` replaces generation), else None."""
        if not getattr(args, "use_vllm", False) or rollout_func is not None:
            return None
        from ..generation.vllm_generation import VLLMGeneration

        image_token_id = self._image_token_id
        return VLLMGeneration(
            self.model,
            self.accelerator,
            args,
            eos_token_ids=self.eos_token_ids,
            max_tokens=self.max_completion_length,
            # As with transformers' generate: a sampled image token would have no image behind it in training.
            suppress_token_ids=[image_token_id] if image_token_id is not None else None,
        )

    def _uses_sampling_logps(self) -> bool:
        """Whether the sampler's per-token log-probabilities are used (vLLM importance-sampling correction): only
        then does `_generate` return them, since they cost an extra log-probability pass over the batch."""
        return bool(getattr(self.args, "vllm_importance_sampling_correction", False))

    def _generate_with_vllm(
        self, prompt_ids: list[list[int]], images: list | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Generation through vLLM: the trainer tokenizes (so prompt ids are the same as with transformers), vLLM
        samples one completion per row and returns the sampled tokens' log-probabilities. The trainer's step counter
        versions the weights: a new optimizer step makes vLLM's copy stale."""
        image_prompts = self.__dict__.get("_image_prompts")
        if images is not None and image_prompts is not None:
            return self._generate_with_vllm_and_images(prompt_ids, images, image_prompts)
        output = self.vllm_generation.generate(
            prompt_ids, model=self.model_wrapped, weights_version=self.state.global_step
        )
        return output["completion_ids"], output["logprobs"]

    def _generate_with_vllm_and_images(
        self, prompt_ids: list[list[int]], images: list, image_prompts: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """vLLM generation from prompts with images: vLLM receives each prompt's token ids with one placeholder per
        image (its own processor expands them) and the images as multi-modal data; the trainer's processor computed
        the expanded prompt ids trained on (`prompt_ids`), which must be the prompt vLLM sampled from."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        placeholder_ids = tokenizer(image_prompts["texts"], add_special_tokens=not image_prompts["conversational"])[
            "input_ids"
        ]
        output = self.vllm_generation.generate(
            placeholder_ids, model=self.model_wrapped, weights_version=self.state.global_step, images=images
        )
        for row, (ours, theirs) in enumerate(zip(prompt_ids, output["prompt_ids"])):
            if list(theirs) != list(ours):
                raise RuntimeError(
                    f"vLLM expanded the image placeholders of prompt {row} into {len(theirs)} tokens that differ "
                    f"from the {len(ours)} the trainer's processor ({type(self.processing_class).__name__}) gives: "
                    "the completion would be trained on another prompt than it was sampled from. Make the processor "
                    "saved with the model (the one vLLM loads) match `processing_class`, or set use_vllm=False."
                )
        return output["completion_ids"], output["logprobs"]

    def end(self) -> None:
        # Release vLLM first: its in-process engine tears down the process groups it joined, which must still exist.
        if self.vllm_generation is not None:
            self.vllm_generation.close()
        # `Trainer.end` (finish the trackers) exists from transformers 5; before, the same call is the accelerator's.
        parent_end = getattr(super(), "end", None)
        (parent_end or self.accelerator.end_training)()

    def _generate_continuous_batching(self, model: nn.Module, prompt_lists: list[list[int]]) -> list[list[int]]:
        ContinuousBatchingConfig = require_transformers_attribute(*CONTINUOUS_BATCHING_REQUIREMENT)
        config = ContinuousBatchingConfig(**(self.args.transformers_continuous_batching_config or {}))
        # Continuous batching accepts transformers' own attention implementations only.
        with plain_sdpa_attention(model):
            results = model.generate_batch(
                inputs=prompt_lists, generation_config=self.generation_config, continuous_batching_config=config
            )
        # Request ids are assigned in input order.
        ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
        completions = []
        for result in ordered:
            ids = list(result.generated_tokens)
            for k, token in enumerate(ids):
                if token in self.eos_token_ids:
                    ids = ids[: k + 1]
                    break
            completions.append(ids)
        return completions

    def _generate_with_rollout_func(self, prompts: list[Any]) -> dict[str, Any]:
        start = time.perf_counter()
        output = self.rollout_func(prompts, self)
        self._timing["generation"] += time.perf_counter() - start
        if not isinstance(output, dict) or "prompt_ids" not in output or "completion_ids" not in output:
            found = list(output) if isinstance(output, dict) else type(output).__name__
            raise ValueError(
                "rollout_func must return a dict with at least 'prompt_ids' and 'completion_ids' (and optionally "
                f"'logprobs'); got {found}."
            )
        for key in ("prompt_ids", "completion_ids"):
            if len(output[key]) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(output[key])} {key} for {len(prompts)} prompts; it must return one "
                    "entry per prompt (prompts are already repeated num_generations times)."
                )
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        extra.pop("logprob_token_ids", None)
        return {
            "prompt_ids": [list(ids) for ids in output["prompt_ids"]],
            "completion_ids": [list(ids) for ids in output["completion_ids"]],
            "sampling_logps": output.get("logprobs"),
            "extra_fields": extra,
        }

    def _decode_completions(self, prompts: list[Any], completion_ids: list[list[int]]) -> list[Any]:
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if not is_conversational({"prompt": prompts[0]}):
            return texts
        completions = []
        for prompt, text in zip(prompts, texts):
            # A prompt ending with an assistant message is continued: the completion extends that message.
            last = prompt[-1]
            bootstrap = last.get("content", "") if last.get("role") == "assistant" else ""
            if not isinstance(bootstrap, str):
                bootstrap = ""
            completions.append([{"role": "assistant", "content": bootstrap + text}])
        return completions
