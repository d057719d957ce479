"""The persistent tier: DCP saves in the background, their folders and commit, and loading a saved state into place."""
