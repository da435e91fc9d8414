"""The object files a new kernel build can take from an earlier one.

Every finished build records a key per object file (``objects.json``): its source's bytes, the
bytes of the headers of the source directory it includes, directly or not, the rules, torch,
Python, the compiler, and the module's name for a source that uses it (the module's init
function is named after it, and the name follows the sources' key). A new build directory
hard-links (or copies) the objects whose key a finished sibling build of the same compiler has,
and compiles the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pdserve.kernels.build import Build, Extension

OBJECTS = "objects.json"  # {object file: key}, written with the build's marker
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def object_name(source: str) -> str:
    return Path(source).stem + ".o"


def local_includes(ext: "Extension", name: str) -> set[str]:
    """The headers of the source directory that ``name`` includes, directly or through others."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        text = (ext.source_dir / todo.pop()).read_text(errors="replace")
        for inc in _INCLUDE.findall(text):
            if inc not in seen and (ext.source_dir / inc).is_file():
                seen.add(inc)
                todo.append(inc)
    return seen


def object_keys(ext: "Extension", compiler: Optional[str], module: str) -> dict[str, str]:
    """{object file: key} for every source of ``ext``."""
    from pdserve.kernels.build import _digest

    inputs = ext.inputs()
    files = inputs["files"]
    common = {k: inputs[k] for k in ("rules", "torch", "python")} | {"compiler": compiler}
    keys = {}
    for s in ext.sources:
        headers = sorted(local_includes(ext, s))
        names = any(
            "TORCH_EXTENSION_NAME" in (ext.source_dir / f).read_text(errors="replace")
            for f in (s, *headers)
        )
        keys[object_name(s)] = _digest(
            {
                **common,
                "source": files[s],
                "headers": {h: files[h] for h in headers},
                "module": module if names else None,
            }
        )
    return keys


def reuse(b: "Build", keys: dict[str, str]) -> dict[str, str]:
    """Link (or copy) into ``b``'s fresh directory the objects whose key a finished sibling build of
    the same compiler has; returns {object: the donor directory's name}."""
    from pdserve.kernels.build import MARKER, _read_marker

    reused: dict[str, str] = {}
    donors = sorted(
        (m.parent for m in b.directory.parent.glob(f"*/{MARKER}")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for donor in donors:
        if donor == b.directory or _read_marker(donor).get("compiler") != b.compiler:
            continue
        try:
            have = json.loads((donor / OBJECTS).read_text())
        except (OSError, ValueError):
            continue
        for obj, key in keys.items():
            if obj in reused or have.get(obj) != key or not (donor / obj).is_file():
                continue
            try:
                os.link(donor / obj, b.directory / obj)
            except OSError:
                shutil.copy2(donor / obj, b.directory / obj)
            reused[obj] = donor.name
    return reused
