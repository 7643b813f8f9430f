"""Package-level behaviour: lazy imports, public names, the experimental warning, package data, import layering."""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trl


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


def test_import_trl_does_not_import_torch_or_transformers():
    result = _run("import sys, trl; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False False"


def test_import_is_fast():
    code = "import time; t = time.perf_counter(); import trl; print(time.perf_counter() - t)"
    # best of three: the machine may be busy with other work
    best = min(float(_run(code).stdout) for _ in range(3))
    assert best < 0.3


@pytest.mark.parametrize(
    "module_name",
    ["trl", "trl.trainer", "trl.models", "trl.scripts"],
)
def test_every_lazy_name_resolves(module_name):
    module = importlib.import_module(module_name)
    for name in module._class_to_module:
        assert getattr(module, name) is not None, f"{module_name}.{name}"
    assert set(module._class_to_module) <= set(dir(module))


def test_top_level_names_come_from_their_contract_modules():
    assert trl.SFTTrainer.__module__ == "trl.trainer.sft_trainer"
    assert trl.SFTConfig.__module__ == "trl.trainer.sft_config"
    assert trl.pack_dataset.__module__ == "trl.data_utils"
    assert trl.clone_chat_template.__module__ == "trl.chat_template_utils"
    assert trl.TrlParser.__module__ == "trl.scripts.utils"
    assert trl.BEMACallback.__module__ == "trl.trainer.callbacks"
    assert trl.ModelConfig.__module__ == "trl.trainer.model_config"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError):
        trl.DoesNotExist  # noqa: B018


def test_version():
    assert trl.__version__ == importlib.metadata.version("trl")


def test_experimental_warning_and_silencing():
    code = "import warnings; warnings.simplefilter('always'); import trl.experimental"
    env = {k: v for k, v in os.environ.items() if k != "TRL_EXPERIMENTAL_SILENCE"}
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "TRLExperimentalWarning" in loud.stderr
    quiet = _run(code, TRL_EXPERIMENTAL_SILENCE="1")
    assert "TRLExperimentalWarning" not in quiet.stderr


def test_package_data_is_present():
    root = os.path.dirname(trl.__file__)
    for relative in (
        "py.typed",
        "templates/lm_model_card.md",
        "templates/rm_model_card.md",
        "chat_templates/tiny_qwen2_5.jinja",
        "chat_templates/qwen2_5_training.jinja",
        "chat_templates/tiny_llama3.jinja",
        "chat_templates/llama3_training.jinja",
        "accelerate_configs/zero3.yaml",
    ):
        assert os.path.isfile(os.path.join(root, relative)), relative


# Import layering: each package may not import the packages named against it (a layer above it). Sub-packages count
# as their package; imports inside functions and under `TYPE_CHECKING` count too.
FORBIDDEN_IMPORTS = {
    "trl.trainer": ("trl.scripts", "trl.cli", "trl.experimental"),
    "trl.experimental": ("trl.scripts", "trl.cli"),
    "trl.models": ("trl.scripts", "trl.cli"),
    "trl.generation": ("trl.scripts", "trl.cli"),
    "trl.scripts": ("trl.cli",),
}
# Low modules shared by the layers above import none of them.
_LAYERS = ("trl.models", "trl.generation", "trl.trainer", "trl.experimental", "trl.scripts", "trl.cli")
FORBIDDEN_IMPORTS.update({low: _LAYERS for low in ("trl._compat", "trl._config_file", "trl._data", "trl.data_utils")})
# Deliberate compatibility re-exports (marked as such in their source): module -> the package it may import.
COMPATIBILITY_REEXPORTS = {"trl.trainer.judges": "trl.experimental"}


def _imports(path: Path, module: str) -> list[tuple[int, list[str]]]:
    """`(line, names)` for every import statement of a file, relative imports resolved. `import a, b` gives `[a, b]`;
    `from a import b` gives `[a, a.b]` (`b` may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.append((node.lineno, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            found.append((node.lineno, [source] + [f"{source}.{alias.name}" for alias in node.names]))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_upward_imports():
    root = Path(trl.__file__).parent
    offences = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        forbidden = [
            above for layer, aboves in FORBIDDEN_IMPORTS.items() if _within(module, layer) for above in aboves
        ]
        forbidden = [above for above in forbidden if COMPATIBILITY_REEXPORTS.get(module) != above]
        for line, names in _imports(path, module):
            hits = [name for name in names for above in forbidden if _within(name, above)]
            if hits:
                offences.append(f"{path.relative_to(root.parent)}:{line} imports {hits[0]}")
    assert not offences, "imports that run up the layers:\n" + "\n".join(offences)


def test_compatibility_reexports_are_marked():
    root = Path(trl.__file__).parent.parent
    for module in COMPATIBILITY_REEXPORTS:
        source = (root / Path(*module.split("."))).with_suffix(".py").read_text()
        assert "Compatibility re-export" in source, module


def test_stable_bases_never_name_experimental_trainers():
    """Stable modules (`trl/trainer/`) hold no experimental trainer's code: no identifier of an experimental trainer
    class and no branch on one of their names (mentions in docstrings and comments are fine)."""
    import ast

    import trl.experimental as experimental

    root = Path(trl.__file__).parent
    experimental_classes = set()
    for path in (root / "experimental").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Trainer", "Config")):
                experimental_classes.add(node.name)
    stable_names = {name for name in dir(trl) if name.endswith(("Trainer", "Config"))}
    experimental_only = experimental_classes - stable_names - {"GRPOTrainer"}  # gspo_token re-uses the stable name
    assert experimental
    offences = []
    for path in sorted((root / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in experimental_only:
                offences.append(f"{path.relative_to(root.parent)}:{node.lineno} names {name}")
    assert not offences, "\n".join(offences)
