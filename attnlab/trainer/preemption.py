"""Preemption: SIGTERM and SIGUSR1 end a run after the current step, with a checkpoint of that step, on every rank at
the same step."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that end a run after the current step with a checkpoint (schedulers send SIGTERM before killing a job,
Slurm's ``--signal=USR1@<seconds>`` sends SIGUSR1 ahead of the time limit); the process then exits with status
128 + the signal number (143, 138), so a wrapper sees an interrupted run, not a finished one."""


class StopSignals:
    """Handlers for :data:`STOP_SIGNALS` from construction to :meth:`restore`. A signal is only noted; the loop asks
    :meth:`agreed` once per step. Repeats are noted too: under Slurm a worker gets SIGTERM from slurmstepd and again
    from its torchrun agent."""

    def __init__(self):
        self._received = 0
        self._group = None
        self._flag, self._work = None, None
        self._old = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}

    def _note(self, signum: int, frame) -> None:
        self._received = signum

    def use_process_group(self) -> None:
        """Agree over a gloo group of all ranks (a CPU all-reduce, no device sync); call on every rank once the
        default process group exists."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def agreed(self) -> int:
        """The stop signal any rank received (0: none), the same on every rank, so all stop after the same step.

        Over several ranks the k-th call answers with the all-reduce the (k − 1)-th call started (in the background,
        ``async_op``), so the host never waits for the other ranks' hosts at a step: that reduction finished during
        the step between (the ranks run the step's collectives together). A signal therefore stops the run one step
        later than on one process, where the answer is immediate."""
        if self._group is None:
            return self._received
        answer = 0
        if self._work is not None:
            self._work.wait()
            answer = int(self._flag)
        self._flag = torch.tensor(self._received, dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return answer

    def wait(self) -> None:
        """Finish the all-reduce in flight (every rank, at the end of training, before the process groups go)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
