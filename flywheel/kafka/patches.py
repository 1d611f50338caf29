"""Fixes for kafka-python defects that would stop or mislead a reader, installed explicitly.

Each is named for the defect it works around and lives in a module of its own:

- :func:`~flywheel.kafka.headers.tolerate_bad_header_keys`: a record whose header key is not
  UTF-8 raised inside the fetcher and stopped the consumer for good (flywheel/kafka/headers.py);
- :func:`~flywheel.kafka.batches.tolerate_unreadable_batches`: a batch that cannot be unpacked
  (an unknown codec, a corrupt payload) did the same (flywheel/kafka/batches.py);
- :func:`~flywheel.kafka.ends.record_last_stable_offsets`: a read_committed consumer was not
  told where it can read to, so its lag counted open transactions (flywheel/kafka/ends.py).

:func:`install_client_patches` is called by every factory that makes a consumer
(flywheel/kafka/clients.py); it is idempotent, and nothing is patched merely by importing.
"""

from __future__ import annotations

from flywheel.kafka.batches import tolerate_unreadable_batches
from flywheel.kafka.ends import record_last_stable_offsets
from flywheel.kafka.headers import tolerate_bad_header_keys


def install_client_patches() -> None:
    """Install every patch above (again is a no-op)."""
    tolerate_bad_header_keys()
    tolerate_unreadable_batches()
    record_last_stable_offsets()
