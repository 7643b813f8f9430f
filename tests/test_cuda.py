"""The CUDA paths: kernels, the rollout decode loop, activation offloading with streams, bf16 defaults and MFU on a
real GPU.

Every test here needs CUDA and is skipped without it (CI has no GPU). The rest of the suite also runs on a GPU
machine, where the trainers place models on CUDA by themselves; this module covers what only a GPU exercises.
"""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path
from trl.kernels import linear_selective_log_softmax, selective_log_softmax
from trl.kernels.decoder_layers import rms_norm, swiglu_mlp
from trl.trainer.fast_paths.rollout_decode import decode_rollouts
from trl.trainer.online_generation import generate_with_shared_prompts
from trl.trainer.utils.flops import get_peak_flops


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """Comparisons below are against float32 formulas: keep TF32 off whatever the process default is."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_rms_norm_kernels_match_plain_autograd(dtype):
    torch.manual_seed(0)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    x = torch.randn(3, 17, 64, device=CUDA, dtype=dtype)
    weights = [torch.randn(*shape, device=CUDA, dtype=dtype) * 0.1 for shape in ((96, 64), (96, 64), (64, 96))]
    norm_weight = torch.rand(64, device=CUDA, dtype=dtype)

    def run(kernel: bool):
        inputs = x.clone().requires_grad_(True)
        params = [w.clone().requires_grad_(True) for w in (*weights, norm_weight)]
        if kernel:
            hidden = rms_norm(inputs, params[3], 1e-6)
            out = swiglu_mlp(hidden, *params[:3])
        else:
            x32 = inputs.float()
            hidden = params[3] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            out = F.linear(F.silu(F.linear(hidden, params[0])) * F.linear(hidden, params[1]), params[2])
        out.float().pow(2).sum().backward()
        return out.detach(), inputs.grad, [p.grad for p in params]

    out_kernel, grad_x_kernel, grads_kernel = run(kernel=True)
    out_plain, grad_x_plain, grads_plain = run(kernel=False)
    assert out_kernel.device.type == "cuda" and out_kernel.dtype == dtype
    torch.testing.assert_close(out_kernel, out_plain, **tolerance)
    torch.testing.assert_close(grad_x_kernel, grad_x_plain, **tolerance)
    for kernel_grad, plain_grad in zip(grads_kernel, grads_plain):
        torch.testing.assert_close(kernel_grad, plain_grad, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lm_head_matches_logits_then_log_softmax(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(2, 33, 48, device=CUDA, dtype=dtype)
    weight = torch.randn(1000, 48, device=CUDA, dtype=dtype) * 0.2
    index = torch.randint(0, 1000, (2, 33), device=CUDA)

    fused_hidden, fused_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused, _, _ = linear_selective_log_softmax(fused_hidden, fused_weight, index, temperature=0.7, max_rows=16)
    fused.float().sum().backward()

    plain_hidden, plain_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = F.linear(plain_hidden, plain_weight).float() / 0.7
    plain = torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    plain.sum().backward()

    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(fused.float(), plain, **tolerance)
    torch.testing.assert_close(fused_hidden.grad, plain_hidden.grad, **tolerance)
    torch.testing.assert_close(fused_weight.grad, plain_weight.grad, **tolerance)
    # The unfused selection kernel on the same logits gives the same values.
    torch.testing.assert_close(selective_log_softmax(logits, index), plain, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cuda_model():
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).to(CUDA).eval()


@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=True, top_k=0, temperature=0.8)])
def test_rollout_decode_equals_generate_on_cuda(cuda_model, settings):
    from transformers import GenerationConfig

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cuda_model.config.vocab_size - 10, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    rows = torch.tensor([0, 0, 1, 1], device=CUDA)
    config = GenerationConfig(max_new_tokens=12, pad_token_id=0, eos_token_id=None, **settings)

    torch.manual_seed(3)
    reference = generate_with_shared_prompts(cuda_model, ids, mask, rows, config, share_prompt_cache=True)
    torch.manual_seed(3)
    output = decode_rollouts(cuda_model, ids, mask, rows, config, share_prompt_cache=True, return_logps=True)
    # Same tokens as `generate`, sampled ones included: both draw from the CUDA generator in the same order.
    assert torch.equal(output.sequences.cpu(), reference.cpu())


def _sft_dataset():
    return Dataset.from_dict({"text": [f"The number {i} comes after {i - 1} and before {i + 1}." for i in range(24)]})


def test_kernels_under_cuda_autocast_with_float32_weights():
    """The GPU default: float32 weights under bf16 autocast (the MLP kernel then runs the plain expression)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 64, device=CUDA)
    weights = [
        (torch.randn(*shape, device=CUDA) * 0.1).requires_grad_(True) for shape in ((96, 64), (96, 64), (64, 96))
    ]
    grads = {}
    for name in ("plain", "kernel"):
        for weight in weights:
            weight.grad = None
        inputs = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "kernel":
                output = swiglu_mlp(inputs, *weights)
            else:
                output = F.linear(F.silu(F.linear(inputs, weights[0])) * F.linear(inputs, weights[1]), weights[2])
        output.float().pow(2).sum().backward()
        grads[name] = [inputs.grad] + [weight.grad for weight in weights]
    for plain, kernel in zip(grads["plain"], grads["kernel"]):
        assert torch.equal(plain, kernel)


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_sft_defaults_to_bf16_on_cuda_and_trains(tmp_path, gradient_checkpointing):
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        report_to="none",
        gradient_checkpointing=gradient_checkpointing,
    )
    assert args.bf16 is torch.cuda.is_bf16_supported()
    trainer = SFTTrainer(model=get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=_sft_dataset())
    assert trainer.model.device.type == "cuda"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed


@pytest.mark.parametrize("packing", [False, True])
def test_activation_offloading_with_streams_keeps_the_loss(tmp_path, packing):
    losses = {}
    for offload in (False, True):
        args = SFTConfig(
            output_dir=str(tmp_path / str(offload)),
            max_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            bf16=False,
            packing=packing,
            activation_offloading=offload,
            report_to="none",
            seed=0,
            logging_steps=1,
        )
        trainer = SFTTrainer(model=get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=_sft_dataset())
        trainer.train()
        losses[offload] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_peak_flops_known_for_this_gpu():
    name = torch.cuda.get_device_name(0)
    if not any(key in name.upper() for key in ("H100", "H200", "A100")):
        pytest.skip(f"peak table check written for H100/H200/A100, found {name}")
    assert get_peak_flops(name, "bfloat16") > 5e14
