"""The trainer's components, one object each, plugged into torchtitan's ``Trainer`` by ``train.py``'s
``AttnTrainer`` (docs/architecture.md): the TrainSpec (``spec``), the run folder's locks and checks
(``run_guard``), the checkpoint load and save checks (``checkpoint``), the non-finite guard (``nonfinite``),
metrics (``metrics``), validation (``validate``), stop signals (``preemption``), CPU support (``cpu``) and the
process groups' teardown (``teardown``). Every private torchtitan name they use is in ``titan``."""
