"""``python -m trainer``: the trainer entrypoint for launchers that run a module (torchrun, deepspeed)."""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
