"""``python -m trainer``: the trainer entrypoint for launchers that run a module (torchrun, deepspeed)."""

import sys

from flywheel.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
