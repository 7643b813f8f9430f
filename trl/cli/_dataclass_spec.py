"""Read the fields of the script dataclasses from their source code, without importing them.

`SFTConfig` and friends subclass `transformers.TrainingArguments`; importing them pulls in torch and takes several
seconds. The `trl` command only needs the option *names* (to tell script options from `accelerate launch` options)
and their help texts (for `--help`), so it reads them from the syntax trees of the defining modules and builds a
plain `argparse` parser that mirrors what `HfArgumentParser` would build. Anything this reader cannot follow raises
`DataclassSpecError`, and the caller falls back to importing the real classes.
"""

import argparse
import ast
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any


class DataclassSpecError(Exception):
    """The source code could not be followed statically."""


_MISSING = object()

# Names re-exported lazily by big packages, mapped to the module defining them (avoids parsing their `__init__`).
_KNOWN_LOCATIONS = {
    ("transformers", "TrainingArguments"): "transformers.training_args",
    ("transformers", "Seq2SeqTrainingArguments"): "transformers.training_args_seq2seq",
}


@dataclass
class FieldSpec:
    """What `HfArgumentParser` needs to know about one dataclass field."""

    name: str
    annotation: ast.expr | None
    default: Any = _MISSING
    default_factory: Any = _MISSING
    metadata: dict[str, Any] = field(default_factory=dict)
    init: bool = True
    module: str = ""


@dataclass
class _ModuleInfo:
    name: str
    is_package: bool
    classes: dict[str, ast.ClassDef]
    imports: dict[str, tuple[str, str | None]]
    constants: dict[str, Any]
    lazy_structure: dict[str, str]
    functions: dict[str, ast.FunctionDef]


_module_cache: dict[str, _ModuleInfo] = {}


def module_file(module_name: str) -> str:
    """Path of the source file of `module_name`, found without importing it (nor its parent packages)."""
    parts = module_name.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None or spec.origin is None:
        raise DataclassSpecError(f"cannot locate {parts[0]}")
    if len(parts) == 1:
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise DataclassSpecError(f"{parts[0]} is not a package")
    base = os.path.join(locations[0], *parts[1:])
    if os.path.isfile(base + ".py"):
        return base + ".py"
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py")
    raise DataclassSpecError(f"cannot locate {module_name}")


class _Unevaluable(Exception):
    pass


def _evaluate(node: ast.AST, scope: dict[str, Any]) -> Any:
    """Evaluate a literal-like expression (constants, containers, arithmetic, names bound to literals)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        values = [_evaluate(element, scope) for element in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](values)
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise _Unevaluable
        return {_evaluate(k, scope): _evaluate(v, scope) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, scope)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _evaluate(node.left, scope), _evaluate(node.right, scope)
        try:
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            return left * right
        except TypeError as e:
            raise _Unevaluable from e
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    raise _Unevaluable


def _absolute_module(current: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    package = current if is_package else current.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def _collect(body: list[ast.stmt], info: _ModuleInfo) -> None:
    for node in body:
        if isinstance(node, ast.ClassDef):
            info.classes[node.name] = node
        elif isinstance(node, ast.FunctionDef):
            info.functions[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            target = _absolute_module(info.name, info.is_package, node.module, node.level)
            for alias in node.names:
                info.imports[alias.asname or alias.name] = (target, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    info.imports[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.split(".")[0]
                    info.imports[top] = (top, None)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            try:
                info.constants[name] = _evaluate(node.value, info.constants)
            except _Unevaluable:
                info.constants.pop(name, None)
            if name == "_import_structure" and isinstance(info.constants.get(name), dict):
                for submodule, names in info.constants[name].items():
                    for exported in names:
                        info.lazy_structure[exported] = submodule
        elif isinstance(node, ast.If):
            # Keep both branches of `if TYPE_CHECKING:` / version switches: definitions are what matter here.
            _collect(node.body, info)
            _collect(node.orelse, info)
        elif isinstance(node, ast.Try):
            _collect(node.body, info)


def _module_info(module_name: str) -> _ModuleInfo:
    if module_name in _module_cache:
        return _module_cache[module_name]
    path = module_file(module_name)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError) as e:
        raise DataclassSpecError(f"cannot parse {path}: {e}") from e
    info = _ModuleInfo(module_name, os.path.basename(path) == "__init__.py", {}, {}, {}, {}, {})
    _collect(tree.body, info)
    _module_cache[module_name] = info
    return info


def resolve_class(module_name: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef]:
    """Find the class definition that `name` refers to inside `module_name`, following imports."""
    if _depth > 20:
        raise DataclassSpecError(f"import cycle while resolving {module_name}.{name}")
    if (module_name, name) in _KNOWN_LOCATIONS:
        return resolve_class(_KNOWN_LOCATIONS[(module_name, name)], name, _depth + 1)
    info = _module_info(module_name)
    if name in info.classes:
        return module_name, info.classes[name]
    if name in info.imports:
        target, attribute = info.imports[name]
        if attribute is None:
            raise DataclassSpecError(f"{name} is a module, not a class")
        return resolve_class(target, attribute, _depth + 1)
    if name in info.lazy_structure:
        return resolve_class(f"{module_name}.{info.lazy_structure[name]}", name, _depth + 1)
    raise DataclassSpecError(f"cannot find {name} in {module_name}")


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise DataclassSpecError(f"unsupported expression {ast.unparse(node)}")


def _resolve_expression(module_name: str, node: ast.expr) -> tuple[str, ast.ClassDef]:
    dotted = _dotted_name(node)
    if "." not in dotted:
        return resolve_class(module_name, dotted)
    head, _, attribute = dotted.rpartition(".")
    info = _module_info(module_name)
    first = head.split(".")[0]
    if first in info.imports and info.imports[first][1] is None:
        target = info.imports[first][0] + head[len(first) :]
        return resolve_class(target, attribute)
    raise DataclassSpecError(f"cannot resolve {dotted} in {module_name}")


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    try:
        return _dotted_name(target).split(".")[-1] == "dataclass"
    except DataclassSpecError:
        return False


def _annotation_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    try:
        return _dotted_name(node).split(".")[-1]
    except DataclassSpecError:
        return ""


def class_fields(module_name: str, class_def: ast.ClassDef, _depth: int = 0) -> dict[str, FieldSpec]:
    """Dataclass fields of a class (inherited ones first, as `dataclasses.fields` orders them)."""
    if _depth > 20:
        raise DataclassSpecError("class hierarchy too deep")
    fields: dict[str, FieldSpec] = {}
    for base in reversed(class_def.bases):
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        if isinstance(base, ast.Subscript) and _annotation_name(base) == "Generic":
            continue
        base_module, base_def = _resolve_expression(module_name, base)
        fields.update(class_fields(base_module, base_def, _depth + 1))
    if not any(_is_dataclass_decorator(d) for d in class_def.decorator_list):
        return fields

    info = _module_info(module_name)
    scope = dict(info.constants)
    for node in class_def.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                scope[node.targets[0].id] = _evaluate(node.value, scope)
            except _Unevaluable:
                scope.pop(node.targets[0].id, None)
            continue
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        annotation = _parse_annotation(node.annotation)
        if _annotation_name(annotation) in ("ClassVar", "InitVar"):
            continue
        spec = FieldSpec(name=node.target.id, annotation=annotation, module=module_name)
        value = node.value
        if isinstance(value, ast.Call) and _annotation_name(value.func) in ("field", "HfArg"):
            _read_field_call(spec, value, scope)
        elif value is not None:
            spec.default = _evaluate_or_text(value, scope)
        fields[spec.name] = spec
    return fields


def _parse_annotation(node: ast.expr) -> ast.expr:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.parse(node.value, mode="eval").body
        except SyntaxError as e:
            raise DataclassSpecError(f"bad annotation {node.value!r}") from e
    return node


class _SourceText(str):
    """A default that could not be evaluated statically; shown as its source code."""


def _evaluate_or_text(node: ast.expr, scope: dict[str, Any]) -> Any:
    try:
        return _evaluate(node, scope)
    except _Unevaluable:
        return _SourceText(ast.unparse(node))


def _read_field_call(spec: FieldSpec, call: ast.Call, scope: dict[str, Any]) -> None:
    is_hf_arg = _annotation_name(call.func) == "HfArg"
    for keyword in call.keywords:
        if keyword.arg == "default":
            spec.default = _evaluate_or_text(keyword.value, scope)
        elif keyword.arg == "default_factory":
            spec.default_factory = _evaluate_factory(keyword.value, scope)
        elif keyword.arg == "init":
            spec.init = bool(_evaluate_or_text(keyword.value, scope))
        elif keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
            for key, value in zip(keyword.value.keys, keyword.value.values):
                if not isinstance(key, ast.Constant):
                    continue
                try:
                    spec.metadata[key.value] = _evaluate(value, scope)
                except _Unevaluable:
                    # Unknown choices must not restrict anything; other entries only feed the help text.
                    if key.value == "help":
                        spec.metadata["help"] = None
        elif is_hf_arg and keyword.arg in ("help", "aliases"):
            spec.metadata[keyword.arg] = _evaluate_or_text(keyword.value, scope)


def _evaluate_factory(node: ast.expr, scope: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name) and node.id in ("list", "dict", "set", "tuple"):
        return {"list": list, "dict": dict, "set": set, "tuple": tuple}[node.id]()
    if isinstance(node, ast.Lambda):
        return _evaluate_or_text(node.body, scope)
    return _SourceText(ast.unparse(node) + "()")


# --- types, following the rules of `HfArgumentParser._parse_dataclass_field` -----------------------------------------


def _normalise(node: ast.expr) -> tuple:
    node = _parse_annotation(node)
    if isinstance(node, ast.Constant) and node.value is None:
        return ("none",)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        members = []
        for side in (node.left, node.right):
            normalised = _normalise(side)
            members.extend(normalised[1] if normalised[0] == "union" else [normalised])
        return ("union", members)
    if isinstance(node, ast.Subscript):
        base = _annotation_name(node.value)
        inner = node.slice
        elements = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if base == "Optional":
            return ("union", [_normalise(elements[0]), ("none",)])
        if base == "Union":
            members = []
            for element in elements:
                normalised = _normalise(element)
                members.extend(normalised[1] if normalised[0] == "union" else [normalised])
            return ("union", members)
        if base in ("list", "List"):
            return ("list",)
        if base == "Literal":
            try:
                return ("literal", [_evaluate(element, {}) for element in elements])
            except _Unevaluable:
                return ("name", "str")
        return ("name", base)
    try:
        return ("name", _dotted_name(node).split(".")[-1])
    except DataclassSpecError:
        return ("name", "?")


_BUILTIN_TYPES = {"str", "int", "float", "bool", "dict", "list", "tuple", "set", "Any", "?"}


def _enum_values(module_name: str, type_name: str) -> list[Any] | None:
    """Member values of an `Enum` subclass named `type_name` (as seen from `module_name`), else `None`."""
    if not module_name or type_name in _BUILTIN_TYPES:
        return None
    try:
        _, class_def = resolve_class(module_name, type_name)
    except DataclassSpecError:
        return None
    if not any(_annotation_name(base).endswith("Enum") for base in class_def.bases):
        return None
    values = []
    for node in class_def.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and not node.targets[0].id.startswith("_")
            and isinstance(node.value, ast.Constant)
        ):
            values.append(node.value.value)
    return values or None


def argparse_kwargs(spec: FieldSpec) -> list[tuple[list[str], dict[str, Any]]]:
    """The `add_argument` calls (option strings, keyword arguments) `HfArgumentParser` would make for a field."""
    long_options = [f"--{spec.name}"]
    if "_" in spec.name:
        long_options.append(f"--{spec.name.replace('_', '-')}")
    metadata = dict(spec.metadata)
    aliases = metadata.pop("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    kwargs: dict[str, Any] = {"dest": spec.name}
    help_text = metadata.get("help")
    if isinstance(help_text, str):
        # argparse %-formats help strings: keep `%%` and `%(name)s`, escape stray percent signs so `--help` works.
        kwargs["help"] = re.sub(r"%%|%\(|%", lambda m: "%%" if m.group(0) == "%" else m.group(0), help_text)
    choices = metadata.get("choices")
    # Like `HfArgumentParser`, other metadata entries are `add_argument` keywords (e.g. `nargs="?"`, `const=True`).
    passthrough = {key: metadata[key] for key in ("nargs", "const", "metavar") if key in metadata}

    kind = _normalise(spec.annotation) if spec.annotation is not None else ("name", "str")
    is_bool_or_none = False
    if kind[0] == "union":
        members = kind[1]
        has_none = ("none",) in members
        has_str = ("name", "str") in members
        if not has_str and not (len(members) == 2 and has_none):
            kind = ("name", "?")
        elif not has_none:
            kind = members[0] if members[1] == ("name", "str") else members[1]
        elif ("name", "bool") not in members:
            kind = members[0] if members[1] == ("none",) else members[1]
        else:
            is_bool_or_none = len(members) == 2
            kind = ("name", "bool")
    if kind[0] == "union":
        kind = ("name", "?")

    enum_values = _enum_values(spec.module, kind[1]) if kind[0] == "name" else None
    if enum_values is not None:
        kind = ("literal", enum_values)

    bool_extra = None
    if kind[0] == "literal":
        choices = kind[1]
        if spec.default is not _MISSING:
            kwargs["default"] = spec.default
        else:
            kwargs["required"] = True
    elif kind == ("name", "bool"):
        bool_extra = {k: v for k, v in kwargs.items() if k != "dest"}
        if not is_bool_or_none or (spec.default is not None and spec.default is not _MISSING):
            kwargs["default"] = False if spec.default is _MISSING else spec.default
            kwargs["nargs"] = "?"
            kwargs["const"] = True
    elif kind[0] == "list":
        kwargs["nargs"] = "+"
        if spec.default_factory is not _MISSING:
            kwargs["default"] = spec.default_factory
        elif spec.default is _MISSING:
            kwargs["required"] = True
    else:
        if spec.default is not _MISSING:
            kwargs["default"] = spec.default
        elif spec.default_factory is not _MISSING:
            kwargs["default"] = spec.default_factory
        else:
            kwargs["required"] = True
    if isinstance(choices, (list, tuple, set)):
        kwargs["choices"] = [str(choice) for choice in choices]
    kwargs.update(passthrough)
    calls = [(long_options + list(aliases), kwargs)]
    if bool_extra is not None and spec.default is True:
        bool_extra["default"] = False
        no_options = [f"--no_{spec.name}", f"--no-{spec.name.replace('_', '-')}"]
        calls.append((no_options, {**bool_extra, "action": "store_false", "dest": spec.name}))
    return calls


def dataclass_fields(module_name: str, class_name: str) -> list[FieldSpec]:
    """The init fields of a dataclass, read from source code."""
    owner, class_def = resolve_class(module_name, class_name)
    return [spec for spec in class_fields(owner, class_def).values() if spec.init]


def add_dataclass_arguments(parser: argparse.ArgumentParser, module_name: str, class_name: str) -> None:
    """Add to `parser` the options `TrlParser` would add for a dataclass (values stay strings).

    A field whose name an earlier dataclass already registered is skipped: `TrlParser` shares one option between
    the dataclasses that have the field.
    """
    registered = {action.dest for action in parser._actions}
    for spec in dataclass_fields(module_name, class_name):
        if spec.name in registered:
            continue
        for option_strings, kwargs in argparse_kwargs(spec):
            try:
                parser.add_argument(*option_strings, **kwargs)
            except argparse.ArgumentError as e:
                raise DataclassSpecError(f"conflicting option for field {spec.name}: {e}") from e


def script_dataclasses(module_name: str) -> list[tuple[str, str]]:
    """The dataclasses a script's `make_parser` hands to `TrlParser`, as `(defining module, class name)` pairs.

    Looks for `dataclass_types = (A, B, ...)` or `TrlParser((A, B, ...), ...)` inside `make_parser`.
    """
    info = _module_info(module_name)
    function = info.functions.get("make_parser")
    if function is None:
        raise DataclassSpecError(f"{module_name} has no make_parser")
    sequence = None
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "dataclass_types" for t in node.targets
        ):
            sequence = node.value
        elif (
            sequence is None
            and isinstance(node, ast.Call)
            and _annotation_name(node.func) == "TrlParser"
            and node.args
            and isinstance(node.args[0], (ast.Tuple, ast.List, ast.Name, ast.Attribute))
        ):
            sequence = node.args[0]
    if isinstance(sequence, (ast.Name, ast.Attribute)):
        # A single dataclass (resolving fails, and the caller falls back, if the name is a variable instead).
        elements = [sequence]
    elif isinstance(sequence, (ast.Tuple, ast.List)):
        elements = sequence.elts
    else:
        raise DataclassSpecError(f"cannot find the dataclass types of {module_name}.make_parser")
    result = []
    for element in elements:
        owner, class_def = _resolve_expression(module_name, element)
        result.append((owner, class_def.name))
    return result
