"""Events and logs in: ingestion, bounds, fields, group commit, storage and migrations."""
