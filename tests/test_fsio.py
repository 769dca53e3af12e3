"""The file-system layer (minilm/fsio.py): what minilm writes is created new, never through a link, and staged where
only the user can write (issue 44 class 4); a folder whose model_config does not fit its weights is one line in every
command that loads a model (class 6)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from minilm import checkpoint as C
from minilm import fsio, sample
from minilm.config import ModelConfig
from minilm.model import MiniMindForCausalLM
from ray_jobs import export

CFG = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)


def write_checkpoint(path: Path, model_config: dict | None = None) -> Path:
    """A complete resume checkpoint of a tiny model; `model_config` is what its state.json says (hashed as written)."""
    model = MiniMindForCausalLM(CFG)
    state = {"optimizer_step": 1, "model_config": model_config or CFG.to_dict()}
    return C.write_resume_state(path, C.ResumeState(C.model_tensors(model.state_dict()), {}, {}, state))


def test_a_file_minilm_writes_is_created_new_never_truncated_nor_written_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "state.json").write_text("planted")
    (staged / "model.safetensors").symlink_to(victim)
    for name in ("state.json", "model.safetensors"):
        with pytest.raises(FileExistsError):
            C.write_bytes(staged / name, b"new")
    assert victim.read_text() == "precious" and (staged / "state.json").read_text() == "planted"
    fsio.write_atomic(staged / "state.json", "replaced")  # an atomic write replaces the name, not what it points to
    fsio.write_atomic(staged / "model.safetensors", "replaced")
    assert victim.read_text() == "precious" and not (staged / "model.safetensors").is_symlink()


def test_a_checkpoint_folder_planted_as_a_link_is_refused_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    link = fsio.staging_dir(tmp_path, "00000008")
    link.symlink_to(victim)
    with pytest.raises(C.CheckpointError, match="File exists"):
        write_checkpoint(link)
    assert list(victim.iterdir()) == []


def test_ray_workers_stage_in_a_private_folder_and_never_at_the_old_predictable_path(tmp_path, monkeypatch):
    """The system temp folder is shared: a link planted at the staging name workers used in it (and at the name of
    the private folder) is not followed; the checkpoint is staged in a 0700 folder of this user's."""
    import ray.train

    from ray_jobs import worker

    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir(mode=0o1777)
    victim.mkdir()
    fsio.staging_dir(shared, "00000008").symlink_to(victim)  # the old predictable path
    (shared / f"minilm-staging-{os.getuid()}").symlink_to(victim)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: SimpleNamespace(
        experiment_fs_path=str(tmp_path / "run"), storage_filesystem=None)))
    storage = worker.RayStorage("run", "run")
    st = os.lstat(storage.staging)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert storage.staging.parent == shared and storage.staging.resolve() != victim
    write_checkpoint(fsio.staging_dir(storage.staging, "00000008"))  # where the manager stages step 8
    assert list(victim.iterdir()) == [] and (fsio.staging_dir(storage.staging, "00000008") / C.MARKER).is_file()


def test_export_staging_beside_the_output_is_created_exclusively(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "shared" / "out"
    out.parent.mkdir()
    fsio.staging_dir(out.parent, out.name).symlink_to(victim)
    with pytest.raises(C.CheckpointError, match="File exists"):
        C.export_weights(out, MiniMindForCausalLM(CFG), CFG)
    assert list(victim.iterdir()) == [] and not out.exists()


def test_a_model_config_that_does_not_fit_the_weights_is_one_line_in_every_command(tmp_path, capsys):
    """Checked against the weights' shapes before the model is allocated (a config far larger than its weights is
    refused at once); export, sample and open_weights say the same line."""
    wider = write_checkpoint(tmp_path / "wider", {**CFG.to_dict(), "hidden_size": 64})
    huge = write_checkpoint(tmp_path / "huge", {**CFG.to_dict(), "hidden_size": 4096, "num_hidden_layers": 4096})
    for ckpt in (wider, huge):
        with pytest.raises(C.CheckpointError, match="its weights do not match its model_config") as e:
            C.open_weights(ckpt)
        assert "\n" not in str(e.value)
        assert export.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "do not match its model_config" in err
        assert sample.main(["--checkpoint", str(ckpt), "--tokenizer", str(tmp_path / "none.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "do not match its model_config" in err
    bad = write_checkpoint(tmp_path / "bad", {**CFG.to_dict(), "num_attention_heads": "four"})
    with pytest.raises(C.CheckpointError, match="could not be loaded: ConfigError"):
        C.open_weights(bad)
    listed = write_checkpoint(tmp_path / "listed", [1, 2])
    with pytest.raises(C.CheckpointError, match="its model_config is a list"):
        C.open_weights(listed)
    assert json.loads((listed / "state.json").read_text())["model_config"] == [1, 2]
