"""Warm servers: forks, stale servers, learned imports, spares warmed ahead."""
