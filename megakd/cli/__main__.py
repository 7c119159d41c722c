"""`python -m megakd.cli`, as the launch/ scripts run it."""

from megakd.cli import console

if __name__ == "__main__":  # importing this module (tests/test_layering.py imports them all) runs nothing
    console()
