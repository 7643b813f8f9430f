"""Fuzzed data path: random datasets through each offline trainer's dataset preparation and collator (no training).

Every drawn dataset must end in one of two outcomes:

- a batch that is correct: its shapes and masks are consistent (right padding with the pad token, attention mask on
  the real tokens only, loss positions inside them) and its token ids and loss positions equal a reference the test
  builds itself from the tokenizer (SFT in every format; DPO, CPO and ORPO on standard data with an explicit prompt;
  the others are checked against the invariants);
- a `ValueError` / `TypeError` raised by the trainer's checks, whose message names what was expected.

A `KeyError`, an `IndexError`, an Arrow or tensor-shape error from inside the library fails the test, and hypothesis
reports the smallest dataset that produces it. The default run is seeded (`derandomize`) and bounded; the `slow` test
runs many more examples.
"""

import functools
import json
import tempfile
import warnings

import datasets
import pytest
import torch
from _fuzz_data import conversational_rows, standard_rows, stepwise_rows
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trl.assets import get_model_path, load_test_dataset
from trl.data_utils import common_prefix_length


pytestmark = pytest.mark.reliability
datasets.disable_caching()
datasets.disable_progress_bars()

MAX_LENGTH = 24
DEFAULT = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
SLOW = settings(DEFAULT, max_examples=1500)
# What a clear refusal looks like: the trainer's own checks raise these, with a message of some substance.
CLEAR_ERRORS = (ValueError, TypeError)
# A clear message says what was expected or found (a bare "object of type 'float' has no len()" does not).
EXPLAINING_WORDS = ("expect", "need", "must", "require", "should", "got ", "found", "only", "Raise ")

# kind -> (module, prefix, model asset, a valid dataset the trainer is built with)
TRAINERS = {
    "sft": ("trl", "SFT", "tiny-Qwen2ForCausalLM", "standard_language_modeling"),
    "dpo": ("trl", "DPO", "tiny-Qwen2ForCausalLM", "standard_preference"),
    "kto": ("trl", "KTO", "tiny-Qwen2ForCausalLM", "standard_unpaired_preference"),
    "reward": ("trl", "Reward", "tiny-Qwen2ForSequenceClassification", "standard_preference"),
    "prm": ("trl.experimental.prm", "PRM", "tiny-Qwen2ForTokenClassification", "standard_stepwise_supervision"),
    "cpo": ("trl.experimental.cpo", "CPO", "tiny-Qwen2ForCausalLM", "standard_preference"),
    "orpo": ("trl.experimental.orpo", "ORPO", "tiny-Qwen2ForCausalLM", "standard_preference"),
    "bco": ("trl.experimental.bco", "BCO", "tiny-Qwen2ForCausalLM", "standard_unpaired_preference"),
}


@functools.cache
def trainer(kind):
    import importlib

    module_name, prefix, model, data = TRAINERS[kind]
    module = importlib.import_module(module_name)
    options = dict(max_length=MAX_LENGTH, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                   per_device_train_batch_size=2)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = getattr(module, f"{prefix}Config")(tempfile.mkdtemp(prefix="trl-fuzz-"), **options)
        dataset = load_test_dataset(data, "train").select(range(8))
        return getattr(module, f"{prefix}Trainer")(get_model_path(model), args=args, train_dataset=dataset)


def prepare_and_collate(kind, rows):
    """The library's path for `rows`: the construction-time checks, the dataset preparation, the column filter of
    the dataloader and the collator, on every prepared row. Returns `(prepared rows, batch)`."""
    t = trainer(kind)
    dataset = datasets.Dataset.from_list(rows)
    t._check_train_dataset(dataset, type(t).__name__)
    args, processing_class = t.args, t.processing_class
    if kind == "sft":
        prepared = t._prepare_dataset(dataset, processing_class, args, False, None, "train")
    elif kind == "bco":
        prepared = t._prepare_bco_dataset(dataset, processing_class, args, "train")
    elif kind == "prm":
        prepared = t._prepare_dataset(dataset, processing_class, args, "train", False)
    else:
        prepared = t._prepare_dataset(dataset, processing_class, args, "train")
    prepared_rows = prepared.to_list()
    batch = t.data_collator(t._remove_unused_columns(prepared).to_list())
    return prepared_rows, batch


def run(kind, rows):
    """The outcome of `rows`: `("batch", prepared, batch)` or `("error", exception)`; anything else propagates."""
    try:
        outcome = ("batch", *prepare_and_collate(kind, rows))
        event(f"{kind}: batch")
        return outcome
    except CLEAR_ERRORS as error:
        event(f"{kind}: {type(error).__name__}: {str(error)[:50]}")
        message = str(error)
        assert any(word.lower() in message.lower() for word in EXPLAINING_WORDS), (
            f"unclear {type(error).__name__}: {message!r}"
        )
        return ("error", error)
    except Exception as error:  # noqa: BLE001 - the failure hypothesis must report
        if type(error).__module__.startswith("pyarrow") and _arrow_cannot_store(rows):
            return ("unstorable", error)
        raise


def _arrow_cannot_store(rows):
    try:
        datasets.Dataset.from_list(rows)
    except Exception:  # noqa: BLE001 - the user could not build this dataset either
        return True
    return False


# ---------------------------------------------------------------------------------------------------------------------
# Batch checks shared by every trainer
# ---------------------------------------------------------------------------------------------------------------------
def check_padding(batch, pad_id, loss_key):
    """Right padding: attention mask 1...1 0...0, pad ids behind it, loss positions inside it."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == attention.shape and ids.dim() == 2
    lengths = attention.sum(dim=1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert torch.equal(attention.bool(), positions < lengths.unsqueeze(1)), "attention mask is not right padding"
    assert bool((ids[attention == 0] == pad_id).all()), "padding positions hold other ids than the pad token"
    if loss_key == "labels":
        assert batch["labels"].shape == ids.shape
        assert bool((batch["labels"][attention == 0] == -100).all())
    elif loss_key is not None:
        assert batch[loss_key].shape == ids.shape
        assert bool((batch[loss_key][attention == 0] == 0).all())
    return lengths


def rows_of(batch, loss_key):
    """`[(ids, loss mask)]` of each batch row, padding removed."""
    out = []
    for i, length in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
        ids = batch["input_ids"][i, :length].tolist()
        if loss_key == "labels":
            mask = [int(label != -100) for label in batch["labels"][i, :length].tolist()]
        else:
            mask = batch[loss_key][i, :length].tolist()
        out.append((ids, mask))
    return out


def tokenizer_of(kind):
    processing_class = trainer(kind).processing_class
    return getattr(processing_class, "tokenizer", processing_class)


def with_eos(text, eos):
    return text if text.endswith(eos) else text + eos


def split_sequence(tok, prompt_ids, full_ids):
    """`(ids, mask)` of a prompt + completion sequence: mask 1 after the prompt's shared token prefix."""
    split = common_prefix_length(prompt_ids, full_ids)
    return full_ids, [0] * split + [1] * (len(full_ids) - split)


def truncate(sequence, max_length=MAX_LENGTH):
    ids, mask = sequence
    return ids[:max_length], mask[:max_length]


def is_text(value):
    return isinstance(value, str)


# ---------------------------------------------------------------------------------------------------------------------
# References: what the batch must hold, computed from the tokenizer by the test. None: the input is invalid.
# ---------------------------------------------------------------------------------------------------------------------
def _chat_ids(tok, messages, row, **kwargs):
    tools = json.loads(row["tools"]) if row.get("tools") else None
    return list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def sft_sequence(tok, row):
    """`(ids, loss mask)` of one SFT row before truncation, or None when the row is not valid SFT data."""
    eos = tok.eos_token
    if "messages" in row:
        ids = _chat_ids(tok, row["messages"], row)
        return ids, [1] * len(ids)
    if "text" in row:
        if not is_text(row["text"]):
            return None
        ids = tok(with_eos(row["text"], eos))["input_ids"]
        return ids, [1] * len(ids)
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt_kwargs = {"continue_final_message": True} if prompt[-1]["role"] == "assistant" else {
            "add_generation_prompt": True}  # fmt: skip
        return split_sequence(
            tok, _chat_ids(tok, prompt, row, **prompt_kwargs), _chat_ids(tok, prompt + completion, row)
        )
    if not (is_text(prompt) and is_text(completion)):
        return None
    return split_sequence(tok, tok(prompt)["input_ids"], tok(prompt + with_eos(completion, eos))["input_ids"])


def trained(sequence):
    """Whether a (truncated) sequence has a loss position after its first token (the first is never predicted)."""
    return any(sequence[1][1:])


def preference_sequences(tok, row):
    """The `(chosen, rejected)` sequences of a standard preference row with an explicit prompt, split at the token
    prefix shared by the tokenized prompt and both full sequences; None when the row is not valid."""
    if not all(is_text(row[key]) for key in ("prompt", "chosen", "rejected")):
        return None
    eos, prompt = tok.eos_token, row["prompt"]
    prompt_ids = tok(prompt)["input_ids"]
    full = [tok(prompt + with_eos(row[key], eos))["input_ids"] for key in ("chosen", "rejected")]
    split = min(common_prefix_length(prompt_ids, ids) for ids in full)
    split = min(split, common_prefix_length(full[0], full[1]))
    return [(ids, [0] * split + [1] * (len(ids) - split)) for ids in full]


def check_completion_masks(pairs, scored=True):
    """Each row's loss mask is 0...0 1...1 (the completion after the prompt) and, with `scored`, scores at least one
    token (CPO and ORPO keep pairs whose completion is only the first token, as TRL does)."""
    for _ids, mask in pairs:
        ones = mask.index(1) if 1 in mask else len(mask)
        assert mask == [0] * ones + [1] * (len(mask) - ones), f"loss mask is not one completion: {mask}"
        assert not scored or any(mask[1:]), "a row without any scored token was kept"


# ---------------------------------------------------------------------------------------------------------------------
# The fuzz tests
# ---------------------------------------------------------------------------------------------------------------------
SFT_ROWS = st.one_of(
    standard_rows(("text",)),
    standard_rows(("prompt", "completion")),
    conversational_rows("messages"),
    conversational_rows("prompt_completion"),
)


def _check_sft(rows):
    outcome = run("sft", rows)
    if outcome[0] != "batch":
        stored = datasets.Dataset.from_list(rows).to_list() if outcome[0] == "error" else []
        tok = tokenizer_of("sft")
        try:
            sequences = [sft_sequence(tok, row) for row in stored]
        except Exception:  # noqa: BLE001 - the chat template refuses the row: an error is the right outcome
            return
        if stored and all(s is not None for s in sequences):
            kept = [truncate(s) for s in sequences if trained(truncate(s))]
            assert not kept, f"valid SFT data refused: {outcome[1]!r}"
        return
    _, prepared, batch = outcome
    check_padding(batch, trainer("sft").data_collator.pad_token_id, "labels")
    stored = datasets.Dataset.from_list(rows).to_list()
    sequences = [sft_sequence(tokenizer_of("sft"), row) for row in stored]
    assert all(s is not None for s in sequences), "invalid rows produced a batch"
    expected = [truncate(s) for s in sequences]
    expected = [s for s in expected if trained(s)]
    assert rows_of(batch, "labels") == expected


@DEFAULT
@given(SFT_ROWS)
def test_sft(rows):
    _check_sft(rows)


DPO_ROWS = st.one_of(
    standard_rows(("prompt", "chosen", "rejected")),
    standard_rows(("chosen", "rejected")),
    conversational_rows("preference"),
    conversational_rows("implicit_preference"),
)


def _check_pairs(kind, rows, first_token_pairs=False):
    """DPO / CPO / ORPO: chosen sequences then rejected ones, equal to the reference for standard explicit-prompt rows.

    `first_token_pairs`: the trainer keeps a pair whose completion (after truncation) is only its first token (CPO
    and ORPO, as TRL); DPO drops it, since the first token is never predicted."""
    outcome = run(kind, rows)
    stored = datasets.Dataset.from_list(rows).to_list() if outcome[0] != "unstorable" else []
    explicit = bool(stored) and all("prompt" in row and is_text(row["prompt"]) for row in stored)
    references = [preference_sequences(tokenizer_of(kind), row) for row in stored] if explicit else None
    kept = None
    keeps = (lambda sequence: any(sequence[1])) if first_token_pairs else trained
    if references is not None and all(r is not None for r in references):
        kept = [[truncate(s) for s in r] for r in references]
        kept = [r for r in kept if keeps(r[0]) and keeps(r[1])]
    if outcome[0] != "batch":
        assert not kept, f"valid preference data refused: {outcome[1]!r}"
        return
    _, prepared, batch = outcome
    check_padding(batch, tokenizer_of(kind).pad_token_id, "completion_mask")
    pairs = rows_of(batch, "completion_mask")
    assert len(pairs) == 2 * len(prepared)
    check_completion_masks(pairs, scored=not first_token_pairs)
    if references is not None:
        assert all(r is not None for r in references), "invalid rows produced a batch"
        assert pairs == [r[0] for r in kept] + [r[1] for r in kept]


@DEFAULT
@given(DPO_ROWS)
def test_dpo(rows):
    _check_pairs("dpo", rows)


@DEFAULT
@given(DPO_ROWS)
def test_cpo(rows):
    _check_pairs("cpo", rows, first_token_pairs=True)


@DEFAULT
@given(DPO_ROWS)
def test_orpo(rows):
    _check_pairs("orpo", rows, first_token_pairs=True)


UNPAIRED_ROWS = st.one_of(
    standard_rows(("prompt", "completion"), extra={"label": st.booleans()}),
    standard_rows(("prompt", "completion"), extra={"label": st.one_of(st.booleans(), st.none())}),
    standard_rows(("prompt", "completion", "label")),
    conversational_rows("unpaired", extra={"label": st.booleans()}),
    standard_rows(("prompt", "chosen", "rejected")),
)


def _check_unpaired(kind, rows):
    outcome = run(kind, rows)
    if outcome[0] != "batch":
        return
    _, prepared, batch = outcome
    pad_id = tokenizer_of(kind).pad_token_id
    check_padding(batch, pad_id, "completion_mask")
    check_completion_masks(rows_of(batch, "completion_mask"))
    assert batch["label"].shape == (len(prepared),)
    if "KL_input_ids" in batch:
        kl = {key[3:]: value for key, value in batch.items() if key.startswith("KL_")}
        check_padding(kl, pad_id, "completion_mask")
        assert kl["input_ids"].shape[0] == len(prepared)


@DEFAULT
@given(UNPAIRED_ROWS)
def test_kto(rows):
    _check_unpaired("kto", rows)


@DEFAULT
@given(UNPAIRED_ROWS)
def test_bco(rows):
    _check_unpaired("bco", rows)


@DEFAULT
@given(DPO_ROWS)
def test_reward(rows):
    outcome = run("reward", rows)
    if outcome[0] != "batch":
        return
    _, prepared, batch = outcome
    lengths = check_padding(batch, tokenizer_of("reward").pad_token_id, None)
    assert batch["input_ids"].shape[0] == 2 * len(prepared)
    assert bool((lengths <= MAX_LENGTH).all()) and bool((lengths > 0).all())


@DEFAULT
@given(stepwise_rows())
def test_prm(rows):
    outcome = run("prm", rows)
    if outcome[0] != "batch":
        return
    _, prepared, batch = outcome
    check_padding(batch, tokenizer_of("prm").pad_token_id, "labels")
    labels = batch["labels"]
    assert batch["input_ids"].shape[1] <= MAX_LENGTH
    assert bool(((labels == -100) | (labels == 0) | (labels == 1)).all())
    assert bool(((labels != -100).sum(dim=1) > 0).all()), "a row without any labelled step was kept"


def _check_reward(rows):
    test_reward.hypothesis.inner_test(rows)


def _check_prm(rows):
    test_prm.hypothesis.inner_test(rows)


LONG_RUNS = {
    "sft": (SFT_ROWS, _check_sft),
    "dpo": (DPO_ROWS, functools.partial(_check_pairs, "dpo")),
    "cpo": (DPO_ROWS, functools.partial(_check_pairs, "cpo", first_token_pairs=True)),
    "orpo": (DPO_ROWS, functools.partial(_check_pairs, "orpo", first_token_pairs=True)),
    "kto": (UNPAIRED_ROWS, functools.partial(_check_unpaired, "kto")),
    "bco": (UNPAIRED_ROWS, functools.partial(_check_unpaired, "bco")),
    "reward": (DPO_ROWS, _check_reward),
    "prm": (stepwise_rows(), _check_prm),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LONG_RUNS))
def test_long_fuzz_run(kind):
    """Many more (non-derandomized) examples per trainer: `pytest -m "reliability and slow" -k long_fuzz`."""
    strategy, check = LONG_RUNS[kind]

    def check_rows(rows):
        check(rows)

    settings(SLOW, derandomize=False)(given(strategy)(check_rows))()
