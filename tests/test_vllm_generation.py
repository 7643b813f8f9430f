"""vLLM generation inside the online trainers (`trl.generation.vllm_generation.VLLMGeneration`), both modes.

Tests marked `vllm` run in the vLLM environment (`make test-vllm`): an in-process (colocate) engine on the tiny Qwen2
model, weight pushes checked against the trainer's own log-probabilities, PEFT merging, GRPO and RLOO runs in
colocate mode, a GRPO run against a `trl vllm-serve` subprocess, two-process colocate training, and the error when
the server is down. The unmarked tests run in the main environment (no vLLM): weight names and the ImportError.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from distributed_utils import engine_params
from vllm_utils import free_port, online_args, requires_vllm, running_server, trainer_logps

from trl.assets import get_model_path, load_test_dataset
from trl.generation.vllm_generation import vllm_weight_name
from trl.import_utils import is_vllm_available


MODEL = "tiny-Qwen2ForCausalLM"
PROMPT_IDS = [[11, 22, 33, 44], [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model_path() -> str:
    return get_model_path(MODEL)


@pytest.fixture(scope="module")
def prompts():
    return load_test_dataset("standard_prompt_only", split="train")


def low_id_reward(completion_ids, **kwargs):
    """Share of completion tokens in the lower half of the vocabulary: varies between samples."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def engine_args(**overrides):
    """A config with only the fields an Online-DPO-style trainer has (`max_new_tokens`, no `max_completion_length`
    nor `vllm_max_model_length`): the wrapper must fill in the rest."""
    values = dict(
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        temperature=1.0,
        max_new_tokens=6,
        seed=0,
        generation_kwargs={"temperature": 0.0},  # greedy, merged last
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def perturbed_copy(model, seed: int, scale: float = 0.5):
    perturbed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp_min(0.02))
    return perturbed


def train_logs(trainer):
    return [log for log in trainer.state.log_history if "loss" in log]


def changed_params(before, model):
    return [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], p.detach())]


# ---------------------------------------------------------------------------------------------------------------------
# Main environment (no vLLM needed)
# ---------------------------------------------------------------------------------------------------------------------
def test_vllm_weight_names_for_plain_and_peft_models():
    assert vllm_weight_name("model.layers.0.mlp.up_proj.weight", is_peft=False) == "model.layers.0.mlp.up_proj.weight"
    peft_name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert vllm_weight_name(peft_name, is_peft=True) == "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weight_name("base_model.model.model.norm.weight", is_peft=True) == "model.norm.weight"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", True) is None
    assert vllm_weight_name("base_model.model.lm_head.original_module.weight", is_peft=True) is None
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.default.weight", True) == "lm_head.weight"


@pytest.mark.parametrize("trainer_name", ["GRPO", "RLOO"])
def test_use_vllm_without_vllm_raises_import_error(tmp_path, model_path, prompts, trainer_name):
    if is_vllm_available():
        pytest.skip("vLLM is installed")
    import trl

    config = getattr(trl, f"{trainer_name}Config")(
        output_dir=str(tmp_path), use_vllm=True, per_device_train_batch_size=2, num_generations=2, report_to="none"
    )
    with pytest.raises(ImportError, match="pip install trl\\[vllm\\]"):
        getattr(trl, f"{trainer_name}Trainer")(
            model_path, reward_funcs=low_id_reward, args=config, train_dataset=prompts
        )


# ---------------------------------------------------------------------------------------------------------------------
# Colocate engine (one in-process engine for the module's direct tests)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.fixture(scope="module")
def engine(trainer_model, accelerator):
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration(trainer_model, accelerator, engine_args())
    yield generation
    generation.close()


@pytest.mark.vllm
@requires_vllm
def test_colocate_greedy_generation_matches_transformers(engine, trainer_model):
    assert engine.max_tokens == 6  # from max_new_tokens: the config has no max_completion_length
    out = engine.generate(PROMPT_IDS, model=trainer_model, weights_version=0)
    assert out["prompt_ids"] == PROMPT_IDS
    for prompt, completion, logprobs in zip(PROMPT_IDS, out["completion_ids"], out["logprobs"]):
        with torch.no_grad():
            expected = trainer_model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert completion == expected[: len(completion)] and len(completion) == 6
        assert logprobs == pytest.approx(trainer_logps(trainer_model, prompt, completion), abs=1e-4)


@pytest.mark.vllm
@requires_vllm
def test_weight_push_follows_the_weights_version(engine, trainer_model):
    before = engine.generate(PROMPT_IDS, model=trainer_model, weights_version="original")["completion_ids"]
    perturbed = perturbed_copy(trainer_model, seed=0)

    # Same version: the engine keeps its weights, whatever model is passed.
    same = engine.generate(PROMPT_IDS, model=perturbed, weights_version="original")
    assert same["completion_ids"] == before

    # New version: the perturbed weights are pushed; the engine's log-probs are the perturbed model's.
    after = engine.generate(PROMPT_IDS, model=perturbed, weights_version="perturbed")
    assert after["completion_ids"] != before
    for prompt, ids, logprobs in zip(PROMPT_IDS, after["completion_ids"], after["logprobs"]):
        assert logprobs == pytest.approx(trainer_logps(perturbed, prompt, ids), abs=1e-4)

    # A second push into the already-reloaded engine works as well (CPU repacks weights after every reload).
    twice = perturbed_copy(perturbed, seed=1, scale=0.2)
    out = engine.generate(PROMPT_IDS, model=twice, weights_version="twice")
    for prompt, ids, logprobs in zip(PROMPT_IDS, out["completion_ids"], out["logprobs"]):
        assert logprobs == pytest.approx(trainer_logps(twice, prompt, ids), abs=1e-4)

    # mark_stale forces a push at the same version; pushing the original weights restores the original outputs.
    engine.mark_stale()
    assert engine.generate(PROMPT_IDS, model=trainer_model, weights_version="twice")["completion_ids"] == before


@pytest.mark.vllm
@requires_vllm
def test_peft_adapters_are_merged_for_the_push_and_unmerged_after(engine, trainer_model):
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(trainer_model)
    # Random (non-zero) B matrices: the adapter changes the model's outputs.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    base_weights = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "base_layer" in n}

    out = engine.generate(PROMPT_IDS, model=peft_model, weights_version="peft")
    for prompt, ids, logprobs in zip(PROMPT_IDS, out["completion_ids"], out["logprobs"]):
        expected = trainer_logps(peft_model, prompt, ids)  # adapters active, unmerged
        assert logprobs == pytest.approx(expected, abs=1e-4)
        assert logprobs != pytest.approx(trainer_logps(trainer_model, prompt, ids), abs=1e-3)
    # Unmerged again: the base weights are back to their exact values and the adapters are separate.
    assert not any(getattr(module, "merged", False) for module in peft_model.modules())
    for name, param in peft_model.named_parameters():
        if name in base_weights:
            torch.testing.assert_close(param.detach(), base_weights[name], rtol=0, atol=1e-6)
    engine.generate(PROMPT_IDS, model=trainer_model, weights_version="restore")  # leave the engine as found


@pytest.mark.vllm
@requires_vllm
def test_end_of_sequence_tokens_stop_completions_and_are_kept(engine, trainer_model):
    greedy = engine.generate(PROMPT_IDS[:1], model=trainer_model, weights_version="restore")["completion_ids"][0]
    stop = greedy[2]
    if stop in greedy[:2]:
        pytest.skip("the greedy completion repeats its third token earlier")
    engine.eos_token_ids = [stop]
    try:
        out = engine.generate(PROMPT_IDS[:1], model=trainer_model, weights_version="restore")
    finally:
        engine.eos_token_ids = []
    assert out["completion_ids"][0] == greedy[:3]  # stops at the end-of-sequence token, which is kept
    assert len(out["logprobs"][0]) == 3


@pytest.mark.vllm
@requires_vllm
def test_sampling_params_come_from_the_config(engine):
    from transformers import AutoTokenizer

    args = engine.args
    kwargs = engine.sampling_kwargs()
    assert kwargs == {
        "n": 1,
        "temperature": 0.0,  # generation_kwargs override the named settings
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 6,
        "logprobs": 0,
    }
    engine.args = SimpleNamespace(
        **{**vars(args), "top_k": 5, "top_p": 0.9, "min_p": 0.05, "temperature": 0.7, "generation_kwargs": None}
    )
    engine.args.vllm_structured_outputs_regex = "[0-9]{4}"
    try:
        kwargs = engine.sampling_kwargs()
        assert (kwargs["top_k"], kwargs["top_p"], kwargs["min_p"], kwargs["temperature"]) == (5, 0.9, 0.05, 0.7)
        params = engine._sampling_params()
        assert params.structured_outputs is not None and params.structured_outputs.regex == "[0-9]{4}"
        out = engine.generate(PROMPT_IDS, weights_version="restore")
    finally:
        engine.args = args
    tokenizer = AutoTokenizer.from_pretrained(get_model_path(MODEL))
    for ids in out["completion_ids"]:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert text[:4].isdigit() and len(text.strip()) >= 4, text


@pytest.mark.vllm
@requires_vllm
def test_sleep_mode_on_cpu_warns_and_generation_works(trainer_model, accelerator, engine):
    if torch.cuda.is_available():
        pytest.skip("sleep mode is supported on CUDA")
    from trl.generation.vllm_generation import VLLMGeneration

    with pytest.warns(UserWarning, match="vllm_enable_sleep_mode=True is ignored"):
        generation = VLLMGeneration(trainer_model, accelerator, engine_args(vllm_enable_sleep_mode=True))
    try:
        out = generation.generate(PROMPT_IDS, model=trainer_model, weights_version=0)
        reference = engine.generate(PROMPT_IDS, model=trainer_model, weights_version="restore")
        assert out["completion_ids"] == reference["completion_ids"]
    finally:
        generation.close()


# ---------------------------------------------------------------------------------------------------------------------
# Trainers, colocate mode
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
@requires_vllm
def test_grpo_colocate_trains_with_importance_sampling_correction(tmp_path, model_path, prompts, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_LOG_TIMING", "1")  # the per-step timing breakdown, off by default as in TRL

    args = online_args(GRPOConfig, tmp_path, vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    assert trainer.vllm_generation is not None and trainer.vllm_generation.mode == "colocate"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert len(logs) == 3
    for log in logs:
        for key in ["sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/max", "reward"]:
            assert key in log, key
        # The weights are pushed after every optimizer step: vLLM samples from exactly the trained policy.
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert 0 < log["completions/max_length"] <= 8
        assert log["timing/generation"] >= 0
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()
    trainer.end()  # shuts the engine down before the process group goes
    assert trainer.vllm_generation.llm is None


@pytest.mark.vllm
@requires_vllm
def test_grpo_colocate_with_peft_pushes_merged_adapters(tmp_path, model_path, prompts):
    from peft import LoraConfig

    from trl import GRPOConfig, GRPOTrainer

    # No LoRA dropout: the trainer's log-prob pass runs in training mode, and dropout would make it differ from vLLM's.
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    args = online_args(GRPOConfig, tmp_path, learning_rate=5e-2)
    trainer = GRPOTrainer(
        model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts, peft_config=peft_config
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora_" in name for name in changed)
    for log in train_logs(trainer):
        # After each step the merged (base + trained adapter) weights reach the engine.
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
    assert not any(getattr(module, "merged", False) for module in trainer.model.modules())


@pytest.mark.vllm
@requires_vllm
def test_rloo_colocate_trains(tmp_path, model_path, prompts):
    from trl import RLOOConfig, RLOOTrainer

    args = online_args(RLOOConfig, tmp_path, max_steps=2, beta=0.0)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert len(logs) == 2 and all("reward" in log and "entropy" in log for log in logs)
    # RLOO has no importance-sampling correction: the sampler's log-probs are not requested (no extra pass).
    assert not any(key.startswith("sampling/") for log in logs for key in log)


# ---------------------------------------------------------------------------------------------------------------------
# Trainers, server mode
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@requires_vllm
def test_grpo_server_mode_trains_and_syncs_weights(tmp_path, model_path, prompts):
    from trl import GRPOConfig, GRPOTrainer

    with running_server(model_path, tmp_path / "server.log") as (_, port):
        args = online_args(
            GRPOConfig,
            tmp_path,
            vllm_mode="server",
            vllm_server_base_url=f"http://127.0.0.1:{port}",
            vllm_group_port=free_port(),
            vllm_server_timeout=30,
        )
        trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
        assert trainer.vllm_generation.mode == "server" and trainer.vllm_generation.client.communicator is not None
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        try:
            trainer.train()
        finally:
            trainer.vllm_generation.client.close_communicator()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert len(logs) == 3
    for log in logs:
        # The server samples from the trained policy: its log-probs are the trainer's after every push.
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.vllm
@requires_vllm
def test_server_mode_fails_clearly_when_the_server_is_down(tmp_path, model_path, prompts):
    from trl import GRPOConfig, GRPOTrainer

    port = free_port()
    args = online_args(GRPOConfig, tmp_path, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=1.0)
    args.vllm_server_host = "127.0.0.1"
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*after 1.0 seconds"):
        GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)


# ---------------------------------------------------------------------------------------------------------------------
# Two processes, one colocated engine each (external_launcher)
# ---------------------------------------------------------------------------------------------------------------------
def train_grpo_colocate(out_dir: str, model: str = MODEL, tensor_parallel_size: int = 1, peft: bool = False):
    """Worker: 2 GRPO steps with colocated vLLM in 2 processes (an engine per process, or one engine sharded over
    both with `tensor_parallel_size=2`; LoRA adapters on the policy with `peft=True`); writes this rank's report."""
    from distributed_utils import digest, full_numel, full_state, local_numel, write_report

    from trl import GRPOConfig, GRPOTrainer

    completions = []

    def recording_reward(completion_ids, **kwargs):
        completions.append(completion_ids)
        return low_id_reward(completion_ids)

    args = online_args(
        GRPOConfig,
        out_dir,
        max_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        bf16=False,  # with use_cpu, bf16=None means CPU bf16 autocast (as in TRL); these runs are fp32
        vllm_tensor_parallel_size=tensor_parallel_size,
    )
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = GRPOTrainer(
        get_model_path(model),
        reward_funcs=recording_reward,
        args=args,
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
        peft_config=peft_config,
    )
    trainer.train()
    llm_config = trainer.vllm_generation.llm.llm_engine.vllm_config.parallel_config
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    write_report(
        out_dir,
        {
            "process_index": trainer.accelerator.process_index,
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
            "sharded": local_numel(policy) < full_numel(policy),
            "executor": llm_config.distributed_executor_backend,
            "engine_tensor_parallel_size": llm_config.tensor_parallel_size,
            "weights_digest": digest(full_state(trainer)),
            "merged_after_training": any(getattr(module, "merged", False) for module in policy.modules()),
            "logs": train_logs(trainer),
            "completions": completions,
        },
    )


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("engine", engine_params(["ddp", "zero3", "fsdp2"]))
def test_two_process_colocate_training(tmp_path, engine):
    """An engine per process; under ZeRO-3 and FSDP2 the sharded parameters are gathered for every push."""
    from distributed_utils import EXPECTED_DISTRIBUTED_TYPE, launch

    reports = launch(f"{__file__}:train_grpo_colocate", tmp_path, engine, timeout=600)
    assert [r["process_index"] for r in reports] == [0, 1] and {r["world_size"] for r in reports} == {2}
    assert {r["distributed_type"] for r in reports} == {EXPECTED_DISTRIBUTED_TYPE[engine]}
    assert {r["sharded"] for r in reports} == {engine in ("zero3", "fsdp2")}
    assert {r["executor"] for r in reports} == {"external_launcher"}
    assert {r["engine_tensor_parallel_size"] for r in reports} == {1}
    assert len({r["weights_digest"] for r in reports}) == 1  # one model trained by both processes
    assert reports[0]["completions"] != reports[1]["completions"]  # each engine sampled its own rows
    for report in reports:
        assert len(report["logs"]) == 2
        for log in report["logs"]:
            # Each process's engine received the trained weights after every step.
            assert log["sampling/sampling_logp_difference/max"] < 1e-4


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("engine", engine_params(["zero3", "fsdp2"]))
def test_two_process_colocate_training_with_peft(tmp_path, engine):
    """LoRA on a sharded policy: the adapters are merged into the gathered weights for every push (the engine's
    log-probs then equal the trainer's, which see the adapters) and unmerged afterwards."""
    from distributed_utils import launch

    reports = launch(f"{__file__}:train_grpo_colocate", tmp_path, engine, timeout=600, peft=True)
    assert {r["world_size"] for r in reports} == {2} and {r["sharded"] for r in reports} == {True}
    assert len({r["weights_digest"] for r in reports}) == 1
    assert {r["merged_after_training"] for r in reports} == {False}
    for report in reports:
        assert len(report["logs"]) == 2
        for log in report["logs"]:
            assert log["sampling/sampling_logp_difference/max"] < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_two_process_colocate_tensor_parallel_engine(tmp_path):
    """One engine sharded over both processes (the tiny model has a single attention head: use the ~30M model)."""
    from distributed_utils import launch

    kwargs = {"model": "small-Qwen2ForCausalLM", "tensor_parallel_size": 2}
    reports = launch(f"{__file__}:train_grpo_colocate", tmp_path, "ddp", timeout=600, **kwargs)
    assert {r["executor"] for r in reports} == {"external_launcher"}
    assert {r["engine_tensor_parallel_size"] for r in reports} == {2}
    assert len({r["weights_digest"] for r in reports}) == 1
    assert reports[0]["completions"] != reports[1]["completions"]  # one engine, each process gets its own rows
    for report in reports:
        for log in report["logs"]:
            assert log["sampling/sampling_logp_difference/max"] < 1e-3
