"""Merge the trained model with another one (its base, a reference) with mergekit, at checkpoints or at the end.

Experimental: the API may change or be removed in any release. Needs mergekit (`pip install trl[merge]` or
`pip install mergekit`); every entry point raises an ImportError saying so when it is missing.
"""

import os
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from ..import_utils import is_mergekit_available


logger = logging.get_logger(__name__)

MERGE_METHODS = ("linear", "ties", "dare_ties", "slerp")


def _require_mergekit(name: str) -> None:
    if not is_mergekit_available():
        raise ImportError(f"{name} requires the `mergekit` extra. To install, run `pip install mergekit`.")


class MergeConfig:
    """Which mergekit method merges the policy (the trained checkpoint) with the target model, and its settings.

    Attributes set for every method: `policy_model_path=None`, `target_model_path=None` (filled in by
    [`MergeModelCallback`]) and `dtype="float16"`. Per method (see https://github.com/arcee-ai/mergekit):

    - `linear`: weighted average of the parameters; `policy_model_weight=0.5`, `target_model_weight=0.5`.
    - `ties` / `dare_ties`: task vectors relative to the policy (the base model), trimmed to a density, sign-elected and
      merged (DARE drops and rescales at random instead of trimming by magnitude); `policy_model_weight=1.0`,
      `policy_model_density=[1.0, 0.7, 0.1]` (a gradient over the layers), `target_model_weight=1.0`,
      `target_model_density=[1.0]`, `normalize=1.0`.
    - `slerp`: spherical interpolation from the policy towards the target; `t_values=0.5`.

    Args:
        method (`str`, defaults to `"linear"`): One of `"linear"`, `"ties"`, `"dare_ties"`, `"slerp"`.
    """

    def __init__(self, method: str = "linear"):
        _require_mergekit("MergeConfig")
        if method not in MERGE_METHODS:
            raise ValueError(f"Unsupported merge method: {method}. Expected one of {', '.join(MERGE_METHODS)}.")
        self.method = method
        self.policy_model_path: str | None = None
        self.target_model_path: str | None = None
        self.dtype = "float16"
        if method == "linear":
            self.policy_model_weight = 0.5
            self.target_model_weight = 0.5
        elif method in ("ties", "dare_ties"):
            self.policy_model_weight = 1.0
            self.policy_model_density = [1.0, 0.7, 0.1]
            self.target_model_weight = 1.0
            self.target_model_density = [1.0]
            self.normalize = 1.0
        else:
            self.t_values = 0.5

    def _validated(self, spec: dict[str, Any]) -> "Any":
        from mergekit.config import MergeConfiguration

        if self.policy_model_path is None or self.target_model_path is None:
            raise ValueError(
                "MergeConfig needs policy_model_path and target_model_path set before create() (MergeModelCallback "
                f"sets them); got policy={self.policy_model_path!r}, target={self.target_model_path!r}."
            )
        return MergeConfiguration.model_validate({"dtype": self.dtype, **spec})

    def create_merge_config_linear(self) -> "Any":
        """mergekit `MergeConfiguration` of a linear merge."""
        return self._validated(
            {
                "merge_method": "linear",
                "models": [
                    {"model": self.policy_model_path, "parameters": {"weight": self.policy_model_weight}},
                    {"model": self.target_model_path, "parameters": {"weight": self.target_model_weight}},
                ],
            }
        )

    def _task_vector_merge(self, method: str) -> "Any":
        return self._validated(
            {
                "merge_method": method,
                "base_model": self.policy_model_path,
                "parameters": {"normalize": self.normalize},
                "models": [
                    {
                        "model": self.policy_model_path,
                        "parameters": {"density": self.policy_model_density, "weight": self.policy_model_weight},
                    },
                    {
                        "model": self.target_model_path,
                        "parameters": {"density": self.target_model_density, "weight": self.target_model_weight},
                    },
                ],
            }
        )

    def create_merge_config_ties(self) -> "Any":
        """mergekit `MergeConfiguration` of a TIES merge (the policy is the base model)."""
        return self._task_vector_merge("ties")

    def create_merge_config_dare_ties(self) -> "Any":
        """mergekit `MergeConfiguration` of a DARE-TIES merge (the policy is the base model)."""
        return self._task_vector_merge("dare_ties")

    def create_merge_config_slerp(self) -> "Any":
        """mergekit `MergeConfiguration` of a SLERP merge (`t=0` is the policy, `t=1` the target)."""
        return self._validated(
            {
                "merge_method": "slerp",
                "base_model": self.policy_model_path,
                "parameters": {"t": self.t_values},
                "models": [{"model": self.policy_model_path}, {"model": self.target_model_path}],
            }
        )

    def create(self) -> "Any":
        """mergekit `MergeConfiguration` for `self.method`."""
        return getattr(self, f"create_merge_config_{self.method}")()


def merge_models(config: "Any", out_path: str) -> None:
    """Run a mergekit merge and write the merged model (and the tokenizer of the first model) to `out_path`.

    Args:
        config (`mergekit.config.MergeConfiguration`): What to merge, e.g. from [`MergeConfig.create`].
        out_path (`str`): Output folder.
    """
    _require_mergekit("merge_models")
    import torch
    from mergekit.merge import MergeOptions, run_merge

    use_cuda = torch.cuda.is_available()
    options = MergeOptions(cuda=use_cuda, device="auto", copy_tokenizer=True, lazy_unpickle=False, quiet=True)
    run_merge(config, out_path=out_path, options=options)


def upload_model_to_hf(folder_path: str, repo_id: str) -> None:
    """Create the model repository `repo_id` on the Hugging Face Hub (if needed) and upload `folder_path` to it.

    Needs network access and a Hub token; nothing calls it unless `MergeModelCallback(push_to_hub=True)`.
    """
    _require_mergekit("upload_model_to_hf")
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=folder_path, repo_id=repo.repo_id, repo_type="model")


class MergeModelCallback(TrainerCallback):
    """Merge each saved checkpoint (or only the last) with a target model and write the result beside it.

    The policy is `{output_dir}/checkpoint-{global_step}`; the target defaults to the path/id the trained model was
    loaded from (its `config._name_or_path`), i.e. the model before training. The merged model goes to
    `{output_dir}/checkpoint-{global_step}/merged`. Uploading is off by default: with `push_to_hub=True` the merged
    folder is uploaded to the repo `"{output_dir}_checkpoint-{global_step}_merged"`, which needs network access and a
    Hub login (nothing is uploaded otherwise). Full-model checkpoints only (a PEFT adapter folder is not a model
    mergekit can read).

    Example:

    ```python
    from trl.experimental.merge_model_callback import MergeConfig, MergeModelCallback

    trainer = DPOTrainer(..., callbacks=[MergeModelCallback(MergeConfig("ties"))])
    ```

    Args:
        merge_config (`MergeConfig` or `None`, defaults to `None`): Method and weights; None is `MergeConfig()`
            (linear, 0.5/0.5).
        merge_at_every_checkpoint (`bool`, defaults to `False`): Merge at every save instead of once at the end of
            training (the last step must then be saved: `save_strategy` other than `"no"`).
        push_to_hub (`bool`, defaults to `False`): Upload each merged model (see above).
    """

    def __init__(
        self,
        merge_config: MergeConfig | None = None,
        merge_at_every_checkpoint: bool = False,
        push_to_hub: bool = False,
    ):
        _require_mergekit("MergeModelCallback")
        self.merge_config = merge_config or MergeConfig()
        self.merge_at_every_checkpoint = merge_at_every_checkpoint
        self.push_to_hub = push_to_hub

    def _merge_and_maybe_push(self, output_dir: str, global_step: int, model: Any) -> None:
        checkpoint = os.path.join(output_dir, f"checkpoint-{global_step}")
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(
                f"MergeModelCallback merges the checkpoint of the last step, but {checkpoint} does not exist. Save "
                "that step (e.g. save_strategy='steps' with save_steps dividing max_steps) or merge at every checkpoint."
            )
        self.merge_config.policy_model_path = checkpoint
        if self.merge_config.target_model_path is None:
            self.merge_config.target_model_path = getattr(model.config, "_name_or_path", None)
        merged = os.path.join(checkpoint, "merged")
        merge_models(self.merge_config.create(), merged)
        logger.info(f"Merged {checkpoint} with {self.merge_config.target_model_path} into {merged}")
        if self.push_to_hub:
            upload_model_to_hf(merged, f"{output_dir}_checkpoint-{global_step}_merged")

    def on_train_begin(self, args, state, control, **kwargs):
        if args.save_strategy == "no":
            raise ValueError(
                "MergeModelCallback merges saved checkpoints, but save_strategy='no' saves none. Set save_strategy "
                "to 'steps' or 'epoch' (and make sure the last step is saved)."
            )

    def on_save(self, args, state, control, model=None, **kwargs):
        if self.merge_at_every_checkpoint and state.is_world_process_zero:
            self._merge_and_maybe_push(args.output_dir, state.global_step, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.merge_at_every_checkpoint and state.is_world_process_zero:
            self._merge_and_maybe_push(args.output_dir, state.global_step, model)
