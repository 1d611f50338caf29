"""The example flywheel.toml is generated from the settings and loads back to the defaults."""

from pathlib import Path

from cli.configdoc import example_toml
from flywheel.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_committed_example_is_current():
    assert (ROOT / "flywheel.toml.example").read_text() == example_toml(), (
        "run `flywheel config example > flywheel.toml.example`"
    )


def test_example_loads_back_to_the_defaults(tmp_path):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(example_toml())
    assert load_settings(env={}, config_file=cfg) == Settings()


def test_every_field_is_documented():
    text = example_toml()
    assert "env: FLYWHEEL_SERVE_PORT" in text and "env: FLYWHEEL_KAFKA_BOOTSTRAP" in text
    undocumented = [
        line for prev, line in zip(text.splitlines(), text.splitlines()[1:])
        if line.startswith("# env:") and not prev.startswith("# ")
    ]
    assert not undocumented, undocumented
