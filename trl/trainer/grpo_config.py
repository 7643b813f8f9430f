"""Configuration of the GRPO trainer."""

import warnings
from dataclasses import dataclass, field

from .base_config import warn_trl_trains_anyway
from .online_config import _check_choice, _OnlineConfig


_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# "sequence_token" (GSPO-token) is trained by `trl.experimental.gspo_token.GRPOTrainer` only.
_IS_LEVELS = ("token", "sequence", "sequence_token")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_SCALE_REWARDS = ("group", "batch", "none")
_VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# Documentation of the fields GRPOConfig and RLOOConfig share; appended to both class docstrings.
ONLINE_FIELDS_DOC = r"""
        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line). Its `revision` is reused when loading the processing class.
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads models or processors.
        router_aux_loss_coef (`float` or `None`, defaults to `None`):
            Weight of the mixture-of-experts load-balancing loss. `None` uses the model config's value, `0.0` turns it
            off. Setting it on a model without a router is an error.
        disable_dropout (`bool`, defaults to `False`):
            Set every dropout probability of the trained model (and of the reference model) to zero.

        > Data and generation

        num_generations (`int` or `None`):
            Completions sampled for each prompt (the group size G). Must be at least 2 and divide
            `generation_batch_size`.
        num_generations_eval (`int` or `None`, defaults to `None`):
            Group size during evaluation. `None` uses `num_generations`.
        max_completion_length (`int` or `None`, defaults to `512`):
            Maximum number of generated tokens per completion.
        ds3_gather_for_generation (`bool`, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the full weights before generating (fast). `False` generates with sharded
            weights, which allows models larger than one device (slow; not with vLLM).
        shuffle_dataset (`bool` or `None`, defaults to `True`):
            Shuffle the training prompts.
        pad_to_multiple_of (`int`, `str` or `None`, defaults to `"auto"`):
            Pad sequence lengths to a multiple of this value. `"auto"` means 128 on Neuron devices and `None`
            elsewhere; the strings `"none"`/`"null"` mean `None`.
        generation_batch_size (`int` or `None`, defaults to `None`):
            Completions generated per generation round (unique prompts times `num_generations`), across all
            processes. `None` means `per_device_train_batch_size * num_processes * steps_per_generation`. Cannot be set
            together with `steps_per_generation`.
        steps_per_generation (`int` or `None`, defaults to `None`):
            Number of micro-steps (forward/backward passes) that consume one generation round. `None` means
            `gradient_accumulation_steps`. Cannot be set together with `generation_batch_size`.
        temperature (`float`, defaults to `1.0`):
            Sampling temperature; log-probabilities in the loss use the same temperature.
        top_p (`float`, defaults to `1.0`):
            Nucleus sampling: keep the smallest set of tokens whose probability mass reaches `top_p`.
        top_k (`int`, defaults to `0`):
            Keep only the `top_k` most likely tokens; `0` disables the filter.
        min_p (`float` or `None`, defaults to `None`):
            Drop tokens whose probability is below `min_p` times the probability of the most likely token.
        generation_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra arguments for the transformers `GenerationConfig` (or vLLM `SamplingParams`); they override the
            fields above.
        chat_template_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra keyword arguments for `apply_chat_template` when rendering conversational prompts (for example
            `{"enable_thinking": false}`). A per-row `chat_template_kwargs` column is merged on top.
        repetition_penalty (`float`, defaults to `1.0`):
            Values above 1 discourage tokens already present in the prompt and completion, below 1 encourage them.
        cache_implementation (`str` or `None`, defaults to `None`):
            KV-cache implementation passed to transformers `generate` (for example `"static"`).

        > vLLM (the fields exist and are validated; see the vLLM documentation for their use)

        use_vllm (`bool`, defaults to `False`):
            Generate with vLLM instead of transformers `generate` (requires `vllm`).
        vllm_mode (`str`, defaults to `"colocate"`):
            `"colocate"` (vLLM runs inside the trainer processes) or `"server"` (a separate `trl vllm-serve`).
        vllm_model_impl (`str`, defaults to `"vllm"`):
            Model implementation inside vLLM: `"vllm"` or `"transformers"`.
        vllm_enable_sleep_mode (`bool`, defaults to `False`):
            Put the colocated engine to sleep (offloading its weights and cache) during the optimizer step.
        vllm_structured_outputs_regex (`str` or `None`, defaults to `None`):
            Regular expression constraining vLLM decoding.
        vllm_server_base_url (`str` or `None`, defaults to `None`):
            Full server URL; overrides `vllm_server_host` and `vllm_server_port`.
        vllm_server_host (`str`, defaults to `"0.0.0.0"`):
            Server host in server mode.
        vllm_server_port (`int`, defaults to `8000`):
            Server port in server mode.
        vllm_server_timeout (`float`, defaults to `240.0`):
            Seconds to wait for the server to come up before raising a `ConnectionError`.
        vllm_group_port (`int`, defaults to `51216`):
            Port of the communication group used to push weights to the server.
        vllm_gpu_memory_utilization (`float`, defaults to `0.3`):
            Colocate mode: fraction of GPU memory reserved by vLLM.
        vllm_max_model_length (`int` or `None`, defaults to `None`):
            Colocate mode: context length of the engine. `None` takes it from the model config.
        vllm_tensor_parallel_size (`int`, defaults to `1`):
            Colocate mode: tensor-parallel size of the engine.

        > Training

        num_iterations (`int`, defaults to `1`):
            Optimisation passes over each generated batch (mu). Above 1, the log-probabilities of the sampling policy
            are stored at generation time and importance ratios are used.
        epsilon (`float`, defaults to `0.2`):
            Lower clipping bound of the importance ratio: `1 - epsilon`.
        epsilon_high (`float` or `None`, defaults to `None`):
            Upper clipping bound `1 + epsilon_high` ("clip-higher" from DAPO). `None` uses `epsilon`.
        reward_weights (`list[float]` or `None`, defaults to `None`):
            One weight per reward function. `None` weighs every function 1.0.
        mask_truncated_completions (`bool`, defaults to `False`):
            Leave completions that reached `max_completion_length` without an end-of-sequence token out of the loss.
        sync_ref_model (`bool`, defaults to `False`):
            Every `ref_model_sync_steps` steps, blend the policy into the reference model (TR-DPO). Needs a separate
            reference model (not PEFT).
        ref_model_mixup_alpha (`float`, defaults to `0.6`):
            Blend weight alpha in `ref <- alpha * policy + (1 - alpha) * ref`.
        ref_model_sync_steps (`int`, defaults to `512`):
            Blend frequency in global steps.

        > Logging

        log_completions (`bool`, defaults to `False`):
            At each logging step, print a table of sampled prompts, completions, rewards and advantages (with `rich`)
            and write it to `output_dir/completions/completions_{step:05d}.parquet`.
        log_multimodal (`bool`, defaults to `True`):
            Include images in the completion logs.
        num_completions_to_print (`int` or `None`, defaults to `None`):
            Rows printed to the console. `None` prints all of them.
        log_unique_prompts (`bool`, defaults to `False`):
            Keep only the first completion of each prompt in the logged tables.

        > transformers continuous batching

        use_transformers_continuous_batching (`bool`, defaults to `False`):
            Generate with transformers continuous batching (`model.generate_batch`) instead of `generate`.
        transformers_continuous_batching_config (`dict`, `str` or `None`, defaults to `None`):
            Keyword arguments for transformers' `ContinuousBatchingConfig`.
        use_transformers_paged (`bool`, defaults to `False`):
            Deprecated alias: sets `use_transformers_continuous_batching=True`.
"""


@dataclass
class GRPOConfig(_OnlineConfig):
    r"""Configuration for [`GRPOTrainer`]: Group Relative Policy Optimization.

    For each prompt, `num_generations` completions are sampled and scored; the advantage of a completion is its
    reward relative to the others of its group. Only the fields TRL adds or whose default differs from
    [`~transformers.TrainingArguments`] are listed; every other `TrainingArguments` field works as usual.

    `__post_init__` turns a boolean `scale_rewards` into `"group"`/`"none"`, derives `generation_batch_size` /
    `steps_per_generation` (see those fields), and raises a `ValueError` for inconsistent values (a generation batch
    that is not a multiple of `num_generations`, `num_generations < 2`, `auto_find_batch_size=True`, ...).

    Args:
        learning_rate (`float`, defaults to `1e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        remove_unused_columns (`bool` or `None`, defaults to `False`):
            Extra dataset columns are kept because they are passed to the reward functions.
        cast_lm_head_to_fp32 (`bool`, defaults to `False`):
            Run the output projection of the policy and reference models in float32 (ScaleRL). A head tied to the
            input embeddings gets its own float32 copy of the weight (the tie is dropped, the embeddings keep their
            dtype).
        num_generations (`int` or `None`, defaults to `8`):
            Completions sampled for each prompt.

        > GRPO objective

        beta (`float`, defaults to `0.0`):
            Weight of the KL penalty against the reference model (k3 estimator). `0.0` loads no reference model.
        delta (`float` or `None`, defaults to `None`):
            When set, the unclipped importance ratio is also capped at `delta` (two-sided clipping, INTELLECT-2).
        sapo_temperature_neg (`float`, defaults to `1.05`):
            `loss_type="sapo"`: temperature of the soft gate for non-positive advantages.
        sapo_temperature_pos (`float`, defaults to `1.0`):
            `loss_type="sapo"`: temperature of the soft gate for positive advantages.
        vespo_k_pos (`float`, defaults to `2.0`):
            `loss_type="vespo"`: power exponent of the sequence weight for positive advantages.
        vespo_lambda_pos (`float`, defaults to `3.0`):
            `loss_type="vespo"`: decay rate of the sequence weight for positive advantages.
        vespo_k_neg (`float`, defaults to `3.0`):
            `loss_type="vespo"`: power exponent of the sequence weight for negative advantages.
        vespo_lambda_neg (`float`, defaults to `2.0`):
            `loss_type="vespo"`: decay rate of the sequence weight for negative advantages.
        importance_sampling_level (`str`, defaults to `"token"`):
            `"token"`: one importance ratio per token. `"sequence"` (GSPO): one ratio per completion, the exponential
            of the mean per-token log-ratio. `"sequence_token"` (GSPO-token) is accepted here but trained only by
            `trl.experimental.gspo_token.GRPOTrainer`; this trainer rejects it.
        multi_objective_aggregation (`str`, defaults to `"sum_then_normalize"`):
            With several reward functions: `"sum_then_normalize"` sums the weighted rewards and normalises the sum;
            `"normalize_then_sum"` (GDPO) normalises each reward within its group, sums them with the weights and
            normalises the result over the batch.
        scale_rewards (`str`, defaults to `"group"`):
            Divide the centred rewards by the standard deviation of the `"group"`, of the whole `"batch"`, or not at
            all (`"none"`). `True`/`False` mean `"group"`/`"none"`.
        loss_type (`str`, defaults to `"dapo"`):
            `"grpo"` (per-sequence mean, then mean over sequences), `"dapo"` (sum over all tokens divided by the
            number of completion tokens in the whole optimizer batch), `"dr_grpo"` (divided by batch size times
            `max_completion_length`), `"bnpo"` (divided by the completion tokens of the local micro-batch), `"cispo"`
            (REINFORCE weighted by the clipped, detached ratio; dapo normalisation), `"sapo"` (soft sigmoid gate
            instead of clipping; grpo normalisation), `"luspo"` (GSPO objective with each sequence weighted by its
            length; meant for `importance_sampling_level="sequence"`) or `"vespo"` (policy gradient weighted by a
            smooth function of the sequence ratio; meant for `"token"`; dapo normalisation).
        top_entropy_quantile (`float`, defaults to `1.0`):
            Train only on the tokens whose entropy is in the top `top_entropy_quantile` fraction of the micro-batch
            (`1.0` keeps every token).
        entropy_coef (`float`, defaults to `0.0`):
            Weight of an entropy bonus (mean per-token entropy) subtracted from the loss; the initial value when
            adaptive.
        use_adaptive_entropy (`bool`, defaults to `False`):
            After each optimizer step, move `entropy_coef` by `entropy_coef_delta` towards keeping the mean entropy at
            `entropy_target` (Skywork-OR1).
        entropy_coef_min (`float`, defaults to `0.0`):
            Lower bound of the adaptive coefficient.
        entropy_coef_max (`float`, defaults to `1.0`):
            Upper bound of the adaptive coefficient.
        entropy_coef_delta (`float`, defaults to `0.005`):
            Step of the adaptive coefficient.
        entropy_target (`float`, defaults to `0.2`):
            Target mean entropy (nats) of the adaptive controller.
        max_tool_calling_iterations (`int` or `None`, defaults to `None`):
            Maximum number of tool-call turns per rollout. `None` means unlimited.
        vllm_importance_sampling_correction (`bool`, defaults to `True`):
            When the sampling log-probabilities come from another engine (vLLM or a `rollout_func`), weight the loss by
            the importance ratio between the trainer's and the sampler's probabilities.
        vllm_importance_sampling_mode (`str`, defaults to `"sequence_mask"`):
            `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"`: per-token or per-sequence
            ratio, clipped to the bounds (truncate) or set to zero outside them (mask).
        vllm_importance_sampling_clip_max (`float` or `None`, defaults to `3.0`):
            Upper bound of the correction ratio.
        vllm_importance_sampling_clip_min (`float` or `None`, defaults to `None`):
            Lower bound of the correction ratio; must be below the upper bound.
        off_policy_mask_threshold (`float` or `None`, defaults to `None`):
            Drop from the loss completions with a negative advantage whose KL between sampling and current policy
            exceeds this value (DeepSeek-V3.2). `None` disables it.
        use_bias_correction_kl (`bool`, defaults to `True`):
            Multiply the per-token KL term by the importance ratio (unbiased gradient of the reverse KL when the data
            is off-policy).
        log_completions_hub_repo (`str` or `None`, defaults to `None`):
            Hub dataset repository receiving the parquet completion logs; requires `log_completions=True`.
        vllm_importance_sampling_cap (`float` or `None`, defaults to `None`):
            Deprecated alias of `vllm_importance_sampling_clip_max`.
    """

    cast_lm_head_to_fp32: bool = field(
        default=False, metadata={"help": "Run the LM head in float32 (untied embeddings only)."}
    )
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0.0 loads no reference model."})
    delta: float | None = field(
        default=None, metadata={"help": "Upper cap of the unclipped importance ratio (two-sided clipping)."}
    )
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO gate temperature, advantages <= 0."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO gate temperature, advantages > 0."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO power exponent, positive advantages."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO decay, positive advantages."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO power exponent, negative advantages."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO decay, negative advantages."})
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "Importance ratio per token or per sequence (GSPO).", "choices": list(_IS_LEVELS)},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "How several rewards are combined.", "choices": list(_AGGREGATIONS)},
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Scale centred rewards by the group std, the batch std, or not at all (True/False accepted).",
            "choices": ["group", "batch", "none", "True", "False", "true", "false"],
        },
    )
    loss_type: str = field(default="dapo", metadata={"help": "Loss formulation.", "choices": list(_LOSS_TYPES)})
    top_entropy_quantile: float = field(
        default=1.0, metadata={"help": "Keep only the top-rho entropy tokens in the loss (1.0 keeps all)."}
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight (initial value if adaptive)."})
    use_adaptive_entropy: bool = field(default=False, metadata={"help": "Adapt entropy_coef towards entropy_target."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy_coef lower bound."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy_coef upper bound."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy_coef step."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive target mean entropy (nats)."})
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Maximum tool-call turns per rollout; None is unlimited."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata={"help": "Correct the sampler/trainer log-prob mismatch with importance weights."}
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "How the correction ratio is bounded.", "choices": list(_VLLM_IS_MODES)},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the correction ratio."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the correction ratio."}
    )
    off_policy_mask_threshold: float | None = field(
        default=None, metadata={"help": "Mask negative-advantage completions whose sampling KL exceeds this."}
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "Multiply the KL term by the importance ratio."}
    )
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "Hub dataset repository for the completion logs (needs log_completions)."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated alias of vllm_importance_sampling_clip_max."}
    )

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        elif isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = "group" if self.scale_rewards.lower() == "true" else "none"
        _check_choice(
            "scale_rewards",
            self.scale_rewards,
            _SCALE_REWARDS,
            f"Invalid value for scale_rewards: {self.scale_rewards}. Must be one of 'batch', 'group', or 'none'.",
        )
        _check_choice("loss_type", self.loss_type, _LOSS_TYPES, f"Unknown loss type: {self.loss_type}.")
        _check_choice(
            "importance_sampling_level",
            self.importance_sampling_level,
            _IS_LEVELS,
            f"Unknown importance sampling level: {self.importance_sampling_level}. Possible values are 'token' and "
            "'sequence'. ('sequence_token' is GSPO-token's, with trl.experimental.gspo_token.GRPOTrainer.)",
        )
        _check_choice("multi_objective_aggregation", self.multi_objective_aggregation, _AGGREGATIONS)
        _check_choice("vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, _VLLM_IS_MODES)
        if self.log_completions_hub_repo is not None and not self.log_completions:
            raise ValueError(
                "log_completions_hub_repo is set, but log_completions is False. Enable log_completions to upload "
                "completions to the Hub, or unset log_completions_hub_repo."
            )
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated; use vllm_importance_sampling_clip_max instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
                f"vllm_importance_sampling_clip_max ({clip_max})."
            )
        if self.vllm_importance_sampling_mode.endswith("_truncate") and clip_min is None and clip_max is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} clips the ratio, so it needs "
                "vllm_importance_sampling_clip_max and/or vllm_importance_sampling_clip_min."
            )
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1]; got {self.top_entropy_quantile}.")
        if self.top_entropy_quantile == 0.0:
            warn_trl_trains_anyway(
                "top_entropy_quantile=0.0 keeps only the tokens at the highest entropy in the batch in the loss.",
                "set a fraction in (0, 1] (e.g. 0.2 for the top 20 %) unless this is intended.",
                stacklevel=3,
            )
        if self.delta is not None and self.delta <= 1.0:
            warn_trl_trains_anyway(
                f"delta={self.delta} caps the importance ratio at or below 1, so the upper clip can cut even an "
                "unchanged policy's ratio.",
                "set delta > 1 (e.g. 2.0) or None unless this is intended.",
                stacklevel=3,
            )
        if self.entropy_coef_min > self.entropy_coef_max:
            if self.use_adaptive_entropy:
                warn_trl_trains_anyway(
                    f"entropy_coef_min ({self.entropy_coef_min}) exceeds entropy_coef_max ({self.entropy_coef_max}): "
                    "use_adaptive_entropy raises the coefficient up to entropy_coef_max and lowers it down to "
                    "entropy_coef_min, so it moves outside the range they mean.",
                    "swap them to let the coefficient move between the bounds.",
                    stacklevel=3,
                )
            else:
                warn_trl_trains_anyway(
                    f"entropy_coef_min ({self.entropy_coef_min}) exceeds entropy_coef_max ({self.entropy_coef_max}); "
                    "the bounds are read only with use_adaptive_entropy=True, which is off.",
                    "swap them before turning use_adaptive_entropy on.",
                    stacklevel=3,
                )
        super().__post_init__()


GRPOConfig.__doc__ = GRPOConfig.__doc__.rstrip() + "\n" + ONLINE_FIELDS_DOC
