"""The signals that stop a run: preemption (SIGTERM from Slurm or `timeout`, SIGUSR1 as a
pre-timeout warning) and Ctrl-C.

A training process turns them into a checkpoint at the next step boundary
(`megakd.engine.session.RunSession.stop_signals`); DataLoader workers ignore them
(`megakd.data.workers`), so a signal sent to the whole process group cannot kill a worker first.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
