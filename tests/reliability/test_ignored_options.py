"""A config option that has no effect in a run says so: one warning naming the option and the reason.

`trl/trainer/utils/ignored_options.py` holds one table per trainer. The first test goes through every row of every
table: with the config and run facts of its case the row's reason is reported for that field, and with the
counter-case (the same option, in a run where it does take effect) nothing is reported. A coverage test checks
that no row lacks a case. The remaining tests build real trainers on the tiny offline assets and check that the
warning is emitted at construction, once, and not in a run where the option is used.
"""

import warnings

import pytest
from datasets import Dataset

from trl.assets import get_model_path, load_test_dataset
from trl.trainer.utils import ignored_options as io


pytestmark = pytest.mark.reliability

LM = "tiny-Qwen2ForCausalLM"
QUIET = dict(report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, bf16=False)
TEXT = {"format": "language_modeling", "columns": ["text"]}
PAIRS = {"format": "prompt_completion", "columns": ["prompt", "completion"]}
MESSAGES = {"format": "language_modeling", "columns": ["messages"]}
PREFERENCE = {"format": "preference", "columns": ["prompt", "chosen", "rejected"]}
STREAMED = {**PREFERENCE, "iterable": True}
EVAL = {"eval_dataset": True}
SKIP = {"skip_prepare_dataset": {"skip_prepare_dataset": True}}


def _config_class(name):
    import trl
    from trl.experimental import bco, cpo, gkd, gold, orpo, prm

    for module in (trl, bco, cpo, gkd, gold, orpo, prm):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(name)


# (table, row index, config class, kwargs where the row applies, facts there, kwargs of the counter-case, its facts)
CASES = [
    ("SFT", 0, "SFTConfig", dict(completion_only_loss=True, dataset_kwargs=SKIP["skip_prepare_dataset"]),
     {**PAIRS, "skip_prepare_dataset": True}, dict(completion_only_loss=True), PAIRS),
    ("SFT", 1, "SFTConfig", dict(completion_only_loss=True), TEXT, dict(completion_only_loss=True), PAIRS),
    ("SFT", 1, "SFTConfig", dict(completion_only_loss=True), {"format": "tokenized", "columns": ["input_ids"]},
     dict(completion_only_loss=True), {"format": "tokenized", "columns": ["input_ids", "completion_mask"]}),
    ("SFT", 2, "SFTConfig", dict(dataset_text_field="body"), MESSAGES, dict(dataset_text_field="body"),
     {"format": "language_modeling", "columns": ["body"]}),
    ("SFT", 3, "SFTConfig", dict(packing_strategy="wrapped"), TEXT, dict(packing_strategy="wrapped", packing=True),
     TEXT),
    ("SFT", 4, "SFTConfig", dict(eval_packing=True), TEXT, dict(eval_packing=True), {**TEXT, **EVAL}),
    ("SFT", 5, "SFTConfig", dict(truncation_mode="keep_end", max_length=None), TEXT, dict(truncation_mode="keep_end"),
     TEXT),
    ("SFT", 5, "SFTConfig", dict(truncation_mode="keep_end", packing=True), TEXT,
     dict(truncation_mode="keep_end", packing=True, eval_packing=False), {**TEXT, **EVAL}),
    ("SFT", 6, "SFTConfig", dict(max_length=64), {**TEXT, "skip_prepare_dataset": True}, dict(max_length=64), TEXT),
    ("SFT", 7, "SFTConfig", dict(dataset_num_proc=2), {**TEXT, "skip_prepare_dataset": True},
     dict(dataset_num_proc=2), TEXT),
    ("SFT", 8, "SFTConfig", dict(dataset_num_proc=2), {**TEXT, "iterable": True}, dict(dataset_num_proc=2), TEXT),
    ("GKD", 0, "GKDConfig", dict(completion_only_loss=True), MESSAGES, dict(), MESSAGES),
    ("GKD", 1, "GKDConfig", dict(assistant_only_loss=True), MESSAGES, dict(), MESSAGES),
    ("GKD", 2, "GKDConfig", dict(dataset_text_field="body"), MESSAGES, dict(), MESSAGES),
    ("GKD", 3, "GKDConfig", dict(packing_strategy="wrapped"), MESSAGES, dict(), MESSAGES),
    ("GKD", 4, "GKDConfig", dict(eval_packing=False), MESSAGES, dict(), MESSAGES),
    ("GKD", 5, "GKDConfig", dict(truncation_mode="keep_end"), MESSAGES, dict(), MESSAGES),
    ("GKD", 6, "GKDConfig", dict(dataset_num_proc=2), MESSAGES, dict(), MESSAGES),
    ("GKD", 7, "GKDConfig", dict(loss_type="dft"), MESSAGES, dict(), MESSAGES),
    ("GKD", 8, "GKDConfig", dict(teacher_model_name_or_path="t"), {**MESSAGES, "teacher_given": True},
     dict(teacher_model_name_or_path="t"), {**MESSAGES, "teacher_given": False}),
    ("GKD", 9, "GKDConfig", dict(lmbda=0.0, max_new_tokens=4), MESSAGES, dict(lmbda=0.5, max_new_tokens=4), MESSAGES),
    ("GKD", 10, "GKDConfig", dict(lmbda=0.0, temperature=0.5), MESSAGES, dict(lmbda=0.0, seq_kd=True, temperature=0.5),
     MESSAGES),
    ("GKD", 11, "GKDConfig", dict(lmbda=1.0, seq_kd=True), MESSAGES, dict(lmbda=0.5, seq_kd=True), MESSAGES),
    ("DPO", 0, "DPOConfig", dict(precompute_ref_batch_size=4), PREFERENCE,
     dict(precompute_ref_batch_size=4, precompute_ref_log_probs=True), PREFERENCE),
    ("DPO", 1, "DPOConfig", dict(ref_model_mixup_alpha=0.3), PREFERENCE,
     dict(ref_model_mixup_alpha=0.3, sync_ref_model=True), PREFERENCE),
    ("DPO", 2, "DPOConfig", dict(ref_model_sync_steps=4), PREFERENCE,
     dict(ref_model_sync_steps=4, sync_ref_model=True), PREFERENCE),
    ("DPO", 3, "DPOConfig", dict(sync_ref_model=True, max_steps=3, ref_model_sync_steps=4), PREFERENCE,
     dict(sync_ref_model=True, max_steps=8, ref_model_sync_steps=4), PREFERENCE),
    ("DPO", 4, "DPOConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("DPO", 5, "DPOConfig", dict(f_alpha_divergence_coef=0.3), PREFERENCE,
     dict(f_alpha_divergence_coef=0.3, f_divergence_type="alpha_divergence"), PREFERENCE),
    ("DPO", 6, "DPOConfig", dict(discopop_tau=0.3), PREFERENCE, dict(discopop_tau=0.3, loss_type="discopop"),
     PREFERENCE),
    ("DPO", 7, "DPOConfig", dict(label_smoothing=0.1, loss_type="hinge"), PREFERENCE,
     dict(label_smoothing=0.1, loss_type=["hinge", "aot"]), PREFERENCE),
    ("DPO", 8, "DPOConfig", dict(truncation_mode="keep_end", max_length=None), PREFERENCE,
     dict(truncation_mode="keep_end"), PREFERENCE),
    ("DPO", 9, "DPOConfig", dict(beta=0.5, loss_type="sft"), PREFERENCE, dict(beta=0.5, loss_type=["sft", "sigmoid"]),
     PREFERENCE),
    ("KTO", 0, "KTOConfig", dict(precompute_ref_batch_size=4), PREFERENCE,
     dict(precompute_ref_batch_size=4, precompute_ref_log_probs=True), PREFERENCE),
    ("KTO", 1, "KTOConfig", dict(ref_model_mixup_alpha=0.3), PREFERENCE,
     dict(ref_model_mixup_alpha=0.3, sync_ref_model=True), PREFERENCE),
    ("KTO", 2, "KTOConfig", dict(ref_model_sync_steps=4), PREFERENCE, dict(ref_model_sync_steps=4, sync_ref_model=True),
     PREFERENCE),
    ("KTO", 3, "KTOConfig", dict(sync_ref_model=True, max_steps=3, ref_model_sync_steps=4), PREFERENCE,
     dict(sync_ref_model=True, ref_model_sync_steps=4), PREFERENCE),
    ("KTO", 4, "KTOConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("BCO", 0, "BCOConfig", dict(prompt_sample_size=16), PREFERENCE, dict(prompt_sample_size=16),
     {**PREFERENCE, "udm": True}),
    ("BCO", 1, "BCOConfig", dict(min_density_ratio=0.1), PREFERENCE, dict(min_density_ratio=0.1),
     {**PREFERENCE, "udm": True}),
    ("BCO", 2, "BCOConfig", dict(max_density_ratio=3.0), PREFERENCE, dict(max_density_ratio=3.0),
     {**PREFERENCE, "udm": True}),
    ("BCO", 3, "BCOConfig", dict(generate_during_eval=True), PREFERENCE, dict(generate_during_eval=True),
     {**PREFERENCE, **EVAL}),
    ("BCO", 4, "BCOConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("CPO", 0, "CPOConfig", dict(simpo_gamma=0.9), PREFERENCE, dict(simpo_gamma=0.9, loss_type="simpo"), PREFERENCE),
    ("CPO", 1, "CPOConfig", dict(label_smoothing=0.1, loss_type="ipo"), PREFERENCE, dict(label_smoothing=0.1),
     PREFERENCE),
    ("CPO", 2, "CPOConfig", dict(max_completion_length=8), PREFERENCE, dict(max_completion_length=8),
     {**PREFERENCE, "encoder_decoder": True}),
    ("CPO", 3, "CPOConfig", dict(generate_during_eval=True), PREFERENCE, dict(generate_during_eval=True),
     {**PREFERENCE, **EVAL}),
    ("CPO", 4, "CPOConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("ORPO", 0, "ORPOConfig", dict(max_completion_length=8), PREFERENCE, dict(max_completion_length=8),
     {**PREFERENCE, "encoder_decoder": True}),
    ("ORPO", 1, "ORPOConfig", dict(generate_during_eval=True), PREFERENCE, dict(generate_during_eval=True),
     {**PREFERENCE, **EVAL}),
    ("ORPO", 2, "ORPOConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("REWARD", 0, "RewardConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
    ("PRM", 0, "PRMConfig", dict(dataset_num_proc=2), STREAMED, dict(dataset_num_proc=2), PREFERENCE),
]  # fmt: skip
# Online trainers: each generation option with a run where it has no effect and one where it is used.
_VLLM_SERVER = dict(use_vllm=True, vllm_mode="server")
_VLLM_COLOCATE = dict(use_vllm=True, vllm_mode="colocate")
CASES += [
    ("ONLINE", 0, "GRPOConfig", dict(vllm_mode="server"), {}, _VLLM_SERVER, {}),
    ("ONLINE", 1, "GRPOConfig", dict(vllm_model_impl="transformers"), {},
     dict(vllm_model_impl="transformers", use_vllm=True), {}),
    ("ONLINE", 2, "GRPOConfig", dict(vllm_structured_outputs_regex="a+"), {},
     dict(vllm_structured_outputs_regex="a+", use_vllm=True), {}),
    *[("ONLINE", i, "GRPOConfig", {**_VLLM_COLOCATE, name: value}, {}, {**_VLLM_SERVER, name: value}, {})
      for i, (name, value) in enumerate([("vllm_server_base_url", "http://h:1"), ("vllm_server_host", "h"),
                                         ("vllm_server_port", 9), ("vllm_server_timeout", 9.0),
                                         ("vllm_group_port", 9)], start=3)],
    *[("ONLINE", i, "GRPOConfig", {**_VLLM_SERVER, name: value}, {}, {**_VLLM_COLOCATE, name: value}, {})
      for i, (name, value) in enumerate([("vllm_gpu_memory_utilization", 0.5), ("vllm_tensor_parallel_size", 2),
                                         ("vllm_enable_sleep_mode", True), ("vllm_max_model_length", 64)], start=8)],
    ("ONLINE", 12, "GRPOConfig", dict(vllm_importance_sampling_correction=False), {},
     dict(vllm_importance_sampling_correction=False, use_vllm=True), {}),
    *[("ONLINE", i, "GRPOConfig", {**_VLLM_SERVER, "vllm_importance_sampling_correction": False, name: value}, {},
       {**_VLLM_SERVER, name: value}, {})
      for i, (name, value) in enumerate([("vllm_importance_sampling_mode", "token_mask"),
                                         ("vllm_importance_sampling_clip_min", 0.5),
                                         ("vllm_importance_sampling_clip_max", 2.0)], start=13)],
    ("ONLINE", 16, "GRPOConfig", dict(cache_implementation="static", use_vllm=True), {},
     dict(cache_implementation="static"), {}),
    ("ONLINE", 17, "GRPOConfig", dict(num_generations_eval=4), {}, dict(num_generations_eval=4), EVAL),
]  # fmt: skip
# GOLD's table is the first rows of GKD's: the same cases with GOLD's config.
CASES += [("GOLD", index, "GOLDConfig", *rest) for table, index, _, *rest in CASES if table == "GKD" and index < 9]


def _table(name):
    return getattr(io, f"{name}_IGNORED_OPTIONS")


def _reported(table_name, config_name, kwargs, facts, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = _config_class(config_name)(str(tmp_path), **{**QUIET, **kwargs})
    facts = {"columns": [], "format": None, **facts}
    return dict(io.ignored_options(args, facts, _table(table_name)))


@pytest.mark.parametrize(
    "table_name, index, config_name, on, on_facts, off, off_facts",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{_table(c[0])[c[1]].field}" for c in CASES],
)
def test_every_row(table_name, index, config_name, on, on_facts, off, off_facts, tmp_path):
    row = _table(table_name)[index]
    reported = _reported(table_name, config_name, on, on_facts, tmp_path)
    assert row.field in reported, f"{row.field} not reported; got {reported}"
    assert reported[row.field].split(" ")[:4] == row.reason.split(" ")[:4] or "{" in row.reason[:40]
    assert row.field not in _reported(table_name, config_name, off, off_facts, tmp_path)


def test_every_row_has_a_case():
    covered = {(table, index) for table, index, *_ in CASES}
    tables = [name[: -len("_IGNORED_OPTIONS")] for name in dir(io) if name.endswith("_IGNORED_OPTIONS")]
    missing = [
        (name, index, row.field)
        for name in tables
        if not name.startswith("_")
        for index, row in enumerate(_table(name))
        if (name, index) not in covered
    ]
    assert not missing


def test_defaults_never_warn(tmp_path):
    """Every config at its defaults, on any data, reports nothing (only options the user set are reported)."""
    for name in ("SFT", "GKD", "DPO", "KTO", "BCO", "CPO", "ORPO", "REWARD", "PRM"):
        config = {"REWARD": "RewardConfig"}.get(name, f"{name}Config")
        for facts in (TEXT, PAIRS, STREAMED, {**MESSAGES, "skip_prepare_dataset": True}):
            assert _reported(name, config, {}, facts, tmp_path) == {}, (name, facts)


# ---------------------------------------------------------------------------------------------------------------------
# Real trainers: the warning is emitted once when the trainer is built
# ---------------------------------------------------------------------------------------------------------------------
def _build(kind, tmp_path, dataset, **kwargs):
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    config_class, trainer_class = {
        "sft": (SFTConfig, SFTTrainer),
        "dpo": (DPOConfig, DPOTrainer),
        "cpo": (CPOConfig, CPOTrainer),
    }[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config_class(str(tmp_path), max_length=32, **QUIET, **kwargs)
        trainer_class(get_model_path(LM), args=args, train_dataset=dataset)
    return [str(w.message) for w in caught if "has no effect here" in str(w.message)]


def test_sft_completion_only_loss_on_text_warns(tmp_path):
    data = load_test_dataset("standard_language_modeling", "train").select(range(4))
    messages = _build("sft", tmp_path, data, completion_only_loss=True)
    assert len(messages) == 1
    assert "completion_only_loss=True" in messages[0] and "every token" in messages[0]
    assert messages[0].startswith("SFTTrainer:")


def test_sft_completion_only_loss_on_pairs_is_silent(tmp_path):
    data = load_test_dataset("standard_prompt_completion", "train").select(range(4))
    assert _build("sft", tmp_path, data, completion_only_loss=True) == []


def test_dpo_discopop_tau_with_sigmoid_warns(tmp_path):
    data = load_test_dataset("standard_preference", "train").select(range(4))
    messages = _build("dpo", tmp_path, data, discopop_tau=0.2, precompute_ref_batch_size=2)
    assert sorted(m.split("=")[0] for m in messages) == [
        "DPOTrainer: discopop_tau",
        "DPOTrainer: precompute_ref_batch_size",
    ]


def test_cpo_simpo_gamma_with_sigmoid_warns(tmp_path):
    data = Dataset.from_list(load_test_dataset("standard_preference", "train").to_list()[:4])
    messages = _build("cpo", tmp_path, data, simpo_gamma=0.9, max_completion_length=8)
    assert sorted(m.split("=")[0] for m in messages) == [
        "CPOTrainer: max_completion_length",
        "CPOTrainer: simpo_gamma",
    ]


def test_label_smoothing_factor_reaches_only_sfts_nll_loss(tmp_path):
    """transformers' label smoothing applies where TRL applies it, SFT's `nll` loss; elsewhere the option warns."""
    text = load_test_dataset("standard_language_modeling", "train").select(range(4))
    pairs = load_test_dataset("standard_preference", "train").select(range(4))
    assert _build("sft", tmp_path, text, label_smoothing_factor=0.1) == []
    for kind, data, extra in (("sft", text, {"loss_type": "dft"}), ("dpo", pairs, {})):
        messages = _build(kind, tmp_path, data, label_smoothing_factor=0.1, **extra)
        assert len(messages) == 1 and "label_smoothing_factor=0.1" in messages[0], (kind, messages)
