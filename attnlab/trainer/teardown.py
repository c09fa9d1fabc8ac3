"""The end of a distributed run: every process group destroyed, and its worker threads joined, while the interpreter
is still alive (:func:`destroy_process_groups`)."""

from __future__ import annotations

import gc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def destroy_process_groups() -> None:
    """Destroy every process group now, at the end of the process, after its last collective.

    ``dist.destroy_process_group`` drops only torch's own references to the groups. A device mesh holds its groups
    too (``_pg_registry``, where torch's version has one), and DTensor's caches (sharding propagation, redistribute
    plans, mesh topologies) keep every mesh a DTensor op has seen. Those groups would be destroyed during the
    interpreter's finalisation, where a gloo worker thread still holding its last collective's tensors needs the
    GIL to free them and cannot take it: the process aborts ("terminate called without an active exception") after
    training has finished. With the meshes' references dropped first, the groups go inside
    ``destroy_process_group``, whose destructors join their worker threads."""
    gc.collect()  # reference cycles (the trainer's) that still hold meshes
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()
    if dist.is_initialized():
        dist.destroy_process_group()
