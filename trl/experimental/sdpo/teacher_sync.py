"""EMA teacher updates (shared with SDFT; see `trl.experimental._self_distillation.teacher_sync`)."""

from .._self_distillation.teacher_sync import PEFTAdapterEMACallback, SyncTeacherModelCallback, is_pure_lora_training


__all__ = ["PEFTAdapterEMACallback", "SyncTeacherModelCallback", "is_pure_lora_training"]
