"""Postgres: migrations, bulk writes, the artifact store."""
