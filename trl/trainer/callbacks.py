"""Trainer callbacks shared by the TRL trainers.

All of them are `transformers.TrainerCallback` subclasses and work with a plain `transformers.Trainer` too:

- `BEMACallback`: keeps a bias-corrected exponential moving average (BEMA) of the weights in a shadow model.
- `SyncRefModelCallback`: softly pulls a reference model towards the policy every few steps (TR-DPO).
- `LogCompletionsCallback`: generates completions for evaluation prompts and logs them to W&B / Comet.
- `RichProgressCallback`: rich progress bars and a live table of the latest metrics instead of tqdm.
- `WeaveCallback`: logs evaluation-time completions (and optional scores) to W&B Weave.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import nn
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.utils import logging

from ..import_utils import is_comet_available, is_wandb_available, is_weave_available
from .progress_callback import RichProgressCallback  # noqa: F401 (re-exported: TRL's import path)


logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------


def _unwrap_training_model(model: nn.Module) -> nn.Module:
    """Peel DeepSpeed (`.module`), FSDP (`._fsdp_wrapped_module`) and DDP (`.module`) wrappers off a model."""
    while True:
        if hasattr(model, "_fsdp_wrapped_module"):
            model = model._fsdp_wrapped_module
        elif isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


@contextlib.contextmanager
def _full_parameters(params: list[nn.Parameter], modifier_rank: int | None = None):
    """Yield full-size tensors of `params`, however they are sharded across processes (a collective when sharded).

    DeepSpeed ZeRO-3 partitions are gathered for the duration of the block (the yielded tensors are the parameters
    themselves; with `modifier_rank`, that rank's in-place changes are scattered back on exit). FSDP2 parameters
    (`DTensor`s) are materialised as full copies, read-only. Other parameters are yielded as they are.
    """
    if any(hasattr(param, "ds_tensor") for param in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield [param.data for param in params]
        return
    yield [param.full_tensor() if hasattr(param, "full_tensor") else param.data for param in params]


def _copy_into_parameters(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    """Write full-size `values` into `params`, sharded or not (a collective when sharded; every process must pass
    the same values)."""
    if any(hasattr(param, "ds_tensor") for param in params):
        with _full_parameters(params, modifier_rank=0) as full:
            for target, value in zip(full, values):
                target.copy_(value.to(target.device, target.dtype))
        return
    for param, value in zip(params, values):
        if hasattr(param, "device_mesh"):  # FSDP2 DTensor: keep this process's shard of the full value
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
            param.data.to_local().copy_(value.to_local())
        else:
            param.data.copy_(value.to(param.device, param.dtype))


def _is_deepspeed_zero3_enabled() -> bool:
    """Whether the current run shards parameters with DeepSpeed ZeRO stage 3."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return True
    # Runs launched through `accelerate` carry the stage on the accelerator state instead.
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return False
    plugin = AcceleratorState().deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def _select_eval_prompts(trainer: Trainer, num_prompts: int | None, callback_name: str):
    """Validate the trainer's evaluation dataset and keep its first `num_prompts` rows."""
    eval_dataset = getattr(trainer, "eval_dataset", None)
    if eval_dataset is None:
        raise ValueError(
            f"{callback_name} generates completions for the evaluation prompts, but the trainer has no "
            "`eval_dataset`. Pass `eval_dataset=...` to the trainer."
        )
    if isinstance(eval_dataset, dict):
        raise ValueError(
            f"{callback_name} needs a single evaluation dataset, but the trainer's `eval_dataset` is a dict with keys "
            f"{list(eval_dataset)}. Pass one dataset as `eval_dataset`."
        )
    column_names = getattr(eval_dataset, "column_names", None)
    if column_names is not None and "prompt" not in column_names:
        raise ValueError(
            f"{callback_name} reads prompts from the `prompt` column of the evaluation dataset, but its columns are "
            f"{column_names}. Use a prompt-only or prompt-completion dataset."
        )
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"`num_prompts` must be a positive integer or None, got {num_prompts}.")
        eval_dataset = eval_dataset.select(range(min(num_prompts, len(eval_dataset))))
    return eval_dataset


def _generate_completions(
    trainer: Trainer,
    prompts: list,
    generation_config: GenerationConfig | None,
    batch_size: int,
    model: nn.Module | None = None,
) -> tuple[list[str], list[str]]:
    """Generate one completion per prompt with the trainer's model, or with `model` when given (e.g. a reference
    model prepared by the trainer's accelerator).

    Prompts are split across processes, rendered with the chat template when conversational, generated in batches
    of `batch_size` and gathered back, so every process returns the full `(prompt_texts, completions)` lists.
    """
    # Imported here: these modules are shared foundation helpers and pull in optional integrations.
    from ..data_utils import is_conversational, maybe_apply_chat_template
    from ..models.utils import unwrap_model_for_generation

    accelerator = trainer.accelerator
    processing_class = trainer.processing_class
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if model is None:
        model = getattr(trainer, "model_wrapped", None) or trainer.model

    # Decoder-only generation needs the padding on the left so that every completion starts right after its prompt.
    original_padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        with accelerator.split_between_processes(list(prompts)) as local_prompts:
            texts, add_special_tokens = [], True
            for prompt in local_prompts:
                example = {"prompt": prompt}
                if is_conversational(example):
                    # The chat template already holds the special tokens (BOS included).
                    add_special_tokens = False
                texts.append(maybe_apply_chat_template(example, processing_class)["prompt"])

            with unwrap_model_for_generation(model, accelerator) as unwrapped_model:
                # Generate without dropout, then give the training loop back the mode it had.
                was_training = unwrapped_model.training
                unwrapped_model.eval()
                try:
                    completions = _generate_batches(
                        unwrapped_model,
                        tokenizer,
                        texts,
                        batch_size,
                        add_special_tokens,
                        generation_config,
                        accelerator.device,
                    )
                finally:
                    unwrapped_model.train(was_training)
    finally:
        tokenizer.padding_side = original_padding_side

    return gather_object(texts), gather_object(completions)


def _generate_batches(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    batch_size: int,
    add_special_tokens: bool,
    generation_config: GenerationConfig | None,
    device: torch.device,
) -> list[str]:
    """Generate from `texts` in batches of `batch_size` and decode only the new tokens."""
    completions = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        inputs = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
        with torch.no_grad():
            generated = model.generate(**inputs, generation_config=generation_config)
        prompt_length = inputs["input_ids"].shape[1]
        completions.extend(tokenizer.batch_decode(generated[:, prompt_length:], skip_special_tokens=True))
    return completions


def _log_table_to_comet_experiment(name: str, table: Any) -> None:
    """Log a pandas DataFrame as a CSV table to the running Comet experiment, if there is one."""
    if not is_comet_available():
        raise ModuleNotFoundError(
            "`comet_ml` is in `report_to` but not installed. Install it with `pip install comet_ml`."
        )
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    if experiment is not None:
        experiment.log_table(tabular_data=table, filename=name)


# ---------------------------------------------------------------------------------------------------------------------
# BEMA
# ---------------------------------------------------------------------------------------------------------------------


class BEMACallback(TrainerCallback):
    r"""Bias-corrected exponential moving average (BEMA) of the model weights, kept in a shadow model.

    BEMA ([Block & Zhang, 2025](https://huggingface.co/papers/2508.00180)) reduces the lag of a plain EMA by adding
    back a decaying multiple of the distance travelled since a snapshot \\(\theta_0\\):

    $$\theta'_t = \alpha_t (\theta_t - \theta_0) + \text{EMA}_t, \qquad
      \text{EMA}_t = (1 - \beta_t)\,\text{EMA}_{t-1} + \beta_t\,\theta_t,$$

    with \\(\alpha_t = (\rho + \gamma t)^{-\eta}\\) and \\(\beta_t = \max((\rho + \gamma t)^{-\kappa}, \beta_{\min})\\),
    where \\(t\\) is the trainer's global step. The snapshot \\(\theta_0\\) and the EMA are taken when training
    starts and taken again at step `update_after`; the shadow model is refreshed every `update_freq` steps after
    that. Only trainable parameters are averaged. At the end of training the shadow model is saved to
    `{output_dir}/bema`, from where `from_pretrained` reloads it.

    Args:
        update_freq (`int`, *optional*, defaults to `400`):
            Refresh the BEMA weights every this many steps (\\(\phi\\) in the paper).
        ema_power (`float`, *optional*, defaults to `0.5`):
            Exponent \\(\kappa\\) of the EMA factor \\(\beta_t\\). With `0.0`, \\(\beta_t = 1\\) and the EMA simply
            follows the current weights (no averaging).
        bias_power (`float`, *optional*, defaults to `0.2`):
            Exponent \\(\eta\\) of the correction factor \\(\alpha_t\\). With `0.0`, \\(\alpha_t = 1\\) at every step;
            large values make \\(\alpha_t\\) vanish, which leaves a plain EMA.
        lag (`int`, *optional*, defaults to `10`):
            Offset \\(\rho\\) of the schedule, a virtual starting age that smooths the first updates.
        update_after (`int`, *optional*, defaults to `0`):
            Burn-in steps \\(\tau\\): nothing is updated before this step, and \\(\theta_0\\) is taken at it.
        multiplier (`float`, *optional*, defaults to `1.0`):
            Factor \\(\gamma\\) applied to the step count inside the schedule.
        min_ema_multiplier (`float`, *optional*, defaults to `0.0`):
            Floor of the EMA factor \\(\beta_t\\).
        device (`str`, *optional*, defaults to `"cpu"`):
            Device holding \\(\theta_0\\), the EMA and the shadow model. Keep it different from the training device
            to avoid running out of accelerator memory.

    Example:

    ```python
    from trl import BEMACallback

    trainer = Trainer(..., callbacks=[BEMACallback(update_freq=100)])
    trainer.train()  # the averaged model is in f"{trainer.args.output_dir}/bema"
    ```
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
    ):
        if update_freq < 1:
            raise ValueError(f"`update_freq` must be a positive number of steps, got {update_freq}.")
        if update_after < 0:
            raise ValueError(f"`update_after` must be a non-negative number of steps, got {update_after}.")
        self.update_freq = update_freq
        self.ema_power = ema_power
        self.bias_power = bias_power
        self.lag = lag
        self.update_after = update_after
        self.multiplier = multiplier
        self.min_ema_multiplier = min_ema_multiplier
        self.device = device

        self.param_names: list[str] = []
        self.thetat_params: list[torch.Tensor] = []  # live training parameters
        self.theta0_params: list[torch.Tensor] = []  # snapshot θ0, on `device`
        self.ema_params: list[torch.Tensor] = []  # EMA buffers, on `device`
        self.running_model: PreTrainedModel | None = None
        self._running_params: list[torch.Tensor] = []
        self._resumed_state: dict[str, torch.Tensor] | None = None  # read from a checkpoint, applied at train begin

    def _ema_beta(self, step: int) -> float:
        return max((self.lag + self.multiplier * step) ** (-self.ema_power), self.min_ema_multiplier)

    def _bema_alpha(self, step: int) -> float:
        return (self.lag + self.multiplier * step) ** (-self.bias_power)

    @torch.no_grad()
    def _take_snapshot(self) -> None:
        """Reset θ0 and the EMA to the current training weights."""
        # Sharded parameters (ZeRO-3, FSDP2) are read in full: every process keeps the whole average.
        with _full_parameters(self.thetat_params) as current_params:
            for theta0, ema, thetat in zip(self.theta0_params, self.ema_params, current_params):
                theta0.copy_(thetat.detach())
                ema.copy_(thetat.detach())

    @torch.no_grad()
    def _update_bema_weights(self, step: int) -> None:
        beta = self._ema_beta(step)
        alpha = self._bema_alpha(step)
        with _full_parameters(self.thetat_params) as current_params:
            for thetat, theta0, ema, running in zip(
                current_params, self.theta0_params, self.ema_params, self._running_params
            ):
                current = thetat.detach().to(self.device, dtype=ema.dtype)
                ema.mul_(1.0 - beta).add_(current, alpha=beta)
                running.copy_(ema + alpha * (current - theta0))

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: PreTrainedModel | None = None,
        **kwargs,
    ):
        if model is None:
            raise ValueError("BEMACallback needs the model being trained, but the callback received `model=None`.")
        model = _unwrap_training_model(model)

        self.running_model = type(model)(model.config).to(self.device)
        # Under ZeRO-3 / FSDP2 each process holds a shard of every parameter: copy the gathered full weights.
        named = list(model.named_parameters())
        with _full_parameters([param for _, param in named]) as full:
            state = {name: tensor.detach().to(self.device, copy=True) for (name, _), tensor in zip(named, full)}
        persistent = self.running_model.state_dict()
        state.update({name: buffer for name, buffer in model.named_buffers() if name in persistent})
        self.running_model.load_state_dict(state, strict=False)
        running_params = dict(self.running_model.named_parameters())

        self.param_names, self.thetat_params, self.theta0_params, self.ema_params = [], [], [], []
        self._running_params = []
        for name, param in named:
            if not param.requires_grad:
                continue
            snapshot = state[name].clone()
            self.param_names.append(name)
            self.thetat_params.append(param)
            self.theta0_params.append(snapshot)
            self.ema_params.append(snapshot.clone())
            self._running_params.append(running_params[name])
        if self._resumed_state is not None:
            self._restore_averages(self._resumed_state)
            self._resumed_state = None

    # Resuming: θ0, the EMA and the shadow model cannot be rebuilt from the checkpointed weights, so a TRL trainer
    # saves them into each checkpoint (`save_checkpoint_files`) and hands them back on resume (`load_checkpoint_files`).
    CHECKPOINT_FILE = "bema_state.safetensors"

    def save_checkpoint_files(self, checkpoint_dir: str, is_main_process: bool) -> None:
        """Write θ0, the EMA and the shadow model's weights into `checkpoint_dir` (main process only)."""
        if not is_main_process or self.running_model is None:
            return
        from safetensors.torch import save_file

        tensors = {f"theta0.{name}": tensor for name, tensor in zip(self.param_names, self.theta0_params)}
        tensors.update({f"ema.{name}": tensor for name, tensor in zip(self.param_names, self.ema_params)})
        tensors.update({f"running.{name}": tensor for name, tensor in self.running_model.state_dict().items()})
        # safetensors refuses tensors that share memory (tied embeddings): store independent contiguous copies.
        save_file({key: value.detach().clone().contiguous() for key, value in tensors.items()},
                  os.path.join(checkpoint_dir, self.CHECKPOINT_FILE))  # fmt: skip

    def load_checkpoint_files(self, checkpoint_dir: str) -> None:
        """Read what `save_checkpoint_files` wrote; it is applied when training begins (nothing if absent)."""
        path = os.path.join(checkpoint_dir, self.CHECKPOINT_FILE)
        if os.path.isfile(path):
            from safetensors.torch import load_file

            self._resumed_state = load_file(path, device=str(self.device))
        else:
            logger.warning(
                "The checkpoint %s holds no BEMA state (%s; TRL's checkpoints do not keep it), so BEMA starts over "
                "from the resumed weights (θ0 and the EMA taken there), as under TRL.",
                checkpoint_dir,
                self.CHECKPOINT_FILE,
            )

    @torch.no_grad()
    def _restore_averages(self, state: dict[str, torch.Tensor]) -> None:
        for name, theta0, ema in zip(self.param_names, self.theta0_params, self.ema_params):
            theta0.copy_(state[f"theta0.{name}"])
            ema.copy_(state[f"ema.{name}"])
        running = {key.removeprefix("running."): value for key, value in state.items() if key.startswith("running.")}
        self.running_model.load_state_dict(running, strict=False)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        step = state.global_step
        if step < self.update_after:
            return
        if step == self.update_after:
            self._take_snapshot()
            return
        if (step - self.update_after) % self.update_freq == 0:
            self._update_bema_weights(step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if state.is_world_process_zero and self.running_model is not None:
            self.running_model.save_pretrained(os.path.join(args.output_dir, "bema"))


# ---------------------------------------------------------------------------------------------------------------------
# Reference-model synchronisation
# ---------------------------------------------------------------------------------------------------------------------


class SyncRefModelCallback(TrainerCallback):
    r"""Pull a reference model towards the trained model every few steps (TR-DPO style soft update).

    At every step where `global_step % args.ref_model_sync_steps == 0`, each reference parameter becomes
    \\(\alpha \cdot \theta_{\text{policy}} + (1 - \alpha) \cdot \theta_{\text{ref}}\\) with
    \\(\alpha\\) = `args.ref_model_mixup_alpha`. Frequency and \\(\alpha\\) are read from the training arguments when
    the step ends, not fixed at construction. Under DeepSpeed ZeRO-3 the sharded parameters of both models are
    gathered first and rank 0 applies the update.

    Args:
        ref_model (`PreTrainedModel` or `torch.nn.Module`):
            Reference model updated in place.
        accelerator (`Accelerator` or `None`):
            Accelerator used to unwrap the trained model before reading its weights; `None` without Accelerate.

    Example:

    ```python
    from trl import SyncRefModelCallback

    trainer.add_callback(SyncRefModelCallback(ref_model=ref_model, accelerator=trainer.accelerator))
    ```
    """

    def __init__(self, ref_model: PreTrainedModel | nn.Module, accelerator: Accelerator | None):
        self.accelerator = accelerator
        self.ref_model = ref_model

    @staticmethod
    @torch.no_grad()
    def _sync_target_model(model: nn.Module, target_model: nn.Module, alpha: float) -> None:
        params = list(model.parameters())
        target_params = list(target_model.parameters())
        if len(params) != len(target_params):
            raise ValueError(
                f"Cannot sync the reference model: it has {len(target_params)} parameter tensors while the trained "
                f"model has {len(params)}. Both models must share the same architecture."
            )
        for target_param, param in zip(target_params, params):
            target_param.data.mul_(1.0 - alpha).add_(
                param.data.to(target_param.device, target_param.dtype), alpha=alpha
            )

    @staticmethod
    def sync_target_model(model: nn.Module, target_model: nn.Module, alpha: float) -> None:
        """Update `target_model` in place to `(1 - alpha) * target_model + alpha * model`, parameter by parameter.

        Args:
            model (`torch.nn.Module`):
                Model whose weights are blended in.
            target_model (`torch.nn.Module`):
                Model updated in place.
            alpha (`float`):
                Weight of `model` in the blend.
        """
        if _is_deepspeed_zero3_enabled():
            import deepspeed

            gathered = list(model.parameters()) + list(target_model.parameters())
            with deepspeed.zero.GatheredParameters(gathered, modifier_rank=0):
                # Only the modifier rank writes; DeepSpeed scatters its result when the context exits.
                if deepspeed.comm.get_rank() == 0:
                    SyncRefModelCallback._sync_target_model(model, target_model, alpha)
        else:
            SyncRefModelCallback._sync_target_model(model, target_model, alpha)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        model = kwargs["model"]
        if self.ref_model is not None and state.global_step % args.ref_model_sync_steps == 0:
            if self.accelerator is not None:
                model = self.accelerator.unwrap_model(model)
            self.sync_target_model(model, self.ref_model, args.ref_model_mixup_alpha)


# ---------------------------------------------------------------------------------------------------------------------
# Completion logging
# ---------------------------------------------------------------------------------------------------------------------


class LogCompletionsCallback(TrainerCallback):
    r"""Generate completions for evaluation prompts every few steps and log them as a table to W&B and/or Comet.

    The table is cumulative, with one row per (step, prompt): columns `step`, `prompt`, `completion`. It is logged
    under the key `completions` to Weights & Biases when `"wandb"` is in `report_to`, and as `completions.csv` to
    Comet when `"comet_ml"` is. Prompts come from the `prompt` column of `trainer.eval_dataset`; conversational
    prompts are rendered with the chat template first.

    Args:
        trainer (`Trainer`):
            Trainer whose model, processing class, accelerator and evaluation dataset are used.
        generation_config (`GenerationConfig`, *optional*):
            Generation settings; `None` uses the model's own generation config.
        num_prompts (`int`, *optional*):
            Use only the first `num_prompts` evaluation prompts; `None` uses them all.
        freq (`int`, *optional*):
            Log every this many steps; `None` uses the trainer's evaluation interval (`eval_steps`).

    Example:

    ```python
    from transformers import GenerationConfig
    from trl import LogCompletionsCallback

    callback = LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=32), num_prompts=8, freq=50)
    trainer.add_callback(callback)
    ```
    """

    def __init__(
        self,
        trainer: Trainer,
        generation_config: GenerationConfig | None = None,
        num_prompts: int | None = None,
        freq: int | None = None,
    ):
        self.trainer = trainer
        self.generation_config = generation_config
        self.freq = freq
        self.table: list[list] = []
        self._last_logged_step = -1
        self.eval_dataset = _select_eval_prompts(trainer, num_prompts, type(self).__name__)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # Several events may end on the same step (e.g. when resuming): log once.
        if state.global_step == self._last_logged_step:
            return
        freq = self.freq or state.eval_steps
        if not freq or state.global_step % freq != 0:
            return

        prompts, completions = _generate_completions(
            self.trainer, self.eval_dataset["prompt"], self.generation_config, args.per_device_eval_batch_size
        )

        if self.trainer.accelerator.is_main_process:
            self.table.extend(
                [state.global_step, prompt, completion] for prompt, completion in zip(prompts, completions)
            )
            import pandas as pd

            table = pd.DataFrame(self.table, columns=["step", "prompt", "completion"])
            report_to = args.report_to or []
            if "wandb" in report_to:
                import wandb

                if wandb.run is not None:
                    wandb.log({"completions": wandb.Table(dataframe=table)})
            if "comet_ml" in report_to:
                _log_table_to_comet_experiment("completions.csv", table)

        self._last_logged_step = state.global_step


# ---------------------------------------------------------------------------------------------------------------------
# Weave
# ---------------------------------------------------------------------------------------------------------------------


class WeaveCallback(TrainerCallback):
    r"""Log evaluation-time completions to [W&B Weave](https://weave-docs.wandb.ai/), optionally scored.

    At each evaluation the callback generates a completion for every evaluation prompt (as `LogCompletionsCallback`
    does) and records them with a `weave.EvaluationLogger` whose attributes carry the training step, the model name
    and the generation config.

    - Tracing mode (`scorers=None`): predictions (prompt in, completion out) are logged for inspection.
    - Evaluation mode (`scorers` given): every scorer is called as `scorer(prompt, completion)` for each prediction
      and its score logged with it; a summary holds `total_predictions`, `successful_predictions` and
      `avg_<scorer>` for each scorer.

    Weave is initialised when training starts (or at the first evaluation): an existing Weave client is reused, else
    `project_name` is used, else the `entity/project` of the active wandb run; with none of these a `ValueError` is
    raised. When `weave` is not installed, a warning is emitted and nothing is logged.

    Args:
        trainer (`Trainer`):
            Trainer whose model, processing class, accelerator and evaluation dataset are used.
        project_name (`str`, *optional*):
            Weave project to log to when no Weave client is active yet.
        scorers (`dict[str, Callable]`, *optional*):
            Scorer name → function `scorer(prompt: str, completion: str) -> float | int`. Enables evaluation mode.
        generation_config (`GenerationConfig`, *optional*):
            Generation settings; `None` uses the model's own generation config.
        num_prompts (`int`, *optional*):
            Use only the first `num_prompts` evaluation prompts; `None` uses them all.
        dataset_name (`str`, *optional*, defaults to `"eval_dataset"`):
            Dataset label in the Weave evaluation.
        model_name (`str`, *optional*):
            Model label in the Weave evaluation; defaults to `model.config._name_or_path`, or `"unknown_model"`.

    Example:

    ```python
    from trl import WeaveCallback

    def is_short(prompt, completion):
        return float(len(completion) < 200)

    trainer.add_callback(WeaveCallback(trainer, project_name="my-team/my-project", scorers={"short": is_short}))
    ```
    """

    def __init__(
        self,
        trainer: Trainer,
        project_name: str | None = None,
        scorers: dict[str, Callable] | None = None,
        generation_config: GenerationConfig | None = None,
        num_prompts: int | None = None,
        dataset_name: str = "eval_dataset",
        model_name: str | None = None,
    ):
        self.trainer = trainer
        self.project_name = project_name
        self.scorers = scorers or {}
        self.generation_config = generation_config
        self.dataset_name = dataset_name
        self.model_name = model_name
        self._last_logged_step = -1
        self._weave_client = None
        self._initialized = False
        self.eval_dataset = _select_eval_prompts(trainer, num_prompts, type(self).__name__)
        for name, scorer in self.scorers.items():
            if not callable(scorer):
                raise ValueError(f"Scorer {name!r} must be a callable `scorer(prompt, completion)`, got {scorer!r}.")

    @property
    def is_evaluation_mode(self) -> bool:
        """Whether scorers were given, i.e. predictions are scored and summarised."""
        return bool(self.scorers)

    def _initialize_weave(self) -> None:
        self._initialized = True
        if not is_weave_available():
            logger.warning(
                "WeaveCallback: the `weave` package is not installed, so nothing will be logged to Weave. "
                "Install it with `pip install weave`."
            )
            return
        import weave

        client = weave.get_client()
        if client is None:
            if self.project_name is not None:
                client = weave.init(self.project_name)
            else:
                run = None
                if is_wandb_available():
                    import wandb

                    run = wandb.run
                if run is None:
                    raise ValueError(
                        "WeaveCallback found no Weave project: there is no active Weave client, `project_name` is "
                        "None and no wandb run is active. Pass `project_name=...`, call `weave.init(...)` before "
                        "training, or add 'wandb' to `report_to`."
                    )
                client = weave.init(f"{run.entity}/{run.project}")
        self._weave_client = client

    def _resolved_model_name(self) -> str:
        if self.model_name is not None:
            return self.model_name
        config = getattr(self.trainer.model, "config", None)
        return getattr(config, "_name_or_path", None) or "unknown_model"

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self._initialized and self.trainer.accelerator.is_main_process:
            self._initialize_weave()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if state.global_step == self._last_logged_step:
            return
        accelerator = self.trainer.accelerator
        if not self._initialized and accelerator.is_main_process:
            self._initialize_weave()
        if not is_weave_available():
            # Nothing could be logged: skip generation (the check agrees on every process, unlike the client).
            self._last_logged_step = state.global_step
            return

        prompts, completions = _generate_completions(
            self.trainer, self.eval_dataset["prompt"], self.generation_config, args.per_device_eval_batch_size
        )
        self._last_logged_step = state.global_step
        if not accelerator.is_main_process or self._weave_client is None:
            return

        import weave

        model_name = self._resolved_model_name()
        generation_config = self.generation_config.to_dict() if self.generation_config is not None else None
        evaluation = weave.EvaluationLogger(
            model=model_name,
            dataset=self.dataset_name,
            eval_attributes={
                "training_step": state.global_step,
                "model_name": model_name,
                "generation_config": generation_config,
            },
        )

        totals = dict.fromkeys(self.scorers, 0.0)
        counts = dict.fromkeys(self.scorers, 0)
        successful = 0
        for prompt, completion in zip(prompts, completions):
            prediction = evaluation.log_prediction(inputs={"prompt": prompt}, output=completion)
            all_scored = True
            for name, scorer in self.scorers.items():
                try:
                    score = scorer(prompt, completion)
                except Exception as error:  # a failing user scorer must not stop training
                    logger.warning(f"WeaveCallback: scorer {name!r} failed on a prediction: {error}")
                    all_scored = False
                    continue
                prediction.log_score(name, score)
                totals[name] += float(score)
                counts[name] += 1
            prediction.finish()
            successful += int(all_scored)

        if self.is_evaluation_mode:
            summary = {"total_predictions": len(prompts), "successful_predictions": successful}
            for name in self.scorers:
                summary[f"avg_{name}"] = totals[name] / counts[name] if counts[name] else None
            evaluation.log_summary(summary)
        else:
            evaluation.finish()
