"""Compare one case's output under real TRL with its output under this project.

Outputs are nested dicts/lists; both are flattened to `path -> leaf` (e.g. `eval_before.eval_loss`,
`log_history[1].grad_norm`, `grads[0].model.norm.weight.l2`). Then:

- the two key sets must be equal (missing and extra keys are reported separately, grouped by top-level section);
- floats must agree within `RTOL`/`ATOL` (`GRAD_ATOL` for the gradient fingerprints `grads[*].*`, `UPDATE_RTOL` for
  the update sizes `update.*`, `BF16_RTOL` for both and `grad_norm` when the trainable parameters are bf16) with
  `math.isclose`, NaN equals NaN; ints, bools, strings and None exactly;
- keys whose last component matches `RUNTIME_KEYS` (wall-clock figures) are compared for presence only;
- an `exception.message` leaf is compared through the case's key phrases (each must appear in both messages),
  not verbatim; the exception type must be equal.

See docs/parity.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any


RTOL = 1e-4
ATOL = 1e-6
# Gradient fingerprints (`grads[*].<param>.<stat>`): statistics of clipped gradients (total norm <= 1). Some sums are
# exactly zero in exact arithmetic (the LM head's gradient summed over the vocabulary, the key-projection bias) and
# come out as float noise of ~1e-7; the absolute floor is the general ATOL.
GRAD_ATOL = ATOL
# Update sizes (`update.<param>.{l2,maxabs}`): AdamW moves an element by lr * g / (|g| + eps), so elements whose
# gradient is near eps (1e-8) move by noise-dependent fractions of lr. These sizes are there to catch a different
# learning rate, schedule or optimizer (effects of 1 % and more), not to re-check the gradients.
UPDATE_RTOL = 1e-3
# Float noise that depends on the machine's kernels (AVX2 vs AVX-512 summation orders): what each tolerance below
# allows is the rounding of the quantity a value is made from, not a looser check of the value itself.
# - A gradient's linear statistics (`sum`, `proj`) can cancel to far below the gradient's size while their rounding
#   scales with that size: they are compared to RTOL of the gradient's l2 norm (the precision asked of the l2 itself).
# - Implicit rewards (`rewards/chosen|rejected|margins`) are beta <= 1 times a difference of two sequence log-prob sums:
#   a few ulps of sums of magnitude |logps|, SUM_RESOLUTION * |logps| (~8 fp32 ulps).
# - The update of a parameter whose gradient is float noise on TRL's side at every step (l2 < GRAD_ATOL, e.g. a key
#   projection's bias: 0 in exact arithmetic) is noise too (AdamW divides it by its own size): NOISE_UPDATE_ATOL.
# - A key projection's bias gets a gradient of exactly 0 in exact arithmetic (it adds q.b to every score of a query,
#   which the softmax cancels), whether or not the case records gradients: its update is AdamW's amplification of
#   float noise, at most ~lr * noise / eps per element, and is held to KEY_BIAS_UPDATE_ATOL only (it must stay that
#   small: a real gradient there would be a bug).
SUM_RESOLUTION = 1e-6
# - Trainable parameters in bf16 (a case reporting `trainable_dtypes` with `torch.bfloat16`: adapters on a quantized
#   base, which TRL casts): their gradients, updates and the logged `grad_norm` are bf16 numbers, 8 bits of mantissa.
#   An fp32 rounding difference upstream (a fast path equal to float rounding) moves a bf16 result by one ulp, 2**-8 of
#   its size: these values are compared to BF16_RTOL (two ulps), the gradients' `sum`/`proj` to BF16_RTOL of the l2.
BF16_RTOL = 2**-7
NOISE_UPDATE_ATOL = 1e-5
KEY_BIAS_UPDATE_ATOL = 1e-4
_KEY_BIAS = re.compile(r"(^|\.)(k_proj|key)\.bias$")
_IMPLICIT_REWARD = re.compile(r"^(.*)rewards/(?:chosen|rejected|margins)$")

# Wall-clock figures: present on both sides, values never compared.
RUNTIME_KEYS = re.compile(
    r"(_runtime|_samples_per_second|_steps_per_second|_tokens_per_second|_preparation_time|^step_time)$"
)

_MAX_ITEMS = 40


@dataclass
class Comparison:
    """The differences between the two outputs of one case (all empty: they match)."""

    broken: str | None = None  # the case raised under real TRL: the case itself needs fixing
    raised: str | None = None  # the case raised here only
    missing: list[str] = field(default_factory=list)  # paths in TRL's output, not here
    extra: list[str] = field(default_factory=list)  # paths here, not in TRL's output
    differing: list[str] = field(default_factory=list)  # one line per differing path pattern
    n_differing: int = 0
    # pattern -> [(path, TRL value, value here)]
    groups: dict[str, list[tuple[str, Any, Any]]] = field(default_factory=dict)

    @property
    def matches(self) -> bool:
        return not (self.broken or self.raised or self.missing or self.extra or self.differing)

    @property
    def numbers_match(self) -> bool:
        """Every shared value matches except, possibly, dataset column names (`*_columns`): the numbers agree."""
        return not (self.broken or self.raised) and all(p.endswith("_columns") for p in self.groups)

    @property
    def kind(self) -> str:
        """`match`, `keys` (only key sets differ), `values` (values differ) or `raises`/`broken`."""
        if self.broken:
            return "broken"
        if self.raised:
            return "raises"
        if self.differing:
            return "values"
        return "keys" if self.missing or self.extra else "match"

    def summary(self, max_items: int = 4) -> str:
        """One line saying what differs, by kind (for known_divergences.py and docs/parity.md)."""
        if self.broken or self.raised:
            return (self.broken or self.raised).split("\n")[0][:160]
        parts = []
        for label, paths in (("lacks", self.missing), ("adds", self.extra)):
            by_where: dict[str, list[str]] = {}
            for path in paths:
                by_where.setdefault(_where(path), [])
                name = _metric_name(path)
                if name not in by_where[_where(path)]:
                    by_where[_where(path)].append(name)
            for where, names in by_where.items():
                more = f" +{len(names) - max_items} more" if len(names) > max_items else ""
                parts.append(f"{where} {label} {', '.join(names[:max_items])}{more}")
        values = []
        for pattern, entries in self.groups.items():
            path, a, b = entries[0]
            if pattern.startswith(_PARAM_SECTIONS):
                continue
            if pattern.endswith("_columns") and isinstance(a, str) and isinstance(b, str):
                if pattern.startswith("eval") and any(p.startswith("train_columns") for p in self.groups):
                    continue
                only_trl, only_here = (
                    sorted(set(a.split(",")) - set(b.split(","))),
                    sorted(set(b.split(",")) - set(a.split(","))),
                )
                text = "prepared columns:" + (f" TRL also has {', '.join(only_trl)}" if only_trl else "")
                values.append(text + (f"; here also {', '.join(only_here)}" if only_here else ""))
                continue
            values.append(f"{_metric_name(path)} {_short(a)} vs {_short(b)}")
        for section, label in (("grads[", "gradients"), ("update.", "update size")):
            tensors = {_param_of(e[0]) for p, es in self.groups.items() if p.startswith(section) for e in es}
            if tensors:
                values.append(f"{label} differ in {len(tensors)} tensors")
        if values:
            more = f" +{len(values) - max_items} more" if len(values) > max_items else ""
            parts.append("; ".join(values[:max_items]) + more)
        return "; ".join(parts)

    def problems(self) -> list[str]:
        out = [p for p in (self.broken, self.raised) if p]
        if self.missing:
            out.append(f"missing keys ({len(self.missing)}; in TRL, not here): {_group_paths(self.missing)}")
        if self.extra:
            out.append(f"extra keys ({len(self.extra)}; here, not in TRL): {_group_paths(self.extra)}")
        if self.differing:
            shown = self.differing[:_MAX_ITEMS]
            more = f"\n  ... and {len(self.differing) - len(shown)} more" if len(self.differing) > len(shown) else ""
            out.append(f"differing values ({self.n_differing}):\n  " + "\n  ".join(shown) + more)
        return out


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list):
        if not value:
            out[prefix] = []
        for i, sub in enumerate(value):
            out.update(flatten(sub, f"{prefix}[{i}]"))
    else:
        out[prefix] = value
    return out


def _last_key(path: str) -> str:
    return re.sub(r"\[\d+\]$", "", path).rsplit(".", 1)[-1]


def _is_runtime(path: str) -> bool:
    return bool(RUNTIME_KEYS.search(_last_key(path)))


def _fold(path: str) -> str:
    """Pattern of a path: list indices folded to `[*]`, parameter names to `*` (`grads[*].*.l2`, `update.*.l2`)."""
    if path.startswith(_PARAM_SECTIONS):
        return re.sub(r"\[\d+\]", "[*]", path.split(".", 1)[0]) + ".*." + path.rsplit(".", 1)[-1]
    return re.sub(r"\[\d+\]", "[*]", path)


_PARAM_SECTIONS = ("grads[", "update.")


def _values_equal(real: Any, ours: Any, atol: float = ATOL, rtol: float = RTOL) -> bool:
    if isinstance(real, bool) or isinstance(ours, bool) or real is None or ours is None:
        return real is ours or (real == ours and type(real) is type(ours))
    if isinstance(real, (int, float)) and isinstance(ours, (int, float)):
        if isinstance(real, float) and isinstance(ours, float) and math.isnan(real) and math.isnan(ours):
            return True
        if isinstance(real, int) and isinstance(ours, int):
            return real == ours
        return math.isclose(real, ours, rel_tol=rtol, abs_tol=atol)
    return type(real) is type(ours) and real == ours


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _rel(real: Any, ours: Any) -> float:
    if isinstance(real, (int, float)) and isinstance(ours, (int, float)) and not isinstance(real, bool):
        scale = max(abs(real), abs(ours))
        return abs(real - ours) / scale if scale else 0.0
    return math.inf


def _describe(path: str, real: Any, ours: Any) -> str:
    rel = _rel(real, ours)
    detail = f"  (abs diff {abs(real - ours):.3g}, rel {rel:.3g})" if math.isfinite(rel) and rel else ""
    return f"{path}: TRL {_fmt(real)} vs here {_fmt(ours)}{detail}"


def compare(real: dict, ours: dict, phrases: tuple[str, ...] = ()) -> Comparison:
    result = Comparison()
    if "__exception__" in real:
        exc = real["__exception__"]
        result.broken = f"real TRL raised {exc['type']}: {exc['message'][:300]} -- the case itself is broken, fix it"
        return result
    if "__exception__" in ours:
        exc = ours["__exception__"]
        tail = "\n    ".join(exc.get("traceback", [])[-6:])
        result.raised = f"this project raised {exc['type']}: {exc['message'][:500]}\n    {tail}"
        return result

    flat_real, flat_ours = flatten(real), flatten(ours)
    result.missing = sorted(set(flat_real) - set(flat_ours), key=_natural)
    result.extra = sorted(set(flat_ours) - set(flat_real), key=_natural)

    noise_gradients = _noise_gradient_params(flat_real)
    bf16_trainable = isinstance(real, dict) and "torch.bfloat16" in (real.get("trainable_dtypes") or ())
    groups: dict[str, list[tuple[str, Any, Any]]] = {}
    for path in sorted(set(flat_real) & set(flat_ours), key=_natural):
        a, b = flat_real[path], flat_ours[path]
        if path.endswith("exception.message"):
            absent = [p for p in phrases if p.lower() not in str(a).lower() or p.lower() not in str(b).lower()]
            if absent:
                groups.setdefault(path, []).append((f"{path} (key phrases {absent} not in both)", a, b))
            continue
        if _is_runtime(path):
            continue
        atol = _abs_tolerance(path, flat_real, noise_gradients)
        rtol = UPDATE_RTOL if path.startswith("update.") else RTOL
        if bf16_trainable and (path.startswith(_PARAM_SECTIONS) or path.endswith(".grad_norm")):
            rtol = BF16_RTOL
            if path.endswith((".sum", ".proj")) and path.startswith("grads["):
                atol = max(atol, BF16_RTOL * abs(flat_real.get(path.rsplit(".", 1)[0] + ".l2") or 0.0))
        if not _values_equal(a, b, atol, rtol):
            groups.setdefault(_fold(path), []).append((path, a, b))
    result.groups = groups

    # One line per path pattern: a metric across steps, a list's elements, or one statistic across parameters.
    for pattern, entries in groups.items():
        result.n_differing += len(entries)
        if len(entries) == 1:
            result.differing.append(_describe(*entries[0]))
            continue
        total = sum(1 for p in flat_real if _fold(p) == pattern)
        worst = max(entries, key=lambda e: _rel(e[1], e[2]))
        which = "largest" if math.isfinite(_rel(worst[1], worst[2])) else "first"
        if which == "first":
            worst = entries[0]
        result.differing.append(f"{pattern}: {len(entries)} of {total} differ; {which} {_describe(*worst)}")
    return result


def _noise_gradient_params(flat_real: dict) -> set[str]:
    """Parameters whose recorded gradient is float noise at every step on TRL's side (l2 below GRAD_ATOL)."""
    largest: dict[str, float] = {}
    for path, value in flat_real.items():
        if path.startswith("grads[") and path.endswith(".l2") and isinstance(value, (int, float)):
            param = _param_of(path)
            largest[param] = max(largest.get(param, 0.0), abs(value))
    return {param for param, l2 in largest.items() if l2 < GRAD_ATOL}


def _abs_tolerance(path: str, flat_real: dict, noise_gradients: set[str]) -> float:
    """The absolute tolerance of one value (see the notes at SUM_RESOLUTION)."""
    if path.startswith("grads["):
        l2 = flat_real.get(path.rsplit(".", 1)[0] + ".l2") if path.endswith((".sum", ".proj")) else None
        return max(GRAD_ATOL, RTOL * abs(l2)) if isinstance(l2, (int, float)) else GRAD_ATOL
    if path.startswith("update."):
        if _KEY_BIAS.search(_param_of(path)):
            return KEY_BIAS_UPDATE_ATOL
        return NOISE_UPDATE_ATOL if _param_of(path) in noise_gradients else ATOL
    reward = _IMPLICIT_REWARD.match(path)
    if reward:
        sums = [flat_real.get(f"{reward.group(1)}logps/{side}") for side in ("chosen", "rejected")]
        sums = [abs(v) for v in sums if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if sums:
            return max(ATOL, SUM_RESOLUTION * max(sums))
    return ATOL


def _param_of(path: str) -> str:
    """`grads[0].model.norm.weight.l2` -> `model.norm.weight`."""
    return path.split(".", 1)[1].rsplit(".", 1)[0]


def _metric_name(path: str) -> str:
    """`eval_before.eval_loss` -> `eval_loss`; `completion_ids[0][1][2]` -> `completion_ids`."""
    if path.startswith(_PARAM_SECTIONS):
        return path.split(".", 1)[0].split("[")[0]
    head = re.match(r"[^.\[]+", path).group(0)
    if head in ("eval_before", "eval_after", "train_metrics", "log_history", "eval", "train_output"):
        return re.sub(r"\[\d+\]", "", path).split(".", 1)[-1]
    return re.sub(r"\[\d+\]", "", path)


def _where(path: str) -> str:
    head = re.match(r"[^.\[]+", path).group(0)
    return {
        "eval_before": "evaluate()",
        "eval_after": "evaluate()",
        "eval": "evaluate()",
        "train_metrics": "TrainOutput.metrics",
        "log_history": "log_history",
    }.get(head, "output")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.5g}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _group_paths(paths: list[str]) -> str:
    """Paths grouped by top-level section, list indices folded: `eval_before: epoch, eval_entropy; train_metrics: ...`."""
    by_section: dict[str, list[str]] = {}
    for path in paths:
        head = re.match(r"[^.\[]+(\[\d+\])?", path).group(0)
        rest = path[len(head) :].lstrip(".")
        folded = re.sub(r"\[\d+\]", "[*]", rest)
        items = by_section.setdefault(head, [])
        if folded not in items:
            items.append(folded)
    parts = [f"{head}: {', '.join(i for i in items if i) or '(whole)'}" for head, items in by_section.items()]
    shown = parts[:_MAX_ITEMS]
    return "; ".join(shown) + (f"; ... and {len(parts) - len(shown)} more" if len(parts) > len(shown) else "")


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]
