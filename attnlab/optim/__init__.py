"""Optimizers, parameter roles and schedules. Importing this package registers every optimizer (one import line)."""

# One module per optimizer: importing it runs its @register_optimizer.
from attnlab.optim import adam, muon  # noqa: F401,E401
