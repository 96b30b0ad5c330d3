"""Helpers shared by the integration and end-to-end tests (fixtures live in conftest.py)."""
