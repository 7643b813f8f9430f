"""Nash-MD: the policy plays against a geometric mixture of itself and the reference model.

For each prompt one completion `y` is sampled from the policy and one `y'` from the mixture
`pi_mix ∝ pi^(1 - c) * pi_ref^c` (`c = mixture_coef`). A reward model / reward functions give the probability that
`y` beats `y'` as `sigmoid(score(y) - score(y'))`; a judge gives a hard verdict (or a probability when it supports
`return_scores`). The policy then takes a regularised policy-gradient step (Munos et al., 2023, Nash-MD-PG):

    loss(y) = beta * KL(y) * log pi(y) - (P(y > y') - 1/2) * log pi(y)

where `log pi(y)` is summed over the completion tokens and `KL(y) = log pi(y) - log pi_ref(y)` is a constant
(no gradient): both terms are REINFORCE estimators, the first of the KL divergence to the reference, the second of
the preference against the mixture with baseline 1/2.

The mixture is sampled with transformers `generate` on the policy and [`GeometricMixtureLogitsProcessor`], which runs
the reference model alongside (with its own KV cache) and mixes the two next-token distributions at every step.
"""

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from transformers import (
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)

from ..._compat import CACHE_KEYWORDS, cache_kwargs
from ...trainer.online_rewards import RewardFunc
from ...trainer.utils import use_adapter
from ..online_dpo.online_dpo_config import _schedule_values
from ..online_dpo.online_dpo_trainer import OnlineDPOTrainer
from .nash_md_config import NashMDConfig


def nash_md_loss(
    policy_token_logps: torch.Tensor,
    ref_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    probability: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample Nash-MD policy-gradient loss on completions sampled from the policy.

    Args:
        policy_token_logps: `(n, T)` policy log-probabilities of the tokens of the policy's completions (with
            gradient).
        ref_token_logps: `(n, T)` reference log-probabilities of the same tokens.
        completion_mask: `(n, T)` 1 on completion tokens, 0 on padding.
        probability: `(n,)` probability that each completion beats the mixture's completion of the same prompt.
        beta: Weight of the KL regulariser.

    Returns:
        `(losses, scores, kl)`, all `(n,)`: `losses = beta * sum_t r_t * log pi(y_t) - scores`, where
        `r_t = log pi(y_t) - log pi_ref(y_t)` is taken as a constant (the token-level REINFORCE estimator of the KL,
        as TRL computes it), `scores = (probability - 0.5) * log pi(y)` and `kl = sum_t r_t` (detached).
    """
    mask = completion_mask.to(policy_token_logps.dtype)
    policy_logps = (policy_token_logps * mask).sum(dim=1)
    log_ratio = ((policy_token_logps - ref_token_logps) * mask).detach()
    scores = (probability - 0.5) * policy_logps
    kl_term = (log_ratio * policy_token_logps * mask).sum(dim=1)
    return beta * kl_term - scores, scores, log_ratio.sum(dim=1)


def geometric_mixture_logps(
    policy_logits: torch.Tensor, ref_logits: torch.Tensor, mixture_coef: float
) -> torch.Tensor:
    """Log-probabilities of `pi_mix ∝ pi_policy^(1 - c) * pi_ref^c` (`c = mixture_coef`) from the two models' logits
    over the last dimension, in float32 (float64 for float64 logits).

    Only terms with a non-zero weight enter: `0 * (-inf)` for a token one model masks would give NaN.
    """
    mixed = 0.0
    if mixture_coef > 0.0:
        mixed = mixed + mixture_coef * F.log_softmax(ref_logits.float(), dim=-1)
    if mixture_coef < 1.0:
        mixed = mixed + (1.0 - mixture_coef) * F.log_softmax(policy_logits.float(), dim=-1)
    return F.log_softmax(mixed, dim=-1)


class GeometricMixtureLogitsProcessor(LogitsProcessor):
    """Turns the policy's next-token scores into those of the geometric mixture with a reference model.

    At each generation step the reference model is run on the tokens added since the previous step (its KV cache is
    kept here) and the processor returns `log_softmax(c * log p_ref + (1 - c) * log p_policy)`, the log-probabilities
    of `pi_mix ∝ pi_policy^(1 - c) * pi_ref^c`. Temperature and top-k / top-p warpers of `generate` apply after it.

    Args:
        ref_model: Unwrapped reference model (for a PEFT policy, the policy itself used inside `ref_context`).
        mixture_coef: Weight `c` of the reference, in [0, 1].
        prompt_mask: `(N, L)` attention mask of the left-padded prompts given to `generate`.
        ref_context: Factory of the context inside which `ref_model` acts as the reference (PEFT: adapters
            disabled). Defaults to no context.
    """

    def __init__(
        self,
        ref_model: nn.Module,
        mixture_coef: float,
        prompt_mask: torch.Tensor,
        ref_context: Callable[[], Any] | None = None,
    ):
        if not 0.0 <= mixture_coef <= 1.0:
            raise ValueError(f"mixture_coef must lie in [0, 1]; got {mixture_coef}.")
        self.ref_model = ref_model
        self.mixture_coef = float(mixture_coef)
        self.attention_mask = prompt_mask
        self.ref_context = ref_context or contextlib.nullcontext
        self.cache: DynamicCache | None = None
        self.num_seen = 0

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.cache is None:
            self.cache = DynamicCache(config=self.ref_model.config)
            new_ids = input_ids
            attention_mask = self.attention_mask
        else:
            new_ids = input_ids[:, self.num_seen :]
            extension = torch.ones_like(new_ids, dtype=self.attention_mask.dtype)
            attention_mask = torch.cat([self.attention_mask, extension], dim=1)
        # Positions count from each prompt's first real token, as `generate` numbers them.
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, -new_ids.shape[1] :]
        with self.ref_context():
            outputs = self.ref_model(
                input_ids=new_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **cache_kwargs(self.ref_model, self.cache),
            )
        self.attention_mask = attention_mask
        self.num_seen = input_ids.shape[1]
        return geometric_mixture_logps(scores, outputs.logits[:, -1], self.mixture_coef).to(scores.dtype)


class GeometricMixtureWrapper(GenerationMixin):
    """A model-like object whose next-token logits are those of the geometric mixture of a policy and a reference
    model, so that `generate` samples from `pi_mix ∝ pi_policy^(1 - c) * pi_ref^c` (TRL's Nash-MD helper).

    `forward` runs both models on the same inputs (without gradients) and returns the policy's outputs with `logits`
    replaced by the mixture's log-probabilities. With a KV cache each model keeps its own: the reference's cache is
    created alongside each new cache `generate` hands to the policy, so `generate` gives the same tokens with and
    without the cache (TRL 1.12's wrapper hands the reference the policy's cache, and under transformers 5 its cached
    generations differ from the mixture's). [`NashMDTrainer`] samples the mixture through
    [`GeometricMixtureLogitsProcessor`] instead (the same distribution, the reference run once per new token).

    Args:
        model: The policy (a causal LM).
        ref_model: The reference model (same vocabulary).
        generation_config: Default sampling settings of `generate`.
        mixture_coef: Weight `c` of the reference, in [0, 1].
        device: Device of the inputs `generate` prepares; defaults to the policy's (TRL requires it for `generate`).
    """

    main_input_name = "input_ids"
    _supports_cache_class = False
    _supports_static_cache = False
    _is_stateful = False

    def __init__(
        self,
        model: nn.Module,
        ref_model: nn.Module,
        generation_config: GenerationConfig,
        mixture_coef: float = 0.5,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.model = model
        self.ref_model = ref_model
        self.config = model.config
        self.generation_config = generation_config
        self.mixture_coef = mixture_coef
        self.device = torch.device(device) if device is not None else getattr(model, "device", None)
        self._ref_cache: DynamicCache | None = None
        self._ref_cache_owner: weakref.ref | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def _reference_cache(self, policy_cache: Any) -> DynamicCache:
        """The reference's cache paired with the policy's `policy_cache` (a new one for a new generation)."""
        owner = self._ref_cache_owner() if self._ref_cache_owner is not None else None
        if owner is not policy_cache or self._ref_cache is None:
            self._ref_cache = DynamicCache(config=self.ref_model.config)
            self._ref_cache_owner = weakref.ref(policy_cache)
        return self._ref_cache

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model_outputs = self.model(*args, **kwargs)
        ref_kwargs = dict(kwargs)
        for name in CACHE_KEYWORDS:  # the KV cache, under whichever name the installed transformers uses
            if kwargs.get(name) is not None:
                ref_kwargs[name] = self._reference_cache(kwargs[name])
        ref_outputs = self.ref_model(*args, **ref_kwargs)
        model_outputs.logits = geometric_mixture_logps(model_outputs.logits, ref_outputs.logits, self.mixture_coef)
        return model_outputs

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.prepare_inputs_for_generation(*args, **kwargs)

    def _validate_model_class(self) -> None:
        pass

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]) -> None:
        pass

    # Read and set by `generate` around decoding (mixture-of-experts kernels): the policy's.
    def get_experts_implementation(self) -> Any:
        getter = getattr(self.model, "get_experts_implementation", None)
        return getter() if getter is not None else None

    def set_experts_implementation(self, experts_implementation: Any) -> None:
        setter = getattr(self.model, "set_experts_implementation", None)
        if setter is not None:
            setter(experts_implementation)


class NashMDTrainer(OnlineDPOTrainer):
    """Trainer for Nash-MD (Nash learning from human feedback, mirror descent), a small extension of
    [`OnlineDPOTrainer`].

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.nash_md import NashMDConfig, NashMDTrainer

    trainer = NashMDTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=get_model_path("tiny-Qwen2ForSequenceClassification"),
        args=NashMDConfig(output_dir="nash-md-out", per_device_train_batch_size=2, max_new_tokens=16, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Policy to train (path / hub id or instance).
        ref_model (`str`, `PreTrainedModel` or `None`, defaults to `None`):
            Reference model: part of the opponent mixture and anchor of the KL regulariser. `None` copies the initial
            policy (PEFT policy: the policy with its adapters disabled).
        reward_funcs (`RewardFunc`, `list[RewardFunc]` or `None`, defaults to `None`):
            Reward models and/or functions, as in [`OnlineDPOTrainer`]; the preference probability is the sigmoid of
            the score difference. Exclusive with `judge`.
        args (`NashMDConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `NashMDConfig(f"{model_name}-NashMD")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Must be None (see [`OnlineDPOTrainer`]).
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data with a `prompt` column.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer of the policy (and of the reference).
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; unused.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Accepted for compatibility; unused.
        judge (`BasePairwiseJudge` or `None`, defaults to `None`):
            Pairwise judge comparing the policy's and the mixture's completions: a hard verdict, or the probability
            that the first wins when its `judge` method accepts `return_scores` (as `PairRMJudge` does). Exclusive
            with `reward_funcs`.
        reward_processing_classes (`PreTrainedTokenizerBase`, a list of them or `None`, defaults to `None`):
            Tokenizers of the reward models (keyword only here, as in TRL's signature).
    """

    _tag_names = ["trl", "nash-md"]
    _name = "Nash-MD"
    _paper = {
        "title": "Nash Learning from Human Feedback",
        "id": "2312.00886",
        "citation": (
            "@inproceedings{munos2024nash,\n"
            "    title        = {{Nash Learning from Human Feedback}},\n"
            "    author       = {R{\\'{e}}mi Munos and Michal Valko and Daniele Calandriello and Mohammad Gheshlaghi "
            "Azar and Mark Rowland and Zhaohan Daniel Guo and Yunhao Tang and Matthieu Geist and Thomas Mesnard and "
            'C{\\"{o}}me Fiegel and Andrea Michi and Marco Selvi and Sertan Girgin and Nikola Momchev and Olivier '
            "Bachem and Daniel J. Mankowitz and Doina Precup and Bilal Piot},\n"
            "    year         = 2024,\n"
            "    booktitle    = {Forty-first International Conference on Machine Learning, {ICML} 2024},\n"
            "}"
        ),
    }
    _config_class = NashMDConfig
    _output_dir_suffix = "NashMD"
    _policy_samples_per_prompt = 1
    _reward_models_score_ids = True
    _soft_preferences = True

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module" = None,
        ref_model: "str | PreTrainedModel | nn.Module | None" = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: NashMDConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        peft_config: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        judge: Any = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
    ):
        super().__init__(
            model=model,
            ref_model=ref_model,
            reward_funcs=reward_funcs,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            judge=judge,
        )
        self._mixture_coef_schedule = _schedule_values(self.args.mixture_coef)

    @property
    def mixture_coef(self) -> float:
        """The mixture coefficient of the current epoch (`args.mixture_coef` may hold one value per epoch)."""
        return self._epoch_value(self._mixture_coef_schedule)

    def _generate_pairs(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        # First completion: the policy (through the core's backend); second: the geometric mixture, with transformers.
        output = self._generate_rows(rows)
        prompt_lists = output["prompt_ids"]
        coef = self.mixture_coef
        with self._unwrapped_for_generation(self.model_wrapped) as policy, contextlib.ExitStack() as stack:
            if self.ref_model is not None:
                reference = stack.enter_context(self._unwrapped_for_generation(self.ref_model))
                ref_context = None
            else:  # PEFT policy: the reference is the same model with its adapters disabled during its forward
                reference = policy

                def ref_context():
                    return use_adapter(policy, None)

            mixture_completions = self._generate_with(
                policy,
                prompt_lists,
                lambda prompt_mask: GeometricMixtureLogitsProcessor(reference, coef, prompt_mask, ref_context),
            )
        return prompt_lists, output["completion_ids"], mixture_completions

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        beta = self.beta
        num_pairs = inputs["first_win_prob"].shape[0]
        # The loss and the metrics only need the policy's own completions; the mixture's serve the preference only.
        first = {key: value[:num_pairs] for key, value in inputs.items() if key != "first_win_prob"}
        policy_token_logps, _, aux_loss = self._completion_logps(model, first)
        ref_token_logps = first["ref_per_token_logps"].to(policy_token_logps.dtype)
        mask = first["completion_mask"].to(policy_token_logps.dtype)

        probability = inputs["first_win_prob"].to(policy_token_logps.dtype)
        valid = ~torch.isnan(probability)
        # No verdict carries no preference signal: probability 1/2 zeroes the score term, the KL term stays.
        probability = torch.where(valid, probability, torch.full_like(probability, 0.5))
        losses, scores, kl = nash_md_loss(policy_token_logps, ref_token_logps, mask, probability, beta)
        policy_logps = (policy_token_logps.detach() * mask).sum(dim=1)
        ref_logps = (ref_token_logps * mask).sum(dim=1)
        loss = losses.mean() / self._gradient_accumulation_divisor()
        loss = self._add_aux_loss(loss, aux_loss)

        with torch.no_grad():
            policy_logps = policy_logps.detach()
            valid_f = valid.float()
            count = valid_f.sum()
            contains_eos = inputs["contains_eos"].float()
            # As TRL logs them: `logps/chosen` and `logps/rejected` are the policy's and the reference's
            # log-probabilities of the policy's completions, `rewards/margins` their difference and
            # `rewards/accuracies` the share of pairs where the policy's is higher.
            means = {
                "loss/kl": kl.mean(),
                "loss/score": scores.detach().mean(),
                "objective/entropy": -policy_logps.mean(),
                "logps/chosen": policy_logps.mean(),
                "logps/rejected": ref_logps.mean(),
                "rewards/margins": (policy_logps - ref_logps).mean(),
                "rewards/accuracies": (policy_logps > ref_logps).float().mean(),
                "val/model_contain_eos_token": contains_eos[:num_pairs].mean(),
                "val/ref_contain_eos_token": contains_eos[num_pairs:].mean(),
                "mixture_coef": self.mixture_coef,
                "beta": beta,
            }
            ratios = {"rewards/probabilities": ((probability * valid_f).sum(), count)}
            if "scores" in inputs:
                model_scores, mixture_scores = inputs["scores"][:num_pairs], inputs["scores"][num_pairs:]
                means["rewards/chosen"] = model_scores.mean()
                means["rewards/rejected"] = mixture_scores.mean()
            self._record_batch_metrics(self._mode, means=means, ratios=ratios)
        return loss
