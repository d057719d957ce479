"""The framework integrations: Hugging Face, Lightning, Accelerate, the framework API."""
