"""CPU support for torchtitan 0.2.2, which assumes "cuda" when no accelerator is visible, and the environment of
a run started without torchrun (:func:`single_process_env`).

:func:`install_cpu_shim` points torchtitan's ``device_type``/``device_module`` at the CPU (in every
torchtitan module that copied them at import) so the trainer, its memory monitor and gloo process groups
work on a machine without a GPU. It is a no-op when an accelerator is present."""

from __future__ import annotations

import os
import resource
import socket
import sys
from types import SimpleNamespace

import torch


class _CpuDeviceModule:
    """The subset of ``torch.cuda``'s API torchtitan calls, answered for the host."""

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set, bytes
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def __getattr__(self, name):
        return getattr(torch.cpu, name)


def has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())


def install_cpu_shim() -> None:
    if has_accelerator():
        return
    import torchtitan.tools.utils  # noqa: F401  (make sure the source of the names is loaded)

    module = _CpuDeviceModule()
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and mod is not None:
            if getattr(mod, "device_type", None) == "cuda":
                mod.device_type = "cpu"
            if getattr(mod, "device_module", None) is torch.cuda:
                mod.device_module = module


def single_process_env() -> None:
    """``python -m attnlab.train`` without torchrun: the environment of a world of one process (a free local port)."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
