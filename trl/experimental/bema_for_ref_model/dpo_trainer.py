"""DPO trainer whose callbacks also receive the reference model, for `BEMACallback(update_ref_model=True)`."""

from ...trainer.dpo_trainer import DPOTrainer as _DPOTrainer
from .callback import BEMACallback, CallbackHandlerWithRefModel


class DPOTrainer(_DPOTrainer):
    """[`~trl.DPOTrainer`] that hands its reference model to every callback (as the `ref_model` keyword).

    Same arguments as [`~trl.DPOTrainer`]. Use it with
    [`~trl.experimental.bema_for_ref_model.BEMACallback`]`(update_ref_model=True)`, which periodically loads its
    bias-corrected EMA of the policy weights into the reference model, giving a lagged, smoothed reference.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    trainer = DPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        train_dataset=load_test_dataset("standard_preference", split="train"),
        callbacks=[BEMACallback(update_ref_model=True)],
    )
    trainer.train()
    ```
    """

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(config, "precompute_ref_log_probs", False):
            raise ValueError(
                "The BEMA-reference DPOTrainer updates the reference model during training, but "
                "precompute_ref_log_probs=True fixes the reference log-probs before training and drops the reference "
                "model. Set precompute_ref_log_probs=False."
            )
        super().__init__(*args, **kwargs)
        # Replace the handler (keeping its callbacks, including those added during initialisation) with one that
        # also passes `ref_model` to the callbacks.
        handler = self.callback_handler
        self.callback_handler = CallbackHandlerWithRefModel(
            handler.callbacks,
            self.model,
            self.ref_model,
            self.processing_class,
            self.optimizer,
            self.lr_scheduler,
        )

    def _reference_model_changes(self) -> bool:
        # BEMA loads its averaged weights into the reference model: a checkpoint must hold the reference as it is.
        return super()._reference_model_changes() or any(
            isinstance(callback, BEMACallback) and callback.update_ref_model
            for callback in self.callback_handler.callbacks
        )
