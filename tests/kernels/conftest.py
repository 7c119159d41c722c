"""Run Triton kernels on CPU through the interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated; megakd.kernels imports
its Triton modules lazily (on the first ``backend="triton"`` call), so setting it here, before any
test runs, is early enough. ``backend="auto"`` never picks the interpreter, so other tests in the
session are unaffected.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
