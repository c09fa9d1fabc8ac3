"""One CLI style for every tool script: `--help` exits 0, documents every argument and writes nothing;
unknown flags are rejected; run folders and step folders are both accepted."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.utils import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())

# Runs every script's --help in ONE fresh interpreter (imports are shared, so the whole check takes seconds):
# each script runs as __main__ with argv [script, --help]; parse_args is wrapped to record options that have
# no help text. Prints one JSON line {script: [exit code, undocumented options]}.
HARNESS = r"""
import argparse, json, runpy, sys
results, undocumented = {}, []
real = argparse.ArgumentParser.parse_known_args
def parse_known_args(self, *a, **kw):
    undocumented.extend(a.dest for a in self._actions if not a.help and not isinstance(a, argparse._HelpAction))
    return real(self, *a, **kw)
argparse.ArgumentParser.parse_known_args = parse_known_args
for path in sys.argv[1:]:
    undocumented.clear()
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code or 0
    results[path] = [code, sorted(set(undocumented))]
print("\nRESULTS " + json.dumps(results))
"""


def _snapshot(root: Path) -> dict[str, float]:
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "__pycache__", ".cache", "runs", ".pytest_cache")]
        for f in files:
            p = os.path.join(d, f)
            out[p] = os.stat(p).st_mtime_ns
    return out


def test_every_script_help_is_clean_and_writes_nothing(tmp_path):
    assert len(SCRIPTS) > 10
    before = _snapshot(REPO)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", HARNESS, *map(str, SCRIPTS)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.rsplit("RESULTS ", 1)[1])
    bad = {Path(k).name: v for k, v in results.items() if v != [0, []]}
    assert not bad, f"--help exit code or undocumented options: {bad}"
    assert list(tmp_path.iterdir()) == [], "a script's --help wrote into the working folder"
    after = _snapshot(REPO)
    changed = sorted(p for p in after if before.get(p) != after[p])
    assert not changed, f"--help wrote files: {changed[:5]}"
