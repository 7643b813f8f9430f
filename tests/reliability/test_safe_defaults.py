"""Safe by default: the vLLM server binds to this machine only, YAML configs are read with the safe loader, remote
code stays off, and checkpoints are loaded without unpickling arbitrary objects."""

import dataclasses
import importlib
import os
import subprocess

import pytest
import torch


pytestmark = pytest.mark.reliability


def test_vllm_serve_binds_localhost_unless_told_otherwise():
    from trl.scripts.vllm_serve import ScriptArguments

    host = {f.name: f.default for f in dataclasses.fields(ScriptArguments)}["host"]
    assert host == "127.0.0.1"


def test_yaml_config_is_read_with_the_safe_loader(tmp_path):
    from trl._config_file import load_config_file

    marker = tmp_path / "pwned"
    path = tmp_path / "config.yaml"
    path.write_text(f"learning_rate: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(Exception, match="python/object"):
        load_config_file(str(path))
    assert not marker.exists()


CONFIGS = [
    ("trl", "SFTConfig"),
    ("trl", "DPOConfig"),
    ("trl", "RewardConfig"),
    ("trl", "KTOConfig"),
    ("trl", "GRPOConfig"),
    ("trl", "RLOOConfig"),
    ("trl.experimental.bco", "BCOConfig"),
    ("trl.experimental.online_dpo", "OnlineDPOConfig"),
]


@pytest.mark.parametrize("module,name", CONFIGS, ids=[name for _, name in CONFIGS])
def test_trust_remote_code_is_off_by_default(module, name):
    config_class = getattr(importlib.import_module(module), name)
    fields = {f.name: f.default for f in dataclasses.fields(config_class)}
    assert fields["trust_remote_code"] is False


def test_checkpoint_state_is_loaded_without_unpickling(tmp_path):
    from trl.trainer.utils.checkpoints import load_trainer_state, save_trainer_state, trl_state_file

    save_trainer_state(str(tmp_path), 0, {"total_train_tokens": 12, "buffer": torch.arange(3)})
    state = load_trainer_state(str(tmp_path), 0)
    assert state["total_train_tokens"] == 12 and torch.equal(state["buffer"], torch.arange(3))

    class Payload:  # any object whose unpickling would run code
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    torch.save({"payload": Payload()}, os.path.join(tmp_path, trl_state_file(1)))
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        load_trainer_state(str(tmp_path), 1)
    assert not (tmp_path / "pwned").exists()


def test_resume_never_picks_a_partial_checkpoint(tmp_path):
    from trl.trainer.utils.checkpoints import last_complete_checkpoint

    for step, complete in ((2, True), (4, True), (6, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / ".partial-checkpoint-8" / "checkpoint-8").mkdir(parents=True)
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        last_complete_checkpoint(str(tmp_path / "checkpoint-6"))
