"""Test support that tests and tools import, never the library: `tests/test_layering.py` puts this
package above every other, so no megakd module can depend on it."""
