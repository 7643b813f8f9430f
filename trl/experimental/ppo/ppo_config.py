"""Configuration of the PPO trainer."""

from dataclasses import dataclass, field
from typing import Literal

from ...trainer.base_config import _BaseConfig


class _DefaultMaxGradNorm(float):
    """`TrainingArguments`' default `max_grad_norm` (1.0), marked as not chosen by the user.

    TRL's PPO never clips gradients, so a run that leaves `max_grad_norm` at its default must not clip either (it
    would learn several times less than under TRL); a value the user sets, even 1.0, is a plain float and clips.
    """

    def __repr__(self) -> str:
        return repr(float(self))

    def __reduce__(self):
        return (_DefaultMaxGradNorm, (float(self),))


def clips_gradients(max_grad_norm: float | None) -> bool:
    """Whether a PPO run clips gradients: only at a positive `max_grad_norm` the user set."""
    return bool(max_grad_norm) and max_grad_norm > 0 and not isinstance(max_grad_norm, _DefaultMaxGradNorm)


@dataclass
class PPOConfig(_BaseConfig):
    r"""Configuration for [`experimental.ppo.PPOTrainer`]: PPO with a value model, a reward model and a per-token KL
    penalty to a reference policy.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here. The
    batch-size fields marked "derived" are filled in by the trainer; setting them has no effect.

    Args:
        learning_rate (`float`, defaults to `3e-6`):
            Initial learning rate for AdamW (the parent default is `5e-5`).
        max_grad_norm (`float`, defaults to `1.0`):
            Gradient clipping norm, applied only when set explicitly (any positive value, 1.0 included). Left at its
            default, gradients are not clipped, as in TRL's PPO.
        dataset_num_proc (`int` or `None`, defaults to `None`):
            Processes used by `Dataset.map`.
        num_mini_batches (`int`, defaults to `1`):
            Mini-batches each rollout batch is split into for the PPO updates (one optimizer step per mini-batch).
        total_episodes (`int` or `None`, defaults to `None`):
            Number of prompts (episodes) to train on. `None` means `num_train_epochs * len(train_dataset)`;
            `max_steps > 0` overrides both (`max_steps` rollout batches).
        local_rollout_forward_batch_size (`int`, defaults to `64`):
            Rows per no-grad forward pass (and per generation call) during rollouts.
        num_sample_generations (`int`, defaults to `10`):
            How many times sample completions of the evaluation set are generated and printed during training
            (0 disables).
        response_length (`int`, defaults to `53`):
            Number of tokens generated per prompt.
        stop_token (`"eos"` or `None`, defaults to `None`):
            `"eos"` stops responses at the tokenizer's EOS token. Exclusive with `stop_token_id`.
        stop_token_id (`int` or `None`, defaults to `None`):
            Token id ending a response. Without a stop token every response has `response_length` tokens.
        temperature (`float`, defaults to `0.7`):
            Sampling temperature (log-probabilities are computed at the same temperature).
        missing_eos_penalty (`float` or `None`, defaults to `None`):
            Subtracted from the score of responses that contain no EOS token (a non-negative value).
        sft_model_path (`str`, defaults to `"EleutherAI/pythia-160m"`):
            Path of the SFT model (used by the example scripts).
        reward_model_path (`str`, defaults to `"EleutherAI/pythia-160m"`):
            Path of the reward model (used by the example scripts).
        model_adapter_name (`str` or `None`, defaults to `None`):
            PEFT adapter trained, when the policy holds several.
        ref_adapter_name (`str` or `None`, defaults to `None`):
            PEFT adapter used as reference, when the policy holds several (otherwise adapters are disabled).
        num_ppo_epochs (`int`, defaults to `4`):
            Passes over each rollout batch.
        whiten_rewards (`bool`, defaults to `False`):
            Rescale the per-token rewards to unit variance (mean kept) before GAE.
        kl_coef (`float`, defaults to `0.05`):
            Coefficient of the per-token KL penalty added to the rewards.
        kl_estimator (`"k1"` or `"k3"`, defaults to `"k1"`):
            KL estimator: `k1` (log-ratio) or `k3` (`exp(r) - 1 - r`, non-negative, lower variance).
        cliprange (`float`, defaults to `0.2`):
            Clip range of the policy ratio.
        vf_coef (`float`, defaults to `0.1`):
            Weight of the value loss.
        cliprange_value (`float`, defaults to `0.2`):
            Clip range of the value prediction around the rollout value.
        gamma (`float`, defaults to `1.0`):
            Discount factor.
        lam (`float`, defaults to `0.95`):
            GAE lambda.
        ds3_gather_for_generation (`bool`, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the full weights for generation (faster; `False` allows models that do not
            fit on one device).
        world_size, num_total_batches, micro_batch_size, local_batch_size, batch_size, local_mini_batch_size,
        mini_batch_size (`int` or `None`):
            Derived by the trainer: processes, rollout batches in the run, and the batch sizes (`local_batch_size =
            per_device_train_batch_size * gradient_accumulation_steps` prompts per process and update, split into
            `num_mini_batches` mini-batches).
    """

    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate for AdamW."})
    max_grad_norm: float = field(
        default=_DefaultMaxGradNorm(1.0),
        metadata={"help": "Gradient clipping norm, applied only when set explicitly (unset: no clipping, as in TRL)."},
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used for dataset preparation."})
    num_mini_batches: int = field(default=1, metadata={"help": "Mini-batches per rollout batch."})
    total_episodes: int | None = field(
        default=None, metadata={"help": "Total episodes (prompts). None: num_train_epochs * len(train_dataset)."}
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Rows per no-grad forward pass and generation call during rollouts."}
    )
    num_sample_generations: int = field(
        default=10, metadata={"help": "Sample completions printed this many times during training (0: never)."}
    )
    response_length: int = field(default=53, metadata={"help": "Tokens generated per prompt."})
    stop_token: Literal["eos"] | None = field(
        default=None, metadata={"help": "'eos' stops responses at the EOS token. Exclusive with stop_token_id."}
    )
    stop_token_id: int | None = field(default=None, metadata={"help": "Token id ending a response."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of responses without an EOS token."}
    )
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path of the SFT model."})
    world_size: int | None = field(default=None, metadata={"help": "Derived: number of processes."})
    num_total_batches: int | None = field(default=None, metadata={"help": "Derived: rollout batches in the run."})
    micro_batch_size: int | None = field(default=None, metadata={"help": "Derived: per-device batch * world size."})
    local_batch_size: int | None = field(default=None, metadata={"help": "Derived: rollout batch per process."})
    batch_size: int | None = field(default=None, metadata={"help": "Derived: rollout batch over all processes."})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Derived: mini-batch per process."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Derived: mini-batch over all processes."})
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path of the reward model."})
    model_adapter_name: str | None = field(default=None, metadata={"help": "PEFT adapter trained (multi-adapter)."})
    ref_adapter_name: str | None = field(default=None, metadata={"help": "PEFT adapter used as reference."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the per-token rewards before GAE."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient."})
    kl_estimator: Literal["k1", "k3"] = field(default="k1", metadata={"help": "KL estimator: 'k1' or 'k3'."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value prediction."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "ZeRO-3: gather the full weights for generation."}
    )

    def __post_init__(self):
        if self.stop_token not in (None, "eos"):
            raise ValueError(f"stop_token must be 'eos' or None; got {self.stop_token!r}. Use stop_token_id for ids.")
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError(
                f"stop_token={self.stop_token!r} and stop_token_id={self.stop_token_id} were both set; they are "
                "exclusive. Keep one of them."
            )
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3'; got {self.kl_estimator!r}.")
        for name in ("num_mini_batches", "num_ppo_epochs", "response_length", "local_rollout_forward_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}.")
        if self.num_sample_generations < 0:
            raise ValueError(f"num_sample_generations must be >= 0; got {self.num_sample_generations}.")
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ValueError(f"total_episodes must be a positive integer or None; got {self.total_episodes}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (responses are sampled); got {self.temperature}.")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(
                f"missing_eos_penalty is subtracted from the score and must be >= 0; got {self.missing_eos_penalty}."
            )
        for name in ("cliprange", "cliprange_value"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}.")
        super().__post_init__()
