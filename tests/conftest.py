"""Shared pytest fixtures and environment for the test suite.

The environment variables below keep every test offline and quiet; they are set at import time so that they are in
place before any test module imports transformers or datasets.
"""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402

from trl.assets import get_model_path, get_tokenizer_path, load_test_dataset  # noqa: E402


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Each test starts from the same process-wide state: transformers 4.x's `TrainingArguments` exports settings to
    `os.environ` (`ACCELERATE_MIXED_PRECISION`, `ACCELERATE_USE_FSDP`, ...) and accelerate keeps the first
    `Accelerator`'s mixed precision for every later one, so a bf16 test would turn later fp32 tests into bf16 runs."""
    environment = dict(os.environ)
    yield
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", "no") != "no":
        AcceleratorState._reset_state()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Locally built Qwen2.5-style (ChatML) tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))


@pytest.fixture(scope="session")
def llama_tokenizer():
    """Locally built Llama-3-style tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_tokenizer_path("llama3"))


@pytest.fixture(scope="session")
def tiny_qwen_path() -> str:
    """Directory of the tiny random-weight Qwen2 causal LM (model and tokenizer files)."""
    return get_model_path("tiny-Qwen2ForCausalLM")


# ---------------------------------------------------------------------------------------------------------------------
# Trainer test fixtures (plain helpers are in tests/trainer_utils.py)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_thread():
    """One torch thread while a module runs (opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`).

    Tiny models are faster on one thread, and on a busy machine extra intra-op threads only add contention. Under
    xdist `pytest_configure` already does this; the fixture covers a module run on its own.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_path() -> str:
    """Directory of the model a trainer test module trains: the tiny Qwen2 causal LM unless the module overrides it."""
    return get_model_path("tiny-Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    """Tokenizer saved with the module's `model_path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def prompts():
    """Prompt-only training split of the offline test dataset."""
    return load_test_dataset("standard_prompt_only", split="train")


@pytest.fixture(scope="module")
def unpaired():
    """Unpaired preference test dataset (train and test splits)."""
    return load_test_dataset("standard_unpaired_preference")


def pytest_configure(config):
    # Under pytest-xdist each worker gets one core of the two: a second torch thread per worker only oversubscribes
    # the CPU (tiny-model tests run several times slower).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def rollout_trainer(tmp_path_factory, model_path, prompts):
    """A GRPO trainer (low-id reward, groups of 4) and one scored generation round of 8 completions (2 prompts)."""
    import torch
    from trainer_utils import GROUP_ARGS, args_builder, low_id_reward

    from trl import GRPOConfig, GRPOTrainer

    args = args_builder(GRPOConfig, **GROUP_ARGS)(
        tmp_path_factory.mktemp("grpo"), per_device_train_batch_size=8, num_generations=4
    )
    trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    trainer.model.train()
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([prompts[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)])
    return trainer, batch
