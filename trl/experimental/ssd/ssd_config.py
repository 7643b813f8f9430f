"""Configuration of the Simple Self-Distillation (SSD) trainer."""

from dataclasses import dataclass, field

from .._self_distillation.config import _SelfSampledRolloutConfig


@dataclass
class SSDConfig(_SelfSampledRolloutConfig):
    r"""Configuration for [`experimental.ssd.SSDTrainer`]: fine-tuning a model on its own sampled completions.

    Only the fields TRL adds or whose default differs from [`~transformers.TrainingArguments`] are listed here; every
    other `TrainingArguments` field works as usual (`learning_rate` keeps its `5e-5` default).

    Args:
        > Model

        model_init_kwargs (`dict[str, Any]`, `str` or `None`, defaults to `None`):
            Keyword arguments for `from_pretrained` when the trainer's `model` is a string (a dict, or a JSON string on
            the command line).
        trust_remote_code (`bool`, defaults to `False`):
            Allow custom modelling code from the model repository when the trainer loads the model or processor.
        disable_dropout (`bool`, defaults to `True`):
            Set every dropout probability of the trained model to zero.

        > Generation

        max_prompt_length (`int` or `None`, defaults to `512`):
            Keep at most this many prompt tokens (the last ones). `None` keeps them all.
        max_completion_length (`int` or `None`, defaults to `256`):
            Maximum number of generated tokens per completion.
        generation_batch_size (`int` or `None`, defaults to `None`):
            Completions generated per round; `None` means `per_device_train_batch_size * num_processes *
            steps_per_generation`. Exclusive with `steps_per_generation`.
        steps_per_generation (`int` or `None`, defaults to `None`):
            Micro-steps served by one generation round; `None` means `gradient_accumulation_steps`.
        temperature (`float`, defaults to `1.0`):
            Sampling temperature (the loss scores the completions at temperature 1).
        top_k (`int`, defaults to `0`):
            Top-k filtering; `0` disables it.
        top_p (`float`, defaults to `1.0`):
            Nucleus sampling probability mass.
        min_p (`float` or `None`, defaults to `None`):
            Minimum token probability relative to the most likely token.
        repetition_penalty (`float`, defaults to `1.0`):
            Repetition penalty (above 1 discourages repeats).
        generation_kwargs (`dict[str, Any]` or `None`, defaults to `None`):
            Extra generation keyword arguments (transformers `GenerationConfig` or vLLM `SamplingParams`), overriding
            the ones above.
        cache_implementation (`str` or `None`, defaults to `None`):
            KV-cache implementation of transformers' `generate`.
        chat_template_kwargs (`dict[str, Any]` or `None`, defaults to `None`):
            Extra keyword arguments of the chat template applied to conversational prompts.
        use_vllm (`bool`, defaults to `False`), vllm_mode (`str`, defaults to `"colocate"`), vllm_model_impl,
        vllm_server_base_url, vllm_server_host, vllm_server_port, vllm_server_timeout, vllm_group_port,
        vllm_tensor_parallel_size, vllm_gpu_memory_utilization, vllm_max_model_length, vllm_enable_sleep_mode:
            Generation with vLLM, as in [`GRPOConfig`].
        ds3_gather_for_generation (`bool`, defaults to `True`):
            DeepSpeed ZeRO-3: gather the weights for generation.

        > Training

        filter_empty (`bool`, defaults to `True`):
            Leave out of the loss the completions that are empty or a short single line (fewer than 10 characters
            once stripped of surrounding whitespace).
        num_iterations (`int`, defaults to `1`):
            Optimisation passes over each generated batch.
        shuffle_dataset (`bool`, defaults to `True`):
            Shuffle the training prompts.
    """

    # One completion per prompt (the rollout core reads these; not configurable for SSD).
    num_generations = 1
    num_generations_eval = None

    filter_empty: bool = field(
        default=True, metadata={"help": "Leave empty and short single-line completions out of the loss."}
    )
