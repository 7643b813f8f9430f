"""TRL's older public helpers of the CPO and ORPO trainers, kept for plugins and subclasses written against them.

The trainers' own training step does not use these: it scores a batch in one fused pass (see
`reference_free_base`). The helpers below reproduce TRL's step piece by piece on TRL's batch layout (`chosen_*` and
`rejected_*` tensors, labels -100 outside the scored tokens): tokenising one prompt / answer pair, concatenating the
chosen and rejected halves, one forward pass returning the log-probabilities, logits and NLL, and the loss with its
metrics. A batch from this project's collator (`input_ids`, `attention_mask`, `completion_mask`) is accepted too.
"""

from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


_LABEL_PAD = -100


def pair_metric_values(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_logits_mean: torch.Tensor,
    rejected_logits_mean: torch.Tensor,
    nll_loss: torch.Tensor,
    extra: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """TRL's CPO / ORPO batch metrics, in TRL's order, as detached scalar tensors."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/rejected": rejected_logps.detach().mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logits/rejected": rejected_logits_mean.detach().float(),
        "logits/chosen": chosen_logits_mean.detach().float(),
        "nll_loss": nll_loss.detach(),
        **{key: value.detach() for key, value in extra.items()},
    }


class _ReferenceFreeLegacyHelpers:
    """Mixin of `_ReferenceFreePreferenceTrainer`: TRL's `build_tokenized_answer`, `concatenated_inputs`,
    `concatenated_forward` and `get_batch_loss_metrics` (the subclass supplies `_preference_loss`, `_nll_weight`,
    `_length_normalized`, `_nll_includes_prompt`, `_logits_metric_drops_last` and `get_batch_logps`)."""

    def build_tokenized_answer(self, prompt: str, answer: str) -> dict[str, list[int]]:
        """Token ids of a prompt and of the answer that follows it, split where the joint tokenisation allows.

        `prompt + answer` and `prompt` are tokenised without special tokens. When the prompt's ids are not a prefix
        of the joint ids (a token merges across the boundary), the split moves one token left, so that the prompt
        ids plus the answer ids are exactly the joint ids.

        Returns:
            `prompt_input_ids`, `prompt_attention_mask`, `input_ids` and `attention_mask` (the last two for the answer).
        """
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        full = tokenizer(prompt + answer, add_special_tokens=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full_ids, full_mask = list(full["input_ids"]), list(full["attention_mask"])
        split = len(prompt_ids)
        if prompt_ids != full_ids[:split]:
            split -= 1
        result = {
            "prompt_input_ids": full_ids[:split],
            "prompt_attention_mask": full_mask[:split],
            "input_ids": full_ids[split:],
            "attention_mask": full_mask[split:],
        }
        if len(result["prompt_input_ids"]) != len(result["prompt_attention_mask"]) or len(result["input_ids"]) != len(
            result["attention_mask"]
        ):
            raise ValueError("Prompt and answer token ids and attention masks must have the same lengths.")
        return result

    @staticmethod
    def concatenated_inputs(
        batch: dict[str, Any],
        is_encoder_decoder: bool = False,
        padding_value: int = 0,
        device: torch.device | None = None,
    ) -> dict[str, torch.LongTensor]:
        """Stack the chosen then the rejected tensors of a TRL-layout batch under `concatenated_*` keys.

        Every `chosen_*` / `rejected_*` tensor is right-padded to the longer of the two lengths: labels (and, for an
        encoder-decoder model, every key) with -100, `*_input_ids` with `padding_value`, `*_attention_mask` with 0.
        An encoder-decoder batch also gets the prompt repeated twice as `concatenated_input_ids` /
        `concatenated_attention_mask`.

        Args:
            batch: TRL's collated batch (`chosen_input_ids`, `chosen_attention_mask`, `chosen_labels`, `rejected_*`,
                `prompt_input_ids`, ...).
            is_encoder_decoder: Whether the batch belongs to an encoder-decoder model.
            padding_value: Pad token of the input ids.
            device: Where to put the results (default: where they are).

        Returns:
            `{"concatenated_<name>": (2n, L) tensor}`.
        """
        lengths = [
            batch[key].shape[1]
            for key in ("chosen_labels", "rejected_labels", "chosen_input_ids", "rejected_input_ids")
            if torch.is_tensor(batch.get(key))
        ]
        width = max(lengths) if lengths else 0

        def pad_value(key: str) -> int:
            if is_encoder_decoder or key.endswith("labels"):
                return _LABEL_PAD
            if key.endswith("input_ids"):
                return padding_value
            return 0

        out: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            for key, value in batch.items():
                if not (key.startswith(f"{side}_") and torch.is_tensor(value)):
                    continue
                name = "concatenated" + key[len(side) :]
                padded = F.pad(value, (0, width - value.shape[1]), value=pad_value(key))
                out[name] = padded if name not in out else torch.cat([out[name], padded], dim=0)
        if is_encoder_decoder:
            out["concatenated_input_ids"] = batch["prompt_input_ids"].repeat(2, 1)
            out["concatenated_attention_mask"] = batch["prompt_attention_mask"].repeat(2, 1)
        if device is not None:
            out = {key: value.to(device) for key, value in out.items()}
        return out

    def _legacy_layout(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """`input_ids`, `attention_mask` and `labels` of the `2n` rows (chosen, then rejected), from either layout."""
        if "chosen_labels" in batch:
            pad_id = getattr(self.args, "padding_value", None)
            pad_id = self.pad_token_id if pad_id is None else pad_id
            concatenated = self.concatenated_inputs(batch, self.is_encoder_decoder, pad_id, self.accelerator.device)
            return {
                "input_ids": concatenated["concatenated_input_ids"],
                "attention_mask": concatenated["concatenated_attention_mask"],
                "labels": concatenated["concatenated_labels"],
            }
        if self.is_encoder_decoder:  # this project's encoder-decoder collator already uses TRL's names
            return {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
        scored = (batch["completion_mask"] * batch["attention_mask"]).bool()
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": batch["input_ids"].masked_fill(~scored, _LABEL_PAD),
        }

    def concatenated_forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """One forward pass over the chosen and rejected rows, with full logits, as TRL's step runs it.

        Returns:
            `(chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss)`, plus the router loss when the
            model's auxiliary loss is enabled. The log-probabilities are per-token means for SimPO / IPO / ORPO and
            sums otherwise; `nll_loss` is the cross-entropy of the chosen rows (over the completion for CPO, over
            prompt and completion for ORPO; 0 when CPO's `cpo_alpha` is 0). Decoder-only ORPO logits leave out the
            last position.
        """
        rows = self._legacy_layout(batch)
        labels = rows["labels"]
        kwargs: dict[str, Any] = {"use_cache": False}
        if self.is_encoder_decoder:
            kwargs["decoder_input_ids"] = self.shift_labels_right(labels)
        if self._aux_loss_enabled:
            kwargs["output_router_logits"] = True
        outputs = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], **kwargs)
        logits = outputs.logits
        n = labels.shape[0] // 2

        nll_loss = torch.zeros((), device=logits.device)
        if self._nll_weight():
            nll_labels = labels[:n]
            if self._nll_includes_prompt and not self.is_encoder_decoder:
                nll_labels = rows["input_ids"][:n].masked_fill(rows["attention_mask"][:n] == 0, _LABEL_PAD)
            nll_logits = logits[:n] if self.is_encoder_decoder else logits[:n, :-1]
            targets = nll_labels if self.is_encoder_decoder else nll_labels[:, 1:]
            nll_loss = F.cross_entropy(
                nll_logits.reshape(-1, nll_logits.shape[-1]), targets.reshape(-1), ignore_index=_LABEL_PAD
            )
        logps = self.get_batch_logps(logits, labels, self._length_normalized, self.is_encoder_decoder)
        if self._logits_metric_drops_last and not self.is_encoder_decoder:
            logits = logits[:, :-1]
        result = (logps[:n], logps[n:], logits[:n], logits[n:], nll_loss)
        if self._aux_loss_enabled:
            result = (*result, outputs.aux_loss)
        return result

    def get_batch_loss_metrics(
        self, model: nn.Module, batch: dict[str, Any], train_eval: Literal["train", "eval"] = "train"
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of a batch and its metrics, computed through [`concatenated_forward`].

        Returns:
            `(loss, metrics)`: the preference loss plus the weighted NLL (and router) terms, and TRL's metric values
            as floats averaged over processes (`eval_`-prefixed keys when `train_eval="eval"`).
        """
        chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss, *aux = self.concatenated_forward(
            model, batch
        )
        losses, chosen_rewards, rejected_rewards, extra = self._preference_loss(chosen_logps, rejected_logps)
        loss = losses.mean() + self._nll_weight() * nll_loss
        if aux:
            loss = loss + self._aux_loss_coef * aux[0]
        values = pair_metric_values(
            chosen_rewards,
            rejected_rewards,
            chosen_logps,
            rejected_logps,
            chosen_logits.detach().float().mean(),
            rejected_logits.detach().float().mean(),
            nll_loss,
            extra,
        )
        stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in values.values()])
        gathered = self.accelerator.gather_for_metrics(stacked.unsqueeze(0)).mean(dim=0).tolist()
        prefix = "eval_" if train_eval == "eval" else ""
        return loss, {f"{prefix}{key}": value for key, value in zip(values, gathered)}
