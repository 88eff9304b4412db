"""pith-models."""
