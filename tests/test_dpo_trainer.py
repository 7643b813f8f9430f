"""DPOTrainer: data preparation, every loss type, reference handling, layouts, metrics, saving and resuming."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from trainer_utils import (
    LOGGED_LOSS_TOLERANCE,
    PREFERENCE_ARGS,
    args_builder,
    assert_same_params,
    assert_saved_model_reloads,
    changed_params,
    padded_completion_logps,
    perturb,
    read_model_card,
    snapshot,
)
from transformers import AutoModelForCausalLM

from trl import DPOConfig, DPOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.dpo_trainer import DataCollatorForPreference, dpo_loss
from trl.trainer.utils import compute_sequence_token_logps, pack_padded_sequences, packed_attention_kind


MODEL = "tiny-Qwen2ForCausalLM"
PAIR_METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
]


make_args = args_builder(DPOConfig, **PREFERENCE_ARGS)


@pytest.fixture(scope="module")
def preference():
    return load_test_dataset("standard_preference")


def plain_sequence_logps(model, batch):
    """Summed completion log-probs and lengths with a full log-softmax on the padded batch (the test's oracle)."""
    token_logps, mask, logits = padded_completion_logps(model, batch)
    return (token_logps * mask).sum(1), mask.sum(1), token_logps, mask, logits


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = DPOConfig("out")
    assert args.learning_rate == 1e-6
    assert args.loss_type == ["sigmoid"] and args.loss_weights is None
    assert (args.beta, args.label_smoothing, args.discopop_tau) == (0.1, 0.0, 0.05)
    assert (args.f_divergence_type, args.f_alpha_divergence_coef) == ("reverse_kl", 0.5)
    assert (args.max_length, args.truncation_mode, args.padding_free) == (1024, "keep_start", False)
    assert (args.precompute_ref_log_probs, args.precompute_ref_batch_size) == (False, None)
    assert (args.sync_ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps) == (False, 0.6, 512)
    assert args.disable_dropout is True and args.use_weighting is False and args.ld_alpha is None
    assert args.pad_to_multiple_of is None  # "auto" on a machine without Neuron cores
    assert args.logging_steps == 10 and args.gradient_checkpointing is True
    assert DPOConfig("out", loss_type="ipo").loss_type == ["ipo"]


def test_config_rejects_bad_values():
    with pytest.raises(
        ValueError, match=r"`loss_weights` must have the same length as `loss_type`.*Got 1 weights for 2 loss types"
    ):
        DPOConfig("out", loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="Unknown loss type: "):
        DPOConfig("out", loss_type="kto_pair")
    with pytest.warns(UserWarning, match="ld_alpha=1.5 is outside"):  # TRL trains with it: a warning only
        assert DPOConfig("out", ld_alpha=1.5).ld_alpha == 1.5


# ---------------------------------------------------------------------------------------------------------------------
# Collator and packing
# ---------------------------------------------------------------------------------------------------------------------
def test_collator_concatenates_chosen_then_rejected():
    collator = DataCollatorForPreference(pad_token_id=0)
    examples = [
        {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5], "ref_chosen_logps": -1.0,
         "ref_rejected_logps": -2.0},
        {"prompt_ids": [6], "chosen_ids": [7, 8, 9], "rejected_ids": [10], "ref_chosen_logps": -3.0,
         "ref_rejected_logps": -4.0},
    ]  # fmt: skip
    batch = collator(examples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 8, 9], [1, 2, 4, 5], [6, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch["ref_chosen_logps"].tolist() == [-1.0, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-2.0, -4.0]


def test_collator_truncation_and_multiple():
    example = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5, 6], "rejected_ids": [7]}]
    start = DataCollatorForPreference(pad_token_id=0, max_length=4)(example)
    assert start["input_ids"].tolist() == [[1, 2, 3, 4], [1, 2, 3, 7]]
    assert start["completion_mask"].tolist() == [[0, 0, 0, 1], [0, 0, 0, 1]]
    end = DataCollatorForPreference(pad_token_id=0, max_length=4, truncation_mode="keep_end")(example)
    assert end["input_ids"].tolist() == [[3, 4, 5, 6], [1, 2, 3, 7]]
    assert end["completion_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    padded = DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=8)(example)
    assert padded["input_ids"].shape == (2, 8)


def test_pack_padded_sequences_layouts():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    single = pack_padded_sequences(ids, ids != 0)
    assert single.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert single.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    rows = pack_padded_sequences(ids, ids != 0, capacity=5, pad_token_id=-1)
    assert rows.input_ids.tolist() == [[6, 7, 8, 9, -1], [1, 2, 3, 4, 5]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # next-token values survive a round trip; the first token of each sequence is never a target
    values = torch.arange(12, dtype=torch.float).reshape(3, 4)[:, :3] + 1
    values = values * (ids[:, 1:] != 0)
    packed = rows.pack_next_token(values)
    assert torch.equal(rows.unpack_next_token(packed, (3, 3)), values)


@pytest.mark.parametrize("model_name", [MODEL, "tiny-LlamaForCausalLM"])
def test_padding_free_logps_equal_padded(model_name):
    model = AutoModelForCausalLM.from_pretrained(get_model_path(model_name)).eval()
    assert packed_attention_kind(model) == "masked"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (6, 17), generator=generator)
    lengths = torch.tensor([17, 5, 12, 9, 16, 3])
    mask = (torch.arange(17)[None] < lengths[:, None]).long()
    ids = ids * mask
    target = (torch.arange(16)[None] >= 2) & mask[:, 1:].bool()
    results = {
        layout: compute_sequence_token_logps(model, ids, mask, target, layout=layout, compute_entropy=True)
        for layout in ("padded", "packed", "padding_free")
    }
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    oracle = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * target
    for layout, result in results.items():
        assert torch.allclose(result.logps, oracle, atol=1e-5), layout
        assert torch.allclose(result.entropy, results["padded"].entropy, atol=1e-5), layout


def test_packed_attention_kind():
    t5 = get_model_path("tiny-T5ForConditionalGeneration")
    from transformers import AutoModelForSeq2SeqLM

    encoder_decoder = AutoModelForSeq2SeqLM.from_pretrained(t5)
    assert packed_attention_kind(encoder_decoder) is None
    with pytest.warns(UserWarning, match="falling back to padded batches"):
        assert DPOTrainer._choose_layout(encoder_decoder, padding_free=True, warn=True) == "padded"
    model = AutoModelForCausalLM.from_pretrained(get_model_path(MODEL))
    # SDPA: the trainer swaps in per-sequence attention while it trains and evaluates, so one row is cheapest.
    assert model.config._attn_implementation == "sdpa"
    assert DPOTrainer._choose_layout(model, padding_free=False) == "padding_free"
    model.config._attn_implementation = "eager"  # a dense block mask per row: rows stay short
    assert DPOTrainer._choose_layout(model, padding_free=False) == "packed"
    assert DPOTrainer._choose_layout(model, padding_free=True) == "padding_free"
    model.config._attn_implementation = "flash_attention_2"
    assert packed_attention_kind(model) == "varlen"
    assert DPOTrainer._choose_layout(model, padding_free=False) == "padding_free"


# ---------------------------------------------------------------------------------------------------------------------
# Loss formulas: every loss type against a hand-written formula on fixed log-probs
# ---------------------------------------------------------------------------------------------------------------------
PC = [-5.0, -8.0, -3.5]  # policy chosen
PR = [-6.0, -7.0, -9.0]  # policy rejected
RC = [-5.5, -7.5, -4.0]  # reference chosen
RR = [-5.0, -7.2, -8.0]  # reference rejected
LC = [2, 4, 3]  # chosen lengths
LR = [3, 2, 5]  # rejected lengths
B = 0.1


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x):
    return math.log(sig(x))


def h_sigmoid(ls=0.0, beta=B, cr=None, rr=None):
    cr = cr or [PC[i] - RC[i] for i in range(3)]
    rr = rr or [PR[i] - RR[i] for i in range(3)]
    return [-(1 - ls) * logsig(beta * (c - r)) - ls * logsig(-beta * (c - r)) for c, r in zip(cr, rr)]


def h_ipo():
    out = []
    for i in range(3):
        z = (PC[i] - RC[i]) / LC[i] - (PR[i] - RR[i]) / LR[i]
        out.append((z - 1 / (2 * B)) ** 2)
    return out


def h_sigmoid_norm():
    cr = [(PC[i] - RC[i]) / LC[i] for i in range(3)]
    rr = [(PR[i] - RR[i]) / LR[i] for i in range(3)]
    return h_sigmoid(cr=cr, rr=rr)


def h_hinge():
    return [max(0.0, 1 - B * ((PC[i] - RC[i]) - (PR[i] - RR[i]))) for i in range(3)]


def h_exo(eps):
    out = []
    for i in range(3):
        z = B * ((PC[i] - RC[i]) - (PR[i] - RR[i]))
        out.append(sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps)))
    return out


def h_robust(ls):
    out = []
    for i in range(3):
        z = B * ((PC[i] - RC[i]) - (PR[i] - RR[i]))
        out.append((-(1 - ls) * logsig(z) + ls * logsig(-z)) / (1 - 2 * ls))
    return out


def h_nca():
    out = []
    for i in range(3):
        c, r = B * (PC[i] - RC[i]), B * (PR[i] - RR[i])
        out.append(-logsig(c) - 0.5 * logsig(-c) - 0.5 * logsig(-r))
    return out


def h_bco():
    # TRL 1.16's decision boundary is 0: no batch or running mean of the rewards is subtracted.
    return [-logsig(B * (PC[i] - RC[i])) - logsig(-B * (PR[i] - RR[i])) for i in range(3)]


def h_sppo():
    return [(PC[i] - RC[i] - 1 / (2 * B)) ** 2 + (PR[i] - RR[i] + 1 / (2 * B)) ** 2 for i in range(3)]


def h_aot(ls=0.0):
    policy = sorted(PC[i] - PR[i] for i in range(3))
    ref = sorted(RC[i] - RR[i] for i in range(3))
    return [-(1 - ls) * logsig(B * (p - r)) - ls * logsig(-B * (p - r)) for p, r in zip(policy, ref)]


def h_aot_unpaired():
    chosen = sorted(PC[i] - RC[i] for i in range(3))
    rejected = sorted(PR[i] - RR[i] for i in range(3))
    return [-logsig(B * (c - r)) for c, r in zip(chosen, rejected)]


def h_apo_zero():
    return [1 - sig(B * (PC[i] - RC[i])) + sig(B * (PR[i] - RR[i])) for i in range(3)]


def h_apo_down():
    out = []
    for i in range(3):
        c, r = B * (PC[i] - RC[i]), B * (PR[i] - RR[i])
        out.append(sig(c) + 1 - sig(c - r))
    return out


def h_discopop(tau=0.05):
    out = []
    for i in range(3):
        z = B * ((PC[i] - RC[i]) - (PR[i] - RR[i]))
        m = sig(z / tau)
        out.append(-logsig(z) * (1 - m) + math.exp(-z) * m)
    return out


def h_sft():
    # Token-mean NLL over the batch, spread over the pairs: the mean of the values is -sum(PC) / sum(LC).
    return [-PC[i] * 3 / sum(LC) for i in range(3)]


def h_fprime_shifted(kind, x, coef=0.5):
    """f'(e^x) - f'(1) written out for each divergence (alpha-divergence in TRL's parametrisation a = 1 - coef)."""
    u = math.exp(x)
    if kind == "forward_kl":  # f'(u) = -1/u
        return -1 / u + 1
    if kind == "js_divergence":  # f'(u) = log(2u / (1 + u))
        return math.log(2 * u / (1 + u)) - math.log(2 * 1 / (1 + 1))
    a = 1 - coef
    if a == 0:  # reverse KL: f'(u) = log(u)
        return math.log(u)
    return (1 - u**-a) / a - (1 - 1**-a) / a


def h_fdiv(kind, coef=0.5, loss="sigmoid"):
    out = []
    for i in range(3):
        c = h_fprime_shifted(kind, PC[i] - RC[i], coef)
        r = h_fprime_shifted(kind, PR[i] - RR[i], coef)
        if loss in ("ipo", "sigmoid_norm"):  # each side's term divided by its own length
            c, r = c / LC[i], r / LR[i]
        z = c - r
        out.append((z - 1 / (2 * B)) ** 2 if loss == "ipo" else -logsig(B * z))
    return out


LOSS_CASES = [
    ("sigmoid", {}, h_sigmoid()),
    ("sigmoid", {"label_smoothing": 0.2}, h_sigmoid()),  # TRL 1.16's sigmoid does not read label_smoothing
    ("hinge", {}, h_hinge()),
    ("ipo", {}, h_ipo()),
    ("exo_pair", {"label_smoothing": 1e-3}, h_exo(1e-3)),
    ("nca_pair", {}, h_nca()),
    ("robust", {"label_smoothing": 0.1}, h_robust(0.1)),
    ("bco_pair", {}, h_bco()),
    ("sppo_hard", {}, h_sppo()),
    ("aot", {}, h_aot()),
    ("aot", {"label_smoothing": 0.1}, h_aot(0.1)),
    ("aot_unpaired", {}, h_aot_unpaired()),
    ("apo_zero", {}, h_apo_zero()),
    ("apo_down", {}, h_apo_down()),
    ("discopop", {}, h_discopop()),
    ("discopop", {"discopop_tau": 0.5}, h_discopop(0.5)),
    ("sft", {}, h_sft()),
    ("sigmoid_norm", {}, h_sigmoid_norm()),
    ("sigmoid", {"f_divergence_type": "forward_kl"}, h_fdiv("forward_kl")),
    ("sigmoid", {"f_divergence_type": "js_divergence"}, h_fdiv("js_divergence")),
    ("sigmoid", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}, h_fdiv("alpha", 0.3)),
    # coefficient 1 is reverse KL (plain DPO), 0 is forward KL
    ("sigmoid", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 1.0}, h_sigmoid()),
    ("sigmoid", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.0}, h_fdiv("forward_kl")),
    ("sigmoid", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": -0.5}, h_fdiv("alpha", -0.5)),
    ("ipo", {"f_divergence_type": "forward_kl"}, h_fdiv("forward_kl", loss="ipo")),
    ("ipo", {"f_divergence_type": "js_divergence"}, h_fdiv("js_divergence", loss="ipo")),
    ("ipo", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}, h_fdiv("a", 0.3, "ipo")),
    ("sigmoid_norm", {"f_divergence_type": "forward_kl"}, h_fdiv("forward_kl", loss="sigmoid_norm")),
    ("sigmoid_norm", {"f_divergence_type": "js_divergence"}, h_fdiv("js_divergence", loss="sigmoid_norm")),
    (
        "sigmoid_norm",
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        h_fdiv("alpha", 0.3, "sigmoid_norm"),
    ),
]


@pytest.mark.parametrize(
    "loss_type, kwargs, expected", LOSS_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LOSS_CASES)]
)
def test_loss_formula(loss_type, kwargs, expected):
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    losses = dpo_loss(
        loss_type, t(PC), t(PR), t(RC), t(RR), chosen_lengths=t(LC), rejected_lengths=t(LR), beta=B, **kwargs
    )
    assert losses.shape == (3,)
    assert torch.allclose(losses, t(expected), rtol=1e-9, atol=1e-12), (losses.tolist(), expected)


def test_bco_pair_gradient_has_no_batch_coupling():
    # With a zero decision boundary each pair's loss depends on its own log-ratios only: the gradient of the mean
    # loss with respect to the chosen log-prob of pair i is -beta * sigmoid(-beta * dc_i) / n, whatever the others.
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    chosen = t(PC).requires_grad_()
    rejected = t(PR).requires_grad_()
    dpo_loss("bco_pair", chosen, rejected, t(RC), t(RR), beta=B).mean().backward()
    expected_chosen = [-B * sig(-B * (PC[i] - RC[i])) / 3 for i in range(3)]
    expected_rejected = [B * sig(B * (PR[i] - RR[i])) / 3 for i in range(3)]
    assert torch.allclose(chosen.grad, t(expected_chosen), rtol=1e-9)
    assert torch.allclose(rejected.grad, t(expected_rejected), rtol=1e-9)


def test_f_divergence_losses_vanish_where_policy_equals_reference():
    # Every f-divergence term is 0 at log-ratio 0, so length normalisation cannot shift the logits of an untrained
    # policy: ipo's loss there is (1 / (2 beta))**2 for every divergence.
    zeros = torch.zeros(3, dtype=torch.float64)
    logps = torch.tensor(PC, dtype=torch.float64)
    lengths = torch.tensor(LC, dtype=torch.float64), torch.tensor(LR, dtype=torch.float64)
    for kind in ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"):
        losses = dpo_loss("ipo", logps, logps + 1, logps, logps + 1, *lengths, beta=B, f_divergence_type=kind)
        assert torch.allclose(losses, zeros + (1 / (2 * B)) ** 2, rtol=1e-12), kind


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's loss on a real batch, against an independent computation
# ---------------------------------------------------------------------------------------------------------------------
def test_compute_loss_weighted_losses_and_metrics(tmp_path, model_path, preference):
    args = make_args(tmp_path, loss_type=["sigmoid", "hinge", "sft"], loss_weights=[0.8, 0.5, 1.0],
                     label_smoothing=0.1, beta=0.3)  # fmt: skip
    trainer = DPOTrainer(model_path, args=args, train_dataset=preference["train"].select(range(8)))
    perturb(trainer.model)
    trainer.model.train()  # metrics go to the "train" bucket
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = trainer.compute_loss(trainer.model, batch)

    pol, lengths, _, _, logits = plain_sequence_logps(trainer.model, batch)
    ref, _, _, _, _ = plain_sequence_logps(trainer.ref_model, batch)
    z = (pol[:4] - ref[:4]) - (pol[4:] - ref[4:])
    sigmoid = -F.logsigmoid(0.3 * z).mean()  # label_smoothing=0.1 is not read by the sigmoid loss (TRL 1.16)
    hinge = torch.relu(1 - 0.3 * z).mean()
    sft = -pol[:4].sum() / lengths[:4].sum()  # token mean over the batch's chosen completions, not per sequence
    expected = 0.8 * sigmoid + 0.5 * hinge + 1.0 * sft
    assert torch.allclose(loss, expected, atol=1e-5)

    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    rewards_c, rewards_r = 0.3 * (pol[:4] - ref[:4]), 0.3 * (pol[4:] - ref[4:])
    assert metrics["rewards/chosen"] == pytest.approx(rewards_c.mean().item(), abs=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(rewards_r.mean().item(), abs=1e-5)
    assert metrics["rewards/margins"] == pytest.approx((rewards_c - rewards_r).mean().item(), abs=1e-5)
    assert metrics["rewards/accuracies"] == pytest.approx((rewards_c > rewards_r).float().mean().item())
    assert metrics["logps/chosen"] == pytest.approx(pol[:4].mean().item(), abs=1e-4)
    assert metrics["logps/rejected"] == pytest.approx(pol[4:].mean().item(), abs=1e-4)
    mask = (batch["completion_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()
    assert metrics["logits/chosen"] == pytest.approx(logits[:4][mask[:4]].mean().item(), abs=1e-5)
    assert metrics["logits/rejected"] == pytest.approx(logits[4:][mask[4:]].mean().item(), abs=1e-5)
    probs = torch.softmax(logits, -1)
    entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    assert metrics["entropy"] == pytest.approx(entropy[mask].mean().item(), abs=1e-4)
    correct = logits.argmax(-1) == batch["input_ids"][:, 1:]
    assert metrics["mean_token_accuracy"] == pytest.approx(correct[:4][mask[:4]].float().mean().item())
    assert metrics["num_tokens"] == batch["attention_mask"].sum().item()


def test_sft_loss_is_the_token_mean_nll_of_the_chosen_completions(tmp_path, model_path):
    """TRL's `sft` term: -sum of chosen token log-probs / number of chosen tokens in the batch (not a mean of
    per-sequence means), unaffected by LD-DPO's weights; a reference model exists and the rewards are measured
    against it."""
    rows = [{"prompt": "The sky is", "chosen": " blue and very nice today.", "rejected": " green."},
            {"prompt": "Hello there my good friend,", "chosen": " hi.", "rejected": " go away now please"},
            {"prompt": "A", "chosen": " b c d e f g h i j k", "rejected": " z"}]  # fmt: skip
    args = make_args(tmp_path, loss_type="sft", ld_alpha=0.5, beta=0.2)
    trainer = DPOTrainer(model_path, args=args, train_dataset=Dataset.from_list(rows))
    assert trainer.ref_model is not None
    perturb(trainer.model)
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    loss = trainer.compute_loss(trainer.model, batch)

    pol, lengths, pol_tok, mask, _ = plain_sequence_logps(trainer.model, batch)
    assert len(set(lengths[:3].tolist())) == 3  # different lengths: token mean != mean of per-sequence means
    token_mean = -(pol_tok[:3] * mask[:3]).sum() / mask[:3].sum()
    assert torch.allclose(loss, token_mean, atol=1e-5)
    assert not torch.allclose(loss, (-pol[:3] / lengths[:3]).mean(), atol=1e-3)

    rank = mask.cumsum(1) - 1
    shared = torch.minimum(lengths[:3], lengths[3:]).repeat(2)
    weights = torch.where(rank < shared[:, None], 1.0, 0.5) * mask  # LD-DPO still applies to logps and rewards
    ref_tok = padded_completion_logps(trainer.ref_model, batch)[0]
    pol_ld, ref_ld = (pol_tok * weights).sum(1), (ref_tok * weights).sum(1)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert metrics["rewards/chosen"] == pytest.approx((0.2 * (pol_ld[:3] - ref_ld[:3])).mean().item(), abs=1e-5)
    assert metrics["rewards/chosen"] != pytest.approx((0.2 * pol_ld[:3]).mean().item(), abs=1e-3)


def test_compute_loss_ld_alpha_and_wpo(tmp_path, model_path, preference):
    args = make_args(tmp_path, ld_alpha=0.5, use_weighting=True, loss_type="ipo")
    rows = [{"prompt": "1 + 1 =", "chosen": " 2", "rejected": " two, as everybody knows"},
            {"prompt": "2 + 3 =", "chosen": " 5 for sure", "rejected": " 6"}]  # fmt: skip
    trainer = DPOTrainer(model_path, args=args, train_dataset=Dataset.from_list(rows))
    perturb(trainer.model)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    loss = trainer.compute_loss(trainer.model, batch)

    _, lengths, pol_tok, mask, logits = plain_sequence_logps(trainer.model, batch)
    _, _, ref_tok, _, _ = plain_sequence_logps(trainer.ref_model, batch)
    # LD-DPO: tokens past the shorter completion of the pair count half.
    shared = torch.minimum(lengths[:2], lengths[2:]).repeat(2)
    rank = mask.cumsum(1) - 1
    weights = torch.where(rank < shared[:, None], 1.0, 0.5) * mask
    pol, ref = (pol_tok * weights).sum(1), (ref_tok * weights).sum(1)
    z = (pol[:2] - ref[:2]) / lengths[:2] - (pol[2:] - ref[2:]) / lengths[2:]
    ipo = (z - 1 / (2 * 0.1)) ** 2
    # WPO: exp(mean_t [log p(y_t) - log sum_v p_v^2]) for chosen plus rejected, capped at 1.
    logp_all = torch.log_softmax(logits, -1)
    adjusted = (pol_tok - torch.logsumexp(2 * logp_all, -1)) * mask
    mean_adjusted = adjusted.sum(1) / lengths
    wpo = torch.exp(mean_adjusted[:2] + mean_adjusted[2:]).clamp(max=1)
    assert torch.allclose(loss, (ipo * wpo).mean(), atol=1e-5)


def test_moe_aux_loss(tmp_path, preference):
    path = get_model_path("tiny-Qwen2MoeForCausalLM")
    args = make_args(tmp_path, router_aux_loss_coef=0.01, max_steps=1)
    trainer = DPOTrainer(path, args=args, train_dataset=preference["train"].select(range(4)))
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs[-1]["aux_loss"] > 0
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        DPOTrainer(get_model_path(MODEL), args=args, train_dataset=preference["train"])


# ---------------------------------------------------------------------------------------------------------------------
# Training on every dataset shape
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_name",
    [
        "standard_preference",
        "standard_implicit_prompt_preference",
        "conversational_preference",
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_each_format(tmp_path, model_path, config_name):
    dataset = load_test_dataset(config_name)
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=2)
    trainer = DPOTrainer(model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    before = snapshot(trainer.model)
    ref_before = snapshot(trainer.ref_model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert all(torch.equal(ref_before[n], p) for n, p in trainer.ref_model.named_parameters())
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 2
    for key in [*PAIR_METRICS, "num_tokens"]:
        assert key in train_logs[-1], key
        assert math.isfinite(train_logs[-1][key]), key
    assert train_logs[-1]["num_tokens"] > train_logs[0]["num_tokens"] > 0
    expected = pytest.approx(math.log(2), abs=max(1e-5, LOGGED_LOSS_TOLERANCE))
    assert train_logs[0]["loss"] == expected  # policy == reference at step 1
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    for key in PAIR_METRICS:
        assert f"eval_{key}" in eval_logs[-1], key


def test_implicit_prompt_is_extracted(model_path, tmp_path):
    explicit = load_test_dataset("conversational_preference", split="train").select(range(4))
    implicit = load_test_dataset("conversational_implicit_prompt_preference", split="train").select(range(4))
    a = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=explicit).train_dataset
    b = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=implicit).train_dataset
    assert a["prompt_ids"] == b["prompt_ids"] and a["chosen_ids"] == b["chosen_ids"]


def test_prepared_dataset_keeps_the_raw_columns(tmp_path, model_path, tokenizer):
    """As in TRL: the given columns stay beside the token columns, the prompt is added when extracted, and text
    completions appear with the EOS token appended; an already prepared dataset is left as it is."""
    eos = tokenizer.eos_token
    explicit = Dataset.from_dict({"prompt": ["1 + 1 ="], "chosen": [" 2"], "rejected": [" 3" + eos], "foo": [7]})
    prepared = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=explicit).train_dataset
    assert prepared.column_names == ["prompt", "chosen", "rejected", "foo", "prompt_ids", "chosen_ids", "rejected_ids"]
    assert prepared[0]["prompt"] == "1 + 1 =" and prepared[0]["foo"] == 7
    assert (prepared[0]["chosen"], prepared[0]["rejected"]) == (" 2" + eos, " 3" + eos)
    assert prepared[0]["chosen_ids"] == tokenizer(" 2" + eos)["input_ids"]

    implicit = load_test_dataset("standard_implicit_prompt_preference", split="train").select(range(2))
    prepared = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=implicit).train_dataset
    assert set(prepared.column_names) == {"prompt", "chosen", "rejected", "prompt_ids", "chosen_ids", "rejected_ids"}
    row = prepared[0]
    assert implicit[0]["chosen"] + eos == row["prompt"] + row["chosen"]

    conversational = load_test_dataset("conversational_preference", split="train").select(range(2))
    trainer = DPOTrainer(model_path, args=make_args(tmp_path, max_steps=1), train_dataset=conversational)
    assert trainer.train_dataset[0]["chosen"] == conversational[0]["chosen"]  # messages unchanged
    assert trainer._prepare_dataset(trainer.train_dataset, tokenizer, trainer.args, "train") is trainer.train_dataset
    trainer.train()  # the dataloader drops the raw columns


def test_tools_and_pretokenized(tmp_path, model_path, tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    dataset = load_test_dataset("conversational_preference", split="train").select(range(4))
    dataset = dataset.add_column("tools", [tools] * 4)  # fmt: skip
    trainer = DPOTrainer(model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    prompt = tokenizer.decode(trainer.train_dataset[0]["prompt_ids"])
    assert '"name": "add"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    trainer.train()

    rows = {"prompt_ids": [[5, 6, 7], [8, 9]], "chosen_ids": [[10, 11], [12]], "rejected_ids": [[13], [14, 15, 16]]}
    trainer = DPOTrainer(model_path, args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=2),
                         train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)  # fmt: skip
    assert trainer.train_dataset[1] == {"prompt_ids": [8, 9], "chosen_ids": [12], "rejected_ids": [14, 15, 16]}
    trainer.train()


def test_streaming_dataset(tmp_path, model_path, preference):
    stream = IterableDataset.from_generator(lambda: iter(preference["train"].select(range(8))))
    trainer = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 2


def test_truncation_drops_pairs_without_completion(tmp_path, model_path, caplog):
    rows = [{"prompt": "word " * 30, "chosen": " a", "rejected": " b"},
            {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 3"}]  # fmt: skip
    trainer = DPOTrainer(model_path, args=make_args(tmp_path, max_length=12), train_dataset=Dataset.from_list(rows))
    assert len(trainer.train_dataset) == 1
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"].shape[1] <= 12


# ---------------------------------------------------------------------------------------------------------------------
# Reference model
# ---------------------------------------------------------------------------------------------------------------------
def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **kwargs)


def test_peft_reference_equals_frozen_copy(tmp_path, model_path, preference):
    args = make_args(tmp_path, max_steps=1)
    trainer = DPOTrainer(
        model_path, args=args, train_dataset=preference["train"].select(range(8)), peft_config=_lora()
    )
    assert trainer.ref_model is None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ref = trainer.compute_ref_log_probs(trainer.model, batch)
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    expected, _, _, _, _ = plain_sequence_logps(base, batch)
    assert torch.allclose(ref["ref_chosen_logps"], expected[:4], atol=1e-5)
    assert torch.allclose(ref["ref_rejected_logps"], expected[4:], atol=1e-5)
    policy, _, _, _, _ = plain_sequence_logps(trainer.model, batch)  # adapters active again after the ref pass
    assert not torch.allclose(policy, expected, atol=1e-3)
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)


def test_two_adapters(tmp_path, model_path, preference):
    from peft import get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), _lora(), adapter_name="policy")
    model.add_adapter("reference", _lora())
    args = make_args(tmp_path, max_steps=1, model_adapter_name="policy", ref_adapter_name="reference")
    trainer = DPOTrainer(model, args=args, train_dataset=preference["train"].select(range(8)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ref = trainer.compute_ref_log_probs(trainer.model, batch)
    model.set_adapter("reference")
    expected, _, _, _, _ = plain_sequence_logps(model, batch)
    model.set_adapter("policy")
    assert torch.allclose(ref["ref_chosen_logps"], expected[:4], atol=1e-5)
    reference_before = {n: p.clone() for n, p in model.named_parameters() if ".reference." in n}
    trainer.train()
    assert all(torch.equal(p, reference_before[n]) for n, p in model.named_parameters() if ".reference." in n)
    with pytest.raises(ValueError, match=r"ref_adapter_name='missing' is not an adapter"):
        DPOTrainer(model, args=make_args(tmp_path, ref_adapter_name="missing"), train_dataset=preference["train"])


def test_precomputed_reference_equals_on_the_fly(tmp_path, model_path, preference):
    data = preference["train"].select(range(8))
    args = make_args(tmp_path, precompute_ref_log_probs=True, precompute_ref_batch_size=3, eval_strategy="steps",
                     eval_steps=2)  # fmt: skip
    trainer = DPOTrainer(model_path, args=args, train_dataset=data, eval_dataset=preference["test"].select(range(4)))
    assert trainer.ref_model is None  # released (never even copied)
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.train_dataset.column_names)
    assert "ref_chosen_logps" in trainer.eval_dataset.column_names
    on_the_fly = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)
    batch = on_the_fly.data_collator([on_the_fly.train_dataset[i] for i in range(8)])
    ref = on_the_fly.compute_ref_log_probs(on_the_fly.model, batch)
    assert torch.allclose(torch.tensor(trainer.train_dataset["ref_chosen_logps"]), ref["ref_chosen_logps"], atol=1e-5)
    assert torch.allclose(
        torch.tensor(trainer.train_dataset["ref_rejected_logps"]), ref["ref_rejected_logps"], atol=1e-5
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert any("eval_rewards/margins" in log for log in trainer.state.log_history)
    # Without stored log-probs and with the reference released, a clear error.
    with pytest.raises(ValueError, match="no precomputed reference log-probs"):
        trainer.compute_ref_log_probs(trainer.model, batch)


def test_evaluate_prepares_a_raw_dataset(tmp_path, model_path, preference):
    """`evaluate(eval_dataset=...)` with a raw dataset, an IterableDataset or a dict of them gives what the
    constructor's prepared `eval_dataset` gives; an already prepared dataset is left as it is."""
    test = preference["test"].select(range(8))
    trainer = DPOTrainer(model_path, args=make_args(tmp_path, max_steps=1), train_dataset=test, eval_dataset=test)
    assert trainer._prepare_eval_dataset(trainer.eval_dataset, "eval") is trainer.eval_dataset
    trainer.train()  # the policy moves away from the reference: the rewards are not zero
    prepared = trainer.evaluate()
    assert prepared["eval_rewards/margins"] != 0
    for other in (trainer.evaluate(eval_dataset=test), trainer.evaluate(eval_dataset=test.to_iterable_dataset())):
        for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected"):
            assert other[key] == pytest.approx(prepared[key], rel=1e-5, abs=1e-7), key
    both = trainer.evaluate(eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))})
    # transformers' prefixes for the loss; the trainer's own metrics keep the "eval_" prefix (as in TRL)
    assert {"eval_first_loss", "eval_second_loss", "eval_rewards/chosen", "eval_logps/chosen"} <= set(both)


def test_compute_metrics_and_predict_get_logits_and_token_ids(tmp_path, model_path, preference):
    """As in TRL: predictions are the policy's logits over each batch's padded chosen rows then rejected rows, labels
    their token ids; `predict()` prepares a raw dataset and gives the same."""
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"test": 1.0}

    test = preference["test"].select(range(4))
    trainer = DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=test, eval_dataset=test,
                         compute_metrics=compute_metrics)  # fmt: skip
    assert trainer.evaluate()["eval_test"] == 1.0
    predictions, labels = seen["predictions"], seen["labels"]
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(4)])  # one batch: per_device_eval_batch_size
    assert labels.tolist() == batch["input_ids"].tolist() and batch["input_ids"].shape[0] == 8
    assert predictions.shape == (*labels.shape, trainer.model.config.vocab_size)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(torch.from_numpy(predictions), logits, atol=1e-5)
    predicted = trainer.predict(test)
    assert predicted.label_ids.tolist() == labels.tolist()
    assert predicted.predictions == pytest.approx(predictions, abs=1e-6)
    assert predicted.metrics["test_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference


def test_evaluate_raw_dataset_with_precomputed_reference(tmp_path, model_path, preference):
    """With precompute_ref_log_probs=True a raw evaluation dataset gets its reference log-probs first: from the
    policy before training, from a reference model the user passed (kept, as in TRL) at any time; without one, after
    training has started, a clear error (TRL's behaviour)."""
    train, test = preference["train"].select(range(4)), preference["test"].select(range(4))
    args = make_args(tmp_path, max_steps=1, precompute_ref_log_probs=True)
    trainer = DPOTrainer(model_path, args=args, train_dataset=train, eval_dataset=test)
    before = trainer.evaluate(eval_dataset=test)
    assert before["eval_rewards/chosen"] == 0.0 and before["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    trainer.train()
    with pytest.raises(ValueError, match="after training has started"):
        trainer.evaluate(eval_dataset=test)

    ref_model = AutoModelForCausalLM.from_pretrained(model_path)
    trainer = DPOTrainer(model_path, ref_model=ref_model, args=args, train_dataset=train, eval_dataset=test)
    assert trainer.ref_model is not None
    trainer.train()
    prepared, raw = trainer.evaluate(), trainer.evaluate(eval_dataset=test)
    assert prepared["eval_rewards/margins"] != 0
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected"):
        assert raw[key] == pytest.approx(prepared[key], rel=1e-5, abs=1e-7), key


def test_sync_ref_model(tmp_path, model_path, preference):
    args = make_args(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    trainer = DPOTrainer(model_path, args=args, train_dataset=preference["train"].select(range(8)))
    before = snapshot(trainer.ref_model)
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.ref_model.named_parameters())


def test_bema_reference_dpo_trainer_as_in_seed(tmp_path, monkeypatch):
    from trl.experimental.bema_for_ref_model import BEMACallback
    from trl.experimental.bema_for_ref_model import DPOTrainer as BEMADPOTrainer

    monkeypatch.chdir(tmp_path)
    dataset = load_test_dataset("standard_preference", split="train")
    bema_callback = BEMACallback(update_ref_model=True)
    trainer = BEMADPOTrainer(model=get_model_path(MODEL), train_dataset=dataset, callbacks=[bema_callback])
    assert trainer.args.output_dir.endswith(f"{MODEL}-DPO") and trainer.args.gradient_checkpointing is True
    trainer.train()
    assert trainer.state.global_step == 24  # 64 pairs, batch size 8, 3 epochs
    assert os.path.isdir(os.path.join(trainer.args.output_dir, "bema"))


def test_bema_callback_updates_reference(tmp_path, model_path, preference):
    from trl.experimental.bema_for_ref_model import BEMACallback
    from trl.experimental.bema_for_ref_model import DPOTrainer as BEMADPOTrainer

    callback = BEMACallback(update_freq=1, ref_model_update_freq=2, update_ref_model=True)
    args = make_args(tmp_path, max_steps=2)
    trainer = BEMADPOTrainer(model_path, args=args, train_dataset=preference["train"].select(range(8)),
                             callbacks=[callback])  # fmt: skip
    before = snapshot(trainer.ref_model)
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.ref_model.named_parameters())
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True"):
        BEMADPOTrainer(model_path, args=make_args(tmp_path, precompute_ref_log_probs=True), train_dataset=preference)


# ---------------------------------------------------------------------------------------------------------------------
# Gradient accumulation, saving, resuming
# ---------------------------------------------------------------------------------------------------------------------
def test_gradient_accumulation_invariance(tmp_path, model_path, preference):
    data = preference["train"].select(range(8))
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        args = make_args(tmp_path / f"{batch_size}", optim="sgd", learning_rate=0.5, per_device_train_batch_size=batch_size,
                         gradient_accumulation_steps=accumulation)  # fmt: skip
        trainer = DPOTrainer(model_path, args=args, train_dataset=data)
        perturb(trainer.model)  # non-trivial gradients from the first step
        trainer.train()
        results.append(snapshot(trainer.model))
    for other in results[1:]:
        for name, value in results[0].items():
            assert torch.allclose(value, other[name], atol=1e-6), name


def test_save_reload_and_resume(tmp_path, model_path, preference):
    data = preference["train"].select(range(16))
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = DPOTrainer(model_path, args=args, train_dataset=data)
    trainer.train()
    assert_saved_model_reloads(trainer, tmp_path / "final")
    assert os.path.isfile(tmp_path / "README.md")
    card = read_model_card(tmp_path)
    assert "dpo" in card and "2305.18290" in card

    resumed = DPOTrainer(model_path, args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert_same_params(trainer.model, resumed.model, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: each a clear error before training
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_inputs(tmp_path, model_path, preference):
    train = preference["train"]
    with pytest.raises(ValueError, match=r"missing: \['rejected'\]"):
        DPOTrainer(model_path, args=make_args(tmp_path), train_dataset=train.remove_columns("rejected"))
    with pytest.raises(ValueError, match="needs a `train_dataset`"):
        DPOTrainer(model_path, args=make_args(tmp_path))
    rows = [{"prompt": "word " * 30, "chosen": " a", "rejected": " b"}] * 2
    with pytest.raises(ValueError, match=r"shortest prompt is \d+ tokens, expected fewer than max_length"):
        DPOTrainer(model_path, args=make_args(tmp_path, max_length=8), train_dataset=Dataset.from_list(rows))
    bad_args = [
        (
            dict(loss_type="bco_pair", f_divergence_type="js_divergence"),
            "is only supported for the following loss types",
        ),
        (dict(loss_type="aot", use_weighting=True), "cannot be combined with loss_type 'aot'"),
        (dict(loss_type="robust", label_smoothing=0.5), "0 <= label_smoothing < 0.5"),
        (dict(loss_type="exo_pair"), r"label_smoothing in \(0, 1\)"),
        (dict(sync_ref_model=True, precompute_ref_log_probs=True), "cannot use `sync_ref_model=True` together with"),
    ]
    for kwargs, message in bad_args:
        with pytest.raises(ValueError, match=message):
            DPOTrainer(model_path, args=make_args(tmp_path, **kwargs), train_dataset=train)
    with pytest.raises(NotImplementedError, match="while using a PEFT model, which is currently not supported"):
        DPOTrainer(model_path, args=make_args(tmp_path, sync_ref_model=True), train_dataset=train, peft_config=_lora())
    with pytest.raises(ValueError, match="select adapters of a PeftModel"):
        DPOTrainer(model_path, args=make_args(tmp_path, ref_adapter_name="ref"), train_dataset=train)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(ValueError, match="same object as `model`"):
        DPOTrainer(model, ref_model=model, args=make_args(tmp_path), train_dataset=train)
    args = make_args(tmp_path)
    args.loss_weights = [1.0, 2.0]  # bypassing the config's own check
    with pytest.raises(ValueError, match="one weight per loss_type entry"):
        DPOTrainer(model_path, args=args, train_dataset=train)
