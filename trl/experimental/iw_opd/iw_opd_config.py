"""Configuration of importance-weighted on-policy distillation (IW-OPD)."""

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...trainer.base_config import _BaseConfig


_OBJECTIVES = ("jsd", "iw_opd")
_REVERSE_KL_TOP_1_MODES = ("sampled", "argmax")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of: {', '.join(repr(c) for c in choices)}")


@dataclass
class IWOPDConfig(_BaseConfig):
    r"""Configuration for the IW-OPD trainer (`trl.experimental.iw_opd`).

    The student learns from a frozen teacher on its own samples. With `distillation_objective="iw_opd"` the loss is a
    policy gradient on the sampled tokens whose per-token advantage is the teacher-vs-sampler log-ratio, re-weighted
    towards the start of each completion; with `"jsd"` it is the generalized JSD of GKD, on- or off-policy (`lmbda`).
    Data is conversational: a `messages` column, whose last assistant turn (if any) is the off-policy completion.

    Args:
        learning_rate (`float`, defaults to `1e-6`): AdamW learning rate.
        model_init_kwargs (`dict`, `str` or `None`, defaults to `None`): `from_pretrained` keyword arguments of a
            student given as a string.
        trust_remote_code (`bool`, defaults to `False`): Allow custom modelling code.
        max_length (`int` or `None`, defaults to `1024`): Longest prompt + completion.
        temperature (`float`, defaults to `1.0`): Sampling and loss temperature.
        lmbda (`float`, defaults to `1.0`): Share of on-policy (student-generated) batches; must be 1 for `iw_opd`.
        beta (`float`, defaults to `1.0`): JSD interpolation (0 forward KL, 1 reverse KL).
        distillation_objective (`str`, defaults to `"iw_opd"`): `"iw_opd"` or `"jsd"`.
        iw_opd_gamma (`float`, defaults to `0.5`): Strength of the prefix re-weighting `1 + gamma (1 - P_t / S)`.
        iw_opd_epsilon (`float`, defaults to `1e-8`): Floor of the normaliser `S`.
        reverse_kl_top_1_mode (`str`, defaults to `"sampled"`): Reverse token of the top-1 sparse support:
            `"sampled"` (completion token) or `"argmax"` (student's top token; local teacher only).
        max_completion_length (`int`, defaults to `512`): Longest completion (must be below `max_length`).
        max_prompt_length (`int` or `None`, defaults to `None`): Longest prompt; `None` means
            `max_length - max_completion_length`.
        disable_dropout (`bool`, defaults to `True`): Turn dropout off in student and teacher.
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: Teacher loading settings.
        use_teacher_server (`bool`, defaults to `False`): Score with a teacher vLLM server instead of a local model.
        teacher_model_server_url (`str` or `None`, defaults to `None`): The teacher server's URL.
        loss_top_k (`int`, defaults to `1`): Support size of the sparse JSD losses (0: full vocabulary, local only).
        loss_add_tail (`bool`, defaults to `True`): Tail bucket for the mass outside the support.
        num_generations (`int`, defaults to `1`): Completions sampled per prompt.
        generation_batch_size (`int` or `None`, defaults to `None`): Prompts per generation batch; `None` means
            `per_device_train_batch_size * gradient_accumulation_steps // num_generations`.
        top_p, top_k: Sampling settings (`top_k=0` disables it).
        use_vllm, vllm_*: Student generation with vLLM (colocate or server mode), as in the GRPO configuration.
        log_completions, log_completions_steps, num_completions_to_print: Completion logging.
    """

    _checks_own_beta: ClassVar[bool] = True

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate."})
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "from_pretrained keyword arguments of a student given as a string."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code."})
    max_length: int | None = field(default=1024, metadata={"help": "Longest prompt + completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling and loss temperature."})
    lmbda: float = field(default=1.0, metadata={"help": "Share of on-policy batches."})
    beta: float = field(default=1.0, metadata={"help": "JSD interpolation: 0 forward KL, 1 reverse KL."})
    distillation_objective: str = field(
        default="iw_opd", metadata={"help": "Loss: 'iw_opd' or 'jsd'.", "choices": list(_OBJECTIVES)}
    )
    iw_opd_gamma: float = field(default=0.5, metadata={"help": "Prefix re-weighting strength."})
    iw_opd_epsilon: float = field(default=1e-8, metadata={"help": "Floor of the re-weighting normaliser."})
    reverse_kl_top_1_mode: str = field(
        default="sampled",
        metadata={"help": "Reverse token of the top-1 sparse support.", "choices": list(_REVERSE_KL_TOP_1_MODES)},
    )
    max_completion_length: int = field(default=512, metadata={"help": "Longest completion."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Longest prompt."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in student and teacher."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "Teacher path or hub id."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Teacher revision."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Teacher from_pretrained keyword arguments."}
    )
    use_teacher_server: bool = field(default=False, metadata={"help": "Use a teacher vLLM server."})
    teacher_model_server_url: str | None = field(default=None, metadata={"help": "The teacher server's URL."})
    loss_top_k: int = field(default=1, metadata={"help": "Support size of the sparse JSD losses."})
    loss_add_tail: bool = field(default=True, metadata={"help": "Tail bucket for the mass outside the support."})
    num_generations: int = field(default=1, metadata={"help": "Completions per prompt."})
    generation_batch_size: int | None = field(default=None, metadata={"help": "Prompts per generation batch."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling threshold."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0 disables it)."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM."})
    vllm_mode: str = field(default="colocate", metadata={"help": "'colocate' or 'server'."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (server mode)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8001, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for the server."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Weight-sync group port."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM GPU memory share (colocate)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism (colocate)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM context length."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Structured output regex."})
    vllm_sync_frequency: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode between generations."})
    log_completions: bool = field(default=False, metadata={"help": "Log a completions table."})
    log_completions_steps: int = field(default=100, metadata={"help": "Steps between completion tables."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed per table."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("lmbda", "beta"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0.0, 1.0], got {value}.")
        _one_of("distillation_objective", self.distillation_objective, _OBJECTIVES)
        if self.iw_opd_gamma < 0:
            raise ValueError(f"iw_opd_gamma must be non-negative, got {self.iw_opd_gamma}.")
        if self.iw_opd_epsilon <= 0:
            raise ValueError(f"iw_opd_epsilon must be positive, got {self.iw_opd_epsilon}.")
        _one_of("reverse_kl_top_1_mode", self.reverse_kl_top_1_mode, _REVERSE_KL_TOP_1_MODES)
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(
                f"max_completion_length ({self.max_completion_length}) must be smaller than max_length "
                f"({self.max_length}) to leave room for the prompt."
            )
        if self.max_prompt_length is None and self.max_length is not None:
            self.max_prompt_length = self.max_length - self.max_completion_length
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        rows = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = rows // self.num_generations
        if self.generation_batch_size * self.num_generations != rows:
            raise ValueError(
                "generation_batch_size * num_generations must equal per_device_train_batch_size * "
                f"gradient_accumulation_steps. Got {self.generation_batch_size} * {self.num_generations} != "
                f"{self.per_device_train_batch_size} * {self.gradient_accumulation_steps}."
            )
        if self.distillation_objective == "iw_opd":
            if self.lmbda != 1.0:
                raise ValueError(
                    "distillation_objective='iw_opd' requires lmbda=1.0: IW-OPD is an on-policy objective (every "
                    f"batch is sampled by the student), got lmbda={self.lmbda}."
                )
            if self.reverse_kl_top_1_mode != "sampled":
                raise ValueError(
                    "distillation_objective='iw_opd' requires reverse_kl_top_1_mode='sampled': IW-OPD is defined on "
                    "the sampled completion tokens."
                )
            if self.use_vllm and self.vllm_sync_frequency != 1:
                raise ValueError(
                    "distillation_objective='iw_opd' with use_vllm=True requires vllm_sync_frequency=1, so that the "
                    f"rollouts come from the policy being trained; got {self.vllm_sync_frequency}."
                )
        self._check_teacher_server()
        if self.reverse_kl_top_1_mode == "argmax" and not (self.beta > 0 and self.loss_top_k == 1):
            warnings.warn(
                f"reverse_kl_top_1_mode='argmax' has no effect when beta={self.beta} and loss_top_k="
                f"{self.loss_top_k}. It only applies when beta > 0 and loss_top_k == 1.",
                UserWarning,
                stacklevel=3,
            )
        if self.num_generations > 1 and self.lmbda < 1.0:
            warnings.warn(
                f"num_generations={self.num_generations} with lmbda={self.lmbda} means off-policy batches include "
                f"{self.num_generations} copies of each sample. Consider num_generations=1 for off-policy data.",
                UserWarning,
                stacklevel=3,
            )

    def _check_teacher_server(self) -> None:
        if not self.use_teacher_server:
            return
        if self.teacher_model_server_url is None or not str(self.teacher_model_server_url).strip():
            raise ValueError(
                "teacher_model_server_url must be set when use_teacher_server=True (for example "
                "'http://localhost:8000', a server started with `trl vllm-serve --model <teacher>`)."
            )
        if self.beta == 0.0 and self.loss_top_k < 1:
            raise ValueError(
                f"loss_top_k must be positive when using use_teacher_server=True with beta=0 (got loss_top_k="
                f"{self.loss_top_k}): a server teacher only reports its top-k log-probabilities."
            )
        if self.reverse_kl_top_1_mode == "argmax":
            raise ValueError(
                "reverse_kl_top_1_mode='argmax' is not supported with use_teacher_server=True: the server cannot score "
                "arbitrary student-selected tokens. Use 'sampled'."
            )
        if self.beta > 0.0 and self.loss_top_k != 1:
            raise ValueError(
                f"loss_top_k must be 1 when using use_teacher_server=True with beta>0 (got loss_top_k="
                f"{self.loss_top_k}): the server loss uses the top-1 sparse support."
            )
