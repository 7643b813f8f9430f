"""Online DPO: DPO on pairs of completions sampled from the current policy and ranked during training.

Each training step takes a batch of prompts, samples two completions per prompt from the policy (through the online
core's `_generate`, so transformers `generate` or vLLM), ranks every pair with reward models / reward functions (the
higher weighted score wins) or with a pairwise judge, and takes a DPO (`sigmoid`) or IPO step on the resulting
chosen / rejected pairs against a frozen reference model.

The rollout machinery (generation, reward calling, reference handling, log-probabilities, metrics) is the shared
`_OnlineTrainer` core; this module adds the pairing and the loss. XPO and Nash-MD subclass this trainer and only
change where the second completion of a pair comes from (`_generate_pairs`) and the loss (`_compute_loss`).

Batch layout produced by `_prepare_inputs` for `B` prompts (rows `0..B-1` are the first completion of each pair,
rows `B..2B-1` the second one, same prompt order):

- `prompt_ids`, `prompt_mask` `(2B, P)` left-padded; `completion_ids`, `completion_mask` `(2B, T)` right-padded;
- `ref_per_token_logps` `(2B, T)`: reference log-probabilities of the completion tokens;
- `contains_eos` `(2B,)`: whether the completion ended with an end-of-sequence token;
- `first_win_prob` `(B,)`: probability that the first completion is the better one (1.0 / 0.0 for a hard verdict, NaN
  where a judge gave no valid verdict);
- `scores` `(2B,)`: the weighted reward of each completion (after `missing_eos_penalty`), only with reward functions.
"""

import contextlib
import numbers
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    Trainer,
    TrainerCallback,
)

from ...data_utils import apply_chat_template, is_conversational
from ...models.peft import AS_LOADED
from ...models.utils import unwrap_model_for_generation
from ...trainer.dpo_trainer import dpo_loss
from ...trainer.fast_paths.small_row_linear import small_row_linear
from ...trainer.online_base import _OnlineTrainer
from ...trainer.online_generation import _router_logits_off
from ...trainer.online_math import completion_mask_from_ids
from ...trainer.online_rewards import RewardFunc, _accepts_keyword
from ...trainer.utils import pad
from .online_dpo_config import OnlineDPOConfig, _schedule_values


def online_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> torch.Tensor:
    """Per-pair Online DPO loss from log-probabilities summed over the completion tokens.

    With `h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)`, `sigmoid` is
    `-log(sigmoid(beta * h))` (DPO) and `ipo` is `(h - 1 / (2 * beta))**2` (IPO, with `tau = beta`).

    Args:
        chosen_logps: `(n,)` policy log-probabilities of the chosen completions.
        rejected_logps: `(n,)` policy log-probabilities of the rejected completions.
        ref_chosen_logps: `(n,)` reference log-probabilities of the chosen completions.
        ref_rejected_logps: `(n,)` reference log-probabilities of the rejected completions.
        beta: KL strength (IPO tau).
        loss_type: `"sigmoid"` or `"ipo"`.

    Returns:
        `(n,)` losses.
    """
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo'; got {loss_type!r}.")
    # DPOTrainer's IPO works on per-token means; Online DPO's on sums, which unit lengths leave unchanged.
    ones = torch.ones_like(chosen_logps)
    return dpo_loss(
        loss_type,
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        chosen_lengths=ones,
        rejected_lengths=ones,
        beta=beta,
    )


@torch.no_grad()
def score_token_ids(reward_model: nn.Module, batch: dict[str, torch.Tensor], pad_token_id: int) -> torch.Tensor:
    """Reward-model scores of prompt + completion token ids, read at the last completion token before padding.

    Args:
        reward_model: A sequence-classification model with a `score` head over its backbone's hidden states.
        batch: `prompt_ids` / `prompt_mask` (left-padded) and `completion_ids` / `completion_mask` (right-padded).
        pad_token_id: Padding id; the score is read just before the first one in the completion (at the last prompt
            token for an empty completion).

    Returns:
        `(N,)` float32 scores.
    """
    device = next(reward_model.parameters()).device
    prompt_ids, completion_ids = batch["prompt_ids"].to(device), batch["completion_ids"].to(device)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).to(device).long()
    position_ids = mask.cumsum(dim=1) - mask  # positions count from each row's first real token
    hidden = reward_model.base_model(
        input_ids=input_ids.masked_fill(mask == 0, 0), attention_mask=mask, position_ids=position_ids
    ).last_hidden_state
    is_pad = completion_ids == pad_token_id
    first_pad = torch.where(is_pad.any(dim=1), is_pad.int().argmax(dim=1), completion_ids.shape[1])
    index = prompt_ids.shape[1] + first_pad - 1
    rows = torch.arange(input_ids.shape[0], device=device)
    return reward_model.score(hidden[rows, index]).float()[:, 0]


def _messages_to_text(value: Any, with_roles: bool) -> str:
    """Plain text of a prompt or completion for a judge: strings as they are, chat messages flattened."""
    if isinstance(value, str):
        return value
    parts = []
    for message in value:
        content = message.get("content", "")
        if not isinstance(content, str):  # structured content: keep the text parts
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        parts.append(f"{message.get('role', '').capitalize()}: {content}" if with_roles else content)
    return "\n\n".join(parts)


class OnlineDPOTrainer(_OnlineTrainer):
    """Trainer for Online DPO (online AI feedback, OAIF).

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    trainer = OnlineDPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=get_model_path("tiny-Qwen2ForSequenceClassification"),
        args=OnlineDPOConfig(output_dir="online-dpo-out", per_device_train_batch_size=2, max_new_tokens=16, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Policy to train: a path or hub id (loaded with `args.model_init_kwargs`) or an instantiated causal
            language model.
        ref_model (`str`, `PreTrainedModel` or `None`, defaults to `None`):
            Frozen reference of the DPO loss. `None` creates a copy of the initial policy, or, for a PEFT policy,
            uses the policy with its adapters disabled.
        reward_funcs (`RewardFunc`, `list[RewardFunc]` or `None`, defaults to `None`):
            How completions are scored, as for [`GRPOTrainer`]: sequence-classification reward models (instances or
            paths, scored with their own tokenizer) and/or callables receiving `prompts`, `completions`,
            `completion_ids`, `trainer_state` and the other dataset columns as keyword arguments and returning one
            number (or None) per completion. The score of a completion is the `reward_weights`-weighted sum; the
            higher-scored completion of a pair is chosen (the first one on a tie). Exclusive with `judge`; when both
            are None, `args.reward_model_path` is used.
        args (`OnlineDPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `OnlineDPOConfig(f"{model_name}-OnlineDPO")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Must be None: prompts are tokenized when completions are generated. Kept for signature compatibility.
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data with a `prompt` column (text or chat messages); other columns go to the reward
            functions. `per_device_train_batch_size` counts prompts (two completions each).
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts; evaluation reports the loss and metrics on freshly generated pairs.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer of the policy; loaded from the model's path (left padding) when omitted.
        reward_processing_classes (`PreTrainedTokenizerBase`, a list of them or `None`, defaults to `None`):
            Tokenizers of the reward models, aligned with `reward_funcs`; loaded from each model's path when None.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the reference is then the policy with its adapters disabled.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; evaluation metrics are the trainer's own (no predictions are returned).
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; unused (see `compute_metrics`).
        judge (`BasePairwiseJudge` or `None`, defaults to `None`):
            Pairwise judge ranking the two completions of each prompt (trl 1.0 API): its `judge(prompts, pairs)`
            returns, per prompt, the index (0 or 1) of the better completion, or -1 when it cannot tell (such pairs
            are left out of the loss). Conversational prompts are flattened to `Role: content` text first.
            Exclusive with `reward_funcs`.
    """

    _tag_names = ["trl", "online-dpo"]
    _name = "Online DPO"
    _quantized_base = AS_LOADED
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "Direct Language Model Alignment from Online AI Feedback",
        "id": "2402.04792",
        "citation": (
            "@article{guo2024direct,\n"
            "    title        = {{Direct Language Model Alignment from Online AI Feedback}},\n"
            "    author       = {Shangmin Guo and Biao Zhang and Tianlin Liu and Tianqi Liu and Misha Khalman and "
            "Felipe Llinares and Alexandre Ram{\\'{e}} and Thomas Mesnard and Yao Zhao and Bilal Piot and Johan "
            "Ferret and Mathieu Blondel},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2402.04792}\n"
            "}"
        ),
    }
    _config_class = OnlineDPOConfig
    _output_dir_suffix = "OnlineDPO"
    # The pair batch being scored (token-id reward models read it), set during `_prepare_inputs` only.
    _pair_batch = None
    # Completions `_generate` samples from the policy per prompt: both members of a pair here; XPO and Nash-MD sample
    # one and take the other from the reference / the mixture.
    _policy_samples_per_prompt = 2
    # Nash-MD uses the probability that the first completion wins; Online DPO and XPO only need the winner.
    _soft_preferences = False
    # As in TRL: no `step_time` metric, and reward functions get no `log_extra` / `log_metric` callbacks.
    _logs_step_time = False
    _reward_logging_callbacks = False
    # XPO and Nash-MD (as TRL 1.12) score the policy's token ids with a reward model sharing the policy's vocabulary,
    # instead of decoding and re-tokenizing the text (which does not always give back the same ids).
    _reward_models_score_ids = False

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        ref_model: "str | PreTrainedModel | nn.Module | None" = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: OnlineDPOConfig | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        peft_config: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        judge: Any = None,
    ):
        trainer_name = type(self).__name__
        if data_collator is not None:
            raise ValueError(
                f"{trainer_name} does not take a data_collator: prompts are tokenized when the completions are "
                "generated, and the raw rows go to the reward functions. Remove the data_collator argument."
            )
        if judge is not None:
            if not callable(getattr(judge, "judge", None)):
                raise ValueError(
                    f"judge must be a pairwise judge (a trl.experimental.judges.BasePairwiseJudge, with a "
                    f"`judge(prompts, completions)` method); got {type(judge).__name__}."
                )
            reward_path = getattr(args, "reward_model_path", None)
            if reward_funcs is not None or reward_path is not None:
                given = "reward_funcs" if reward_funcs is not None else f"args.reward_model_path={reward_path!r}"
                raise ValueError(
                    f"{trainer_name} ranks completion pairs with either a judge or reward models/functions, not both; "
                    f"got a judge ({type(judge).__name__}) and {given}. Pass only one of them."
                )
        self.judge = judge
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            ref_model=ref_model,
        )
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self._beta_schedule = _schedule_values(self.args.beta)
        if judge is not None and self.args.missing_eos_penalty is not None:
            warnings.warn(
                "missing_eos_penalty lowers reward scores, but completions are ranked by a judge here, so it has no "
                "effect. Use reward functions to penalise completions without an EOS token.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------------------------
    # Settings and schedules
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _rollout_settings(cls, args: OnlineDPOConfig) -> dict[str, Any]:
        return {
            "num_generations": cls._policy_samples_per_prompt,
            "num_generations_eval": cls._policy_samples_per_prompt,
            "max_completion_length": args.max_new_tokens,
            "chat_template_kwargs": {},
        }

    @staticmethod
    def _needs_ref_model(args: Any) -> bool:
        return True  # the DPO family always compares with the reference

    def _logprob_temperature(self) -> float:
        # The loss scores the policy itself, not the (tempered) sampler.
        return 1.0

    def _epoch_value(self, schedule: list[float]) -> float:
        """The value of a per-epoch schedule for the current epoch (the last value once the list is exhausted)."""
        epoch = int(self.state.epoch or 0) if getattr(self, "state", None) is not None else 0
        return schedule[min(epoch, len(schedule) - 1)]

    @property
    def beta(self) -> float:
        """The KL strength of the current epoch (`args.beta` may hold one value per epoch)."""
        return self._epoch_value(self._beta_schedule)

    # ------------------------------------------------------------------------------------------------------------
    # Scorers
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_reward_funcs(self, reward_funcs: Any, reward_processing_classes: Any, args: Any):
        if self.judge is not None:
            return [], [], []
        if reward_funcs is None:
            if args.reward_model_path is None:
                raise ValueError(
                    f"`reward_funcs` must be provided. {type(self).__name__} needs a way to rank the two completions "
                    "of each prompt: pass "
                    "reward_funcs=<reward model or callable, or a list of them>, judge=<BasePairwiseJudge>, or set "
                    "args.reward_model_path."
                )
            reward_funcs = args.reward_model_path
        return super()._prepare_reward_funcs(reward_funcs, reward_processing_classes, args)

    @staticmethod
    def tokenize_row(
        feature: dict[str, Any], is_encoder_decoder: bool, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, list[int]]:
        """Tokenize the prompt of one example (the chat template is applied to conversational prompts).

        Kept for compatibility with TRL's API: the trainer itself tokenizes prompts when it generates.

        Args:
            feature: A dataset row with a `prompt`.
            is_encoder_decoder: Must be False (decoder-only models only).
            tokenizer: The policy's tokenizer.

        Returns:
            `{"prompt_input_ids": [...], "prompt_attention_mask": [...]}`.
        """
        if is_encoder_decoder:
            raise ValueError("OnlineDPOTrainer supports decoder-only causal language models only.")
        conversational = is_conversational(feature)
        prompt = apply_chat_template(feature, tokenizer)["prompt"] if conversational else feature["prompt"]
        ids = tokenizer(text=prompt, add_special_tokens=not conversational)["input_ids"]
        return {"prompt_input_ids": ids, "prompt_attention_mask": [1] * len(ids)}

    # ------------------------------------------------------------------------------------------------------------
    # Data: one dataloader row per prompt (the pair is generated from it)
    # ------------------------------------------------------------------------------------------------------------
    # The online core's samplers repeat prompts in generation groups; here a batch is simply B prompts, so the plain
    # transformers Trainer loaders and samplers are used.
    def get_train_dataloader(self):
        return Trainer.get_train_dataloader(self)

    def _get_train_sampler(self, train_dataset: Any = None):
        return Trainer._get_train_sampler(self, train_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        if isinstance(dataset, IterableDataset):  # batches are rows (strings): never dispatched (see the base)
            return self._iterable_dataloader(dataset, self.args.per_device_eval_batch_size, "Evaluation")
        return Trainer.get_eval_dataloader(self, eval_dataset)

    def _get_eval_sampler(self, eval_dataset: Any):
        return Trainer._get_eval_sampler(self, eval_dataset)

    # ------------------------------------------------------------------------------------------------------------
    # Rollout: generate the pairs, rank them, compute reference log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        device = self.accelerator.device
        rows = list(inputs)
        num_pairs = len(rows)
        prompt_lists, first_lists, second_lists = self._generate_pairs(rows)
        pair_rows = rows + rows
        completion_lists = list(first_lists) + list(second_lists)

        prompt_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompt_lists] * 2
        completion_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in completion_lists]
        batch: dict[str, Any] = {
            "prompt_ids": pad(prompt_tensors, self.pad_token_id, "left"),
            "prompt_mask": pad([torch.ones_like(t) for t in prompt_tensors], 0, "left"),
            "completion_ids": pad(completion_tensors, self.pad_token_id, "right"),
            "completion_mask": pad([torch.ones_like(t) for t in completion_tensors], 0, "right"),
        }
        if batch["completion_ids"].shape[1] == 0:  # every completion empty: keep one (masked) column
            batch["completion_ids"] = torch.full((2 * num_pairs, 1), self.pad_token_id, device=device)
            batch["completion_mask"] = torch.zeros_like(batch["completion_ids"])
        eos = set(self.eos_token_ids)
        contains_eos = torch.tensor([bool(ids) and ids[-1] in eos for ids in completion_lists], device=device)
        batch["contains_eos"] = contains_eos

        completions = self._decode_completions([row["prompt"] for row in pair_rows], completion_lists)
        if self.judge is not None:
            batch["first_win_prob"] = self._judge_pairs(rows, completions[:num_pairs], completions[num_pairs:])
        else:
            prompts = [row["prompt"] for row in pair_rows]
            self._pair_batch = batch if self._reward_models_score_ids else None
            try:
                rewards = self._calculate_rewards(pair_rows, prompts, completions, completion_lists)
            finally:
                self._pair_batch = None
            index = self.accelerator.process_index
            local = rewards[index * 2 * num_pairs : (index + 1) * 2 * num_pairs]
            scores = self._aggregated_rewards(local).to(device)
            if self.args.missing_eos_penalty is not None:
                scores = scores - self.args.missing_eos_penalty * (~contains_eos).float()
            batch["scores"] = scores
            first, second = scores[:num_pairs], scores[num_pairs:]
            if self._soft_preferences:
                batch["first_win_prob"] = torch.sigmoid(first - second)
            else:
                batch["first_win_prob"] = (first >= second).float()  # ties go to the first completion

        self._truncate_prompts(batch)
        with self._reference_context(self.model, self.ref_model) as reference:
            batch["ref_per_token_logps"] = self._batched_logps(reference, batch)
        self._timing["rollout"] += time.perf_counter() - start
        return batch

    def _score_with_reward_model(
        self, reward_model: nn.Module, tokenizer: Any, prompts: list[Any], completions: list[Any]
    ) -> torch.Tensor:
        batch = self._pair_batch
        policy_tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        same_vocab = tokenizer is policy_tokenizer or tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        if batch is None or not same_vocab or not hasattr(reward_model, "score"):
            return super()._score_with_reward_model(reward_model, tokenizer, prompts, completions)
        return score_token_ids(reward_model, batch, self.pad_token_id)

    def _generate_pairs(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """The two completions of each prompt: `(prompt_ids, first_completion_ids, second_completion_ids)` lists.

        Online DPO samples both from the policy. vLLM gets each prompt twice in a row (a group of two); transformers
        gets the whole batch twice, as TRL samples it, so the same seed draws the same tokens (identical prompts still
        share one prefill).
        """
        if self.vllm_generation is not None:
            doubled = [row for row in rows for _ in range(2)]
            output = self._generate_rows(doubled)
            completions = output["completion_ids"]
            return output["prompt_ids"][0::2], completions[0::2], completions[1::2]
        twice = rows + rows
        output = self._generate_rows(twice)
        completions, n = output["completion_ids"], len(rows)
        return output["prompt_ids"][:n], completions[:n], completions[n:]

    @contextlib.contextmanager
    def _unwrapped_for_generation(self, model: nn.Module):
        """`model` (policy or reference) unwrapped for transformers `generate`, without gradients."""
        args = self.args
        with (
            unwrap_model_for_generation(
                model,
                self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            _router_logits_off(unwrapped),
        ):
            yield unwrapped

    def _generate_with(
        self,
        model: nn.Module,
        prompt_lists: list[list[int]],
        make_logits_processor: Callable[[torch.Tensor], LogitsProcessor] | None = None,
    ) -> list[list[int]]:
        """One completion per prompt from an unwrapped model with transformers `generate`, cut after the first EOS.

        Args:
            model: Unwrapped model (see `_unwrapped_for_generation`).
            prompt_lists: Prompt token ids, one list per prompt.
            make_logits_processor: Optional factory receiving the `(N, L)` prompt attention mask and returning a
                logits processor applied at every step (Nash-MD's mixture).
        """
        start = time.perf_counter()
        device = self.accelerator.device
        tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompt_lists]
        prompt_ids = pad(tensors, self.pad_token_id, "left")
        prompt_mask = pad([torch.ones_like(t) for t in tensors], 0, "left")
        kwargs = {}
        if make_logits_processor is not None:
            kwargs["logits_processor"] = LogitsProcessorList([make_logits_processor(prompt_mask)])
        with small_row_linear(model):
            output = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=self.generation_config,
                disable_compile=True,
                **kwargs,
            )
        completion_ids = output[:, prompt_ids.shape[1] :]
        completion_mask, _ = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        self._timing["generation"] += time.perf_counter() - start
        return [ids[: int(n)].tolist() for ids, n in zip(completion_ids, completion_mask.sum(dim=1))]

    def _judge_pairs(self, rows: list[dict[str, Any]], first: list[Any], second: list[Any]) -> torch.Tensor:
        """Ask the judge which completion of each pair is better; returns the `(B,)` probability that the first wins.

        Hard verdicts give 1.0 / 0.0 and -1 gives NaN (no verdict). With `_soft_preferences` and a judge whose
        `judge` accepts `return_scores` (PairRMJudge), its probabilities are used as they are.
        """
        prompts = [_messages_to_text(row["prompt"], with_roles=True) for row in rows]
        pairs = [
            [_messages_to_text(a, with_roles=False), _messages_to_text(b, with_roles=False)]
            for a, b in zip(first, second)
        ]
        judge_name = type(self.judge).__name__
        soft = self._soft_preferences and _accepts_keyword(self.judge.judge, "return_scores")
        results = self.judge.judge(prompts, pairs, return_scores=True) if soft else self.judge.judge(prompts, pairs)
        if isinstance(results, torch.Tensor):
            results = results.tolist()
        if not isinstance(results, (list, tuple)) or len(results) != len(prompts):
            found = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            raise ValueError(
                f"The judge ({judge_name}) must return one verdict per prompt ({len(prompts)} here), but returned "
                f"{found}. A pairwise judge returns a list with, for each prompt, 0 or 1 (the index of the better "
                "completion) or -1 (no verdict)."
            )
        probabilities = []
        for i, value in enumerate(results):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(
                    f"The judge ({judge_name}) returned a non-numeric verdict at position {i}: {value!r}."
                )
            if soft and value != -1:
                if not 0.0 <= value <= 1.0:
                    raise ValueError(
                        f"The judge ({judge_name}) returned the probability {value!r} at position {i}; probabilities "
                        "that the first completion wins must lie in [0, 1]."
                    )
                probabilities.append(float(value))
            elif value in (0, 1):
                probabilities.append(1.0 - float(value))
            elif value == -1:
                probabilities.append(float("nan"))
            else:
                raise ValueError(
                    f"The judge ({judge_name}) returned {value!r} at position {i}; a pairwise judge returns 0 (first "
                    "completion better), 1 (second better) or -1 (no verdict)."
                )
        return torch.tensor(probabilities, dtype=torch.float32, device=self.accelerator.device)

    def _truncate_prompts(self, batch: dict[str, Any]) -> None:
        """Drop the leftmost prompt columns so that prompt + completion fits `max_length` (one prompt token is kept:
        it predicts the first completion token)."""
        prompt_length = batch["prompt_ids"].shape[1]
        excess = prompt_length + batch["completion_ids"].shape[1] - self.args.max_length
        if excess > 0:
            drop = min(excess, prompt_length - 1)
            batch["prompt_ids"] = batch["prompt_ids"][:, drop:]
            batch["prompt_mask"] = batch["prompt_mask"][:, drop:]

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _sequence_logps(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Policy (with gradient) and reference log-probabilities of every completion, summed over its tokens."""
        per_token_logps, _, aux_loss = self._completion_logps(model, inputs)
        mask = inputs["completion_mask"].to(per_token_logps.dtype)
        logps = (per_token_logps * mask).sum(dim=1)
        ref_logps = (inputs["ref_per_token_logps"].to(per_token_logps.dtype) * mask).sum(dim=1)
        return logps, ref_logps, aux_loss

    @staticmethod
    def _chosen_rejected(first_win_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row indices of the chosen and rejected completion of each pair, and which pairs have a verdict."""
        num_pairs = first_win_prob.shape[0]
        first = torch.arange(num_pairs, device=first_win_prob.device)
        first_chosen = first_win_prob >= 0.5
        chosen = torch.where(first_chosen, first, first + num_pairs)
        rejected = torch.where(first_chosen, first + num_pairs, first)
        return chosen, rejected, ~torch.isnan(first_win_prob)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        beta = self.beta
        logps, ref_logps, aux_loss = self._sequence_logps(model, inputs)
        chosen, rejected, valid = self._chosen_rejected(inputs["first_win_prob"])
        losses = online_dpo_loss(
            logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], beta, self.args.loss_type
        )
        valid_f = valid.to(losses.dtype)
        loss = torch.where(valid, losses, torch.zeros_like(losses)).sum() / valid_f.sum().clamp(min=1.0)
        loss = loss / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, aux_loss)

        with torch.no_grad():
            logps, ref_logps = logps.detach(), ref_logps.detach()
            kl = logps - ref_logps
            chosen_rewards = beta * (logps[chosen] - ref_logps[chosen])
            rejected_rewards = beta * (logps[rejected] - ref_logps[rejected])
            count = valid_f.sum()

            def over_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return (values.float() * valid_f).sum(), count

            means = {
                "objective/kl": kl.mean(),
                "objective/entropy": -logps.mean(),
                "objective/non_score_reward": (-beta * kl).mean(),  # the KL penalty, a negative reward
            }
            ratios = {}
            if "scores" in inputs:
                scores = inputs["scores"]
                means["objective/rlhf_reward"] = (scores - beta * kl).mean()
                means["objective/scores"] = scores.mean()
                ratios["objective/scores_margin"] = over_pairs(scores[chosen] - scores[rejected])
            ratios.update(
                {
                    "rewards/chosen": over_pairs(chosen_rewards),
                    "rewards/rejected": over_pairs(rejected_rewards),
                    "rewards/accuracies": over_pairs(chosen_rewards > rejected_rewards),
                    "rewards/margins": over_pairs(chosen_rewards - rejected_rewards),
                    "logps/chosen": over_pairs(logps[chosen]),
                    "logps/rejected": over_pairs(logps[rejected]),
                }
            )
            means["val/contain_eos_token"] = inputs["contains_eos"].float().mean()
            means["beta"] = beta
            self._record_batch_metrics(self._mode, means=means, ratios=ratios)
        return loss
