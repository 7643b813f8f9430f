"""Parity cases: each one exercises TRL's public API on the tiny offline assets and returns a JSON-able dict.

This module is imported by `worker.py` twice, once in the oracle's venv (real `trl==1.16.0` in `.venv-parity`, or
`trl==1.12.0` in `.venv-parity-112` for a case registered with `oracle="1.12"`) and once with this project's `trl`,
so it must only use API that both share (the contract in `shared/api/`): no `trl.assets`, no private
helpers, nothing imported from this project at module level. Asset paths arrive through the worker's `Ctx`.

A case is registered with `@case(name)` or `register(name, fn)`; `name` starts with its group (`sft/`, `dpo/`, ...),
which the docs' pass-count table uses. `oracle` names the real TRL release the case runs against (`ORACLES`): 1.16 by
default, 1.12 for the experimental methods 1.16 no longer ships (BCO, PRM, XPO, Nash-MD, replay buffer, GSPO-token),
1.5 for GFPO (removed in 1.8), 0.22 for DDPO and AlignProp (`.venv-parity-022`, transformers 4.57 and diffusers). Case
outputs are compared key by key by `compare.py`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------
# Oracle name -> the exact `trl` version its venv holds (the worker refuses another one).
ORACLES = {"1.16": "1.16.0", "1.12": "1.12.0", "1.5": "1.5.0", "0.22": "0.22.2"}
DEFAULT_ORACLE = "1.16"


@dataclass
class Case:
    name: str
    fn: Callable[[Any], dict]
    # For cases that expect an exception: phrases that must appear (case-insensitively) in both messages.
    phrases: tuple[str, ...] = field(default_factory=tuple)
    # The real TRL release to compare with (a key of `ORACLES`).
    oracle: str = DEFAULT_ORACLE

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]


CASES: dict[str, Case] = {}


def register(
    name: str, fn: Callable[[Any], dict], phrases: tuple[str, ...] = (), oracle: str = DEFAULT_ORACLE
) -> None:
    if name in CASES or "," in name or "[" in name:
        raise ValueError(f"parity case name {name!r} is taken or holds ',' or '['")
    if oracle not in ORACLES:
        raise ValueError(f"parity case {name!r}: unknown oracle {oracle!r}, expected one of {sorted(ORACLES)}")
    CASES[name] = Case(name, fn, tuple(phrases), oracle)


def case(name: str, phrases: tuple[str, ...] = (), oracle: str = DEFAULT_ORACLE):
    def decorator(fn):
        register(name, fn, phrases, oracle)
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------------------------------
# Shared settings and helpers
# ---------------------------------------------------------------------------------------------------------------------
QWEN = "tiny-Qwen2ForCausalLM"
QWEN_RM = "tiny-Qwen2ForSequenceClassification"

# Settings every trainer case shares: one logged optimizer step on CPU in fp32, nothing saved, no reporting.
COMMON_ARGS = dict(
    seed=0,
    bf16=False,
    fp16=False,
    use_cpu=True,
    report_to="none",
    dataloader_num_workers=0,
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=1,
    max_steps=1,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    # Large enough that one AdamW step moves every parameter visibly (the fingerprint compares the update).
    learning_rate=1e-3,
)


def to_jsonable(value: Any) -> Any:
    """Tensors, numpy values, tuples and dataclass-like objects turned into plain JSON types."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return to_jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def prediction_fingerprint(output: Any) -> dict:
    """A `PredictionOutput` as JSON: predictions and label ids with their shapes and dtypes (small arrays in full,
    large ones as sums and their first and last values) and the metrics other than timings."""
    import numpy as np

    def arrays(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (tuple, list)):
            return {"tuple": [arrays(item) for item in value]}
        array = np.asarray(value)
        summary = {"shape": list(array.shape), "dtype": str(array.dtype)}
        if array.size <= 512:
            return {**summary, "values": array.tolist()}
        flat = array.astype(np.float64).ravel()
        return {**summary, "sum": flat.sum(), "abs_sum": np.abs(flat).sum(), "head": flat[:16], "tail": flat[-16:]}

    timings = ("_runtime", "_per_second", "_time")
    metrics = {key: value for key, value in output.metrics.items() if not key.endswith(timings)}
    return to_jsonable(
        {"predictions": arrays(output.predictions), "label_ids": arrays(output.label_ids), "metrics": metrics}
    )


def predict_eval_dataset(trainer: Any) -> dict:
    """`predict()` on the trainer's prepared evaluation dataset, as [`prediction_fingerprint`]."""
    return prediction_fingerprint(trainer.predict(trainer.eval_dataset))


def exception_record(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def expect_error(fn: Callable[[], Any]) -> dict:
    """Run `fn`; the output is the exception it raised (type and message), or `{"raised": None}`."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the case's output
        return {"exception": exception_record(exc)}
    if result is None or isinstance(result, (bool, int, float, str, dict, list)):
        return {"raised": None, "result": to_jsonable(result)}
    return {"raised": None, "result_type": type(result).__name__}


def snapshot(model) -> dict:
    import torch

    return {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters() if p.requires_grad}


def tensor_stats(name: str, tensor) -> dict:
    """`sum`, `l2`, `maxabs` and `proj` (projection on a fixed random direction seeded by the name) in float64."""
    import torch

    t = tensor.detach().to(torch.float64)
    direction = torch.randn(t.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())), dtype=t.dtype)
    return {
        "sum": t.sum().item(),
        "l2": t.norm().item(),
        "maxabs": t.abs().max().item(),
        "proj": (t * direction).sum().item(),
    }


def update_fingerprint(before: dict, model) -> dict:
    """Per trainable parameter, the size of its update (after - before): `l2` and `maxabs`, float64.

    Only sizes: an AdamW step moves each element by about lr * sign(grad), so an element whose gradient is float noise
    can flip sign between two faithful implementations. Where the gradients point is compared by `grads`.
    """
    import torch

    out = {}
    for name, p in model.named_parameters():
        if name in before:
            delta = p.detach().to(torch.float64) - before[name]
            out[name] = {"l2": delta.norm().item(), "maxabs": delta.abs().max().item()}
    return out


def grad_recorder(trainer) -> list:
    """Attach a callback recording `tensor_stats` of every gradient at each optimizer step (after clipping)."""
    from transformers import TrainerCallback

    steps: list[dict] = []

    class GradRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            steps.append({n: tensor_stats(n, p.grad) for n, p in model.named_parameters() if p.grad is not None})

    trainer.add_callback(GradRecorder())
    return steps


def column_names(dataset) -> str | None:
    """Sorted column names as one string (one comparison line per dataset rather than one per position)."""
    names = getattr(dataset, "column_names", None)
    return ",".join(sorted(names)) if names is not None else None


def run_trainer(trainer, *, evaluate: bool = True) -> dict:
    """The standard trainer scenario: evaluate, train (logging every step), evaluate again; the gradients at each
    optimizer step (`grads`) and the size of the whole update (`update`) fingerprint the training."""
    out = {"train_columns": column_names(trainer.train_dataset)}
    if evaluate:
        out["eval_columns"] = column_names(trainer.eval_dataset)
        out["eval_before"] = trainer.evaluate()
    before = snapshot(trainer.model)
    grads = grad_recorder(trainer)
    result = trainer.train()
    out["train_output"] = {"global_step": result.global_step, "training_loss": result.training_loss}
    out["train_metrics"] = result.metrics
    if evaluate:
        out["eval_after"] = trainer.evaluate()
    out["log_history"] = trainer.state.log_history
    out["grads"] = grads
    out["update"] = update_fingerprint(before, trainer.model)
    return to_jsonable(out)


def tokenizer(ctx, name: str = QWEN):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.model(name))


# Importing the group modules registers their cases (they import the helpers above, so this comes last).
from . import (  # noqa: E402, F401
    async_distillation,
    async_grpo,
    callbacks,
    chat_templates,
    collators,
    cpo_orpo,
    data,
    dataclass_fields,
    deviations,
    diffusion,
    distillation,
    distillation_online,
    dpo_losses,
    errors,
    errors_trl,
    experimental,
    frontier,
    frontier_online,
    grpo_variants,
    internals,
    iw_opd,
    offline,
    online,
    plugins,
    ppo,
    quantization,
    self_distillation,
    server_distillation,
    vlm,
)
