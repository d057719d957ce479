"""Integrations with training frameworks; each imports its framework, so import it by name."""
