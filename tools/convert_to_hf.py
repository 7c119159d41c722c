"""Export a megakd run/checkpoint/model directory to HuggingFace format.

Same as `megakd convert to-hf SRC OUT [--force]`; kept as a script for users who expect one.
"""

import sys

from megakd.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "to-hf", *sys.argv[1:]]))
