"""Fuzzed data path: random datasets through each offline trainer's dataset preparation and collator (no training).

Every drawn dataset must end in one of two outcomes:

- a batch that is correct: its shapes and masks are consistent (right padding with the pad token, attention mask on
  the real tokens only, loss positions inside them) and its token ids and loss positions equal a reference the test
  builds itself from the tokenizer (SFT and Reward in every format; KTO and BCO, main and KL sequences and labels, on
  standard rows with an explicit prompt and on conversational rows; PRM on standard stepwise rows; DPO, CPO and ORPO
  on standard data with an explicit prompt; the other formats are checked against the invariants);
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
from _fuzz_data import conversational_rows, standard_rows, stepwise_rows, vision_rows
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
EXPLAINING_WORDS = ("expect", "need", "must", "require", "should", "got ", "found", "only", "Raise ", "exactly")

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
    # Vision-language models, one per image layout (grid patches, image tiles, fixed-size images); no truncation.
    "sft_vlm": ("trl", "SFT", "tiny-Qwen2VLForConditionalGeneration", "vision_conversational_prompt_completion"),
    "dpo_vlm": ("trl", "DPO", "tiny-Idefics3ForConditionalGeneration", "vision_conversational_preference"),
    "kto_vlm": ("trl", "KTO", "tiny-LlavaForConditionalGeneration", "vision_conversational_unpaired_preference"),
}


@functools.cache
def trainer(kind):
    import importlib

    module_name, prefix, model, data = TRAINERS[kind]
    module = importlib.import_module(module_name)
    options = dict(max_length=None if kind.endswith("_vlm") else MAX_LENGTH, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
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
    if kind == "sft_vlm":  # image rows reach the vision collator as they are, as in SFTTrainer
        prepared = dataset
    elif kind == "sft":
        prepared = t._prepare_dataset(dataset, processing_class, args, False, None, "train")
    elif kind == "bco":
        prepared = t._prepare_bco_dataset(dataset, processing_class, args, "train")
    elif kind == "prm":
        prepared = t._prepare_dataset(dataset, processing_class, args, "train", False)
    else:
        prepared = t._prepare_dataset(dataset, processing_class, args, "train")
    prepared_rows = prepared.to_list()
    loaded = t._remove_unused_columns(prepared)
    batch = t.data_collator([loaded[i] for i in range(len(loaded))])  # rows as the dataloader reads them (images)
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
    return prompt_completion_sequence(tok, row)


def prompt_completion_sequence(tok, row):
    """`(ids, loss mask)` of a prompt + completion row (text: EOS appended to the completion; messages: the prompt
    rendered with the generation prompt), split at the prefix shared with the tokenized prompt; None if not valid."""
    eos = tok.eos_token
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


# A reference that says the rows are invalid (the library must refuse them), beside None: no reference for the format.
INVALID = "invalid"


def unpaired_sequences(tok, rows):
    """`[((ids, loss mask), label)]` of unpaired rows in the library's order, paired rows being unpaired first (every
    chosen row with label True, then every rejected row with False); INVALID when a row is not valid; None (no
    reference, invariants only) for standard rows without a text prompt."""
    if not rows:
        return None
    if "chosen" in rows[0]:
        rows = [{**row, "completion": row[key], "label": key == "chosen"} for key in ("chosen", "rejected")
                for row in rows]  # fmt: skip
    prompt = rows[0].get("prompt")
    conversational = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if not conversational and not all(is_text(row.get("prompt")) for row in rows):
        return None  # e.g. `None` or an empty list, which the library reads as no prompt
    out = []
    for row in rows:
        sequence = prompt_completion_sequence(tok, row) if isinstance(row["label"], bool) else None
        if sequence is None:
            return INVALID
        out.append((sequence, row["label"]))
    return out


def bco_sequence(tok, sequence, max_completion_length):
    """A kept BCO sequence: the completion ends with EOS (appended after a chat template's end) and is cut to
    `max_completion_length` before the whole sequence is cut to `max_length`."""
    ids, mask = sequence
    split = mask.count(0)
    completion = ids[split:] if ids[-1:] == [tok.eos_token_id] else ids[split:] + [tok.eos_token_id]
    completion = completion[:max_completion_length] if max_completion_length is not None else completion
    return truncate((ids[:split] + completion, [0] * split + [1] * len(completion)))


def kl_sequences(kept, chunk_size):
    """TRL's mismatched KL pairs: within each chunk of `chunk_size` kept rows, row i's prompt with the completion of
    row i - 1 (the chunk's first row takes the chunk's last completion)."""
    out = []
    for start in range(0, len(kept), chunk_size):
        chunk = [sequence for sequence, _label in kept[start : start + chunk_size]]
        for i, (ids, mask) in enumerate(chunk):
            other_ids, other_mask = chunk[i - 1]
            split, other_split = mask.count(0), other_mask.count(0)
            completion = other_ids[other_split:]
            out.append(truncate((ids[:split] + completion, [0] * split + [1] * len(completion))))
    return out


def reward_ids(tok, row, key):
    """Token ids of one side of a Reward pair: the prompt prepended (text: EOS appended); INVALID if not valid; None
    for a standard row whose prompt is not text (no reference)."""
    prompt, completion = row.get("prompt"), row[key]
    if isinstance(completion, list) and completion and isinstance(completion[0], dict):
        return _chat_ids(tok, list(prompt or []) + completion, row)
    if "prompt" in row and not is_text(prompt):
        return None
    if not is_text(completion):
        return INVALID
    ids = list(tok((prompt or "") + completion)["input_ids"])
    return ids if ids[-1:] == [tok.eos_token_id] else ids + [tok.eos_token_id]


def prm_sequence(tok, row, separator):
    """`(ids, labels)` of a stepwise row: BOS (if any) and the prompt, then each step followed by the separator whose
    last token holds the step's label, cut to `max_length`; INVALID if the row is not valid."""
    prompt, steps, labels = row["prompt"], row["completions"], row["labels"]
    if not (is_text(prompt) and isinstance(steps, list) and all(is_text(step) for step in steps)):
        return INVALID
    if not isinstance(labels, list) or len(labels) != len(steps):
        return INVALID
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids += tok(prompt, add_special_tokens=False)["input_ids"]
    targets = [-100] * len(ids)
    separator_ids = tok(separator, add_special_tokens=False)["input_ids"]
    for step, label in zip(steps, labels):
        step_ids = tok(step, add_special_tokens=False)["input_ids"] + separator_ids
        ids += step_ids
        targets += [-100] * (len(step_ids) - 1) + [int(label)]
    return ids[:MAX_LENGTH], targets[:MAX_LENGTH]


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
    standard_rows(("prompt", "chosen", "rejected"), text_only=True),
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
    standard_rows(("prompt", "completion"), extra={"label": st.booleans()}, text_only=True),
    standard_rows(("prompt", "chosen", "rejected"), text_only=True),
    standard_rows(("prompt", "completion"), extra={"label": st.one_of(st.booleans(), st.none())}),
    standard_rows(("prompt", "completion", "label")),
    conversational_rows("unpaired", extra={"label": st.booleans()}),
    standard_rows(("prompt", "chosen", "rejected")),
)


def _check_unpaired(kind, rows):
    """KTO / BCO: the main sequences, labels and (KTO) KL sequences equal the reference where there is one."""
    outcome = run(kind, rows)
    stored = datasets.Dataset.from_list(rows).to_list() if outcome[0] != "unstorable" else []
    tok = tokenizer_of(kind)
    try:
        references = unpaired_sequences(tok, stored)
    except Exception:  # noqa: BLE001 - the chat template refuses a row: an error is the right outcome
        references = INVALID
    kept = None
    if references not in (None, INVALID):
        kept = [(sequence, label) for sequence, label in references if trained(truncate(sequence))]
    if outcome[0] != "batch":
        assert not kept, f"valid unpaired data refused: {outcome[1]!r}"
        return
    assert references != INVALID, "invalid rows produced a batch"
    _, prepared, batch = outcome
    pad_id = tok.pad_token_id
    check_padding(batch, pad_id, "completion_mask")
    check_completion_masks(rows_of(batch, "completion_mask"))
    assert batch["label"].shape == (len(prepared),)
    kl = None
    if "KL_input_ids" in batch:
        kl = {key[3:]: value for key, value in batch.items() if key.startswith("KL_")}
        check_padding(kl, pad_id, "completion_mask")
        assert kl["input_ids"].shape[0] == len(prepared)
    if kept is None:
        return
    if kind == "bco":
        expected = [bco_sequence(tok, sequence, trainer(kind).args.max_completion_length) for sequence, _ in kept]
    else:
        expected = [truncate(sequence) for sequence, _label in kept]
    event(f"{kind}: batch equal to the reference")
    assert rows_of(batch, "completion_mask") == expected
    assert batch["label"].tolist() == [label for _sequence, label in kept]
    if kind == "kto":
        assert kl is not None, "KTO's default loss needs the KL sequences"
        assert rows_of(kl, "completion_mask") == kl_sequences(kept, trainer(kind).args.per_device_train_batch_size)


@DEFAULT
@given(UNPAIRED_ROWS)
def test_kto(rows):
    _check_unpaired("kto", rows)


@DEFAULT
@given(UNPAIRED_ROWS)
def test_bco(rows):
    _check_unpaired("bco", rows)


def _check_reward(rows):
    """Reward: chosen rows then rejected rows, pairs longer than `max_length` dropped, equal to the reference."""
    outcome = run("reward", rows)
    stored = datasets.Dataset.from_list(rows).to_list() if outcome[0] != "unstorable" else []
    tok = tokenizer_of("reward")
    try:
        pairs = [(reward_ids(tok, row, "chosen"), reward_ids(tok, row, "rejected")) for row in stored]
    except Exception:  # noqa: BLE001 - the chat template refuses a row: an error is the right outcome
        pairs = [(INVALID, INVALID)]
    invalid = any(INVALID in pair for pair in pairs)
    known = bool(pairs) and not invalid and all(None not in pair for pair in pairs)
    kept = [pair for pair in pairs if all(len(ids) <= MAX_LENGTH for ids in pair)] if known else None
    if outcome[0] != "batch":
        assert not kept, f"valid preference data refused: {outcome[1]!r}"
        return
    assert not invalid, "invalid rows produced a batch"
    _, prepared, batch = outcome
    lengths = check_padding(batch, tok.pad_token_id, None)
    assert batch["input_ids"].shape[0] == 2 * len(prepared)
    assert bool((lengths <= MAX_LENGTH).all()) and bool((lengths > 0).all())
    if kept is not None:
        event("reward: batch equal to the reference")
        ids = [ids for ids, _mask in rows_of(batch, "attention_mask")]
        assert ids == [chosen for chosen, _ in kept] + [rejected for _, rejected in kept]


@DEFAULT
@given(DPO_ROWS)
def test_reward(rows):
    _check_reward(rows)


def _check_prm(rows):
    """PRM: every valid row tokenized step by step with its labels on the separators; rows left without a label
    dropped; invalid rows refused."""
    outcome = run("prm", rows)
    stored = datasets.Dataset.from_list(rows).to_list() if outcome[0] != "unstorable" else []
    tok = tokenizer_of("prm")
    references = [prm_sequence(tok, row, trainer("prm").args.step_separator) for row in stored]
    invalid = not stored or INVALID in references
    kept = [] if invalid else [ref for ref in references if any(label != -100 for label in ref[1])]
    if outcome[0] != "batch":
        assert not kept, f"valid stepwise data refused: {outcome[1]!r}"
        return
    assert not invalid, "invalid rows produced a batch"
    _, prepared, batch = outcome
    check_padding(batch, tok.pad_token_id, "labels")
    assert batch["input_ids"].shape[1] <= MAX_LENGTH
    assert bool(((batch["labels"] != -100).sum(dim=1) > 0).all()), "a row without any labelled step was kept"
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    found = [(batch["input_ids"][i, :n].tolist(), batch["labels"][i, :n].tolist()) for i, n in enumerate(lengths)]
    event("prm: batch equal to the reference")
    assert found == kept


@DEFAULT
@given(stepwise_rows())
def test_prm(rows):
    _check_prm(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Image rows (vision-language models)
# ---------------------------------------------------------------------------------------------------------------------
def vision_sequence(processor, prompt, completion, images, joint=True):
    """`(ids, loss mask)` of a conversational image row, built with the processor from the row's images (converted
    to RGB) and the rendered texts: the prompt rendered with the generation prompt, the completion being the rest of
    the rendered conversation. `joint`: the whole text is processed at once and the mask is 1 after the prefix it
    shares with the processed prompt (SFT); otherwise the processed prompt is followed by the completion text
    tokenized on its own (DPO, KTO)."""
    images = [image.convert("RGB") for image in images]
    kwargs = {"images": images} if images else {}

    def ids(text):
        return list(processor(text=[text], return_tensors="pt", **kwargs)["input_ids"][0].tolist())

    full_text = processor.apply_chat_template(prompt + completion, tokenize=False)
    if not completion:
        full = ids(full_text)
        return full, [1] * len(full)
    prompt_text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    prefix = ids(prompt_text)
    if joint:
        full = ids(full_text)
        split = common_prefix_length(prefix, full)
        return full, [0] * split + [1] * (len(full) - split)
    assert full_text.startswith(prompt_text)
    completion_ids = processor.tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    return prefix + list(completion_ids), [0] * len(prefix) + [1] * len(completion_ids)


def _check_vision(kind, rows):
    """Image rows through the vision collators: a batch with pixel values whose sequences equal the processor's
    reference (SFT: chosen-free prompt + completion or whole conversation; DPO: chosen then rejected; KTO: main rows
    and the KL rows, each prompt with the previous row's completion), or a clear error."""
    outcome = run(kind, rows)
    processor = trainer(kind).processing_class
    try:
        if kind == "dpo_vlm":
            pairs = [[vision_sequence(processor, row["prompt"], row[key], row["images"], joint=False) for row in rows]
                     for key in ("chosen", "rejected")]  # fmt: skip
            expected = pairs[0] + pairs[1]
        elif "messages" in rows[0]:
            expected = [vision_sequence(processor, row["messages"], [], row["images"]) for row in rows]
        else:
            joint = kind == "sft_vlm"
            expected = [vision_sequence(processor, row["prompt"], row["completion"], row["images"], joint)
                        for row in rows]  # fmt: skip
    except Exception:  # noqa: BLE001 - the processor refuses the rows (e.g. placeholders and images disagree)
        expected = None
    if outcome[0] != "batch":
        assert expected is None, f"valid image rows refused: {outcome[1]!r}"
        return
    assert expected is not None, "rows the processor refuses produced a batch"
    _, _prepared, batch = outcome
    loss_key = "labels" if kind == "sft_vlm" else "completion_mask"
    check_padding(batch, processor.tokenizer.pad_token_id, loss_key)
    if any(row["images"] for row in rows):
        assert "pixel_values" in batch
    event(f"{kind}: batch equal to the reference")
    assert rows_of(batch, loss_key) == expected
    if kind == "kto_vlm":
        assert batch["label"].tolist() == [row["label"] for row in rows]
        kl_rows = [
            vision_sequence(processor, row["prompt"], rows[i - 1]["completion"], row["images"], joint=False)
            for i, row in enumerate(rows)
        ]
        kl = {key[3:]: value for key, value in batch.items() if key.startswith("KL_")}
        assert rows_of(kl, "completion_mask") == kl_rows


VISION_RUNS = {
    "sft_vlm": st.one_of(vision_rows("prompt_completion"), vision_rows("messages")),
    "dpo_vlm": vision_rows("preference"),
    "kto_vlm": vision_rows("unpaired"),
}
VISION = settings(DEFAULT, max_examples=50)


@VISION
@given(VISION_RUNS["sft_vlm"])
def test_sft_images(rows):
    _check_vision("sft_vlm", rows)


@VISION
@given(VISION_RUNS["dpo_vlm"])
def test_dpo_images(rows):
    _check_vision("dpo_vlm", rows)


@VISION
@given(VISION_RUNS["kto_vlm"])
def test_kto_images(rows):
    _check_vision("kto_vlm", rows)


LONG_RUNS = {
    "sft": (SFT_ROWS, _check_sft),
    "dpo": (DPO_ROWS, functools.partial(_check_pairs, "dpo")),
    "cpo": (DPO_ROWS, functools.partial(_check_pairs, "cpo", first_token_pairs=True)),
    "orpo": (DPO_ROWS, functools.partial(_check_pairs, "orpo", first_token_pairs=True)),
    "kto": (UNPAIRED_ROWS, functools.partial(_check_unpaired, "kto")),
    "bco": (UNPAIRED_ROWS, functools.partial(_check_unpaired, "bco")),
    "reward": (DPO_ROWS, _check_reward),
    "prm": (stepwise_rows(), _check_prm),
    **{kind: (strategy, functools.partial(_check_vision, kind)) for kind, strategy in VISION_RUNS.items()},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LONG_RUNS))
def test_long_fuzz_run(kind):
    """Many more (non-derandomized) examples per trainer: `pytest -m "reliability and slow" -k long_fuzz`."""
    strategy, check = LONG_RUNS[kind]

    def check_rows(rows):
        check(rows)

    settings(SLOW, derandomize=False)(given(strategy)(check_rows))()
