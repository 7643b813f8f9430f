"""Hypothesis strategies of the fuzzed data path (`test_fuzz_data_path.py`): datasets in every format the offline
trainers accept, with the values users get wrong.

A dataset is drawn as a list of rows sharing one layout. Each text column has one "kind" per dataset, so that the
rows can always be stored by `datasets` (Arrow needs one type per column): strings (empty, one token, long, or
ordinary, with `None` mixed in), integers, floats or lists of strings. Conversations mix system, user, assistant and
tool messages, assistant tool calls and a `tools` column of JSON schemas.
"""

import json

from hypothesis import strategies as st


TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            },
        }
    ]
)

_WORDS = st.text(alphabet="abc xyz,.!?\n0123456789é中", min_size=1, max_size=24)
TEXT = st.one_of(
    _WORDS,
    st.just(""),
    st.sampled_from(["a", "!", " ", "\n"]),  # a single token
    st.text(alphabet="ab ", min_size=300, max_size=600),  # longer than any max_length used here
)


def column_values(n: int, allow_none: bool = True, text_only: bool = False) -> st.SearchStrategy:
    """`n` values of one text column, all of one kind per draw (`text_only`: strings only, no `None`)."""
    strings = st.one_of(TEXT, st.none()) if allow_none else TEXT
    if text_only:
        return st.lists(TEXT, min_size=n, max_size=n)
    return st.one_of(
        st.lists(TEXT, min_size=n, max_size=n),
        st.lists(strings, min_size=n, max_size=n),
        st.lists(st.integers(-5, 5), min_size=n, max_size=n),
        st.lists(st.floats(allow_nan=False, width=32), min_size=n, max_size=n),
        st.lists(st.lists(TEXT, max_size=2), min_size=n, max_size=n),
    )


def _message(role: str) -> st.SearchStrategy:
    if role == "assistant":
        call = st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.just("add"),
                                                                             "arguments": st.fixed_dictionaries({"a": st.integers(0, 9)})})}
        )  # fmt: skip
        return st.fixed_dictionaries(
            {"role": st.just(role), "content": TEXT}, optional={"tool_calls": st.lists(call, min_size=1, max_size=1)}
        )
    if role == "tool":
        return st.fixed_dictionaries({"role": st.just(role), "name": st.just("add"), "content": TEXT})
    return st.fixed_dictionaries({"role": st.just(role), "content": TEXT})


@st.composite
def conversation(draw, ends_with_assistant: bool = True, min_turns: int = 1, system: bool | None = None):
    """A message list: optional system message, alternating user/assistant turns, maybe a tool round trip."""
    messages = []
    if draw(st.booleans()) if system is None else system:
        messages.append(draw(_message("system")))
    for _ in range(draw(st.integers(min_turns, 2))):
        messages.append(draw(_message("user")))
        messages.append(draw(_message("assistant")))
        if draw(st.booleans()) and draw(st.booleans()):
            messages.append(draw(_message("tool")))
            messages.append(draw(_message("assistant")))
    if not ends_with_assistant:
        messages.pop()
    return messages


def _normalise(messages):
    """One key set for every message of a dataset (Arrow fills absent keys with None anyway)."""
    return [{"role": m["role"], "content": m["content"], "tool_calls": m.get("tool_calls"), "name": m.get("name")}
            for m in messages]  # fmt: skip


def _columns_to_rows(columns: dict[str, list]) -> list[dict]:
    n = len(next(iter(columns.values())))
    return [{name: values[i] for name, values in columns.items()} for i in range(n)]


@st.composite
def standard_rows(draw, names: tuple[str, ...], extra: dict | None = None, text_only: bool = False):
    """Rows of standard (text) data with the given text columns, each column of one drawn kind (`text_only`: valid
    strings in every column, so that most draws reach the collator)."""
    n = draw(st.integers(1, 5))
    columns = {name: draw(column_values(n, text_only=text_only)) for name in names}
    for name, strategy in (extra or {}).items():
        columns[name] = draw(st.lists(strategy, min_size=n, max_size=n))
    return _columns_to_rows(columns)


@st.composite
def conversational_rows(draw, layout: str, extra: dict | None = None):
    """Rows of conversational data. `layout`: "messages", "prompt_completion", "preference",
    "implicit_preference" or "unpaired"."""
    n = draw(st.integers(1, 4))
    with_tools = draw(st.booleans())
    rows = []
    for _ in range(n):
        if layout == "messages":
            row = {"messages": _normalise(draw(conversation()))}
        else:
            prompt = _normalise(draw(conversation(ends_with_assistant=False)))
            if layout == "prompt_completion" or layout == "unpaired":
                row = {"prompt": prompt, "completion": _normalise([draw(_message("assistant"))])}
            elif layout == "preference":
                row = {"prompt": prompt, "chosen": _normalise([draw(_message("assistant"))]),
                       "rejected": _normalise([draw(_message("assistant"))])}  # fmt: skip
            else:
                row = {"chosen": prompt + _normalise([draw(_message("assistant"))]),
                       "rejected": prompt + _normalise([draw(_message("assistant"))])}  # fmt: skip
        if with_tools:
            row["tools"] = TOOLS
        for name, strategy in (extra or {}).items():
            row[name] = draw(strategy)
        rows.append(row)
    return rows


@st.composite
def stepwise_rows(draw):
    """Stepwise-supervision rows; half the draws are valid throughout (string prompt and steps, one label a step)."""
    n = draw(st.integers(1, 4))
    valid = draw(st.booleans())
    step = TEXT if valid else st.one_of(TEXT, st.none())
    rows = []
    for _ in range(n):
        steps = draw(st.lists(step, min_size=0, max_size=4))
        same_length = st.lists(st.booleans(), min_size=len(steps), max_size=len(steps))
        labels = draw(same_length if valid else st.one_of(same_length, st.lists(st.booleans(), max_size=4)))
        rows.append({"prompt": draw(step), "completions": steps, "labels": labels})
    return rows


def _image() -> st.SearchStrategy:
    from PIL import Image

    return st.builds(
        lambda mode, width, height, shade: Image.new(mode, (width, height), shade),
        st.sampled_from(["RGB", "L", "RGBA"]),
        st.integers(1, 64),
        st.integers(1, 64),
        st.integers(0, 255),
    )


@st.composite
def vision_rows(draw, layout: str):
    """Rows of conversational image data: a user turn of text parts and image placeholders (usually one per image of
    the row's `images`, sometimes not), images of random sizes and modes, and the answer(s) of `layout`:
    "prompt_completion", "messages", "preference" or "unpaired" (with a boolean `label`)."""
    n = draw(st.integers(1, 3))
    matching = draw(st.booleans()) or draw(st.booleans())
    rows = []
    for _ in range(n):
        images = draw(st.lists(_image(), min_size=0, max_size=2))
        placeholders = len(images) if matching else draw(st.integers(0, 2))
        parts = [{"type": "image", "text": None}] * placeholders + [{"type": "text", "text": draw(TEXT)}]
        parts = draw(st.permutations(parts))
        prompt = [{"role": "user", "content": list(parts)}]

        def answer():
            return [{"role": "assistant", "content": [{"type": "text", "text": draw(TEXT)}]}]

        if layout == "messages":
            row = {"messages": prompt + answer()}
        elif layout == "preference":
            row = {"prompt": prompt, "chosen": answer(), "rejected": answer()}
        else:
            row = {"prompt": prompt, "completion": answer()}
            if layout == "unpaired":
                row["label"] = draw(st.booleans())
        row["images"] = images
        rows.append(row)
    return rows
