"""Checkpoint atomicity without DeepSpeed: a checkpoint cut off at any byte is never picked on resume (the
previous one is), leftovers of a killed save are ignored, keep-last-K never deletes the newest."""

import os

import pytest
import torch

from hpc_rl import checkpoints
from hpc_rl.rundir import RunDir, write_json_atomic
from hpc_rl.train import checkpoint


def _fake_checkpoint(run: RunDir, step: int, finish: bool = True):
    """The files save() writes (torch shards, safetensors, trainer state), then the manifest and rename."""
    from safetensors.torch import save_file

    tmp = run.checkpoints / f".step_{step}.tmp"
    (tmp / "deepspeed" / "actor" / "state").mkdir(parents=True)
    torch.save({"w": torch.arange(64, dtype=torch.float32) * step},
               tmp / "deepspeed" / "actor" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp / "hf").mkdir()
    save_file({"w": torch.full((8, 8), float(step))}, str(tmp / "hf" / "model.safetensors"))
    (tmp / "trainer_state.json").write_text(f'{{"step": {step}}}')
    if not finish:
        return tmp
    write_json_atomic(tmp / "manifest.json", checkpoints.manifest(tmp))
    final = checkpoints.step_dir(run, step)
    os.rename(tmp, final)
    (run.checkpoints / "latest").write_text(final.name)
    return final


@pytest.fixture
def run(tmp_path):
    r = RunDir(tmp_path / "run")
    r.checkpoints.mkdir(parents=True)
    return r


def test_complete_checkpoints_verify_and_newest_wins(run):
    _fake_checkpoint(run, 1)
    _fake_checkpoint(run, 2)
    assert checkpoints.verify(checkpoints.step_dir(run, 2))
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 2)


def test_cut_at_every_byte_falls_back_to_previous(run):
    """Every file of the newest checkpoint, cut at every byte (small files) or at 64 seeded offsets (big
    ones): find_latest picks the previous checkpoint each time, and the cut one never verifies."""
    import random

    _fake_checkpoint(run, 1)
    newest = _fake_checkpoint(run, 2)
    rng = random.Random(7)
    files = sorted(p for p in newest.rglob("*") if p.is_file())
    assert len(files) == 4
    cuts = 0
    for f in files:
        data = f.read_bytes()
        offsets = range(len(data)) if len(data) <= 400 else sorted(rng.sample(range(len(data)), 64) + [0])
        for n in offsets:
            f.write_bytes(data[:n])
            assert not checkpoints.verify(newest), (f, n)
            assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 1), (f, n)
            cuts += 1
        f.write_bytes(data)
        assert checkpoints.find_latest(run) == newest
    assert cuts > 200


def test_missing_file_or_manifest_falls_back(run):
    _fake_checkpoint(run, 1)
    newest = _fake_checkpoint(run, 2)
    (newest / "hf" / "model.safetensors").unlink()
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 1)
    (newest / "manifest.json").unlink()
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 1)


def test_killed_save_leaves_tmp_that_is_never_picked(run):
    _fake_checkpoint(run, 1)
    _fake_checkpoint(run, 2, finish=False)  # killed before the manifest and the rename
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 1)
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_1"]


def test_kill_between_rename_and_pointer_keeps_the_renamed_step(run):
    """The rename is the commit point: a complete step_2 that `latest` does not name yet is used."""
    _fake_checkpoint(run, 1)
    _fake_checkpoint(run, 2)
    (run.checkpoints / "latest").write_text("step_1")
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, 2)


def test_no_checkpoint_at_all(run):
    assert checkpoints.find_latest(run) is None
    _fake_checkpoint(run, 1)
    (checkpoints.step_dir(run, 1) / "trainer_state.json").write_text("")
    assert checkpoints.find_latest(run) is None


def test_prune_never_deletes_latest(run):
    for s in (1, 2, 3, 4):
        _fake_checkpoint(run, s)
    (run.checkpoints / "latest").write_text("step_1")
    checkpoints.prune(run, 2, checkpoints.step_dir(run, 1))
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_1", "step_3", "step_4"]


class _ShardWriter:
    """Writes what DeepSpeed's save_checkpoint leaves on disk (a shard file under DIR/TAG), nothing else."""

    module = torch.nn.Linear(1, 1)  # all trained: no frozen parameters to leave out

    def save_checkpoint(self, save_dir, tag, save_latest, exclude_frozen_parameters=False):
        d = os.path.join(save_dir, tag)
        os.makedirs(d)
        torch.save({"w": torch.arange(64, dtype=torch.float32)}, os.path.join(d, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def test_save_flushes_every_file_and_directory_before_the_rename(run, monkeypatch):
    """A node crash after the rename must not leave a right-sized but unflushed shard that passes verify():
    every file and directory of the checkpoint is fsynced before the rename, the parent directory after it."""
    from transformers import PretrainedConfig

    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a, b):
        events.append(("rename", str(a), str(b)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    final = checkpoint.save(run, 3, {"actor": _ShardWriter()}, {"step": 3}, {"w": torch.ones(4, 4)},
                            PretrainedConfig(), None, keep_last=2, rank=0)
    assert checkpoints.verify(final)
    (i,) = [k for k, e in enumerate(events) if e[0] == "rename" and e[2] == str(final)]
    tmp = events[i][1]
    synced = {e[1] for e in events[:i] if e[0] == "fsync"}
    written = [p for p in final.rglob("*")]
    assert len([p for p in written if p.is_file()]) >= 4  # shard, safetensors, config, state, manifest
    for p in written + [final]:
        assert tmp + str(p)[len(str(final)):] in synced, f"{p} was not flushed before the rename"
    assert str(run.checkpoints) in {e[1] for e in events[i + 1:] if e[0] == "fsync"}, "rename not made durable"
