"""`WinRateCallback`: at every evaluation, a pairwise judge compares the model's completions with the reference
model's on the evaluation prompts, and the share of prompts won by the model is logged as `eval_win_rate`."""

from __future__ import annotations

import inspect
from typing import Any

from accelerate.utils import broadcast_object_list
from transformers import GenerationConfig, Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..import_utils import is_wandb_available
from ..trainer.callbacks import _generate_completions, _log_table_to_comet_experiment, _select_eval_prompts
from .judges import BasePairwiseJudge


def _prompt_for_judge(prompt: Any) -> str:
    """Plain text of a prompt for the judge: standard prompts as they are, conversations as a readable transcript
    (`Role: content` blocks) rather than a chat-template rendering full of special tokens."""
    if isinstance(prompt, str):
        return prompt
    blocks = []
    for message in prompt:
        content = message.get("content", "")
        if isinstance(content, list):  # multimodal content parts: keep the text ones
            content = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
        blocks.append(f"{str(message.get('role', '')).capitalize()}: {content}")
    return "\n\n".join(blocks)


def _accepts_argument(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class WinRateCallback(TrainerCallback):
    r"""Measure how often the trained model beats the reference model, according to a pairwise judge.

    When training starts, the callback generates a reference completion for every evaluation prompt, with
    `trainer.ref_model` when the trainer has one and with the model being trained otherwise (that is, its initial
    weights). As a baseline it then judges the reference completions against themselves and logs the result as
    `eval_win_rate`.

    At every evaluation it generates the current model's completions, asks the judge to compare each pair
    `[reference_completion, model_completion]`, and logs `eval_win_rate`: the fraction of prompts whose winner index is
    `1` (the trained model). Invalid verdicts (`-1`) count as not won. The value is also added to the metrics returned
    by `trainer.evaluate()`.

    With `use_soft_judge=True` the judge must accept `return_scores=True` (as `PairRMJudge` does) and return, per
    prompt, the probability that the first (reference) completion is better; the winner is the model when that
    probability is at most 0.5, and `eval_avg_win_prob` = 1 - mean probability is logged as well.

    When `"wandb"` is in `report_to`, a table `win_rate_completions` (columns `step`, `prompt`, `reference_model`,
    `policy`, `winner_index`) is logged at each evaluation; with `"comet_ml"`, `win_rate_completions.csv`.

    Prompts come from the `prompt` column of `trainer.eval_dataset`. Conversational prompts are rendered with the chat
    template for generation and shown to the judge as a plain `Role: content` transcript. The judge runs on the main
    process only (so remote judges receive each request once) and its result is shared with the other processes.

    Args:
        judge (`BasePairwiseJudge`):
            Judge comparing two completions per prompt.
        trainer (`Trainer`):
            Trainer whose model, processing class, accelerator, evaluation dataset and (if any) `ref_model` are used.
        generation_config (`GenerationConfig`, *optional*):
            Generation settings for both models; `None` uses each model's own generation config.
        num_prompts (`int`, *optional*):
            Use only the first `num_prompts` evaluation prompts; `None` uses them all.
        shuffle_order (`bool`, *optional*, defaults to `True`):
            Passed to the judge: show each pair in a random order to cancel position bias.
        use_soft_judge (`bool`, *optional*, defaults to `False`):
            Use the judge's probabilities (`return_scores=True`) instead of hard verdicts, and also log
            `eval_avg_win_prob`.

    Example:

    ```python
    from transformers import GenerationConfig
    from trl.experimental.judges import PairRMJudge
    from trl.experimental.winrate_callback import WinRateCallback

    trainer = DPOTrainer(..., eval_dataset=eval_dataset)
    trainer.add_callback(WinRateCallback(PairRMJudge(), trainer, GenerationConfig(max_new_tokens=64), num_prompts=64))
    trainer.train()
    ```
    """

    def __init__(
        self,
        judge: BasePairwiseJudge,
        trainer: Trainer,
        generation_config: GenerationConfig | None = None,
        num_prompts: int | None = None,
        shuffle_order: bool = True,
        use_soft_judge: bool = False,
    ):
        if not callable(getattr(judge, "judge", None)):
            raise ValueError(
                f"WinRateCallback needs a pairwise judge with a `judge(prompts, completions, shuffle_order)` method, "
                f"got {type(judge).__name__}. Pass a `BasePairwiseJudge` such as PairRMJudge or OpenAIPairwiseJudge."
            )
        if use_soft_judge and not _accepts_argument(judge.judge, "return_scores"):
            raise ValueError(
                f"use_soft_judge=True calls `judge.judge(..., return_scores=True)`, but {type(judge).__name__}.judge "
                "has no `return_scores` argument. Use a judge that returns probabilities (e.g. PairRMJudge) or set "
                "use_soft_judge=False."
            )
        self.judge = judge
        self.trainer = trainer
        self.generation_config = generation_config
        self.shuffle_order = shuffle_order
        self.use_soft_judge = use_soft_judge
        self.eval_dataset = _select_eval_prompts(trainer, num_prompts, type(self).__name__)
        self.ref_completions: list[str] = []

    # -- generation and judging ---------------------------------------------------------------------------------------

    def _generate(self, use_reference: bool, batch_size: int) -> list[str]:
        model = getattr(self.trainer, "ref_model", None) if use_reference else None
        _, completions = _generate_completions(
            self.trainer, self.eval_dataset["prompt"], self.generation_config, batch_size, model=model
        )
        return completions

    def _judge(self, pairs: list[list[str]]) -> tuple[list[int], float | None]:
        """Judge `[reference, policy]` pairs on the main process; every process gets `(winner_indices, avg_prob)`."""
        accelerator = self.trainer.accelerator
        result: list[Any] = [None]
        error = None
        if accelerator.is_main_process:
            try:
                result = [self._run_judge(pairs)]
            except Exception as caught:  # tell the other processes too, instead of leaving them waiting
                error = caught
                result = [f"{type(caught).__name__}: {caught}"]
        if accelerator.num_processes > 1:
            result = broadcast_object_list(result, from_process=0)
        if error is not None:
            raise error
        if isinstance(result[0], str):
            raise RuntimeError(f"WinRateCallback: the judge failed on the main process ({result[0]}).")
        return result[0]

    def _run_judge(self, pairs: list[list[str]]) -> tuple[list[int], float | None]:
        """Call the judge and turn its output into winner indices (and the mean win probability when soft)."""
        prompts = [_prompt_for_judge(prompt) for prompt in self.eval_dataset["prompt"]]
        if self.use_soft_judge:
            outputs = list(self.judge.judge(prompts, pairs, self.shuffle_order, return_scores=True))
        else:
            outputs = list(self.judge.judge(prompts, pairs, self.shuffle_order))
        if len(outputs) != len(prompts):
            raise ValueError(
                f"WinRateCallback: {type(self.judge).__name__}.judge returned {len(outputs)} results for "
                f"{len(prompts)} prompts. A pairwise judge must return one result per prompt."
            )
        if not self.use_soft_judge:
            return [int(winner) for winner in outputs], None
        # Soft verdicts: the probability that the first (reference) completion is the better one.
        first_probs = [float(prob) for prob in outputs]
        winners = [0 if prob > 0.5 else 1 for prob in first_probs]
        avg_win_prob = 1.0 - sum(first_probs) / len(first_probs) if first_probs else float("nan")
        return winners, avg_win_prob

    def _metrics(self, winners: list[int], avg_win_prob: float | None) -> dict[str, float]:
        metrics = {"eval_win_rate": sum(w == 1 for w in winners) / len(winners) if winners else float("nan")}
        if avg_win_prob is not None:
            metrics["eval_avg_win_prob"] = avg_win_prob
        return metrics

    def _log_table(self, args: TrainingArguments, step: int, policy: list[str], winners: list[int]) -> None:
        report_to = args.report_to or []
        if not self.trainer.accelerator.is_main_process or not ({"wandb", "comet_ml"} & set(report_to)):
            return
        import pandas as pd

        table = pd.DataFrame(
            {
                "step": [step] * len(winners),
                "prompt": [_prompt_for_judge(prompt) for prompt in self.eval_dataset["prompt"]],
                "reference_model": self.ref_completions,
                "policy": policy,
                "winner_index": winners,
            }
        )
        if "wandb" in report_to and is_wandb_available():
            import wandb

            if wandb.run is not None:
                wandb.log({"win_rate_completions": wandb.Table(dataframe=table)})
        if "comet_ml" in report_to:
            _log_table_to_comet_experiment("win_rate_completions.csv", table)

    # -- events -------------------------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.ref_completions = self._generate(use_reference=True, batch_size=args.per_device_eval_batch_size)
        # Baseline: the reference against itself (about 0.5 for an unbiased judge).
        winners, avg_win_prob = self._judge([[ref, ref] for ref in self.ref_completions])
        self.trainer.log(self._metrics(winners, avg_win_prob))

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs,
    ):
        if not self.ref_completions:
            # Evaluation without training (`trainer.evaluate()` alone): the reference completions are still missing.
            self.ref_completions = self._generate(use_reference=True, batch_size=args.per_device_eval_batch_size)
        policy_completions = self._generate(use_reference=False, batch_size=args.per_device_eval_batch_size)
        pairs = [[ref, policy] for ref, policy in zip(self.ref_completions, policy_completions)]
        winners, avg_win_prob = self._judge(pairs)
        win_metrics = self._metrics(winners, avg_win_prob)
        if metrics is not None:
            metrics.update(win_metrics)
        self.trainer.log(win_metrics)
        self._log_table(args, state.global_step, policy_completions, winners)
