"""A rank of the launcher test that fails on purpose: `python failing_worker.py FOLDER HOW`.

raise   rank 1 raises an error; rank 0 waits
killed  rank 1 dies of SIGKILL; rank 0 then raises, as a collective whose peer died does
"""

import os
import signal
import sys
import time


def main(folder: str, how: str) -> None:
    rank, pid_file = int(os.environ["RANK"]), os.path.join(folder, "rank1.pid")
    if rank == 1:
        if how == "raise":
            raise RuntimeError("a bug in rank 1")
        with open(pid_file + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".part", pid_file)
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while how == "killed" and time.monotonic() < deadline:
        if os.path.exists(pid_file) and not os.path.exists(f"/proc/{open(pid_file).read()}"):
            raise RuntimeError("Connection reset by peer (rank 1)")
        time.sleep(0.01)
    time.sleep(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    main(*sys.argv[1:])
