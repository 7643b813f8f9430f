"""The online trainers sample from the policy they train (issue 30): sampling settings keep TRL's meaning.

Sampling at temperature `T` from `softmax(logits / T)` gives tokens whose mean log-probability under that distribution
equals minus its mean entropy (both are `E[log p]`). A sampler that truncates the distribution behind the trainer's back
(e.g. transformers' default top-k of 50 leaking in when `top_k=0`) draws tokens that are far likelier than the
distribution says, so the two means drift apart. With `top_k`/`top_p` set, every sampled token must lie in the allowed
set of the (temperature-scaled) distribution.
"""

import pytest
import torch
from trainer_utils import args_builder, requires_response_parser

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.import_utils import is_vllm_available


pytestmark = pytest.mark.usefixtures("single_thread")

MODEL = "tiny-Qwen2ForCausalLM"
NUM_PROMPTS = 4
NUM_GENERATIONS = 16
COMPLETION_LENGTH = 16  # 4 x 16 x 16 = 1024 sampled tokens per path


def _constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(
    tmp_path,
    trainer_class=GRPOTrainer,
    config_class=GRPOConfig,
    dataset_name="standard_prompt_only",
    tools=None,
    **overrides,
):
    settings = dict(
        per_device_train_batch_size=NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_LENGTH,
        max_steps=1,
        seed=0,
    )
    settings.update(overrides)
    args = args_builder(config_class)(tmp_path, **settings)
    dataset = load_test_dataset(dataset_name, split="train")
    extra = {"tools": tools} if tools else {}
    trainer = trainer_class(
        model=get_model_path(MODEL), reward_funcs=_constant_reward, args=args, train_dataset=dataset, **extra
    )
    return trainer, dataset


def _sample(trainer, dataset):
    """Sample `NUM_GENERATIONS` completions for each of the first prompts through the trainer's rollout path."""
    inputs = [dataset[i] for i in range(NUM_PROMPTS) for _ in range(NUM_GENERATIONS)]
    torch.manual_seed(0)
    out = trainer._generate_rows(trainer._prepare_rollout_rows(inputs))
    return out["prompt_ids"], out["completion_ids"]


@torch.no_grad()
def _scored(trainer, prompt_ids, completion_ids, temperature):
    """Per sampled token: its log-prob, the entropy and the logits (temperature-scaled) at its position."""
    model = trainer.model
    model.eval()
    logps, entropies, logits_rows, tokens = [], [], [], []
    for prompt, completion in zip(prompt_ids, completion_ids):
        if not completion:
            continue
        ids = torch.tensor([list(prompt) + list(completion)])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        log_probs = logits.log_softmax(-1)
        target = torch.tensor(completion)
        logps.append(log_probs.gather(-1, target[:, None]).squeeze(-1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
        logits_rows.append(logits)
        tokens.append(target)
    return torch.cat(logps), torch.cat(entropies), torch.cat(logits_rows), torch.cat(tokens)


def _assert_on_policy(logps, entropies):
    assert logps.numel() >= 512, f"too few sampled tokens for the statistic: {logps.numel()}"
    gap = (logps.mean() + entropies.mean()).item()
    # log p + H has mean 0 under on-policy sampling: allow four standard errors (and a floor for float noise).
    tolerance = max(4 * (logps + entropies).std().item() / logps.numel() ** 0.5, 0.02)
    assert abs(gap) < tolerance, (
        f"sampled tokens are not drawn from the policy: mean log p = {logps.mean():.3f}, "
        f"mean entropy = {entropies.mean():.3f}, tolerance {tolerance:.3f} (on-policy sampling gives mean log p "
        "~ -entropy)"
    )


@pytest.mark.parametrize("share_prompt_cache", [True, False], ids=["prefix_shared", "plain_generate"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_samples_follow_the_policy(tmp_path, share_prompt_cache, temperature):
    trainer, dataset = _trainer(tmp_path, temperature=temperature)
    trainer._share_prompt_cache = share_prompt_cache
    prompt_ids, completion_ids = _sample(trainer, dataset)
    logps, entropies, _, _ = _scored(trainer, prompt_ids, completion_ids, temperature)
    _assert_on_policy(logps, entropies)


def _multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: First factor.
        b: Second factor.
    """
    return a * b


@requires_response_parser
def test_tool_loop_samples_follow_the_policy(tmp_path):
    """The tool-calling rollout (`_ToolCallingMixin._rollout`) samples its turns through the same generation path."""
    trainer, dataset = _trainer(tmp_path, dataset_name="conversational_prompt_only", tools=[_multiply])
    prompt_ids, completion_ids = _sample(trainer, dataset)
    logps, entropies, _, _ = _scored(trainer, prompt_ids, completion_ids, 1.0)
    _assert_on_policy(logps, entropies)


def test_rloo_samples_follow_the_policy(tmp_path):
    trainer, dataset = _trainer(tmp_path, trainer_class=RLOOTrainer, config_class=RLOOConfig)
    prompt_ids, completion_ids = _sample(trainer, dataset)
    logps, entropies, _, _ = _scored(trainer, prompt_ids, completion_ids, 1.0)
    _assert_on_policy(logps, entropies)


def test_top_k_restricts_samples_to_the_k_most_likely_tokens(tmp_path):
    trainer, dataset = _trainer(tmp_path, top_k=5)
    prompt_ids, completion_ids = _sample(trainer, dataset)
    _, _, logits, tokens = _scored(trainer, prompt_ids, completion_ids, 1.0)
    allowed = logits.topk(5, dim=-1).indices
    inside = (allowed == tokens[:, None]).any(-1)
    assert inside.all(), f"{int((~inside).sum())} of {tokens.numel()} sampled tokens lie outside the top 5"


def test_top_p_restricts_samples_to_the_nucleus(tmp_path):
    top_p = 0.3
    trainer, dataset = _trainer(tmp_path, top_p=top_p)
    prompt_ids, completion_ids = _sample(trainer, dataset)
    _, _, logits, tokens = _scored(trainer, prompt_ids, completion_ids, 1.0)
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # A token is in the nucleus when the mass of the tokens strictly likelier than it is below top_p.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    rank = (order == tokens[:, None]).float().argmax(-1)
    before = mass_before.gather(-1, rank[:, None]).squeeze(-1)
    assert (before < top_p + 1e-5).all(), "a sampled token lies outside the top-p nucleus"


def test_generation_config_sets_every_sampling_parameter(tmp_path):
    """`top_k=0` and `top_p=1.0` mean "no truncation" and reach `generate` as such, not as transformers' defaults."""
    trainer, _ = _trainer(tmp_path)
    config = trainer.generation_config
    assert config.do_sample is True
    assert config.top_k == 0
    assert config.top_p == 1.0
    assert config.min_p is None
    assert config.temperature == 1.0
    assert config.repetition_penalty == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# vLLM colocate (the vLLM suite: `make test-vllm`)
# ---------------------------------------------------------------------------------------------------------------------
VLLM_COLOCATE = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=256)


@pytest.mark.vllm
@pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)")
def test_vllm_colocate_samples_follow_the_policy(tmp_path):
    trainer, dataset = _trainer(tmp_path, **VLLM_COLOCATE)
    prompt_ids, completion_ids = _sample(trainer, dataset)
    logps, entropies, _, _ = _scored(trainer, prompt_ids, completion_ids, 1.0)
    _assert_on_policy(logps, entropies)


@pytest.mark.vllm
@pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)")
def test_vllm_colocate_top_k_restricts_samples(tmp_path):
    trainer, dataset = _trainer(tmp_path, top_k=5, **VLLM_COLOCATE)
    prompt_ids, completion_ids = _sample(trainer, dataset)
    _, _, logits, tokens = _scored(trainer, prompt_ids, completion_ids, 1.0)
    inside = (logits.topk(5, dim=-1).indices == tokens[:, None]).any(-1)
    assert inside.all(), f"{int((~inside).sum())} of {tokens.numel()} sampled tokens lie outside the top 5"
