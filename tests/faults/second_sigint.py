"""`python -m tests.faults.second_sigint ARGS`: `megakd ARGS` (an ELECTRA pretraining run) whose second
optimizer step receives two SIGINTs in its first micro-batch.

The second SIGINT is sent only once megakd has handled the first (its "received SIGINT" warning), and
the micro-batch then waits for the second one's KeyboardInterrupt: both land inside the step however
slow the machine is, so the test of "a second SIGINT aborts at once" depends on no time window.
Two signals sent back to back could merge into one pending signal; these cannot.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from megakd.cli import console
from megakd.engine.layouts import DecoupledElectra

STEP = 1  # 0-based: the second optimizer step, after one logged step
WAIT_S = 60  # a bound that only a broken handler reaches (the run then saves, and the test fails)


class _FirstHandled(logging.Handler):
    seen = False

    def emit(self, record: logging.LogRecord) -> None:
        if "received SIGINT" in record.getMessage():
            _FirstHandled.seen = True


def _wait(done) -> None:
    """Sleep in short slices (a signal's Python handler runs in each) until `done()` or WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


def _micro_step_with_two_sigints(real):
    sent = False

    def micro_step(self, run, batch, step):
        nonlocal sent
        if step.index == STEP and not sent:
            sent = True
            os.kill(os.getpid(), signal.SIGINT)
            _wait(lambda: _FirstHandled.seen)
            os.kill(os.getpid(), signal.SIGINT)
            _wait(lambda: False)  # ended by the second SIGINT's KeyboardInterrupt
        return real(self, run, batch, step)

    return micro_step


if __name__ == "__main__":
    logging.getLogger("megakd").addHandler(_FirstHandled())
    DecoupledElectra.micro_step = _micro_step_with_two_sigints(DecoupledElectra.micro_step)
    console()
