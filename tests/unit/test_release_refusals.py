"""What approvers read when an action is refused: an undo's verification error without the
server's filesystem paths (release/actions.py ``without_paths``)."""

from __future__ import annotations

import pytest

from release.actions import verification_refused, without_paths


@pytest.mark.parametrize(("text", "shown"), [
    # what verify_dir raises on a damaged file: the store's directory, then the file
    ("/srv/flywheel/checkpoints/v00000001: model.safetensors hash mismatch (got ab…, manifest cd…)",
     "v00000001: model.safetensors hash mismatch (got ab…, manifest cd…)"),
    # an OSError's text quotes the path
    ("[Errno 2] No such file or directory: '/tmp/flywheel-verify-x1/version/model.safetensors'",
     "[Errno 2] No such file or directory: 'model.safetensors'"),
    ("cannot open store URI 'file:///var/lib/ckpt/v3': denied", "cannot open store URI 'v3': denied"),
    ("no manifest.json at s3://bucket/prefix/v3/: not in the store", "no manifest.json at v3: not in the store"),
    ("a directory ends in a slash: /data/ckpt/ and more", "a directory ends in a slash: ckpt and more"),
    ("the root alone: / is gone", "the root alone:  is gone"),
    # not paths: a fraction, a ratio, words with slashes inside
    ("1/2 of the shards, and/or the parent", "1/2 of the shards, and/or the parent"),
    ("version 3 has neither weights nor a parent", "version 3 has neither weights nor a parent"),
])
def test_without_paths_keeps_the_last_part_of_each_path(text, shown):
    assert without_paths(text) == shown


def test_a_verification_refusal_names_the_error_and_the_file_but_no_directory():
    exc = FileNotFoundError(2, "No such file or directory", "/srv/ckpt/v00000001/model.safetensors")
    refused = str(verification_refused(1, exc))
    assert refused == ("version 1 failed verification, stable stays: FileNotFoundError: "
                       "[Errno 2] No such file or directory: 'model.safetensors'")
