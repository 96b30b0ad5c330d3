"""The development harness: the local Kafka and Postgres (`stack`), the scripted model, tool and
MCP servers (`servers`), and the demo and chaos runs (`demo`). Production code never imports it
(tests/unit/test_layers.py); the command line's development commands and `agentruns run` do."""
