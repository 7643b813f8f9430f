"""trl.rewards: built-in reward functions, and the reward registry of the grpo/rloo scripts."""

import math
import sys

import pytest

from trl.import_utils import is_math_verify_available
from trl.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)


requires_math_verify = pytest.mark.skipif(not is_math_verify_available(), reason="needs math_verify")


def message(text):
    return [{"role": "assistant", "content": text}]


def test_lazy_module_exports():
    import trl
    import trl.rewards as rewards

    assert trl.rewards is rewards
    for name in (
        "accuracy_reward",
        "reasoning_accuracy_reward",
        "get_cosine_scaled_reward",
        "think_format_reward",
        "get_repetition_penalty_reward",
        "get_soft_overlong_punishment",
    ):
        assert name in rewards.__all__ and callable(getattr(rewards, name))
    for submodule in ("accuracy_rewards", "format_rewards", "other_rewards"):
        assert submodule in rewards.__all__


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nSome reasoning.\n</think>\nThe answer is 4.", 1.0),
        ("<think>short</think>", 1.0),
        ("The answer is 4.", 0.0),
        ("<think>one<think>two</think>", 0.0),  # a second opening tag
        ("<think>never closed", 0.0),
        (" <think>late start</think>", 0.0),
    ],
)
def test_think_format_reward(text, expected):
    assert think_format_reward([message(text)]) == [expected]
    assert think_format_reward([text]) == [expected]  # plain strings work too


def test_soft_overlong_punishment_matches_contract_example():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward.__name__ == "soft_overlong_punishment_reward"
    assert reward(completion_ids=[[0] * 70, [0] * 80, [0] * 90, [0] * 100, [0] * 120]) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache must be in"):
        get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=20)


def test_repetition_penalty_reward():
    reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert reward.__name__ == "repetition_penalty_reward"
    # [1,1,1,1]: bigrams (1,1) x3 -> 1 distinct of 3; [1,2,1,2,3]: 4 bigrams, 3 distinct
    assert reward(completion_ids=[[1, 2, 3, 4], [1, 1, 1, 1], [1, 2, 1, 2, 3], [7]]) == pytest.approx(
        [0.0, -(1 - 1 / 3), -(1 - 3 / 4), 0.0]
    )
    with pytest.raises(ValueError, match="must not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_accuracy_reward_without_math_verify_explains_how_to_install(monkeypatch):
    # An environment without the package, simulated (the test extra installs math_verify).
    monkeypatch.setattr("trl.rewards.accuracy_rewards.is_math_verify_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install trl\[math-verify\]"):
        accuracy_reward([message("4")], ["4"])
    with pytest.raises(ImportError, match="math_verify"):
        reasoning_accuracy_reward([message("</think>4")], ["4"])


@requires_math_verify
def test_accuracy_reward():
    logged = {}
    rewards = accuracy_reward(
        [message(r"My answer is $\boxed{\frac{1}{3}}$"), message(r"My answer is $\boxed{\frac{1}{2}}$"), message("x")],
        [r"\frac{1}{3}", r"\frac{1}{3}", "no math here"],
        log_extra=lambda name, values: logged.__setitem__(name, values),
    )
    assert rewards == [1.0, 0.0, None]  # an unparseable reference skips the sample
    assert set(logged) == {"solution", "gold_parsed", "answer_parsed"}
    assert logged["gold_parsed"][2] == "[unparseable]"


@requires_math_verify
def test_reasoning_accuracy_reward_grades_after_the_delimiter():
    completions = [
        message(r"<think>maybe $\boxed{\frac{1}{2}}$</think> so $\boxed{\frac{1}{3}}$"),
        message(r"<think>still thinking $\boxed{\frac{1}{3}}$"),
        message(r"reasoning END $\boxed{\frac{1}{3}}$"),
    ]
    solution = [r"\frac{1}{3}"] * 3
    assert reasoning_accuracy_reward(completions, solution) == [1.0, 0.0, 0.0]
    assert reasoning_accuracy_reward(completions, solution, reasoning_delimiters=["END"]) == [0.0, 0.0, 1.0]


@requires_math_verify
def test_cosine_scaled_reward_formula():
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward.__name__ == "cosine_scaled_reward"
    completions = [message(r"$\boxed{2}$"), message(r"$\boxed{3}$"), message(r"$\boxed{2}$"), message("x")]
    values = reward(
        completions, solution=["2", "2", "2", "nothing"], completion_ids=[[0] * 50, [0] * 25, [0] * 200, []]
    )

    def cosine(length, low, high):
        return low + 0.5 * (high - low) * (1 + math.cos(min(length / 100, 1.0) * math.pi))

    assert values[0] == pytest.approx(cosine(50, 0.5, 1.0))  # 0.75
    assert values[1] == pytest.approx(cosine(25, -0.5, -1.0))  # wrong and short: close to -1
    assert values[2] == pytest.approx(0.5)  # correct but over max_len
    assert values[3] is None


# ---------------------------------------------------------------------------------------------------------------------
# Script registry (`--reward_funcs`)
# ---------------------------------------------------------------------------------------------------------------------
def test_script_reward_registry(tmp_path, monkeypatch):
    from trl.scripts.grpo import GRPOScriptArguments, build_reward_funcs, resolve_reward_func
    from trl.scripts.rloo import RLOOScriptArguments

    assert resolve_reward_func("think_format_reward") is think_format_reward
    overlong = resolve_reward_func("get_soft_overlong_punishment")
    assert overlong(completion_ids=[[0] * 1024, [0] * 1280, [0] * 1281]) == [0.0, -1.0, -1.0]

    (tmp_path / "my_rewards.py").write_text(
        "def constant(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    custom = resolve_reward_func("my_rewards.constant")
    assert custom(["a", "b"]) == [1.0, 1.0]

    with pytest.raises(ValueError, match="Unknown reward function 'nonsense'"):
        resolve_reward_func("nonsense")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_func("my_rewards.missing")

    args = RLOOScriptArguments(reward_model_name_or_path="some/model", reward_funcs=["think_format_reward"])
    assert build_reward_funcs(args) == ["some/model", think_format_reward]
    with pytest.raises(ValueError, match="No reward given"):
        build_reward_funcs(GRPOScriptArguments())


def test_builtin_reward_functions_pickle():
    """Every reward function of `trl.rewards`, and those its factories build, survives pickling (dataloader workers,
    multiprocessing) and keeps its name and results, as TRL's do."""
    import pickle

    from trl.rewards import get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment

    for func in (accuracy_reward, reasoning_accuracy_reward, think_format_reward):
        assert pickle.loads(pickle.dumps(func)) is func
    ids = [[1, 2, 1, 2, 1, 2], [0] * 9]
    for func in (get_repetition_penalty_reward(ngram_size=2), get_soft_overlong_punishment(8, 4)):
        copy = pickle.loads(pickle.dumps(func))
        assert copy.__name__ == func.__name__ and copy(completion_ids=ids) == func(completion_ids=ids)
    cosine = pickle.loads(pickle.dumps(get_cosine_scaled_reward(max_len=100)))
    assert cosine.__name__ == "cosine_scaled_reward" and cosine.max_len == 100
