"""``lifetime.end_with_parent``: a child outlives no parent, however the parent ends; and the
stop-signal handlers work when SIGINT was inherited ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.cluster import is_alive, wait_for

# The parent starts the child and prints its pid; the child arms end_with_parent (or only the pid
# watch, when prctl is taken away from it) and then sleeps far longer than the test waits.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    print(child.pid, flush=True)
    time.sleep(120)
""")
CHILD = textwrap.dedent("""
    import sys, time
    from pdserve import lifetime
    if {no_prctl}:
        lifetime.set_parent_death_signal = lambda sig: False
    print(lifetime.end_with_parent(int(sys.argv[1])), file=sys.stderr, flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("no_prctl", [False, True], ids=["prctl", "watch"])
def test_child_ends_when_its_parent_is_killed(no_prctl):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD.format(no_prctl=no_prctl)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    try:
        # the child is armed once it said how
        how = parent.stderr.readline().strip()
        assert how == ("watch" if no_prctl else "prctl")
        time.sleep(0.2)
        assert is_alive(child)  # it does not end while its parent lives
        parent.kill()
        parent.wait()
        wait_for(lambda: not is_alive(child), 5, "the child to end with its parent", interval=0.05)
    finally:
        if is_alive(child):
            os.kill(child, signal.SIGKILL)


def test_child_whose_parent_died_before_arming_ends_at_once():
    # the pid given is not this child's parent: as if the parent had died during start-up
    code = (
        "import os, time; from pdserve import lifetime; lifetime.end_with_parent(os.getppid() + "
        "1); time.sleep(60)"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == -signal.SIGTERM


def test_stop_handlers_replace_an_inherited_sigint_ignore():
    code = textwrap.dedent("""
        import signal, time
        from pdserve import lifetime
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        lifetime.handle_stop_signals(lifetime.raise_interrupt)
        try:  # "armed" inside: the signal may come as soon as the line is written
            print("armed", flush=True)
            time.sleep(60)
        except KeyboardInterrupt as e:
            print("interrupted by", e, flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout.readline().strip() == "armed"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "interrupted by SIGINT" and proc.returncode == 0
