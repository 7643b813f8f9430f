"""BEMA callback variant that also refreshes the trainer's reference model with the averaged weights.

The reference model is not part of what `transformers` hands to callbacks, so trainers that use this variant
dispatch events through `CallbackHandlerWithRefModel`, which adds a `ref_model` keyword to every callback call.
"""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging

from ...import_utils import is_peft_available
from ...trainer.callbacks import BEMACallback as _BEMACallback
from ...trainer.callbacks import _copy_into_parameters, _unwrap_training_model


logger = logging.get_logger(__name__)

# Parameter-name components that belong to PEFT adapters rather than to the base model.
_ADAPTER_PREFIXES = ("lora_", "adapter_")


def _is_peft_model(model) -> bool:
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


class CallbackHandlerWithRefModel(CallbackHandler):
    """`CallbackHandler` that also passes the trainer's reference model to callbacks, as the `ref_model` keyword.

    Args:
        callbacks (`list`):
            Callbacks (instances or classes) to dispatch events to.
        model (`PreTrainedModel` or `torch.nn.Module`):
            Model being trained.
        ref_model (`PreTrainedModel`, `torch.nn.Module` or `None`):
            Reference model handed to callbacks; `None` when the trainer has none (e.g. with PEFT, where the
            reference is the base model with adapters disabled).
        processing_class:
            Tokenizer or processor of the trainer.
        optimizer (`torch.optim.Optimizer` or `None`):
            Optimizer of the trainer.
        lr_scheduler (`torch.optim.lr_scheduler.LRScheduler` or `None`):
            Learning-rate scheduler of the trainer.
    """

    def __init__(self, callbacks, model, ref_model, processing_class, optimizer, lr_scheduler):
        super().__init__(callbacks, model, processing_class, optimizer, lr_scheduler)
        self.ref_model = ref_model

    def call_event(self, event, args, state, control, **kwargs):
        for callback in self.callbacks:
            result = getattr(callback, event)(
                args,
                state,
                control,
                model=self.model,
                ref_model=self.ref_model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            # Like the base handler: a callback may return nothing when it leaves `control` untouched.
            if result is not None:
                control = result
        return control


class BEMACallback(_BEMACallback):
    r"""[`~trl.BEMACallback`] that can also load the BEMA weights into the reference model during training.

    This gives a lagged, smoothed copy of the policy as the reference (e.g. for DPO). The trainer must dispatch its
    callback events through [`CallbackHandlerWithRefModel`] so that the reference model reaches the callback, as the
    experimental `DPOTrainer` of this package does.

    Args:
        update_freq (`int`, *optional*, defaults to `400`):
            Refresh the BEMA weights every this many steps (\\(\phi\\) in the paper).
        ema_power (`float`, *optional*, defaults to `0.5`):
            Exponent \\(\kappa\\) of the EMA factor; `0.0` makes the EMA follow the current weights.
        bias_power (`float`, *optional*, defaults to `0.2`):
            Exponent \\(\eta\\) of the correction factor; `0.0` keeps \\(\alpha_t = 1\\).
        lag (`int`, *optional*, defaults to `10`):
            Offset \\(\rho\\) of the schedule.
        update_after (`int`, *optional*, defaults to `0`):
            Burn-in steps \\(\tau\\) before updates start; \\(\theta_0\\) is taken at this step.
        multiplier (`float`, *optional*, defaults to `1.0`):
            Factor \\(\gamma\\) applied to the step count inside the schedule.
        min_ema_multiplier (`float`, *optional*, defaults to `0.0`):
            Floor of the EMA factor.
        device (`str`, *optional*, defaults to `"cpu"`):
            Device holding the BEMA buffers and shadow model.
        update_ref_model (`bool`, *optional*, defaults to `False`):
            Whether to copy the BEMA weights into the reference model.
        ref_model_update_freq (`int`, *optional*, defaults to `400`):
            Copy the BEMA weights into the reference model every this many steps.
        ref_model_update_after (`int`, *optional*, defaults to `0`):
            Do not touch the reference model before this step.

    Example:

    ```python
    from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    trainer = DPOTrainer(model=..., train_dataset=..., callbacks=[BEMACallback(update_ref_model=True)])
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
        update_ref_model: bool = False,
        ref_model_update_freq: int = 400,
        ref_model_update_after: int = 0,
    ):
        super().__init__(
            update_freq=update_freq,
            ema_power=ema_power,
            bias_power=bias_power,
            lag=lag,
            update_after=update_after,
            multiplier=multiplier,
            min_ema_multiplier=min_ema_multiplier,
            device=device,
        )
        if ref_model_update_freq < 1:
            raise ValueError(
                f"`ref_model_update_freq` must be a positive number of steps, got {ref_model_update_freq}."
            )
        if ref_model_update_after < 0:
            raise ValueError(
                f"`ref_model_update_after` must be a non-negative number of steps, got {ref_model_update_after}."
            )
        self.update_ref_model = update_ref_model
        self.ref_model_update_freq = ref_model_update_freq
        self.ref_model_update_after = ref_model_update_after

    def _load_into_reference(self, model, ref_model) -> None:
        bema_state = self.running_model.state_dict()
        if ref_model is not None:
            target = _unwrap_training_model(ref_model)
            if _is_peft_model(target):
                target = target.get_base_model()
            named = [(name, param) for name, param in target.named_parameters() if name in bema_state]
            if any(hasattr(param, "ds_tensor") or hasattr(param, "device_mesh") for _, param in named):
                # A reference sharded by ZeRO-3 / FSDP2: each process writes its shard of the full BEMA weights.
                _copy_into_parameters([param for _, param in named], [bema_state[name] for name, _ in named])
            else:
                target.load_state_dict(bema_state, strict=False)
            logger.info("Updated the reference model with the BEMA weights.")
            return

        # Without a separate reference model, the reference is the base model under the adapters (PEFT).
        model = _unwrap_training_model(model)
        if not _is_peft_model(model):
            logger.warning(
                "BEMACallback: `update_ref_model=True` but the trainer has no reference model and the trained model "
                "is not a PEFT model, so there is no reference to update. Skipping."
            )
            return
        filtered = {}
        for key, value in bema_state.items():
            if any(part.startswith(_ADAPTER_PREFIXES) for part in key.split(".")):
                continue
            filtered[key.removeprefix("base_model.")] = value
        model.get_base_model().load_state_dict(filtered, strict=False)
        logger.info("Updated the base model (the PEFT reference) with the BEMA weights.")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if not self.update_ref_model:
            return
        step = state.global_step
        if step < self.ref_model_update_after or (step - self.ref_model_update_after) % self.ref_model_update_freq:
            return
        if "ref_model" not in kwargs:
            raise ValueError("'ref_model' not found in kwargs.")
        self._load_into_reference(kwargs.get("model"), kwargs["ref_model"])
