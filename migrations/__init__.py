"""The database schema's Alembic migrations. No module imports them: Alembic reads them by path,
run by `ett service migrate` (service/migrate.py finds them beside the service package) or by
`alembic upgrade head` from the repository's root. A package only so the wheel installs them."""
