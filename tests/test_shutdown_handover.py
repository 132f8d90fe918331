"""A child that dies while taking a file descriptor from its parent (the DHT child, killed by a
signal to the process group halfway through a hivemind call's fd handover) makes
multiprocessing's handover thread print a traceback in the parent: `quiet_handover_errors`
turns exactly that into one line, and leaves every other exception to the previous hook.

Each case runs in a fresh interpreter with the real `multiprocessing.resource_sharer`: a
receiver connects to its server thread and dies at once, then a well-formed handover
follows, which the thread serves only after it has dealt with the broken one."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import logging, os, socket, sys
from multiprocessing import resource_sharer

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="log: %(message)s")
if sys.argv[1] == "quiet":
    from bagel.protocol.shutdown import quiet_handover_errors

    quiet_handover_errors()
    quiet_handover_errors()  # twice: still one hook
fd = os.open(os.devnull, os.O_RDONLY)
dup = resource_sharer.DupFd(fd)  # starts the handover server thread
broken = socket.socket(socket.AF_UNIX)
broken.connect(resource_sharer._resource_sharer._address)
broken.close()  # a receiver that dies mid-handover
got = dup.detach()  # served after the broken one: its error has been handled by now
print("handed over", os.fstat(got).st_ino == os.fstat(fd).st_ino, flush=True)
try:
    raise ConnectionResetError("not a handover")
except ConnectionResetError:
    sys.excepthook(*sys.exc_info())  # anything else still reaches the previous hook
"""


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_a_child_dying_mid_handover_is_one_line_not_a_traceback() -> None:
    plain = run("plain")
    assert plain.returncode == 0, plain.stderr
    # without the hook the broken handover prints a traceback from the handover thread
    assert plain.stderr.count("Traceback") == 2, plain.stderr
    assert "resource_sharer.py" in plain.stderr

    quiet = run("quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert "handed over True" in quiet.stdout
    lines = [ln for ln in quiet.stderr.splitlines() if ln.startswith("log: ")]
    assert len(lines) == 1 and "ended while taking a file descriptor" in lines[0], quiet.stderr
    # one traceback left: the ConnectionResetError raised outside the handover thread
    assert quiet.stderr.count("Traceback") == 1, quiet.stderr
    assert "not a handover" in quiet.stderr and "resource_sharer.py" not in quiet.stderr
