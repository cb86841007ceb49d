"""Package boundaries: megatron_bridge is a library of its own (rlstack depends on it, never the
reverse), and `import rlstack` stays light."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BRIDGE = os.path.join(ROOT, "megatron_bridge")


def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):  # function-level imports too: they are the ones that hide a cycle
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_bridge_source_never_imports_rlstack():
    offenders, seen = {}, 0
    for folder, _, files in os.walk(BRIDGE):  # megatron_bridge/patches/ too
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            seen += 1
            bad = sorted(m for m in _imported_modules(path) if m.split(".")[0] == "rlstack")
            if bad:
                offenders[os.path.relpath(path, BRIDGE)] = bad
    assert seen > 20 and not offenders, offenders


BLOCK_RLSTACK = """
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "rlstack" or name.startswith("rlstack."):
            raise ImportError(f"{name} must not be imported by megatron_bridge")
        return None

sys.meta_path.insert(0, Block())
import megatron_bridge
names = [m.name for m in pkgutil.walk_packages(megatron_bridge.__path__, "megatron_bridge.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_bridge_imports_with_rlstack_unimportable():
    proc = subprocess.run([sys.executable, "-c", BLOCK_RLSTACK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 10


def test_import_rlstack_imports_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, rlstack, rlstack.config, rlstack.preflight; print('torch' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
