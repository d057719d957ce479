"""The webhooks a job's `notify` asks for: signed deliveries, retried until they land."""
