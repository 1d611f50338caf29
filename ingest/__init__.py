"""Ingest stage: join generations with user feedback into episodes, exactly once (``flywheel ingest``)."""
