"""The revisions, oldest first (Alembic reads them by file; this marks the folder a package to ship)."""
