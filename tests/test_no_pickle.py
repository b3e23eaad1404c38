"""No module of the package can unpickle: weights come from safetensors or GGUF only.

Refusing ``.bin``/``.pt`` files by suffix is only a courtesy; this scan of every module's syntax
tree is the guarantee that no code path imports a pickle module or calls ``torch.load`` /
``numpy.load`` (whose ``allow_pickle`` and ``weights_only`` flags have been bypassed before:
CVE-2025-32434, CVE-2026-24747).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gemma_engine"
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve"}
# (object, attribute) pairs whose call deserializes with pickle.
UNPICKLING_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("serialization", "load")}


def unpickling_uses(source: str, filename: str = "<string>") -> list[str]:
    """Lines of ``source`` that import a pickle module or call a pickle-based loader."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if (owner, node.attr) in UNPICKLING_CALLS:
                found.append(f"{filename}:{node.lineno}: {owner}.{node.attr}")
            continue
        else:
            continue
        bad = [
            name
            for name in names
            if set(name.split(".")) & UNPICKLING_MODULES
            or name in ("torch.load", "torch.serialization")
        ]
        if bad:
            found.append(f"{filename}:{node.lineno}: import {bad[0]}")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    offending = (
        "import pickle\n"
        "from torch import load\n"
        "import torch\n"
        "x = torch.load('w.pt')\n"
        "import numpy as np\n"
        "y = np.load('a.npy', allow_pickle=True)\n"
        "from joblib import load as jl\n"
        "z = torch.serialization.load\n"
    )
    assert len(unpickling_uses(offending)) == 6
    assert unpickling_uses("import json\nfrom safetensors import safe_open\n") == []


def test_no_module_unpickles() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10  # the package is where we think it is
    found = [hit for f in files for hit in unpickling_uses(f.read_text(), str(f))]
    assert found == []
