"""Building blocks shared by the trainers, one module per concern; this front re-exports them all so that every
`from trl.trainer.utils import ...` keeps working.

| module | concern |
|---|---|
| `tensors` | padding, flushing rows left/right, NaN-aware reductions |
| `sampling` | repeated-index samplers, splitting and shuffling dictionaries of batch data |
| `logprobs` | per-token log-probabilities of a causal LM, per-token statistics of the output distribution |
| `packing` | packed sequences, sequence-level log-probabilities, precomputed reference log-probabilities |
| `prefix_sharing` | rows that start alike (preference pairs, KTO's KL rows) run their common prefix once |
| `dataset_rows` | prompt/completion tokenisation and collation for the offline preference trainers |
| `reporting` | console sample tables, tracker URLs and tables, model cards |
| `flops` | FLOPs per token, accelerator peak FLOP/s, MFU |
| `callables` | identity, callable names, async detection |
| `token_losses` | DFT and chunked cross-entropy losses as standalone functions (TRL's `sft_trainer` names) |
| `divergence` | generalized Jensen-Shannon divergence between student and teacher, chunked over positions |
| `distributed` | `MASTER_ADDR`/`MASTER_PORT`, whether DeepSpeed or FSDP shards the model, a clean exit for gloo processes |
| `vision` | per-sample grouping of pixel values, image-free messages, vision dataset/processor checks |

Chunked log-softmax kernels live in `trl.kernels.log_softmax` (TRL's `_ChunkedLogProbFunction` in
`trl.kernels.chunked_logprob`); model loading, PEFT preparation and model-level
helpers in `trl.models.loading`, `trl.models.peft` and `trl.models.utils`. They are re-exported here.
"""

# TRL's name for the fused LM-head log-prob function (imported by code written for TRL).
from ...kernels.chunked_logprob import ChunkedLogProbFunction as _ChunkedLogProbFunction  # noqa: F401
from ...kernels.log_softmax import _log_softmax_stats, entropy_from_logits, selective_log_softmax
from ...models.loading import (
    create_model_from_path,
    get_config_model_id,
    get_kbit_device_map,
    get_quantization_config,
)
from ...models.peft import (
    enable_gradient_checkpointing,
    get_peft_config,
    peft_module_casting_to_bf16,
    prepare_peft_model,
    use_adapter,
)
from ...models.utils import disable_dropout_in_model, hash_module
from ..fast_paths.fused_lm_head import FusedCausalLMOutput, add_fused_lm_head, maybe_gather_lm_head_ctx
from .callables import (
    get_callable_name,
    identity,
    is_async_callable,
    shutdown_event_loop_in_daemon,
    start_event_loop_in_daemon,
)
from .dataset_rows import (
    PromptCompletionTokenizer,
    as_token_list,
    collate_prompt_completions,
    map_kwargs_with_desc,
    parse_tools_column,
    remove_none_values,
    scored_completion_tokens,
)
from .distributed import ensure_master_addr_port, global_then_local_main_first, uses_sharding_engine
from .divergence import generalized_jsd_loss, per_token_generalized_jsd
from .flops import adjusted_mfu, compute_flops_per_token, compute_mfu, get_peak_flops, get_peak_flops_per_device
from .logprobs import (
    TokenLogps,
    compute_token_logps,
    fusable_lm_head,
    logits_statistics,
    model_accepts_argument,
    selective_log_softmax_and_entropy,
)
from .packing import (
    MIN_SAVED_SHARE,
    PackedSequences,
    SequenceTokenLogps,
    common_packed_width,
    compute_sequence_token_logps,
    drop_padding,
    pack_padded_sequences,
    packed_attention_kind,
    packed_sdpa_applicable,
    packed_sdpa_attention,
    packed_sequence_logps_in_one_pass,
    precompute_reference_logps,
    sequence_scores_without_padding,
)
from .reporting import (
    generate_model_card,
    get_comet_experiment_url,
    get_trackio_space_url,
    log_table_to_comet_experiment,
    print_prompt_completions_sample,
)
from .sampling import (
    RepeatedIterableDataset,
    RepeatSampler,
    repeat_iterable_dataset,
    shuffle_sequence_dict,
    split_tensor_dict,
)
from .tensors import flush_left, flush_right, nanmax, nanmin, nanstd, pad
from .vision import split_pixel_values_by_grid, strip_images_from_messages, unsplit_pixel_values_by_grid


__all__ = [
    "FusedCausalLMOutput",
    "RepeatSampler",
    "add_fused_lm_head",
    "adjusted_mfu",
    "compute_flops_per_token",
    "compute_mfu",
    "create_model_from_path",
    "disable_dropout_in_model",
    "enable_gradient_checkpointing",
    "ensure_master_addr_port",
    "entropy_from_logits",
    "flush_left",
    "flush_right",
    "generalized_jsd_loss",
    "generate_model_card",
    "get_callable_name",
    "get_comet_experiment_url",
    "get_config_model_id",
    "get_kbit_device_map",
    "get_peak_flops",
    "get_peak_flops_per_device",
    "get_peft_config",
    "get_quantization_config",
    "get_trackio_space_url",
    "global_then_local_main_first",
    "hash_module",
    "identity",
    "is_async_callable",
    "log_table_to_comet_experiment",
    "maybe_gather_lm_head_ctx",
    "nanmax",
    "nanmin",
    "nanstd",
    "pad",
    "peft_module_casting_to_bf16",
    "per_token_generalized_jsd",
    "prepare_peft_model",
    "print_prompt_completions_sample",
    "remove_none_values",
    "RepeatedIterableDataset",
    "repeat_iterable_dataset",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "shuffle_sequence_dict",
    "shutdown_event_loop_in_daemon",
    "split_pixel_values_by_grid",
    "split_tensor_dict",
    "start_event_loop_in_daemon",
    "strip_images_from_messages",
    "unsplit_pixel_values_by_grid",
    "use_adapter",
]
