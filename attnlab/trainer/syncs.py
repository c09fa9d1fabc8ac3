"""Host syncs per training step, counted: with ``ATTNLAB_COUNT_SYNCS=1`` the trainer records every call that makes
the host wait (for the GPU, or for the other ranks), with the file and line it came from, step by step, into
``<dump_folder>/syncs/rank<R>.jsonl`` (:class:`StepSyncs`, one record per step) and logs rank 0's per step.

A sync stalls the host until the GPU finished all the work queued before it, so the GPU then idles while the host
prepares the next kernels; a training step that never syncs lets the host run ahead of the GPU.

On CUDA the count is torch's: ``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronising CUDA call (a
device-to-host read such as ``.item()``, a blocking copy either way, ``nonzero``, a stream synchronize), each
recorded at the innermost frame outside torch. On a CPU nothing waits, so :class:`CpuSyncs` counts the Python-level
calls that would wait on CUDA, by the rules of its docstring. Both also count the collectives that make the host
wait for the other ranks (:data:`HOST_COLLECTIVES`)."""

from __future__ import annotations

import collections
import functools
import json
import os
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from torchtitan.tools.logging import logger

ENV = "ATTNLAB_COUNT_SYNCS"
"""Set to 1: the trainer counts its host syncs per step (:class:`StepSyncs`)."""

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu", "equal",
         "allclose", "is_nonzero"}
"""Calls that hand a device tensor's values to the host."""

DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
"""Calls whose output size depends on the values: the host reads it before allocating the output."""

FROM_DATA = {"tensor", "as_tensor", "asarray", "new_tensor"}
"""Factories that copy Python data: to a device, a blocking copy."""

HOST_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                    "reduce", "gather", "scatter", "all_to_all_single", "barrier", "monitored_barrier",
                    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""``torch.distributed`` calls that block the host until every rank arrived: a barrier and the ``*_object`` calls
always; a tensor collective when synchronous (``async_op=False``) on host tensors (gloo). A collective of device
tensors is queued on the GPU's stream (NCCL) and does not stop the host."""


@dataclass(frozen=True)
class Sync:
    """One host sync: ``what`` waited (``Tensor.item``, ``list index``, ``all_reduce (host)``, ``cuda sync``, ...),
    ``where`` the innermost frame outside torch (``attnlab/attention/cp.py:114``)."""

    what: str
    where: str


_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE, _WARNINGS = os.path.abspath(__file__), os.path.abspath(warnings.__file__)


def _where() -> str:
    """``path:line`` of the innermost frame of the caller outside torch and this file (``path`` relative to the
    folder holding its package: ``attnlab/...``, ``torchtitan/...``)."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if f.startswith(_TORCH) or f in (_HERE, _WARNINGS):
            continue
        parts = f.split(os.sep)
        for package in ("attnlab", "torchtitan", "tests", "benchmarks"):
            if package in parts:
                f = os.sep.join(parts[len(parts) - 1 - parts[::-1].index(package):])
                break
        return f"{f}:{frame.lineno}"
    return "?"


class _Counter:
    """What both counters share: the syncs seen since the last :meth:`take`, and the host collectives."""

    def __init__(self):
        self.seen: list[Sync] = []
        self._dist: dict[str, object] = {}

    def note(self, what: str) -> None:
        self.seen.append(Sync(what, _where()))

    def take(self) -> list[Sync]:
        """The syncs since the last call."""
        out, self.seen = self.seen, []
        return out

    def is_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def _patch_dist(self) -> None:
        for name in HOST_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._dist[name] = fn
                setattr(dist, name, self._counted(name, fn))

    def _restore_dist(self) -> None:
        for name, fn in self._dist.items():
            setattr(dist, name, fn)
        self._dist = {}

    def _counted(self, name: str, fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if "barrier" in name or name.endswith("_object") or name.endswith("_object_list"):
                self.note(name)
            elif not kwargs.get("async_op") and tensors and all(self.is_host(t) for t in tensors):
                self.note(f"{name} (host)")
            return fn(*args, **kwargs)

        return collective


class CpuSyncs(_Counter, TorchFunctionMode):
    """The calls that would make the host wait on CUDA, counted on a CPU run while entered (a ``TorchFunctionMode``:
    every torch call of this thread passes through it, the backward's included).

    Which tensors would live on the GPU: the host tensors are those :meth:`mark_host` was given (a batch from the
    data loader), those made by a factory without a ``device`` argument (or with ``device="cpu"``), by ``.cpu()``,
    ``.to("cpu")`` or ``pin_memory()``, and whatever is computed from host tensors only; every other tensor (the
    model's, the optimizer's, the gradients, anything made with ``device=``) is a device tensor. ``.to(device)`` of
    a host tensor returns a copy here, as on a GPU, so the host tensor stays one.

    Counted, on device tensors: the reads of :data:`READS` (``.item()``, ``.tolist()``, ``bool()``, ``int()``,
    ``float()``, ``.cpu()``, ``.to("cpu")``, ...); the calls of :data:`DATA_DEPENDENT`, ``torch.where(cond)`` and
    ``repeat_interleave`` without ``output_size``; indexing with a Python list, a boolean mask or a host index tensor
    (the index is copied to the GPU first, and a mask goes through ``nonzero``); a blocking copy from a host tensor
    or Python data (``.to(device)`` without ``non_blocking``, ``copy_``, ``torch.tensor(..., device=)``,
    ``new_tensor``); and the host collectives (:class:`_Counter`)."""

    def __init__(self):
        _Counter.__init__(self)
        TorchFunctionMode.__init__(self)
        self._host = WeakIdKeyDictionary()
        # the last ``.device`` objects read from host tensors (held, so their ids stay theirs): ``device=x.device``
        self._host_devices: collections.OrderedDict[int, torch.device] = collections.OrderedDict()

    def __enter__(self):
        self._patch_dist()
        return TorchFunctionMode.__enter__(self)

    def __exit__(self, *exc):
        self._restore_dist()
        return TorchFunctionMode.__exit__(self, *exc)

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def _host_device(self, d) -> bool:
        """Whether ``d`` (a ``device`` argument) names the host: ``"cpu"``, or the ``.device`` of a host tensor."""
        return (isinstance(d, str) and d == "cpu") or self._host_devices.get(id(d)) is d

    def _device_kwarg(self, kwargs) -> bool:
        """Whether ``kwargs`` put a factory's output on the device."""
        d = kwargs.get("device")
        return d is not None and not self._host_device(d)

    def _target(self, name: str, args, kwargs) -> str | None:
        """For a call that moves a tensor: "host" or "device", where its output lives; None for any other call."""
        if name in ("cpu", "numpy", "pin_memory"):
            return "host"
        if name == "cuda":
            return "device"
        if name != "to":
            return None
        dest = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if dest is None:  # a dtype, or ``.to(other)``: the output is where ``other`` is (an input of the call)
            return None
        return "host" if self._host_device(dest) else "device"

    def mark_host(self, tree) -> None:
        """Every tensor in ``tree`` (a batch from the data loader) is a host tensor."""
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self._host[t] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.backward:  # run the backward with this mode active (its Python code is counted)
            with self:
                return _backward(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device_in = any(not self.is_host(t) for t in tensors)
        target = self._target(name, args, kwargs)
        self._count(name, args, kwargs, tensors, device_in, target)
        out = func(*args, **kwargs)
        if isinstance(out, torch.device) and tensors and not device_in:
            self._host_devices[id(out)] = out
            if len(self._host_devices) > 256:
                self._host_devices.popitem(last=False)
            return out
        host_out = not device_in and not self._device_kwarg(kwargs) if target is None else target == "host"
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if target is not None and any(t is a for a in tensors) and self.is_host(t) != host_out:
                out = t = t.clone()  # a copy to the other side, as on a GPU (``.to`` returns the tensor itself here)
            if host_out:
                self._host[t] = True
            elif t in self._host:
                del self._host[t]
        return out

    def _count(self, name, args, kwargs, tensors, device_in, target) -> None:
        self_device = bool(args) and isinstance(args[0], torch.Tensor) and not self.is_host(args[0])
        if name in READS and self_device:
            self.note(f"Tensor.{name}")
        elif name in DATA_DEPENDENT and device_in:
            self.note(name)
        elif name == "where" and len(args) + len(kwargs) == 1 and device_in:
            self.note("where(cond)")
        elif name == "repeat_interleave" and device_in and "output_size" not in kwargs and any(
                isinstance(a, torch.Tensor) for a in args[1:2]):
            self.note("repeat_interleave")
        elif name in ("__getitem__", "__setitem__") and self_device:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            for i in index:
                if isinstance(i, list):
                    self.note("list index")
                elif isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                    self.note("boolean-mask index")
                elif isinstance(i, torch.Tensor) and self.is_host(i) and i.dim():
                    self.note("host index tensor")
        elif name in FROM_DATA and (self_device if name == "new_tensor" else self._device_kwarg(kwargs)):
            self.note(f"{name} to device")
        elif target == "host" and tensors and not self.is_host(tensors[0]):
            self.note(f"Tensor.{name} to host")
        elif target == "device" and tensors and self.is_host(tensors[0]) and not _non_blocking(args, kwargs):
            self.note(f"Tensor.{name} blocking to device")
        elif name == "copy_" and len(args) > 1 and self.is_host(args[0]) != self.is_host(args[1]):
            if self.is_host(args[0]) or not _non_blocking(args[2:], kwargs):
                self.note("copy_ to host" if self.is_host(args[0]) else "copy_ blocking to device")


def _non_blocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking") or any(a is True for a in args if isinstance(a, bool)))


def _backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``tensor.backward(...)`` without passing it through torch-function modes again (``torch.autograd.backward``'s
    own body, which :class:`CpuSyncs` would otherwise run with itself switched off)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensor,)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(gradient, 1), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)


class CudaSyncs(_Counter):
    """torch's sync debug mode on CUDA, its warnings counted while entered (and not shown)."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=self.MESSAGE)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if self.MESSAGE in str(message):
                self.note("cuda sync")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._patch_dist()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._restore_dist()
        self._warnings.__exit__(*exc)
        return False


class StepSyncs:
    """The trainer's per-step record (module docstring): :meth:`end_step` files the syncs since the previous call
    under ``step``."""

    def __init__(self, dump_folder: str, rank: int):
        self.counter = CudaSyncs() if torch.cuda.is_available() else CpuSyncs()
        self.rank = rank
        folder = os.path.join(dump_folder, "syncs")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._counting = False

    @staticmethod
    def from_env(job_config) -> "StepSyncs | None":
        if os.environ.get(ENV, "") in ("", "0"):
            return None
        return StepSyncs(job_config.job.dump_folder, int(os.environ.get("RANK", "0")))

    def __enter__(self):
        self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        self._file.close()
        return self.counter.__exit__(*exc)

    def host_batches(self, data_iterator):
        """``data_iterator``'s batches, each marked as host tensors (:meth:`CpuSyncs.mark_host`; on CUDA the
        tensors say where they are)."""
        for batch in data_iterator:
            if isinstance(self.counter, CpuSyncs):
                self.counter.mark_host(batch)
            yield batch

    def end_step(self, step: int) -> None:
        """At the top of the training loop: the syncs since the previous call were step ``step``'s (none before the
        first call, which starts the count)."""
        syncs = self.counter.take()
        if not self._counting:
            self._counting = True
            return
        where = collections.Counter(f"{s.where} {s.what}" for s in syncs)
        self._file.write(json.dumps({"step": step, "count": len(syncs), "syncs": dict(where)}) + "\n")
        self._file.flush()
        if self.rank == 0:
            listed = ", ".join(f"{k} x{n}" for k, n in where.items())
            logger.info(f"host syncs in step {step}: {len(syncs)}{' (' + listed + ')' if listed else ''}")


def read_step_syncs(path: str | os.PathLike) -> dict[int, dict]:
    """step -> its record (``count``, ``syncs``: "where what" -> times) from a ``syncs/rank<R>.jsonl``."""
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r for r in map(json.loads, f) if r}
