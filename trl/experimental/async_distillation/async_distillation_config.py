"""Configuration of the asynchronous distillation trainer."""

import json
from dataclasses import dataclass, field
from typing import Any

from ...trainer.base_config import _BaseConfig
from ...trainer.online_config import _RolloutFields


@dataclass
class AsyncDistillationConfig(_BaseConfig):
    r"""Configuration for [`experimental.async_distillation.AsyncDistillationTrainer`].

    The student samples completions through a vLLM server beside training; one or more teacher servers score each
    completion's tokens (top-k log-probabilities); the trainer minimises a sparse-support divergence between the
    student and the teacher on them. Samples more than `max_staleness` policy versions old are dropped.

    Args:
        model_init_kwargs (`dict`, `str` or `None`, defaults to `None`): `from_pretrained` keyword arguments.
        dtype (`str`, defaults to `"float32"`): Precision the student is loaded in (`"auto"`, `"bfloat16"`,
            `"float16"`, `"float32"`); a `dtype` in `model_init_kwargs` wins.
        trust_remote_code (`bool`, defaults to `False`): Allow model code from the Hub.
        max_completion_length (`int`, defaults to `2048`): Longest sampled completion.
        temperature, top_p, top_k, min_p, repetition_penalty: Student sampling settings (`top_k=0` disables it).
        chat_template_kwargs (`dict`, `str` or `None`, defaults to `None`): Extra chat-template arguments.
        vllm_server_base_url (`str`, defaults to `"http://localhost:8000"`): The student's generation server.
        vllm_server_timeout (`float`, defaults to `240.0`): Seconds to wait for the servers.
        teacher_server_urls (`dict[str, str]`, `str` or `None`, defaults to `None`): Teacher id -> server URL (a JSON
            string on the command line; one URL string is kept as given). `None` means
            `{"default": "http://localhost:8001"}`. With two or more teachers each row names its teacher in a
            `teacher_id` column.
        request_timeout (`int`, defaults to `600`): Seconds per generation or scoring request.
        weight_sync_timeout (`int`, defaults to `1800`): Seconds per weight sync.
        beta (`float`, defaults to `0.0`): 0 forward KL over the teacher's candidates; otherwise the divergence on
            {teacher top-1, sampled token} (the sampled token alone at 1).
        teacher_temperature (`float`, defaults to `1.0`): Temperature of the teacher's scores; the student's logits
            are divided by it in the loss.
        teacher_top_k (`int`, defaults to `8`): Candidates the teachers report per position.
        add_tail_bucket (`bool`, defaults to `True`): Keep the mass outside the support as one bucket.
        token_budget (`int` or `None`, defaults to `None`): Tokens per packed row (`None`: the server's
            `max_model_len`; `<= 0`: a fixed number of samples per micro-batch).
        max_inflight_tasks (`int`, defaults to `-1`): Concurrent rollouts (`< 0`: `max(max_staleness, 1)` times the
            samples of one step).
        max_staleness (`int`, defaults to `4`): Largest accepted policy-version lag of a sample.
        queue_maxsize (`int`, defaults to `1024`): Capacity of the rollout queue.
        weight_sync_steps (`int`, defaults to `1`): Optimizer steps between weight syncs.
        heartbeat_stale_after_s (`float`, defaults to `300.0`): Rollout-worker silence after which training stops.
        log_completions, log_completions_steps, num_completions_to_print: Completion logging.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "teacher_server_urls",
        "chat_template_kwargs",
    ]

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate for AdamW."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N steps."})
    ignore_data_skip: bool = field(
        default=True, metadata={"help": "The rollout position is restored from `rollout_state.json` instead."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` (dict or JSON string)."}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Student precision.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the Hub."})
    max_completion_length: int = field(default=2048, metadata={"help": "Longest sampled completion."})
    temperature: float = field(default=1.0, metadata={"help": "Student sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0 disables it)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling threshold."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty."})
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for the chat template."}
    )
    vllm_server_base_url: str = field(default="http://localhost:8000", metadata={"help": "Student vLLM server."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for the servers."})
    teacher_server_urls: dict[str, str] | str | None = field(
        default=None, metadata={"help": "Teacher id -> URL (None: {'default': 'http://localhost:8001'})."}
    )
    request_timeout: int = field(default=600, metadata={"help": "Seconds per generation or scoring request."})
    weight_sync_timeout: int = field(default=1800, metadata={"help": "Seconds per weight sync."})
    beta: float = field(default=0.0, metadata={"help": "0 forward KL, 1 reverse KL on the sampled token."})
    teacher_temperature: float = field(default=1.0, metadata={"help": "Temperature of the teacher's scores."})
    teacher_top_k: int = field(default=8, metadata={"help": "Teacher candidates per position."})
    add_tail_bucket: bool = field(default=True, metadata={"help": "Tail bucket for the mass outside the support."})
    token_budget: int | None = field(default=None, metadata={"help": "Tokens per packed row."})
    max_inflight_tasks: int = field(default=-1, metadata={"help": "Concurrent rollouts (<0: derived)."})
    max_staleness: int = field(default=4, metadata={"help": "Largest accepted policy-version lag."})
    queue_maxsize: int = field(default=1024, metadata={"help": "Capacity of the rollout queue."})
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs."})
    heartbeat_stale_after_s: float = field(default=300.0, metadata={"help": "Worker silence limit (seconds)."})
    log_completions: bool = field(default=False, metadata={"help": "Log sampled completions."})
    log_completions_steps: int = field(default=100, metadata={"help": "Steps between completion logs."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed."})

    def __post_init__(self):
        if isinstance(self.teacher_server_urls, str) and self.teacher_server_urls.strip().startswith("{"):
            self.teacher_server_urls = json.loads(self.teacher_server_urls)
        super().__post_init__()
        if self.teacher_server_urls is None:
            self.teacher_server_urls = {"default": "http://localhost:8001"}
        if isinstance(self.teacher_server_urls, dict) and not self.teacher_server_urls:
            raise ValueError("teacher_server_urls must have at least one entry.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        _RolloutFields._reject_context_parallelism(self)
        # Rank 0 owns the rollout queue and scatters one packed row to every process.
        self.accelerator_config.split_batches = True
        self.accelerator_config.dispatch_batches = True
