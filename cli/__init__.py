"""The ``flywheel`` command (cli/main.py): one subcommand per process role, plus the operator
tools that are no stage's (``flywheel deadletters``, ``flywheel config``)."""
