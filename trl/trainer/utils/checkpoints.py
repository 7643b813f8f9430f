"""Checkpoints that survive a kill: written atomically, chosen only when complete, with the trainer state that
transformers does not save.

A checkpoint is assembled in a hidden staging directory (`.partial-checkpoint-N/checkpoint-N`) and renamed to
`checkpoint-N` only once every file is written, so a process killed in the middle of a save leaves the previous
checkpoints untouched and no `checkpoint-N` that lacks files. `resume_from_checkpoint=True` resumes from the latest
checkpoint that holds a `trainer_state.json` (transformers' last file), so a partial directory left by another writer
is skipped too.
"""

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..._compat import rotate_checkpoints, saved_weight_renamer


TRAINER_STATE_FILE = "trainer_state.json"
_STAGING_PREFIX = ".partial-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def trl_state_file(process_index: int) -> str:
    """Name of the file holding one process's TRL trainer state inside a checkpoint."""
    return f"trl_state_{process_index}.pt"


def save_trainer_state(checkpoint_dir: str, process_index: int, state: dict[str, Any]) -> None:
    """Write `state` (tensors, numbers, strings and containers of them) for process `process_index`."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save(state, os.path.join(checkpoint_dir, trl_state_file(process_index)))


def load_trainer_state(checkpoint_dir: str, process_index: int) -> dict[str, Any] | None:
    """The state saved by `save_trainer_state` for `process_index`, or None when the checkpoint has none.

    Read with `weights_only=True`: a checkpoint can never run code while it is loaded.
    """
    path = os.path.join(checkpoint_dir, trl_state_file(process_index))
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


REFERENCE_MODEL_FILE = "ref_model.safetensors"


def save_reference_model(checkpoint_dir: str, ref_model: Any) -> None:
    """Save the weights of a reference model that changes during training (SyncRef) into a checkpoint."""
    if ref_model is None:
        return
    from safetensors.torch import save_model

    os.makedirs(checkpoint_dir, exist_ok=True)
    save_model(ref_model, os.path.join(checkpoint_dir, REFERENCE_MODEL_FILE))


def load_reference_model(checkpoint_dir: str, ref_model: Any) -> None:
    """Load the reference weights saved by `save_reference_model`, in place.

    A checkpoint without them (TRL writes none) leaves the reference at its initial weights, which is what TRL does
    on every resume; a warning says so, since the run then departs from an uninterrupted one.
    """
    path = os.path.join(checkpoint_dir, REFERENCE_MODEL_FILE)
    if ref_model is None:
        return
    if not os.path.isfile(path):
        from transformers.utils import logging

        logging.get_logger(__name__).warning(
            "The checkpoint %s holds no reference-model weights (%s; TRL's checkpoints do not keep them), so the "
            "reference refreshed by sync_ref_model restarts from its initial weights, as under TRL. The losses after "
            "the resume differ from an uninterrupted run's until the next syncs pull it back.",
            checkpoint_dir,
            REFERENCE_MODEL_FILE,
        )
        return
    from safetensors.torch import load_model

    load_model(ref_model, path, device=str(next(ref_model.parameters()).device))


def last_complete_checkpoint(output_dir: str) -> str:
    """The highest-numbered `checkpoint-N` in `output_dir` whose `trainer_state.json` was written.

    Raises:
        ValueError: When `output_dir` holds no complete checkpoint.
    """
    candidates = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            match = _CHECKPOINT_NAME.match(name)
            path = os.path.join(output_dir, name)
            if match and os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
                candidates.append((int(match.group(1)), path))
    if not candidates:
        raise ValueError(
            f"resume_from_checkpoint=True, but {output_dir!r} holds no complete checkpoint (a `checkpoint-N` "
            f"directory with a {TRAINER_STATE_FILE}). Train without resume_from_checkpoint, or pass the path of a "
            "checkpoint."
        )
    return max(candidates)[1]


def save_checkpoint_atomically(trainer: Any, model: Any, trial: Any, save: Callable[[Any, Any], None]) -> None:
    """Run transformers' checkpoint save `save(model, trial)` into a staging directory, then rename it into place.

    Every process writes its files (model shards, RNG state, the TRL state of `trainer._save_checkpoint_extras`) into
    the staging directory; after a barrier the saving process moves the finished checkpoint to `checkpoint-N`
    (replacing an older one of the same step), fixes `best_model_checkpoint`, and applies `save_total_limit`. With
    `push_to_hub` the checkpoint is written in place, as transformers does, since the upload reads its folder.
    """
    args = trainer.args
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final_dir = os.path.join(run_dir, name)
    if args.push_to_hub:
        save(model, trial)
        trainer._save_checkpoint_extras(final_dir)
        return
    staging_root = os.path.join(run_dir, _STAGING_PREFIX + name)
    staged_dir = os.path.join(staging_root, name)
    if args.should_save and os.path.exists(staging_root):
        shutil.rmtree(staging_root)  # left by a process killed while saving this same step
    trainer.accelerator.wait_for_everyone()
    # transformers builds the checkpoint path from `_get_output_dir`: point it at the staging root for this save.
    trainer._get_output_dir = lambda trial=None: staging_root
    try:
        save(model, trial)
    finally:
        del trainer._get_output_dir
    best = trainer.state.best_model_checkpoint
    if best is not None and os.path.normpath(best) == os.path.normpath(staged_dir):
        trainer.state.best_model_checkpoint = final_dir  # transformers saw the staged path; record the final one
        if args.should_save:
            trainer.state.save_to_json(os.path.join(staged_dir, TRAINER_STATE_FILE))
    trainer._save_checkpoint_extras(staged_dir)
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        if os.path.exists(final_dir):
            os.replace(final_dir, os.path.join(staging_root, "replaced"))
        os.replace(staged_dir, final_dir)
        shutil.rmtree(staging_root, ignore_errors=True)
        rotate_checkpoints(trainer, run_dir)
    trainer.accelerator.wait_for_everyone()


def load_renamed_weights(model: Any, checkpoint_dir: str) -> Any:
    """Load a checkpoint's weights into `model`, mapping the names `save_pretrained` wrote back to the model's.

    `save_pretrained` writes the weights of models with a transformers conversion mapping (vision-language models,
    e.g. `model.language_model.layers.*` saved as `model.layers.*`) under their original checkpoint names, and
    `from_pretrained` converts them back; transformers' `Trainer` reloads a checkpoint with a plain `load_state_dict`,
    which misses every renamed weight. Here the names are mapped back as the installed transformers wrote them
    (`trl._compat.saved_weight_renamer`).

    Args:
        model (`transformers.PreTrainedModel`): The bare (unwrapped, non-PEFT) model to load into.
        checkpoint_dir (`str`): A checkpoint holding `model.safetensors` or a sharded `model.safetensors.index.json`.

    Returns:
        The `load_state_dict` result (missing and unexpected keys), or `None` when no weight is saved under another
        name (the caller then loads as transformers does).
    """
    import json

    from safetensors.torch import load_file
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    model_name_of = saved_weight_renamer(model)
    if model_name_of is None:
        return None
    single = os.path.join(checkpoint_dir, SAFE_WEIGHTS_NAME)
    index = os.path.join(checkpoint_dir, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(checkpoint_dir, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        return None
    state = {}
    for file in files:
        state.update({model_name_of(name): tensor for name, tensor in load_file(file, device="cpu").items()})
    return model.load_state_dict(state, strict=False)
