"""Claims the docs make about the code and the demo's settings, held to them: a changed setting
fails here until the sentence that states it changes too."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_demo_cadence_the_docs_state_is_local_demo_toml(doc):
    every = tomllib.loads((ROOT / "local" / "demo.toml").read_text())["trainer"]["publish_every_steps"]
    text = (ROOT / doc).read_text()
    # "a version every 10 steps or 60 s" is production's default, not the demo's
    stated = [int(n) for n in re.findall(r"a version every (\d+) steps(?! or)", text)]
    stated += [int(n) for n in re.findall(r"a demo version \((\d+) steps of", text)]
    assert stated, f"{doc} no longer states the demo's cadence: drop this test's case with the sentence"
    assert set(stated) == {every}, f"{doc} says a version every {stated} steps; local/demo.toml: {every}"


def test_no_doc_says_no_process_uses_a_database_server():
    # the release controller can keep its state in PostgreSQL (release/store.py)
    for doc in ("README.md", "docs/architecture.md"):
        assert "No process uses a database" not in (ROOT / doc).read_text(), doc


def test_runbooks_point_to_the_release_controller_not_an_older_model_directory():
    runbooks = ROOT / "dashboards" / "runbooks"
    assert "no release controller" not in (runbooks / "policy-collapse.md").read_text().lower()
    for name in ("serving-errors.md", "policy-collapse.md"):
        text = (runbooks / name).read_text()
        assert "flywheel release undo --to" in text, name
        assert "restart serving on the previous version's directory" not in text, name
    assert "`flywheel-release`" in (runbooks / "process-down.md").read_text()


def test_the_deploy_guides_memory_table_is_flywheel_sizing():
    """The guide said the gpu overlay ran 'up to about 8B' on one trainer GPU with full
    fine-tuning, against its own 16 bytes per parameter; its table is now flywheel/sizing.py's,
    which tests/unit/test_gpu_overlay.py holds the overlay to."""
    from flywheel import sizing

    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert sizing.markdown() in guide, \
        "regenerate docs/deploy.md's Devices and memory table: python -c 'from flywheel import sizing; print(sizing.markdown())'"
    assert "up to about 8B" not in guide
    assert f"trains LoRA (rank {sizing.GPU_OVERLAY.lora_rank}) by\ndefault" in guide


def test_the_partitions_and_replication_the_guide_says_the_manifests_set_are_every_roles():
    """'The manifests set 4 and 3' was true of ingest and reward only; the other roles created a
    missing topic with the defaults (replication factor 1) if they started first."""
    from k8s_render import kustomize, pod_spec

    guide = (ROOT / "docs" / "deploy.md").read_text()
    [(partitions, replication)] = re.findall(r"sets? (\d+) and (\d+)", guide.split("## From zero", 1)[1].split("\n2.")[0])
    for overlay in ("cpu", "gpu"):
        for w in (r for r in kustomize(ROOT / "deploy" / "k8s" / "overlays" / overlay) if pod_spec(r)):
            env = {e["name"]: e.get("value") for e in pod_spec(w)["containers"][0]["env"]}
            assert (env.get("FLYWHEEL_KAFKA_PARTITIONS"), env.get("FLYWHEEL_KAFKA_REPLICATION_FACTOR")) == \
                (partitions, replication), f"{overlay}: {w['metadata']['name']}"


def test_the_guide_offers_an_object_store_only_with_what_reads_one():
    """The guide offered `s3://` checkpoints 'and no volume', with no s3fs installed and a
    release controller that reads only its local store. Now: the s3 extra the guide names holds
    s3fs, the image installs it, and the controller fetches an announced URL
    (tests/integration/test_object_store*.py run them)."""
    import inspect

    from release.controller import verified_dir

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    guide = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert "### Checkpoints on an object store" in (ROOT / "docs" / "deploy.md").read_text()
    assert "flywheel[s3]" in guide and "AWS_ENDPOINT_URL" in guide
    assert any(re.match(r"s3fs\b", r) for r in extras["s3"])
    assert "[${EXTRA},s3]" in (ROOT / "deploy" / "Dockerfile").read_text()
    assert "fetch_version(uri" in inspect.getsource(verified_dir)
    assert "does not replace this volume yet" not in guide


def test_serving_adapters_and_the_stream_stages_database_are_stated_as_they_are():
    """docs/trainer.md said serving could not load adapter versions (serve.lora does, through
    serving/adapters.py); docs/architecture.md said ingest and reward kept their state in SQLite
    only (stream.database_url puts it in PostgreSQL, docs/shared-state.md)."""
    from flywheel.settings import Settings

    trainer = (ROOT / "docs" / "trainer.md").read_text()
    assert "Serving does not load adapter versions" not in trainer
    assert "`serve.lora`" in trainer and (ROOT / "serving" / "adapters.py").is_file()
    assert "lora" in type(Settings().serve).model_fields
    architecture = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    assert "Only the release controller may use a database server" not in architecture
    assert "Ingest and reward keep their state in PostgreSQL too" in architecture
    assert "database_url" in type(Settings().stream).model_fields


def test_the_key_rotation_waits_for_every_serving_replica_before_the_signer_switches():
    """Serving reads a changed Secret within about a minute: a signer restarted at once signs
    routings a replica still on the old key alone refuses (unknown_key). Step 1 ends with the wait,
    on the gauge serving really exports."""
    from flywheel.signing import SERVING_RELEASE

    guide = (ROOT / "docs" / "deploy.md").read_text()
    section = guide.split("### Rotating the signing keys", 1)[1].split("\n## ", 1)[0]
    step1 = section.split("# 1.", 1)[1].split("# 2.", 1)[0]
    assert "wait until every serving replica trusts both" in step1
    assert f"{SERVING_RELEASE.trusted} < 2" in step1
