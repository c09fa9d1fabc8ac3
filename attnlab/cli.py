"""The ``attnlab`` command: ``attnlab train [--section.key value ...]``, ``attnlab configs`` and ``attnlab TOOL
[args]`` for each tool of :mod:`attnlab.tools`, from any folder (each is also ``python -m attnlab.tools.TOOL``).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "attnlab.train",
    "configs": "attnlab.configs",
    **{name: f"attnlab.tools.{name}" for name in (
        "eval_ppl", "passkey", "generate", "analyze", "synthetic", "eval_downstream", "plot_ppl",
        "export_hf", "import_hf", "convert_to_parallax", "train_tokenizer", "fetch_tokenizer",
        "smoke_configs", "multigpu_check")},
}
"""Command name → the module whose ``main(argv)`` runs it (``configs`` prints the shipped configurations)."""


def usage() -> str:
    return ("usage: attnlab COMMAND [args ...]   (attnlab COMMAND --help for each)\ncommands: "
            + ", ".join(COMMANDS))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = argv[0].replace("-", "_"), argv[1:]
    if name not in COMMANDS:
        sys.exit(f"attnlab: error: unknown command {argv[0]!r}\n{usage()}")
    module = importlib.import_module(COMMANDS[name])
    if name == "configs":
        print("\n".join(module.names()))
        return
    sys.argv = [f"attnlab {argv[0]}", *rest]
    result = module.main(rest)
    if isinstance(result, int):
        sys.exit(result)


if __name__ == "__main__":
    main()
