"""Every public name of `shared/api/frontier.md` (TRL 1.16's newer modules, plus SSD and MiniLLM from TRL 1.12) imports:
`IMPLEMENTED` must import, and `OPTIONAL` modules import when their optional package is installed, as in TRL 1.16.
"""

import importlib
import importlib.util

import pytest


# module -> names that must import from it (an empty list: the module itself)
IMPLEMENTED = {
    "trl.kernels": ["ChunkedLogProbFunction"],
    "trl.kernels.chunked_logprob": ["ChunkedLogProbFunction", "TOKEN_CHUNK_SIZE", "OPTIONAL_OUTPUTS"],
    "trl.kernels.chunked_divergence": ["ChunkedDivergenceFunction", "TOKEN_CHUNK_SIZE", "VOCAB_CHUNK_SIZE"],
    "trl.kernels.logprob_entropy": ["selective_log_softmax_and_entropy"],
    "trl.trainer": ["add_fused_lm_head"],
    "trl.trainer.utils": [
        "FusedCausalLMOutput",
        "add_fused_lm_head",
        "maybe_gather_lm_head_ctx",
        "selective_log_softmax",
        "selective_log_softmax_and_entropy",
        "entropy_from_logits",
        "compute_flops_per_token",
        "get_peak_flops",
        "get_peak_flops_per_device",
        "compute_mfu",
        "adjusted_mfu",
        "get_callable_name",
        "is_async_callable",
        "start_event_loop_in_daemon",
        "shutdown_event_loop_in_daemon",
        "use_adapter",
        "ensure_master_addr_port",
        "global_then_local_main_first",
        "hash_module",
        "get_config_model_id",
        "create_model_from_path",
    ],
    "trl.models": ["enable_selective_activation_checkpointing"],
    "trl.models.selective_activation_checkpointing": ["enable_selective_activation_checkpointing"],
    "trl.experimental.tpo": ["TPOConfig", "TPOTrainer"],
    "trl.experimental.gmpo": ["GMPOConfig", "GMPOTrainer"],
    "trl.experimental.a2po": ["A2POConfig", "A2POTrainer"],
    # From TRL 1.12 (issue 52 brings them back; oracle trl==1.12.0)
    "trl.experimental.ssd": ["SSDConfig", "SSDTrainer"],
    "trl.experimental.minillm": ["MiniLLMConfig", "MiniLLMTrainer"],
    "trl.experimental.sdft": ["SDFTConfig", "SDFTTrainer", "loss_utils", "teacher_sync"],
    "trl.experimental.sdpo": ["SDPOConfig", "SDPOTrainer", "loss_utils", "teacher_sync"],
    "trl.experimental.sdpo.sdpo_trainer": ["SuccessfulRolloutTeacherContextBuilder", "DistillationLogits"],
    "trl.experimental.tpo.tpo_trainer": ["DataCollatorForTriplePreference"],
    "trl.experimental.harbor": ["AGENTS", "HarborBashEnv", "HarborEnv", "HarborSpec"],
    "trl.experimental.openreward": ["OpenRewardSpec"],
    "trl.experimental.openreward.environment": ["_RolloutEnvironment"],
    "trl.experimental.cpo": ["CPOConfig", "CPOTrainer"],
    "trl.experimental.orpo": ["ORPOConfig", "ORPOTrainer"],
    "trl.import_utils": ["is_harbor_available", "is_openreward_available", "is_aiohttp_available"],
    "trl.experimental.async_grpo": [
        "AsyncGRPOConfig",
        "AsyncGRPOTrainer",
        "async_grpo_trainer",
        "async_rollout_worker",
        "packing",
        "vllm_client",
        "weight_transfer",
    ],
    "trl.experimental.async_grpo.vllm_client": ["VLLMClient"],
    "trl.experimental.async_distillation": [
        "AsyncDistillationConfig",
        "AsyncDistillationTrainer",
        "async_distillation_trainer",
        "async_rollout_worker",
        "vllm_client",
        "weight_transfer",
    ],
    "trl.experimental.async_distillation.async_distillation_trainer": [
        "AsyncDistillationTrainer",
        "RolloutWorkerProtocol",
        "WeightTransferProtocol",
        "StepIntervalCallback",
        "RolloutQueueDataset",
        "FixedCountBatcher",
        "TokenBudgetBatcher",
        "DataCollatorForRollout",
        "log_rollout_traces",
        "round_lora_rank",
        "validate_lora_for_vllm_sync",
        "save_lora_adapter",
        "select_adapter_sync",
        "VLLMClient",
        "WeightTransferClient",
    ],
    "trl.experimental.async_distillation.async_rollout_worker": ["AsyncRolloutWorker", "RolloutSample"],
    "trl.experimental.async_distillation.vllm_client": ["VLLMClient"],
    "trl.experimental.async_distillation.weight_transfer": ["WeightTransferClient"],
    "trl.experimental.async_grpo.weight_transfer": ["WeightTransferClient"],
    "trl.experimental.async_grpo.async_grpo_trainer": [
        "AsyncGRPOTrainer",
        "StepIntervalCallback",
        "FixedCountBatcher",
        "TokenBudgetBatcher",
        "RolloutQueueDataset",
        "DataCollatorForRollout",
        "log_rollout_traces",
        "round_lora_rank",
        "validate_lora_for_vllm_sync",
        "save_lora_adapter",
        "select_adapter_sync",
        "RolloutWorkerProtocol",
        "WeightTransferProtocol",
    ],
    "trl.experimental.async_grpo.async_rollout_worker": [
        "AsyncRolloutWorker",
        "DriftKind",
        "TurnRecord",
        "TrainingSequence",
        "RolloutGroup",
        "RolloutSample",
    ],
    "trl.experimental.async_grpo.packing": ["TreeRow", "TREE_ATTENTION", "tree_attention", "register_tree_attention"],
    "trl.experimental.server_distillation": [
        "ServerDistillationConfig",
        "ServerDistillationTrainer",
        "build_teacher_request_inputs",
    ],
    "trl.distributed": ["DistributedBackend"],
    "trl.experimental.iw_opd": ["IWOPDConfig", "IWOPDTrainer", "iw_opd_trainer"],
    "trl.experimental.iw_opd.iw_opd_trainer": ["IWOPDTrainer", "build_teacher_request_inputs"],
}
# (object path, attribute) pairs: methods the contract adds to existing classes
IMPLEMENTED_ATTRIBUTES = [
    (f"trl.experimental.{kind}.{kind.upper()}Trainer", name)
    for kind in ("cpo", "orpo")
    for name in (
        "build_tokenized_answer",
        "tokenize_row",
        "concatenated_inputs",
        "get_batch_logps",
        "concatenated_forward",
        "get_batch_loss_metrics",
        "generate_from_model",
        "store_metrics",
    )
] + [
    ("trl.experimental.cpo.CPOTrainer", "cpo_loss"),
    ("trl.experimental.orpo.ORPOTrainer", "odds_ratio_loss"),
    ("trl.GRPOTrainer", "get_gamma_weights"),
    ("trl.generation.vllm_client.VLLMClient", "get_server_info"),
    ("trl.generation.vllm_client.VLLMClient", "image_features"),
]

# Modules that import only with an optional package, as in TRL 1.16: module -> (package, names)
OPTIONAL = {
    "trl.experimental.async_grpo.openenv_harness": (
        "openenv",
        ["CaptureContractError", "HarnessRolloutOutcome", "HarnessRolloutWorker"],
    ),
}


def _cases(table):
    return [(module, name) for module, names in table.items() for name in names]


def _resolve(path: str):
    module_name, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


@pytest.fixture(autouse=True)
def _silence_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.mark.parametrize("module, name", _cases(IMPLEMENTED))
def test_name_imports(module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path, name", IMPLEMENTED_ATTRIBUTES)
def test_method_exists(path, name):
    assert callable(getattr(_resolve(path), name))


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_optional_module(module):
    package, names = OPTIONAL[module]
    if importlib.util.find_spec(package) is None:
        with pytest.raises(ModuleNotFoundError, match=package):
            importlib.import_module(module)
    else:
        assert all(hasattr(importlib.import_module(module), name) for name in names)
