"""Configuration of the server-teacher distillation trainer."""

from dataclasses import dataclass, field

from ...trainer.distillation_config import DistillationConfig


_REVERSE_KL_TOP_1_MODES = ("sampled", "argmax")


@dataclass
class ServerDistillationConfig(DistillationConfig):
    r"""Configuration for [`~trl.experimental.server_distillation.ServerDistillationTrainer`].

    Everything of [`DistillationConfig`] applies (the student samples its completions on-policy); the teacher is a
    vLLM server that scores the student's sequences and reports a few log-probabilities per position, so the
    divergence is taken on a sparse support of tokens instead of the whole vocabulary.

    Args:
        vllm_server_port (`int`, defaults to `8001`):
            Port of the student's own generation server when `use_vllm` is on in server mode (the teacher's server is
            reached through `teacher_model_server_url`).
        teacher_model_server_url (`str` or `None`, defaults to `None`):
            Base URL of the teacher's vLLM server, for example `"http://localhost:8000"`. Required.
        loss_top_k (`int`, defaults to `1`):
            Teacher log-probabilities requested per position. With `beta=0` (forward KL) the support is the
            teacher's top-k tokens; with `beta>0` it must be 1 (top-1 sparse support: the teacher's top token plus the
            sampled token).
        loss_add_tail (`bool`, defaults to `True`):
            Keep the probability mass outside the support as one extra "tail" slot; otherwise both distributions are
            renormalised over the support.
        reverse_kl_top_1_mode (`str`, defaults to `"sampled"`):
            Reverse token of the top-1 sparse support. Only `"sampled"` (the realised completion token) is possible
            with a server teacher; `"argmax"` is rejected.
    """

    vllm_server_port: int = field(
        default=8001,
        metadata={"help": "Port of the student's generation server (the teacher uses teacher_model_server_url)."},
    )
    teacher_model_server_url: str | None = field(
        default=None, metadata={"help": "Base URL of the teacher's vLLM server (required)."}
    )
    loss_top_k: int = field(default=1, metadata={"help": "Teacher log-probabilities requested per position."})
    loss_add_tail: bool = field(
        default=True, metadata={"help": "Add a tail bucket for the mass outside the support instead of renormalising."}
    )
    reverse_kl_top_1_mode: str = field(
        default="sampled",
        metadata={"help": "Reverse token of the top-1 sparse support.", "choices": list(_REVERSE_KL_TOP_1_MODES)},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.reverse_kl_top_1_mode not in _REVERSE_KL_TOP_1_MODES:
            raise ValueError(
                f"reverse_kl_top_1_mode must be one of {list(_REVERSE_KL_TOP_1_MODES)}, got "
                f"{self.reverse_kl_top_1_mode!r}."
            )
        if self.teacher_model_server_url is None or not str(self.teacher_model_server_url).strip():
            raise ValueError(
                "teacher_model_server_url is required: the URL of the teacher's vLLM server, for example "
                "'http://localhost:8000' (start it with `trl vllm-serve --model <teacher>`)."
            )
        if self.beta == 0.0 and self.loss_top_k < 1:
            raise ValueError(
                f"loss_top_k must be at least 1 with beta=0 (forward KL over the teacher's top-k), got "
                f"{self.loss_top_k}."
            )
        if self.reverse_kl_top_1_mode == "argmax":
            raise ValueError(
                "reverse_kl_top_1_mode='argmax' is not supported with a teacher server: the server only scores the "
                "tokens of the sequence it is sent. Use reverse_kl_top_1_mode='sampled'."
            )
        if self.beta > 0.0 and self.loss_top_k != 1:
            raise ValueError(
                f"With beta > 0 (got beta={self.beta}) the server loss uses the top-1 sparse support, so loss_top_k "
                f"must be 1, got {self.loss_top_k}. Set loss_top_k=1, or beta=0 for a forward KL over the top-k."
            )
