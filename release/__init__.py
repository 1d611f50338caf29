"""Release controller: gate, canary, then promote or roll back each version (``flywheel release serve``)."""
