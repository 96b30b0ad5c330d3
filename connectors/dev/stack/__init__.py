"""The local development stack: Kafka and Postgres processes, service resolution, supervision."""
