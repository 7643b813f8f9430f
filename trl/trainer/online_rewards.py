"""Scoring for the online RL trainers: reward functions and reward models, from completions to rewards.

[`_OnlineRewardsMixin`] is inherited by `_OnlineTrainer` (see `online_base.py`). `_prepare_reward_funcs` turns the
`reward_funcs` argument into callables and frozen reward models (with their tokenizers and names);
`_calculate_rewards` calls each of them on a round (async functions concurrently) and gathers the `(N_global, F)`
rewards, NaN where a function returned None; `_aggregated_rewards` applies the reward weights.
"""

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from ..data_utils import apply_chat_template, is_conversational
from .online_math import aggregate_rewards
from .utils import get_callable_name, is_async_callable


RewardFunc = str | PreTrainedModel | Callable[..., list[float | None]]


# ---------------------------------------------------------------------------------------------------------------------
# Reward function plumbing
# ---------------------------------------------------------------------------------------------------------------------
# Reward functions already warned about returning NaN (once per function name and process).
_WARNED_NAN_REWARDS: set[str] = set()


def _to_float_list(values: Any, name: str, expected: int, prompts: list | None = None) -> list[float]:
    """Validate a reward function's output: one finite number (or None) per completion. None becomes NaN.

    None is TRL's way for a function to say "does not apply to this completion"; NaN is read the same way (as TRL
    does, with a one-time warning). An infinite number is a bug in the function (a log of 0) that would turn the
    advantages into NaN, and is refused, naming the function and the prompt.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(
            f"Reward function {name!r} must return a list with one reward per completion ({expected} values); it "
            f"returned {type(values).__name__}. Return e.g. `[1.0, 0.0, ...]` (None for completions it does not "
            "score)."
        )
    if len(values) != expected:
        raise ValueError(
            f"Reward function {name!r} returned {len(values)} values, but {expected} completions were scored; it "
            "must return exactly one reward (or None) per completion, in the order of `completions`."
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"Reward function {name!r} returned a non-numeric value at position {i}: {value!r} "
                f"({type(value).__name__}). Rewards must be numbers (int/float) or None."
            )
        if math.isnan(value):
            # As TRL: NaN counts like None (left out of the NaN-aware means), which a bug can also produce: said once.
            if name not in _WARNED_NAN_REWARDS:
                _WARNED_NAN_REWARDS.add(name)
                warnings.warn(
                    f"Reward function {name!r} returned NaN for completion {i}; it is treated like None (no reward "
                    "for that completion), as TRL does. Return None explicitly if that is intended.",
                    UserWarning,
                    stacklevel=3,
                )
            out.append(float("nan"))
            continue
        if not math.isfinite(value):
            prompt = str(prompts[i])[:200] if prompts is not None and i < len(prompts) else "?"
            raise ValueError(
                f"Reward function {name!r} returned {value} for completion {i} (prompt {prompt!r}). Rewards must "
                "be finite numbers; return None for a completion the function does not apply to."
            )
        out.append(float(value))
    return out


def _run_coroutines(coroutines: list) -> list:
    """Run coroutines concurrently and return their results, also when an event loop is already running here."""

    async def gather_all():
        return await asyncio.gather(*coroutines)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather_all())
    # Inside a running loop (e.g. a notebook): run on a fresh loop in a worker thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather_all()).result()


def _accepts_keyword(func: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def reward_signature_problem(func: Callable, keywords: list[str]) -> str | None:
    """Why calling `func(**{name: ... for name in keywords})` would fail, or None when it would not (or when its
    signature cannot be read).

    A function with `**kwargs` takes every keyword; one without must name each of `keywords` as a parameter. (Required
    parameters are not checked: a `rollout_func`, tools or vLLM may add keywords beyond the dataset columns.)
    """
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {parameter.name for parameter in parameters if parameter.kind in by_keyword}
    unexpected = [name for name in keywords if name not in accepted]
    if unexpected:
        return f"it has no `**kwargs` and does not accept {unexpected}"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions of the trainer
# ---------------------------------------------------------------------------------------------------------------------
class _OnlineRewardsMixin:
    """Reward-function preparation and scoring of [`_OnlineTrainer`] (not usable on its own).

    Reads from the trainer: `accelerator`, `state`, `reward_funcs`, `reward_processing_classes`,
    `reward_func_names`, `reward_weights`, `_metrics`, `_logged_extra` and `_mode`.
    """

    # Whether reward functions get the `log_extra` / `log_metric` callbacks (GRPO and RLOO, as in TRL; TRL's Online
    # DPO family passes neither).
    _reward_logging_callbacks = True

    def _prepare_reward_funcs(self, reward_funcs: Any, reward_processing_classes: Any, args: Any):
        if reward_funcs is None:
            raise ValueError(
                f"{type(self).__name__} needs at least one reward function: pass reward_funcs=<callable>, a reward "
                "model (a path/id or an AutoModelForSequenceClassification), or a list of them."
            )
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is an empty list; give at least one reward function or reward model.")
        if reward_processing_classes is None:
            processing = [None] * len(funcs)
        else:
            # A single processing class stands for one reward function, never for several (as in TRL).
            if isinstance(reward_processing_classes, (list, tuple)):
                processing = list(reward_processing_classes)
            else:
                processing = [reward_processing_classes]
            if len(processing) != len(funcs):
                raise ValueError(
                    f"The number of reward processing classes ({len(processing)}) must match the number of reward "
                    f"functions ({len(funcs)}). Pass a list with one entry per reward function, None for plain "
                    "callables and for reward models whose tokenizer is loaded from their path."
                )
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        init_kwargs.pop("quantization_config", None)
        names = []
        for i, func in enumerate(funcs):
            if isinstance(func, str):
                from .utils import create_model_from_path

                funcs[i] = create_model_from_path(
                    func, architecture=AutoModelForSequenceClassification, num_labels=1, **init_kwargs
                )
                func = funcs[i]
            if isinstance(func, nn.Module):
                func.eval()
                for param in func.parameters():
                    param.requires_grad_(False)
                name_or_path = getattr(getattr(func, "config", None), "_name_or_path", "") or type(func).__name__
                names.append(name_or_path.rstrip("/").split("/")[-1])
                if processing[i] is None:
                    processing[i] = AutoTokenizer.from_pretrained(name_or_path)
                reward_tokenizer = processing[i]
                if reward_tokenizer.pad_token is None:
                    reward_tokenizer.pad_token = reward_tokenizer.eos_token
                if getattr(func.config, "pad_token_id", None) is None:
                    func.config.pad_token_id = reward_tokenizer.pad_token_id
            elif callable(func):
                names.append(get_callable_name(func))
            else:
                raise ValueError(
                    f"reward_funcs[{i}] is a {type(func).__name__}; expected a callable, a model path/id (str) or an "
                    "AutoModelForSequenceClassification model."
                )
        return funcs, processing, names

    def _check_reward_func_signatures(self, train_dataset: Any) -> None:
        """Refuse, before training, a reward function that the first scoring call would fail on (a function without
        `**kwargs` gets a `TypeError` for the first keyword it does not name)."""
        from .._data.formats import get_dataset_column_names

        columns = get_dataset_column_names(train_dataset) if train_dataset is not None else []
        keywords = ["prompts", "completions", "completion_ids", "trainer_state"]
        if self._reward_logging_callbacks:
            keywords += ["log_extra", "log_metric"]
        keywords += [column for column in columns if column not in ("prompt", "completion", "completion_ids")]
        for func, name in zip(self.reward_funcs or [], self.reward_func_names or []):
            if isinstance(func, nn.Module):
                continue
            problem = reward_signature_problem(func, keywords)
            if problem is not None:
                raise TypeError(
                    f"Reward function {name!r} cannot be called as the trainer calls it: {problem}. Reward functions "
                    f"get keyword arguments: {', '.join(keywords)} (the dataset columns included). Add `**kwargs` "
                    f"to its signature to take the ones it does not use, e.g. `def {name}(completions, **kwargs):`."
                )

    # Environments of the round's rows (tool calling with `environment_factory`), passed to the reward functions.
    environments: list[Any] | None = None

    def _log_completion_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` callback of reward functions: a column added to the completions table."""
        self._logged_extra[column] = list(values)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` callback of reward functions: a scalar averaged into this interval's metrics."""
        self._metrics[self._mode][name].append(float(value))

    def _calculate_rewards(
        self,
        inputs: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids_list: list[list[int]],
    ) -> torch.Tensor:
        """TRL's hook: score every completion with every reward function; returns the float32 `(N_global, F)`
        rewards of all processes (rank order), NaN where a function returned None.

        Reads `reward_funcs`, `reward_processing_classes` and `reward_func_names` at call time. Callables are called
        with keyword arguments `prompts`, `completions`, `completion_ids`, `trainer_state`, `log_extra`,
        `log_metric` (see `_reward_logging_callbacks`), `environments` (with an environment factory) and every other
        column of `inputs`. `async def` functions run concurrently.
        """
        completion_ids = completion_ids_list
        device = self.accelerator.device
        num = len(prompts)
        rewards = torch.full((num, len(self.reward_funcs)), float("nan"), dtype=torch.float32, device=device)

        columns = {
            key: [example.get(key) for example in inputs]
            for key in inputs[0]
            if key not in ("prompt", "completion", "completion_ids")
        }
        if self.environments is not None:
            columns["environments"] = self.environments
        common = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "trainer_state": self.state,
            **(
                {"log_extra": self._log_completion_extra, "log_metric": self._log_metric}
                if self._reward_logging_callbacks
                else {}
            ),
            **columns,
        }
        pending: list[tuple[int, Any]] = []
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if isinstance(func, nn.Module):
                rewards[:, i] = self._score_with_reward_model(
                    func, self.reward_processing_classes[i], prompts, completions
                ).to(device)
                continue
            kwargs = common
            if _accepts_keyword(func, "completions_ids"):  # spelling used in some older examples
                kwargs = {**common, "completions_ids": completion_ids}
            if is_async_callable(func):
                pending.append((i, func(**kwargs)))
            else:
                values = func(**kwargs)
                if inspect.iscoroutine(values):
                    pending.append((i, values))
                else:
                    rewards[:, i] = torch.tensor(_to_float_list(values, name, num, prompts), device=device)
        if pending:
            results = _run_coroutines([coroutine for _, coroutine in pending])
            for (i, _), values in zip(pending, results):
                rewards[:, i] = torch.tensor(
                    _to_float_list(values, self.reward_func_names[i], num, prompts), device=device
                )

        all_nan = torch.isnan(rewards).all(dim=1)
        if bool(all_nan.any()):
            row = int(all_nan.nonzero()[0])
            shown = {key: values[row] for key, values in columns.items()}
            warnings.warn(
                f"Every reward function returned None for completion {row} (prompt {str(prompts[row])[:200]!r}, "
                f"columns {str(shown)[:200]}); its reward counts as 0. Make sure at least one reward function "
                "applies to every sample.",
                UserWarning,
                stacklevel=2,
            )
        return self.accelerator.gather(rewards)

    @torch.no_grad()
    def _score_with_reward_model(
        self, reward_model: nn.Module, tokenizer: Any, prompts: list[Any], completions: list[Any]
    ) -> torch.Tensor:
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": prompt + completion}, tokenizer)["text"]
                for prompt, completion in zip(prompts, completions)
            ]
        else:
            texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
        encoded = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        device = next(reward_model.parameters()).device
        encoded = {key: value.to(device) for key, value in encoded.items()}
        return reward_model(**encoded).logits[:, 0].float()

    def _aggregated_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        return aggregate_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))


class _NoRewardsMixin:
    """For online trainers whose signal is not a reward (distillation from a teacher): no reward functions, an empty
    `(N_global, 0)` score table and zero advantages, so that the online core's bookkeeping stays uniform.

    Placed before `_OnlineTrainer` in the bases so that these overrides win.
    """

    def _prepare_reward_funcs(self, reward_funcs: Any, reward_processing_classes: Any, args: Any):
        return [], [], []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        num_global = len(prompts) * self.accelerator.num_processes
        return torch.zeros((num_global, 0), dtype=torch.float32, device=self.accelerator.device)

    def _compute_advantages(self, rewards_per_func: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        return torch.zeros(rewards_per_func.shape[0], dtype=torch.float32, device=rewards_per_func.device)
