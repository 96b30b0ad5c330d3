"""`agentruns demo` and `agentruns chaos`."""
