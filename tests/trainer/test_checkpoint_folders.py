"""Which folders the trainer resumes from and rotates (attnlab/trainer/checkpoint.py): exact ``step-N`` folders
holding a DCP checkpoint (attnlab/checkpoint/layout.py ``step_folders``), never a Hugging Face export, a user's copy
or a save still in flight. Tools see every checkpoint folder, the export included."""

import queue
from types import SimpleNamespace

from attnlab.checkpoint.layout import step_folders
from attnlab.trainer.checkpoint import CheckpointGuard


def _dcp(folder):
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"")
    (folder / ".metadata").write_bytes(b"")  # DCP writes it last


def _hf_export(folder):
    """A sharded Hugging Face export (as export_hf or ``checkpoint.last_save_in_hf`` write one)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')


def _checkpoint_folder(tmp_path):
    """step-2, step-4, step-6 (DCP), step-7 (a save in flight: shards, no .metadata), step-9 (an HF export),
    step-4.bak (a user's copy)."""
    ck = tmp_path / "checkpoint"
    for n in (2, 4, 6):
        _dcp(ck / f"step-{n}")
    (ck / "step-7").mkdir()
    (ck / "step-7" / "__0_0.distcp").write_bytes(b"")
    _hf_export(ck / "step-9")
    _dcp(ck / "step-4.bak")
    return ck


def _guard(ck, keep_latest_k):
    """A CheckpointGuard around a stand-in for torchtitan's CheckpointManager that records the purged folders."""
    checkpointer = SimpleNamespace(enable=True, load_only=False, folder=str(ck), keep_latest_k=keep_latest_k,
                                   purge_queue=queue.Queue(),
                                   _create_checkpoint_id=lambda step: str(ck / f"step-{step}"),
                                   load=None, save=None, dcp_load=None)
    return CheckpointGuard(SimpleNamespace(checkpointer=checkpointer), nonfinite=None, after_load=lambda: None)


def test_an_hf_export_in_the_checkpoint_folder_is_neither_resumed_nor_rotated(tmp_path):
    ck = _checkpoint_folder(tmp_path)
    guard = _guard(ck, keep_latest_k=2)
    assert guard.newest_step() == 6
    guard.rotate()
    q = guard.checkpointer.purge_queue
    purged = [q.get() for _ in range(q.qsize())]
    assert purged == [str(ck / "step-2")]


def test_tools_see_every_checkpoint_folder_and_the_trainer_the_dcp_ones(tmp_path):
    ck = _checkpoint_folder(tmp_path)
    assert sorted(step_folders(ck)) == [2, 4, 6, 9]
    assert step_folders(ck, dcp_only=True) == {n: ck / f"step-{n}" for n in (2, 4, 6)}
    assert step_folders(tmp_path / "absent") == {}
