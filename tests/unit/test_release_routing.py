"""The routing record the controller publishes (release/streams.py ``release_event``): each canary
carries its own salt for the hash that splits users, fixed for the whole canary."""

from __future__ import annotations

from flywheel.contracts import VersionRef
from release.store import Revision
from release.streams import release_event


def ref(version: int) -> VersionRef:
    return VersionRef(version=version, uri=f"file:///ckpt/v{version}", manifest_sha256=f"{version:064x}")


def rev(revision: int, stable: int, canary: int | None, share: float = 0.1) -> Revision:
    return Revision(revision, stable, canary, share if canary else 0.0, "why", 1.0)


def test_each_canary_has_its_own_salt_which_every_revision_of_it_repeats():
    first = release_event(rev(1, 0, 5), "prod", ref)
    again = release_event(rev(2, 0, 5, share=0.3), "prod", ref)  # the same canary, a new share
    second = release_event(rev(4, 0, 6), "prod", ref)
    assert first.canary_salt and first.canary_salt == again.canary_salt  # a user keeps their arm
    assert second.canary_salt != first.canary_salt  # the next canary draws a fresh split
    assert release_event(rev(1, 0, 5), "staging", ref).canary_salt != first.canary_salt
    # a version rebuilt under the same number (a wiped checkpoint store) is another canary
    other = release_event(rev(1, 0, 5), "prod", lambda v: ref(v).model_copy(update={"manifest_sha256": "f" * 64}))
    assert other.canary_salt != first.canary_salt
    assert release_event(rev(3, 5, None), "prod", ref).canary_salt == ""  # no canary, no salt
