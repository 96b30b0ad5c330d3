"""The upstream doors: the HTTP API service and the Kafka client (RunsProducer)."""
