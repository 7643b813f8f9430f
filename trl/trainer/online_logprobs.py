"""Log-probabilities of the online trainers: TRL's `_get_per_token_logps_and_entropies` hook and what runs behind it.

[`_OnlineLogprobsMixin`] is inherited by `_OnlineTrainer` (see `online_base.py`). The hook computes the completion
tokens' log-probabilities (and entropies) of prompt + completion rows; behind it, the completions of one prompt run
that prompt once (`_shared_prompt_layout`, `fast_paths/prefix_sharing.py`). A subclass overriding the hook replaces
that. `_compute_rollout_logps` adds the old-policy and reference log-probabilities to a
rollout batch.
"""

from typing import Any

import torch
import torch.nn as nn

from .fast_paths.prefix_sharing import (
    MIN_SHARED_SAVING,
    SharedPrefixLayout,
    contiguous_rows,
    same_prompt_groups,
    share_prefixes,
    shared_prefix_token_logps,
    sharing_possible_now,
    supports_prefix_sharing,
)
from .online_math import positions_from_mask
from .utils import compute_token_logps
from .utils.vision import collate_vision_rows


class _OnlineLogprobsMixin:
    """Log-probability passes of [`_OnlineTrainer`] (not usable on its own).

    Reads from the trainer: `args`, `model`, `ref_model`, `pad_token_id`, `_mode`, `_aux_loss_enabled`,
    `_share_prefix`, `_logprob_temperature`, `_needs_rollout_logps`, `_needs_ref_model` and `_reference_context`.
    """

    @staticmethod
    def _sequence_inputs(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask, position_ids)` of prompt + completion, each `(B, P + C)`.

        Completion tokens outside `completion_mask` (padding, masked truncated rows) are not attended to; they are
        never scored. Positions are counted from each prompt's first real token, as during generation.
        """
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"].long()], dim=1)
        return input_ids, attention_mask, positions_from_mask(attention_mask)

    @staticmethod
    def _multimodal_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
        """The image inputs of a batch as keyword arguments of `_get_per_token_logps_and_entropies` (`{}` for
        text)."""
        if inputs.get("vision_rows") is None:
            return {}
        width = inputs["prompt_ids"].shape[1]
        total = width + inputs["completion_ids"].shape[1]
        device = inputs["prompt_ids"].device
        collated = collate_vision_rows(inputs["vision_rows"], width, total)
        return {key: value.to(device) for key, value in collated.items()}

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's hook: log-probabilities (and entropies) of the last `logits_to_keep` tokens of each row.

        `input_ids` / `attention_mask` are `(B, L)`: prompt then completion. The model runs on chunks of
        `batch_size` rows (all rows when None; rows with images run together), with the logits divided by the
        sampling temperature; the LM head runs only on the attended completion positions.

        Returns:
            `(logps, entropies, aux_loss)`: `(B, logits_to_keep)` float log-probabilities (0 where
            `attention_mask` is 0); the entropies alike when `compute_entropy`, else None; the mean router
            load-balancing loss of the chunks when `compute_aux_loss`, else None.
        """
        image_inputs = {
            key: value
            for key, value in (
                ("pixel_values", pixel_values),
                ("image_grid_thw", image_grid_thw),
                ("pixel_attention_mask", pixel_attention_mask),
                ("spatial_shapes", spatial_shapes),
                ("image_sizes", image_sizes),
                ("token_type_ids", token_type_ids),
                ("mm_token_type_ids", mm_token_type_ids),
                ("image_position_ids", image_position_ids),
            )
            if value is not None
        }
        rows = input_ids.shape[0]
        size = rows if (batch_size is None or image_inputs) else max(1, int(batch_size))
        logps, entropies, aux_losses = [], [], []
        for start in range(0, rows, size):
            chunk = slice(start, start + size)
            chunk_logps, chunk_entropy, outputs = self._token_logps_pass(
                model, input_ids[chunk], attention_mask[chunk], logits_to_keep, compute_entropy, image_inputs
            )
            logps.append(chunk_logps)
            if compute_entropy:
                entropies.append(chunk_entropy)
            aux = getattr(outputs, "aux_loss", None) if compute_aux_loss else None
            if aux is not None:
                aux_losses.append(aux)
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if aux_losses else None,
        )

    def _token_logps_pass(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        compute_entropy: bool,
        image_inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """One forward pass of `_get_per_token_logps_and_entropies`: `(logps, entropy, outputs)` of the completion.

        Completions of one prompt run that prompt once when the model takes the shared-prefix layout
        (`_shared_prompt_layout`).
        """
        prompt_length = input_ids.shape[1] - logits_to_keep
        target_mask = torch.zeros(
            input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool, device=input_ids.device
        )
        target_mask[:, prompt_length - 1 :] = attention_mask[:, prompt_length:].bool()
        position_ids = None if image_inputs else positions_from_mask(attention_mask)
        layout = None
        if not image_inputs:  # the model derives its own (possibly multi-dimensional) positions around image tokens
            layout = self._shared_prompt_layout(model, input_ids, attention_mask, prompt_length)
        if layout is not None:
            result = shared_prefix_token_logps(
                model,
                input_ids,
                layout,
                target_mask,
                compute_entropy=compute_entropy,
                temperature=self._logprob_temperature(),
            )
        else:
            result = compute_token_logps(
                model,
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **image_inputs,
                target_mask=target_mask,
                temperature=self._logprob_temperature(),
                compute_entropy=compute_entropy,
            )
        logps = result.logps[:, prompt_length - 1 :]
        entropy = result.entropy[:, prompt_length - 1 :] if result.entropy is not None else None
        return logps, entropy, result.outputs

    def _completion_logps(
        self, model: nn.Module, inputs: dict[str, Any], compute_entropy: bool = False, batch_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`_get_per_token_logps_and_entropies` on a rollout batch dict (TRL's call: prompt + completion ids, their
        mask, the completion width, the image inputs)."""
        input_ids, attention_mask, _ = self._sequence_inputs(inputs)
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].shape[1],
            batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=self._aux_loss_enabled,
            **self._multimodal_inputs(inputs),
        )

    def _shared_prompt_layout(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
    ) -> SharedPrefixLayout | None:
        """The shared-prefix layout of rows whose completions of one prompt run that prompt once
        ([`~trl.trainer.fast_paths.prefix_sharing.share_prefixes`]), or None to run whole rows.

        Whole rows run when the model cannot take the layout ([`supports_prefix_sharing`], checked once per model),
        when an auxiliary router loss reads the forward's outputs, when attended tokens are not contiguous
        (multi-turn tool results), or when sharing saves too few tokens to pay."""
        if not self._share_prefix or self._aux_loss_enabled:
            return None
        cache = self.__dict__.setdefault("_prefix_sharing_support", {})
        if id(model) not in cache:
            cache[id(model)] = supports_prefix_sharing(model)
        if not cache[id(model)] or not sharing_possible_now(model):
            return None
        groups = same_prompt_groups(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
        if len(groups) == input_ids.shape[0] or not contiguous_rows(attention_mask):
            return None
        layout = share_prefixes(input_ids, attention_mask, groups, pad_token_id=self.pad_token_id)
        if layout.saved_share < MIN_SHARED_SAVING:
            return None
        self._shared_prefix_passes += 1
        return layout

    @torch.no_grad()
    def _batched_logps(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Log-probabilities of a whole rollout batch without gradients, in micro-batch-sized pieces."""
        size = self.args.per_device_train_batch_size if self._mode == "train" else self.args.per_device_eval_batch_size
        return self._completion_logps(model, batch, batch_size=size)[0]

    def _compute_rollout_logps(self, batch: dict[str, Any]) -> None:
        """Add `old_per_token_logps` (when the data will be off-policy) and `ref_per_token_logps` (when `beta != 0`)
        to a rollout batch. On-policy, the loss pass's detached log-probabilities are the old ones (a trainer that
        compares them with an external sampler's, like GRPO, does so in its loss)."""
        if self._needs_rollout_logps():
            batch["old_per_token_logps"] = self._batched_logps(self.model, batch)
        if self._needs_ref_model(self.args):
            with self._reference_context(self.model, self.ref_model) as reference:
                batch["ref_per_token_logps"] = self._batched_logps(reference, batch)
