"""Configuration of the GOLD trainer (General Online Logit Distillation, across tokenizers)."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...trainer.sft_config import SFTConfig
from ..gkd.gkd_config import check_distillation_ranges


@dataclass
class GOLDConfig(SFTConfig):
    r"""Configuration for [`experimental.gold.GOLDTrainer`]; every [`SFTConfig`] field applies as well.

    Args:
        learning_rate (`float`, defaults to `1e-7`):
            Initial learning rate for AdamW.
        temperature (`float`, defaults to `0.9`):
            Sampling temperature of the generations; also divides both models' logits in the generalized JSD.
        top_p (`float`, defaults to `0.95`):
            Nucleus sampling mass, in (0, 1].
        top_k (`int`, defaults to `0`):
            Top-k filter of the sampling; 0 disables it.
        lmbda (`float`, defaults to `0.5`):
            Probability, drawn once per training batch, that the completions are the student's own samples.
        beta (`float`, defaults to `0.5`):
            Generalized JSD interpolation: 0 forward KL `KL(teacher || student)`, 1 reverse KL.
        max_completion_length (`int`, defaults to `128`):
            Maximum number of tokens generated per completion.
        teacher_model_name_or_path (`str` or `None`, defaults to `None`):
            Teacher path or hub id, used when the trainer's `teacher_model` argument is None.
        teacher_model_revision (`str` or `None`, defaults to `None`):
            Revision of the teacher (and of its tokenizer) when loaded from a string.
        teacher_model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the teacher is given as a string.
        teacher_tokenizer_name_or_path (`str` or `None`, defaults to `None`):
            Tokenizer of the teacher for the cross-tokenizer loss; None loads it from the teacher's path.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the student and the teacher to zero.
        seq_kd (`bool`, defaults to `False`):
            Sequence-level KD: on batches that are not on-policy, train on the teacher's generations.
        num_generations (`int`, defaults to `1`):
            Completions sampled per prompt on on-policy batches: each step takes `generation_batch_size` prompts and
            repeats each `num_generations` times in a row, every copy getting its own sample.
        generation_batch_size (`int` or `None`, defaults to `None`):
            Prompts per process and optimizer step; None is `per_device_train_batch_size *
            gradient_accumulation_steps // num_generations`, the only value allowed.
        use_uld_loss (`bool`, defaults to `False`):
            Use Universal Logit Distillation (teacher and student tokenizers may differ) instead of the JSD.
        uld_token_merge_strategy (`str`, defaults to `"observed"`):
            How a group of tokens split differently by the two tokenizers gets one distribution: `"observed"` or
            `"bayesian"` (see [`~experimental.gold.ULDLoss`]).
        use_extended_uld (`bool`, defaults to `True`):
            Align the two tokenizations by their byte spans (False: positional truncation, as in the ULD paper).
        uld_use_hybrid_loss (`bool`, defaults to `False`):
            Generalized JSD over the tokens both vocabularies share, ULD over the rest.
        uld_hybrid_matched_weight (`float` or `None`, defaults to `None`):
            Weight of the shared-vocabulary term; None (with the unmatched weight None too) weights by the share of
            the teacher vocabulary that has a match.
        uld_hybrid_unmatched_weight (`float` or `None`, defaults to `None`):
            Weight of the ULD term over the rest of the vocabularies.
        uld_crossentropy_weight (`float`, defaults to `0.0`):
            Weight of the student's cross-entropy on the completion tokens.
        uld_distillation_weight (`float`, defaults to `1.0`):
            Weight of the ULD distillation term.
        uld_student_temperature (`float`, defaults to `1.0`):
            Temperature of the student's distribution in ULD.
        uld_teacher_temperature (`float`, defaults to `1.0`):
            Temperature of the teacher's distribution in ULD.
        uld_skip_student_eos (`bool`, defaults to `True`):
            Leave the student's last completion token (its end of sequence) out of ULD.
        uld_skip_teacher_eos (`bool`, defaults to `True`):
            Leave the teacher's last completion token (the appended eos) out of ULD.
        use_vllm (`bool`, defaults to `False`):
            Generate the on-policy completions with vLLM.
        vllm_mode (`str`, defaults to `"colocate"`):
            `"colocate"` (engine in the trainer's processes) or `"server"` (`trl vllm-serve`).
        vllm_server_base_url (`str` or `None`, defaults to `None`):
            Server URL; overrides host and port.
        vllm_server_host (`str`, defaults to `"0.0.0.0"`):
            Server host.
        vllm_server_port (`int`, defaults to `8001`):
            Server port.
        vllm_server_timeout (`float`, defaults to `240.0`):
            Seconds to wait for the server.
        vllm_group_port (`int`, defaults to `51216`):
            Port of the weight-synchronisation group.
        vllm_gpu_memory_utilization (`float`, defaults to `0.9`):
            Colocate: GPU memory fraction of the engine.
        vllm_tensor_parallel_size (`int`, defaults to `1`):
            Colocate: tensor-parallel size of the engine.
        vllm_max_model_length (`int` or `None`, defaults to `None`):
            Colocate: context length of the engine.
        vllm_model_impl (`str`, defaults to `"vllm"`):
            `"vllm"` or `"transformers"` model implementation inside vLLM.
        vllm_structured_outputs_regex (`str` or `None`, defaults to `None`):
            Regex constraining vLLM's decoding.
        vllm_sync_frequency (`int`, defaults to `1`):
            Optimizer steps between weight pushes to vLLM.
        vllm_enable_sleep_mode (`bool`, defaults to `False`):
            Put the colocated engine to sleep outside generation.
        log_completions (`bool`, defaults to `False`):
            Log the latest step's generated (prompt, completion) pairs every `log_completions_steps`: printed as a
            table, written to `output_dir/completions/` as parquet and sent to wandb when it is a `report_to` target.
        log_completions_steps (`int`, defaults to `100`):
            Steps between two completion samples.
        num_completions_to_print (`int` or `None`, defaults to `None`):
            Rows printed; None prints all.
        wandb_log_unique_prompts (`bool`, defaults to `True`):
            Keep one row per prompt in the logged completions (the table, the parquet file and wandb).
        callbacks (`list[str]`, defaults to `[]`):
            Names of extra callbacks. Not resolved here: must stay empty (the trainer raises otherwise); pass callback
            instances to the trainer.
    """

    # `beta` interpolates two divergences here: its [0, 1] range is checked below, not by the shared rule.
    _checks_own_beta: ClassVar[bool] = True

    _VALID_DICT_FIELDS = SFTConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs"]

    learning_rate: float = field(default=1e-7, metadata={"help": "Initial learning rate for AdamW."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (and JSD temperature)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass, in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling filter; 0 disables it."})
    lmbda: float = field(default=0.5, metadata={"help": "Probability per batch of training on student samples."})
    beta: float = field(default=0.5, metadata={"help": "Generalized JSD interpolation: 0 forward KL, 1 reverse KL."})
    max_completion_length: int = field(default=128, metadata={"help": "Maximum tokens generated per completion."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "Teacher path or hub id."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Teacher revision."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for the teacher's `from_pretrained`."}
    )
    teacher_tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Teacher tokenizer for ULD; None loads it from the teacher's path."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student and the teacher."})
    seq_kd: bool = field(default=False, metadata={"help": "Sequence-level KD: train on teacher generations."})
    num_generations: int = field(default=1, metadata={"help": "Generations per prompt."})
    generation_batch_size: int | None = field(default=None, metadata={"help": "Prompts per process and step."})
    use_uld_loss: bool = field(default=False, metadata={"help": "Universal Logit Distillation across tokenizers."})
    uld_token_merge_strategy: str = field(
        default="observed", metadata={"help": "Merging of split tokens: observed or bayesian."}
    )
    use_extended_uld: bool = field(default=True, metadata={"help": "Align tokenizations by byte spans."})
    uld_use_hybrid_loss: bool = field(default=False, metadata={"help": "JSD on shared tokens, ULD on the rest."})
    uld_hybrid_matched_weight: float | None = field(default=None, metadata={"help": "Weight of the shared part."})
    uld_hybrid_unmatched_weight: float | None = field(default=None, metadata={"help": "Weight of the ULD part."})
    uld_crossentropy_weight: float = field(default=0.0, metadata={"help": "Weight of the cross-entropy term."})
    uld_distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the distillation term."})
    uld_student_temperature: float = field(default=1.0, metadata={"help": "ULD student temperature."})
    uld_teacher_temperature: float = field(default=1.0, metadata={"help": "ULD teacher temperature."})
    uld_skip_student_eos: bool = field(default=True, metadata={"help": "Leave the student's eos out of ULD."})
    uld_skip_teacher_eos: bool = field(default=True, metadata={"help": "Leave the teacher's eos out of ULD."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM."})
    vllm_mode: str = field(default="colocate", metadata={"help": "colocate or server."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8001, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for the vLLM server."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-sync group."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Colocate: GPU memory fraction."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: tensor-parallel size."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Colocate: context length."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vllm or transformers."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Decoding regex."})
    vllm_sync_frequency: int = field(default=1, metadata={"help": "Steps between weight pushes to vLLM."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Sleep the colocated engine."})
    log_completions: bool = field(default=False, metadata={"help": "Print samples of generated completions."})
    log_completions_steps: int = field(default=100, metadata={"help": "Steps between completion samples."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Rows printed; None = all."})
    wandb_log_unique_prompts: bool = field(default=True, metadata={"help": "Log unique prompts only."})
    callbacks: list[str] = field(default_factory=list, metadata={"help": "Names of extra callbacks."})

    def __post_init__(self):
        super().__post_init__()
        check_distillation_ranges(
            self.lmbda, self.beta, self.temperature, "max_completion_length", self.max_completion_length
        )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.uld_token_merge_strategy not in ("observed", "bayesian"):
            raise ValueError(
                f'uld_token_merge_strategy must be either "observed" or "bayesian", got "{self.uld_token_merge_strategy}".'
            )
        weights_set = (self.uld_hybrid_matched_weight, self.uld_hybrid_unmatched_weight) != (None, None)
        if weights_set and not (self.use_uld_loss and self.uld_use_hybrid_loss):
            raise ValueError(
                "uld_hybrid_matched_weight / uld_hybrid_unmatched_weight only apply to the hybrid ULD loss; set "
                "use_uld_loss=True and uld_use_hybrid_loss=True, or leave both weights None."
            )
        if (self.uld_hybrid_matched_weight is None) != (self.uld_hybrid_unmatched_weight is None):
            raise ValueError(
                "uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must both be None (for adaptive weighting) "
                "or both be set to numeric values. Got "
                f"uld_hybrid_matched_weight={self.uld_hybrid_matched_weight} and "
                f"uld_hybrid_unmatched_weight={self.uld_hybrid_unmatched_weight}."
            )
        for name in ("uld_student_temperature", "uld_teacher_temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}.")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            raise ValueError(f"vllm_model_impl must be 'vllm' or 'transformers', got {self.vllm_model_impl!r}.")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        local_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = local_batch // self.num_generations
        if self.generation_batch_size * self.num_generations != local_batch:
            raise ValueError(
                "generation_batch_size and num_generations must exactly partition the local optimizer-step batch. "
                "Expected generation_batch_size * num_generations == per_device_train_batch_size * "
                f"gradient_accumulation_steps, got {self.generation_batch_size} * {self.num_generations} != "
                f"{self.per_device_train_batch_size} * {self.gradient_accumulation_steps}."
            )
