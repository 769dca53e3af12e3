"""Corrupt state on disk: partial, torn and missing checkpoints refused by the driver, a code-running pickle.

Every checkpoint carries COMPLETE.json (SHA-256 of each file, written last); a checkpoint whose
marker is missing or whose files do not match it is never loaded. Truncated and bit-flipped checkpoints
passed over by --resume auto: tests/test_trainer.py.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
from helpers import save_resume_state, write_marker
from runs import is_complete, pretrain, tiny_args

from minilm import checkpoint as C

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]  # on the baseline run (~35 s)


def test_resume_path_refuses_missing_partial_and_corrupt(ray_address, run_data, run_storage, baseline, tmp_path):
    good = run_storage / "baseline" / "checkpoint_00000020"
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "COMPLETE.json").unlink()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    with open(corrupt / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    cases = {tmp_path / "missing": "does not exist", partial: "incomplete: COMPLETE.json is missing",
             corrupt: "corrupt: optimizer.pt does not match its SHA-256"}
    for path, message in cases.items():
        proc = pretrain(ray_address, tiny_args(run_data, run_storage, f"p-{path.name}", "--resume", str(path)),
                        check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (run_storage / f"p-{path.name}").exists()  # refused before any work started


def test_the_driver_skips_a_checkpoint_torn_mid_upload(tmp_path, capsys, baseline, run_storage):
    """A kill during Ray's upload can leave a folder whose marker was copied before the files it names:
    --resume auto passes over it (no traceback reading its state.json) to the previous complete one."""
    from minilm.checkpoint import RunFolder

    run = tmp_path / "run"
    shutil.copytree(run_storage / "baseline" / "checkpoint_00000016", run / "checkpoint_00000016")
    torn = run / "checkpoint_00000020"
    torn.mkdir()
    shutil.copyfile(run_storage / "baseline" / "checkpoint_00000020" / "COMPLETE.json", torn / "COMPLETE.json")
    assert RunFolder(run).newest_complete() == "checkpoint_00000016"  # what the driver and the workers take
    assert "skipping checkpoint: checkpoint " in capsys.readouterr().out
    assert not is_complete(torn)


class RunsCode:
    """A pickle that runs code when unpickled (here it would only create a file)."""

    def __init__(self, flag, shell=False):
        self.flag, self.shell = str(flag), shell

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",)) if self.shell else (open, (self.flag, "w"))


def torch_save(obj, path):
    import torch

    torch.save(obj, path)


def legacy_pickle(obj, path):
    path.write_bytes(pickle.dumps(obj, protocol=2))


@pytest.mark.parametrize("shell, write", [(False, legacy_pickle), (True, torch_save)], ids=["open-raw", "system-zip"])
def test_a_checkpoint_with_a_code_running_pickle_is_refused_unrun(tmp_path, shell, write):
    """Whoever can write a checkpoint folder can also rewrite its COMPLETE.json: the hashes match, and loading
    must still never unpickle arbitrary objects (torch.load(weights_only=True), safe since torch 2.6:
    CVE-2025-32434), whether the file is a raw pickle or torch.save's zip calling os.system."""
    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_grad_scaler, make_optimizer

    model = MiniMindForCausalLM(ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2))
    ckpt = save_resume_state(tmp_path / "evil", model=model, optimizer=make_optimizer(model, TrainConfig()),
                             scaler=make_grad_scaler(torch.float32, "cpu"), state={"optimizer_step": 1})
    C.load_resume_state(ckpt)  # loads as written
    flag = tmp_path / "payload-ran"
    write({"state": RunsCode(flag, shell)}, ckpt / "optimizer.pt")
    write_marker(ckpt, C.RESUME_FILES)
    C.verify(ckpt)  # the hashes match the new files
    with pytest.raises(C.CheckpointError, match="could not be loaded: UnpicklingError"):
        C.load_resume_state(ckpt)
    assert not flag.exists()
