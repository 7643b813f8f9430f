"""The tied-embedding gradient fast path (`trl/trainer/fast_paths/tied_embedding_grad.py`) against `nn.Embedding`'s own
backward: the same gradient of the tied weight (bitwise without repeated tokens), in every order autograd may
accumulate it, and the predicate that keeps the plain path elsewhere."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trainer_utils import COMMON_ARGS, DECODER_SIZES
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback

from trl import SFTConfig, SFTTrainer
from trl.kernels.linear_log_softmax import linear_selective_log_softmax
from trl.trainer.fast_paths import tied_embedding_grad
from trl.trainer.fast_paths.tied_embedding_grad import sparse_tied_embedding_grad, tied_embedding_grad_fallback_reason


pytestmark = pytest.mark.usefixtures("single_thread")


def _tied_model(**overrides):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**DECODER_SIZES, "tie_word_embeddings": True, **overrides}))


def _ids(unique: bool, rows: int = 2, length: int = 9):
    if unique:  # no token twice: the sum of each row's gradient has one term
        return (
            torch.randperm(DECODER_SIZES["vocab_size"] - 10, generator=torch.Generator().manual_seed(0))[
                : rows * length
            ].view(rows, length)
            + 10
        )
    return torch.randint(10, 40, (rows, length), generator=torch.Generator().manual_seed(0))


def _grad(model, ids, fast: bool, loss: str = "logits", passes: int = 1):
    model.zero_grad(set_to_none=True)
    with sparse_tied_embedding_grad(model) if fast else torch.enable_grad():
        for _ in range(passes):
            if loss == "logits":
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
            elif loss == "fused":
                hidden = model.model(input_ids=ids).last_hidden_state
                logps, _, _ = linear_selective_log_softmax(hidden, model.lm_head.weight, ids)
                logps.mean().neg().backward()
            else:  # the embedding alone: no gradient reaches the head
                model.get_input_embeddings()(ids).square().sum().backward()
    return model.get_input_embeddings().weight.grad.clone()


@pytest.mark.parametrize("loss", ["logits", "fused"])
def test_unique_tokens_give_the_plain_gradient_bitwise(loss):
    model = _tied_model()
    assert tied_embedding_grad_fallback_reason(model) is None
    ids = _ids(unique=True)
    plain, fast = _grad(model, ids, fast=False, loss=loss), _grad(model, ids, fast=True, loss=loss)
    assert not fast.is_sparse
    assert torch.equal(plain, fast)


def test_repeated_tokens_gradient_accumulation_and_embedding_alone():
    model = _tied_model()
    ids = _ids(unique=False)
    for loss, passes in (("logits", 1), ("fused", 2), ("embedding", 1), ("embedding", 2)):
        plain = _grad(model, ids, fast=False, loss=loss, passes=passes)
        fast = _grad(model, ids, fast=True, loss=loss, passes=passes)
        torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-7)


def test_padding_row_gets_no_gradient_and_forward_is_restored():
    model = _tied_model(pad_token_id=12)
    embeddings = model.get_input_embeddings()
    assert embeddings.padding_idx == 12
    ids = _ids(unique=False)
    ids[0, :3] = 12
    plain, fast = _grad(model, ids, fast=False, loss="embedding"), _grad(model, ids, fast=True, loss="embedding")
    torch.testing.assert_close(fast, plain)
    assert "forward" not in vars(embeddings)
    with torch.no_grad(), sparse_tied_embedding_grad(model) as switched:
        assert switched and "forward" in vars(embeddings)
        torch.testing.assert_close(embeddings(ids), F.embedding(ids, embeddings.weight))
    assert "forward" not in vars(embeddings)


def test_predicate_keeps_the_plain_path():
    untied = Qwen2ForCausalLM(Qwen2Config(**DECODER_SIZES))
    assert "not tied" in tied_embedding_grad_fallback_reason(untied)
    frozen = _tied_model()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert "trained" in tied_embedding_grad_fallback_reason(frozen)
    hooked = _tied_model()
    hooked.get_input_embeddings().weight.register_hook(lambda grad: grad)
    assert "hooks" in tied_embedding_grad_fallback_reason(hooked)
    model = _tied_model()
    assert "process" in tied_embedding_grad_fallback_reason(model, SimpleNamespace(world_size=2))
    with sparse_tied_embedding_grad(untied) as switched:
        assert not switched and "forward" not in vars(untied.get_input_embeddings())


def test_sft_trains_a_tied_model_to_the_plain_path_numbers(tmp_path, monkeypatch):
    from trl.assets import get_model_path

    tokenizer_path = get_model_path("tiny-Qwen2ForCausalLM")
    dataset = Dataset.from_dict({"text": ["a b c d e f g h", "the cat sat on the mat", "one two three"] * 4})
    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append("forward" in vars(model.get_input_embeddings()))

    def train(fast: bool):
        if not fast:
            monkeypatch.setattr(tied_embedding_grad, "tied_embedding_grad_fallback_reason", lambda *a: "off")
        args = SFTConfig(
            str(tmp_path / str(fast)), max_steps=2, per_device_train_batch_size=3, learning_rate=1e-2, seed=0,
            **COMMON_ARGS,
        )  # fmt: skip
        from transformers import AutoTokenizer

        trainer = SFTTrainer(
            _tied_model(vocab_size=4096, pad_token_id=4089), args=args, train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
            callbacks=[Spy()],
        )  # fmt: skip
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, trainer.model.get_input_embeddings().weight.detach().clone()

    fast_losses, fast_weight = train(True)
    assert seen == [True, True]
    plain_losses, plain_weight = train(False)
    assert seen[2:] == [False, False]
    assert fast_losses == pytest.approx(plain_losses, rel=1e-6)
    torch.testing.assert_close(fast_weight, plain_weight, rtol=1e-5, atol=1e-6)


def test_autograd_grad_and_backward_with_inputs_get_the_plain_gradient():
    """`torch.autograd.grad` never writes `.grad`: the lookup returns its dense gradient there; a `backward(inputs=...)`
    that leaves the weight out gives it nothing."""
    model = _tied_model()
    ids = _ids(unique=False)
    weight = model.get_input_embeddings().weight

    def loss():
        return model(input_ids=ids, labels=ids).loss

    (plain,) = torch.autograd.grad(loss(), [weight])
    with sparse_tied_embedding_grad(model):
        (fast,) = torch.autograd.grad(loss(), [weight])
        assert weight.grad is None
        norm = model.model.norm.weight
        loss().backward(inputs=[norm])
        assert weight.grad is None and norm.grad is not None
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-7)
