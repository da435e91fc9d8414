"""Builds a torch C++ extension with ninja into a cache directory, once per build key.

The directory is named by a key over what changes the binary: the sources' and headers' bytes (not
their paths: checkouts of the same sources share one build), the build rules and flags, torch's
version, Python's ABI and the compiler's identity. A finished build writes ``BUILD_COMPLETE`` last
and atomically; a process that finds it imports the module from its file and never runs ninja, so
headers outside the sources (torch's, Python's, the system's) changing later start no rebuild.

Without the marker a process builds under an exclusive flock on the directory (released by the OS
if its holder dies): the others log that they wait, then load what it built. A killed build leaves
no marker; the next process finishes it (ninja redoes what the log does not show as done).

A new build compiles only the sources that changed (``objects.py``): a new directory takes the
object files a finished sibling build made from the same inputs.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

from pdserve.kernels import objects

logger = logging.getLogger("pdserve.kernels")

MARKER = "BUILD_COMPLETE"
LOCK = ".pdserve-build.lock"
_STATUS = (
    "@pdserve-ninja "  # NINJA_STATUS prefix: tells ninja's progress lines from compiler output
)

# Everything in the ninja file but the paths (the variables in _paths), which the key leaves out.
_RULES = """\
ninja_required_version = 1.3
cflags = -DTORCH_EXTENSION_NAME=$module -DTORCH_API_INCLUDE_EXTENSION_H -I$src $system_includes \
-fPIC {cflags}
ldflags = -shared {ldflags} -L$torch_lib -lc10 -ltorch_cpu -ltorch -ltorch_python

rule compile
  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out
  depfile = $out.d
  deps = gcc
  description = compiled $label

rule link
  command = $cxx $in $ldflags -o $out
  description = linked $label
"""


class BuildError(RuntimeError):
    """The build failed or could not run."""


class MissingTool(BuildError):
    """No compiler or no ninja to build with."""


class SourcesChanged(BuildError):
    """The sources are not (or no longer) those the build's key was computed from."""


@dataclass(frozen=True)
class Extension:
    """A Python extension module built from ``sources`` (C++ files in ``source_dir``, which holds
    its headers too) with ``cflags``/``ldflags`` on top of torch's include paths and libraries."""

    name: str
    source_dir: Path
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    def headers(self) -> list[str]:
        return sorted(p.name for p in self.source_dir.iterdir() if p.suffix in (".h", ".hpp"))

    def rules(self) -> str:
        import torch

        cflags = [*self.cflags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        return _RULES.format(cflags=" ".join(cflags), ldflags=" ".join(self.ldflags))

    def inputs(self) -> dict:
        """What the source key covers, kept in the marker to say later what changed."""
        import torch

        files = {
            n: hashlib.sha256((self.source_dir / n).read_bytes()).hexdigest()[:16]
            for n in (*self.sources, *self.headers())
        }
        return {
            "files": files,
            "sources": list(self.sources),
            "rules": self.rules(),
            "torch": f"{torch.__version__} ({torch.version.git_version})",
            "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.version,
        }

    def source_key(self) -> str:
        return _digest(self.inputs())[:12]


def compiler_command() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "c++")


def compiler_identity() -> Optional[str]:
    """``<cxx> --version``'s first line and target, or None when there is no compiler to run."""
    cxx = compiler_command()
    try:
        version = subprocess.run(
            [*cxx, "--version"], capture_output=True, text=True, check=True, timeout=60
        )
        target = subprocess.run([*cxx, "-dumpmachine"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{version.stdout.strip().splitlines()[0]} [{target.stdout.strip()}]"


@dataclass(frozen=True)
class Build:
    """Where one build of an extension lives: ``<root>/<tag>/<module>.so``; ``key``: the source key
    it is built for."""

    ext: Extension
    directory: Path
    module: str
    compiler: Optional[str]
    key: str = ""

    @property
    def library(self) -> Path:
        return self.directory / f"{self.module}.so"

    def complete(self) -> bool:
        return _read_marker(self.directory).get("module") == self.module and self.library.exists()


def locate(ext: Extension, root: Path) -> Build:
    """The build of ``ext`` for this torch, Python and compiler under ``root``. Without a compiler
    to identify, a finished build of the same sources by any compiler (the only kind that can
    load)."""
    import torch

    key = ext.source_key()
    tag = (
        f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
        f"-{key}"
    )
    compiler = compiler_identity()
    if compiler is None:
        for marker in sorted(
            root.glob(f"{tag}-*/{MARKER}"), key=lambda p: p.stat().st_mtime, reverse=True
        ):
            b = Build(ext, marker.parent, _read_marker(marker.parent).get("module", ""), None, key)
            if b.complete():
                return b
        cc = "nocompiler"
    else:
        cc = hashlib.sha256(compiler.encode()).hexdigest()[:8]
    return Build(ext, root / f"{tag}-{cc}", f"{ext.name}_{key}_{cc}", compiler, key)


def ensure_built(b: Build, rebuild: bool = False) -> bool:
    """Make ``b`` complete (building it, or waiting for the process that is). True if this call
    built it."""
    if b.complete() and not rebuild:
        return False
    b.directory.mkdir(parents=True, exist_ok=True)
    with open(b.directory / LOCK, "a+") as lk:
        try:
            fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lk.seek(0)
            holder = lk.read().strip() or "another process"
            logger.info(
                "CPU kernels: waiting for %s, which is building them in %s", holder, b.directory
            )
            t0 = time.monotonic()
            fcntl.flock(lk, fcntl.LOCK_EX)
            logger.info(
                "CPU kernels: waited %.0f s for the build in %s", time.monotonic() - t0, b.directory
            )
            if b.complete():
                return False
        lk.seek(0)
        lk.truncate()
        lk.write(f"pid {os.getpid()}")
        lk.flush()
        if b.complete() and not rebuild:
            return False
        _build(b, rebuild)
        return True


def import_module(b: Build) -> ModuleType:
    """Load a complete build from its file (no ninja, no compiler)."""
    import torch  # noqa: F401  (the module links against torch's libraries, found loaded)

    spec = importlib.util.spec_from_file_location(b.module, b.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {b.library}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(b: Build, rebuild: bool) -> None:
    if b.compiler is None:
        raise MissingTool(
            f"no C++ compiler to run ({' '.join(compiler_command())}; set CXX to use another)"
        )
    if shutil.which("ninja") is None:
        raise MissingTool("ninja is not installed (pip install ninja)")
    inputs = b.ext.inputs()
    if _digest(inputs)[:12] != b.key:
        raise SourcesChanged(f"the sources changed since {b.directory.name} was chosen")
    d = b.directory
    (d / MARKER).unlink(missing_ok=True)
    if rebuild:
        for p in d.iterdir():
            if p.name != LOCK:
                p.unlink()
    fresh = not (d / "build.ninja").exists()
    keys = objects.object_keys(b.ext, b.compiler, b.module)
    reused = objects.reuse(b, keys) if fresh and not rebuild else {}
    _write_ninja_file(b, skip=set(reused))
    if reused:
        donors = sorted(set(reused.values()))
        logger.info(
            "CPU kernels: %d of %d objects are unchanged since %s: compiling %d",
            len(reused),
            len(keys),
            ", ".join(donors),
            len(keys) - len(reused),
        )
    if rebuild:
        reason = "a rebuild was asked for"
    elif fresh:
        reason = f"no build yet for these sources ({_what_changed(b)})"
    else:
        reason = f"an earlier build here did not finish; {_explain(d)}"
    jobs = _jobs()
    logger.info(
        "CPU kernels: building %d files with %d jobs in %s: %s",
        len(keys) - len(reused),
        jobs,
        d,
        reason,
    )
    t0 = time.monotonic()
    _run_ninja(d, jobs, t0)
    seconds = time.monotonic() - t0
    edited = [n for n, h in b.ext.inputs()["files"].items() if inputs["files"].get(n) != h]
    if edited:  # what was compiled may not be what the key says: not complete
        raise SourcesChanged(
            f"{', '.join(edited)} changed during the build; it is not marked complete"
        )
    with open(b.library, "rb") as f:
        os.fsync(f.fileno())
    (d / objects.OBJECTS).write_text(json.dumps(keys, indent=1))
    info = {
        "module": b.module,
        "library": b.library.name,
        "compiler": b.compiler,
        "inputs": inputs,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(seconds, 1),
        "jobs": jobs,
    }
    tmp = d / f".{MARKER}.{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, d / MARKER)  # last: a build killed before here is never taken as complete
    logger.info("CPU kernels: built in %.0f s (%d jobs)", seconds, jobs)


def _paths(b: Build) -> str:
    import torch.utils.cpp_extension as cpp

    includes = [*cpp.include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    return "\n".join(
        [
            f"cxx = {_shell(*compiler_command())}",
            f"module = {b.module}",
            f"src = {_shell(b.ext.source_dir.resolve())}",
            "system_includes = " + " ".join(f"-isystem {_shell(p)}" for p in includes),
            f"torch_lib = {_shell(cpp.library_paths()[0])}",
        ]
    )


def _write_ninja_file(b: Build, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """``skip``: objects already in the directory (taken from an earlier build): linked, not
    compiled."""
    names = [objects.object_name(s) for s in b.ext.sources]
    src = _ninja_path(b.ext.source_dir.resolve())
    edges = [
        f"build {o}: compile {src}/{s}\n  label = {s}"
        for o, s in zip(names, b.ext.sources)
        if o not in skip
    ]
    edges.append(
        f"build $module.so: link {' '.join(names)}\n  label = $module.so\ndefault $module.so"
    )
    text = f"{_paths(b)}\n{b.ext.rules()}\n" + "\n".join(edges) + "\n"
    (b.directory / "build.ninja").write_text(text)


def _run_ninja(d: Path, jobs: int, t0: float) -> None:
    env = {**os.environ, "NINJA_STATUS": _STATUS + "[%f/%t] "}
    proc = subprocess.Popen(
        ["ninja", "-j", str(jobs)],
        cwd=d,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    output = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(_STATUS):
            logger.info("CPU kernels: %s (%.0f s)", line[len(_STATUS) :], time.monotonic() - t0)
        elif line.strip():
            output.append(line)
    if proc.wait() != 0:
        cxx = shlex.join(compiler_command())
        shown = [ln for ln in output if not ln.startswith(cxx)][-40:]
        logger.error("CPU kernels: the build failed in %s:\n%s", d, "\n".join(shown))
        errors = [ln for ln in output if "error" in ln.lower() and not ln.startswith(cxx)]
        raise BuildError(f"ninja failed in {d}: {(errors or shown or ['no output'])[0].strip()}")
    for line in output:
        logger.debug("CPU kernels: %s", line)


def _explain(d: Path) -> str:
    """What ninja would redo and why (its ``-d explain`` lines, the first few)."""
    out = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=d, capture_output=True, text=True)
    lines = [
        ln.split("ninja explain: ", 1)[1]
        for ln in (out.stdout + out.stderr).splitlines()
        if ln.startswith("ninja explain: ")
    ]
    more = f" (+{len(lines) - 3} more)" if len(lines) > 3 else ""
    return "ninja: " + "; ".join(lines[:3]) + more if lines else "ninja finds nothing left to do"


def _what_changed(b: Build) -> str:
    """Against the newest finished build of the same extension under the same root."""
    newest, newest_t = None, 0.0
    for marker in b.directory.parent.glob(f"*/{MARKER}"):
        info, t = _read_marker(marker.parent), marker.stat().st_mtime
        if (
            info.get("module", "").startswith(b.ext.name + "_")
            and "inputs" in info
            and t > newest_t
        ):
            newest, newest_t = info, t
    if newest is None:
        return f"none in {b.directory.parent}"
    old, new = newest["inputs"], b.ext.inputs()
    changes = [
        f"{n} changed"
        for n in new["files"]
        if n in old["files"] and old["files"][n] != new["files"][n]
    ]
    changes += [f"{n} added" for n in new["files"] if n not in old["files"]]
    changes += [f"{n} removed" for n in old["files"] if n not in new["files"]]
    changes += [f"{k} changed" for k in ("sources", "rules") if old.get(k) != new[k]]
    changes += [
        f"{k} {old.get(k)} -> {new[k]}" for k in ("torch", "python") if old.get(k) != new[k]
    ]
    if newest.get("compiler") != b.compiler:
        changes.append(f"compiler {newest.get('compiler')} -> {b.compiler}")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(newest_t))
    return f"against the build of {when}: {', '.join(changes) or 'nothing differs'}"


def _jobs() -> int:
    raw = os.environ.get("MAX_JOBS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else max(1, len(os.sched_getaffinity(0)))


def _read_marker(d: Path) -> dict:
    try:
        return json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _ninja_path(p) -> str:
    """A path in a ninja build line."""
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _shell(*words) -> str:
    """Words of a shell command, as the value of a ninja variable."""
    return shlex.join(str(w) for w in words).replace("$", "$$")
