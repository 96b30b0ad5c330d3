"""The projection: the sink into Postgres, replay and audit of the topics."""
