"""The kernels' build (``pdserve/kernels/build.py``) on a tiny extension in a temporary cache: a
first build says why and shows its progress; a finished build loads without ninja even when a
header outside the sources is newer; a change of sources builds anew naming the change; a build
that did not finish is completed, not loaded; concurrent starts build once; ``rebuild`` compiles
again; the key covers contents and flags, not paths."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve import kernels
from pdserve.kernels import build, objects

REPO = Path(__file__).resolve().parents[2]

MAIN = r"""
#include <Python.h>
#include "value.h"
#include "outside.h"
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)
static PyObject* value(PyObject*, PyObject*) { return PyLong_FromLong(the_value() + OUTSIDE); }
static PyMethodDef methods[] = {
    {"value", value, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&def); }
"""


def make_ext(tmp: Path, value: int, name: str = "tiny") -> build.Extension:
    src, outside = tmp / "src", tmp / "outside"
    src.mkdir(parents=True, exist_ok=True)
    outside.mkdir(exist_ok=True)
    (src / "main.cpp").write_text(MAIN)
    (src / "value.cpp").write_text('#include "value.h"\nlong the_value() { return VALUE; }\n')
    (src / "value.h").write_text(f"#pragma once\n#define VALUE {value}\nlong the_value();\n")
    (outside / "outside.h").write_text(
        "#define OUTSIDE 0\n"
    )  # stands for torch's, Python's, the system's
    return build.Extension(name, src, ("main.cpp", "value.cpp"), ("-O0", f"-I{outside}"), ())


def messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "pdserve.kernels")


def value_of(b: build.Build) -> int:
    """The built module's value (each test's build has a module name of its own: imported once)."""
    return build.import_module(b).value()


@pytest.fixture
def built(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.kernels")
    ext = make_ext(tmp_path, 42)
    b = build.locate(ext, tmp_path / "cache")
    assert build.ensure_built(b)
    return ext, b


def test_first_build_says_why_shows_progress_and_loads(built, caplog):
    ext, b = built
    log = "\n".join(
        r.getMessage() for r in caplog.get_records("setup") if r.name == "pdserve.kernels"
    )
    assert "building 2 files" in log and "no build yet for these sources (none in" in log
    assert (
        "[1/3] compiled " in log
        and "[2/3] compiled " in log
        and f"[3/3] linked {b.module}.so" in log
    )
    assert "built in" in log
    assert (b.directory / build.MARKER).exists() and b.complete()
    assert b.directory.name.startswith("torch") and ext.source_key() in b.directory.name
    assert value_of(b) == 42


def test_finished_build_loads_without_ninja_when_a_header_outside_is_newer(
    built, tmp_path, monkeypatch, caplog
):
    ext, b = built
    later = time.time() + 100
    os.utime(tmp_path / "outside" / "outside.h", (later, later))
    would = subprocess.run(
        ["ninja", "-n", "-d", "explain"], cwd=b.directory, capture_output=True, text=True
    )
    assert "outside.h" in would.stdout + would.stderr  # ninja itself would rebuild
    bin_dir = tmp_path / "bin"  # the compiler, and no ninja: running ninja would fail
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(shutil.which("c++"))
    monkeypatch.setenv("PATH", str(bin_dir))
    caplog.clear()
    again = build.locate(ext, tmp_path / "cache")
    assert again == b and again.complete()
    assert build.ensure_built(again) is False
    assert "building" not in messages(caplog)
    assert value_of(again) == 42


def test_changed_header_builds_anew_naming_the_change(built, tmp_path, caplog):
    _, b = built
    ext = make_ext(tmp_path, 43)
    b2 = build.locate(ext, tmp_path / "cache")
    assert b2.directory != b.directory and b2.module != b.module and not b2.complete()
    caplog.clear()
    assert build.ensure_built(b2)
    log = messages(caplog)
    assert (
        "no build yet for these sources (against the build of" in log
        and ": value.h changed)" in log
    )
    assert value_of(b2) == 43 and value_of(b) == 42


def test_unfinished_build_is_completed_not_loaded(built, caplog):
    _, b = built
    # what a build killed while linking leaves: objects, a partial module, no marker
    (b.directory / build.MARKER).unlink()
    (b.directory / "value.o").unlink()
    b.library.write_bytes(b.library.read_bytes()[:1000])
    assert not b.complete()
    caplog.clear()
    assert build.ensure_built(b)
    log = messages(caplog)
    assert "an earlier build here did not finish; ninja: " in log and "value.o" in log
    assert "[1/2] compiled value.cpp" in log and "[2/2] linked" in log
    assert b.complete() and value_of(b) == 42


def test_rebuild_compiles_everything_again(built, caplog):
    _, b = built
    caplog.clear()
    assert build.ensure_built(b, rebuild=True)
    log = messages(caplog)
    assert "a rebuild was asked for" in log and "[3/3] linked" in log
    assert b.complete() and value_of(b) == 42


def test_concurrent_starts_build_once(tmp_path):
    ext = make_ext(tmp_path, 7)
    b = build.locate(ext, tmp_path / "cache")
    b.directory.mkdir(parents=True)
    script = (
        f"import logging, sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
        "logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "from pdserve.kernels import build; "
        f"ext = build.Extension('tiny', Path({str(ext.source_dir)!r}), {ext.sources!r}, "
        f"{ext.cflags!r}); b = build.locate(ext, Path({str(tmp_path / 'cache')!r})); "
        "build.ensure_built(b); print(build.import_module(b).value())"
    )
    logs = [tmp_path / f"start{i}.log" for i in range(2)]
    with open(b.directory / build.LOCK, "a+") as held:  # as a process that is building would
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 1 (the test)")
        held.flush()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=open(log, "w"),
                text=True,
            )
            for log in logs
        ]
        deadline = time.monotonic() + 120
        while not all("waiting for pid 1 (the test)" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
            time.sleep(0.05)
        fcntl.flock(held, fcntl.LOCK_UN)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o in outs] == ["7", "7"]
    texts = [log.read_text() for log in logs]
    assert sum("CPU kernels: building" in t for t in texts) == 1, texts
    assert all("waited" in t for t in texts)
    ninja_log = (
        (b.directory / ".ninja_log").read_text().splitlines()[1:]
    )  # start, end, mtime, output, hash
    assert [line.split("\t")[3] for line in ninja_log].count("value.o") == 1


def test_without_a_compiler_a_finished_build_still_loads(built, tmp_path, monkeypatch):
    ext, b = built
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build.locate(ext, tmp_path / "cache") == build.Build(
        ext, b.directory, b.module, None, b.key
    )
    other = build.locate(make_ext(tmp_path / "other", 5), tmp_path / "cache")
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        build.ensure_built(other)


def test_key_covers_contents_and_flags_not_paths(tmp_path):
    a, b = make_ext(tmp_path / "a", 1), make_ext(tmp_path / "b", 1)
    flags = ("-O0",)  # make_ext's include flag names its own directory
    same = [build.Extension("tiny", e.source_dir, e.sources, flags) for e in (a, b)]
    assert same[0].source_key() == same[1].source_key()
    assert (
        build.Extension("tiny", a.source_dir, a.sources, ("-O2",)).source_key()
        != same[0].source_key()
    )
    (a.source_dir / "extra.h").write_text("// a header no source includes yet\n")
    assert same[0].source_key() != same[1].source_key()


def test_pdserve_kernels_use_openmp_and_a_path_free_key(tmp_path):
    ext = kernels.extension()
    assert "-fopenmp" in ext.cflags and "-fopenmp" in ext.ldflags
    copy = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCE_DIR, copy)
    assert (
        build.Extension(ext.name, copy, ext.sources, ext.cflags, ext.ldflags).source_key()
        == ext.source_key()
    )


def test_a_source_edited_during_the_build_is_not_marked_complete(tmp_path, monkeypatch):
    ext = make_ext(tmp_path, 9)
    wrapper = tmp_path / "cxx-that-edits"  # the compiler, and an editor saving value.h meanwhile
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -c "*) echo \'// edited\' >> {ext.source_dir / "value.h"};; '
        f'esac\nexec {shutil.which("c++")} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    b = build.locate(ext, tmp_path / "cache")
    with pytest.raises(RuntimeError, match="value.h changed during the build"):
        build.ensure_built(b)
    assert not b.complete()


def test_a_new_build_compiles_only_what_changed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.kernels")
    tiny = make_ext(tmp_path, 42)
    (tiny.source_dir / "twice.cpp").write_text("long twice(long v) { return 2 * v; }\n")
    ext = build.Extension("tiny", tiny.source_dir, (*tiny.sources, "twice.cpp"), tiny.cflags)
    b = build.locate(ext, tmp_path / "cache")
    assert build.ensure_built(b)
    (ext.source_dir / "value.cpp").write_text(
        '#include "value.h"\nlong the_value() { return VALUE + 1; }\n'
    )
    b2 = build.locate(ext, tmp_path / "cache")
    assert b2.directory != b.directory
    caplog.clear()
    assert build.ensure_built(b2)
    log = messages(caplog)
    # twice.o is taken; main.cpp defines the module, whose name follows the sources' key: compiled
    assert f"1 of 3 objects are unchanged since {b.directory.name}: compiling 2" in log
    assert "building 2 files" in log and "compiled value.cpp" in log and "compiled main.cpp" in log
    assert "twice.cpp" not in log and "[3/3] linked" in log
    assert (b2.directory / "twice.o").stat().st_ino == (b.directory / "twice.o").stat().st_ino
    assert value_of(b2) == 43
    # a header both value.cpp and main.cpp include: only twice.o is taken again
    (ext.source_dir / "value.h").write_text("#pragma once\n#define VALUE 50\nlong the_value();\n")
    b3 = build.locate(ext, tmp_path / "cache")
    caplog.clear()
    assert build.ensure_built(b3)
    assert "1 of 3 objects are unchanged" in messages(caplog) and value_of(b3) == 51
    # rebuild compiles everything
    caplog.clear()
    assert build.ensure_built(b3, rebuild=True)
    assert "unchanged since" not in messages(caplog) and "[4/4] linked" in messages(caplog)


def test_object_keys_follow_local_includes(tmp_path):
    ext = make_ext(tmp_path, 1)
    (ext.source_dir / "extra.h").write_text("// included by nothing\n")
    before = objects.object_keys(ext, "cc", "m1")
    (ext.source_dir / "extra.h").write_text("// still included by nothing\n")
    assert objects.object_keys(ext, "cc", "m1") == before
    assert objects.local_includes(ext, "main.cpp") == {"value.h"}
    assert objects.object_keys(ext, "other cc", "m1") != before
    # the module's name changes only the object that defines the module
    renamed = objects.object_keys(ext, "cc", "m2")
    assert renamed["value.o"] == before["value.o"] and renamed["main.o"] != before["main.o"]
