"""A checkout's shortcut for ``python -m attnlab.train`` (the entry point, :mod:`attnlab.train`), so
``python train.py`` and ``torchrun ... train.py`` run from the repository's root as they always have."""

from attnlab.train import main

if __name__ == "__main__":
    main()
