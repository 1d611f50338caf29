"""Running Flywheel on one machine: the embedded Kafka-protocol broker (local/broker.py) and the
demo (local/demo.py). Production runs each stage alone against a real cluster instead."""
