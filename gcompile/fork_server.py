"""Imported by the server ranks are forked from (gcompile.launch.PRELOAD), and by nothing else: the server
ignores SIGTERM, as it ignores SIGINT and as multiprocessing's resource tracker ignores both.

The server is in the launcher's process group; the ranks are not (sessions of their own). A SIGTERM to
that group (a job scheduler ending a job step, `kill -TERM -- -PGID`) would end the server, and
multiprocessing reads every rank of a dead server as exited: the launcher would stop waiting, and its
ranks would leave with it, in the middle of --exit-signal-handler's save. The server still ends with the
launcher (multiprocessing closes its pipe), and each rank takes SIGTERM back (gcompile.launch._run_rank).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
