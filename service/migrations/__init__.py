"""The database schema's Alembic migrations, shipped with the package: `ett service migrate` runs
them (service/migrate.py), and so does `alembic upgrade head` from the repository's root."""
