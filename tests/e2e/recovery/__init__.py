"""Failures recovered end to end: node and peer loss, warm spares, stragglers, slow time."""
