"""python -m services.common.die_with_parent PARENT_PID COMMAND [ARG...]: run COMMAND (by exec, same pid) so that
it gets SIGKILL when PARENT_PID dies (Linux PR_SET_PDEATHSIG, which survives exec; elsewhere plain exec).

`meshserve up` starts every service through this, so a `kill -9` of `up` leaves no orphan. It replaces a
subprocess preexec_fn, which is unsafe in a process with threads: a supervisor that restarts services while
gRPC and torch threads run saw the forked child segfault before exec. Note: the "parent" of the signal is the
thread that forked the child; the supervisor forks from one long-lived thread.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def arm(parent: int) -> bool:
    """SIGKILL this process when `parent` dies; False if it is already gone (then nobody would stop us)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent


def main() -> None:
    parent, command = int(sys.argv[1]), sys.argv[2:]
    if not arm(parent):
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
