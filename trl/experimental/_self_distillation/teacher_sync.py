"""Keeping a self-distillation teacher an exponential moving average (EMA) of the student.

Two mechanisms, picked by the trainer: a frozen copy of the model blended towards the student
([`SyncTeacherModelCallback`]), or, when only LoRA adapters train, a second adapter named `teacher` on the same model
whose weights are the EMA of the student adapter's ([`PEFTAdapterEMACallback`]).
"""

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ...trainer.callbacks import SyncRefModelCallback


__all__ = ["PEFTAdapterEMACallback", "SyncTeacherModelCallback", "is_pure_lora_training"]


def _peft_model_class():
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return PeftModel


def is_pure_lora_training(model, accelerator=None) -> bool:
    """Whether `model` is a PEFT model whose active adapter is LoRA and whose trainable parameters are all LoRA's.

    Args:
        model: The trained model (possibly wrapped by Accelerate).
        accelerator: Unwraps `model` when given.

    Returns:
        True when only `lora_` parameters require gradients on a LoRA PEFT model.
    """
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    peft_class = _peft_model_class()
    if peft_class is None or not isinstance(model, peft_class):
        return False
    config = model.peft_config.get(model.active_adapter)
    if config is None or str(getattr(config.peft_type, "value", config.peft_type)).upper() != "LORA":
        return False
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    return bool(trainable) and all("lora_" in name for name in trainable)


class SyncTeacherModelCallback(SyncRefModelCallback):
    """Blend a frozen teacher copy towards the student: `theta_T <- (1 - rate) theta_T + rate theta` every
    `args.teacher_sync_steps` optimizer steps, with rate `args.teacher_update_rate` (read when the step ends).

    Args:
        teacher_model: The teacher, updated in place.
        accelerator: Unwraps the trained model before reading its weights.
    """

    def __init__(self, teacher_model, accelerator=None):
        super().__init__(ref_model=teacher_model, accelerator=accelerator)
        self.teacher_model = teacher_model

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        model = kwargs["model"]
        if self.teacher_model is None or state.global_step % args.teacher_sync_steps != 0:
            return
        if self.accelerator is not None:
            model = self.accelerator.unwrap_model(model)
        self.sync_target_model(model, self.teacher_model, args.teacher_update_rate)


class PEFTAdapterEMACallback(TrainerCallback):
    """An EMA teacher kept as a second LoRA adapter of the trained PEFT model.

    When training begins, an adapter named `teacher_adapter_name` with the active adapter's configuration is added and
    its weights zeroed; a shadow copy of the student adapter's weights starts at zero too. Every `sync_steps` steps the
    shadow becomes `(1 - update_rate) shadow + update_rate student` and is loaded into the teacher adapter.

    Args:
        model: The PEFT model (possibly wrapped by Accelerate).
        teacher_adapter_name: Name of the teacher adapter.
        update_rate: EMA rate.
        sync_steps: Update every this many optimizer steps.
        accelerator: Unwraps `model` when given.
    """

    def __init__(
        self,
        model,
        teacher_adapter_name: str = "teacher",
        update_rate: float = 0.05,
        sync_steps: int = 1,
        accelerator=None,
    ):
        self.model = model
        self.teacher_adapter_name = teacher_adapter_name
        self.update_rate = update_rate
        self.sync_steps = sync_steps
        self.accelerator = accelerator
        self._shadow: dict[str, torch.Tensor] | None = None

    def _unwrapped(self):
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def _student_state(self, model) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model, adapter_name=model.active_adapter)

    def on_train_begin(self, args, state, control, **kwargs):
        model = self._unwrapped()
        if self.teacher_adapter_name not in model.peft_config:
            from peft import set_peft_model_state_dict

            active = model.active_adapter
            model.add_adapter(self.teacher_adapter_name, model.peft_config[active])
            model.set_adapter(active)  # adding an adapter must not change which one trains
            zeros = {k: torch.zeros_like(v) for k, v in self._student_state(model).items()}
            set_peft_model_state_dict(model, zeros, adapter_name=self.teacher_adapter_name)
            for name, param in model.named_parameters():
                if f".{self.teacher_adapter_name}." in name:
                    param.requires_grad_(False)
        self._shadow = {k: torch.zeros_like(v) for k, v in self._student_state(model).items()}

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if self._shadow is None or self.sync_steps <= 0 or state.global_step % self.sync_steps != 0:
            return
        from peft import set_peft_model_state_dict

        model = self._unwrapped()
        for key, value in self._student_state(model).items():
            shadow = self._shadow[key]
            shadow.mul_(1.0 - self.update_rate).add_(value.detach().to(shadow.dtype), alpha=self.update_rate)
        set_peft_model_state_dict(model, self._shadow, adapter_name=self.teacher_adapter_name)
