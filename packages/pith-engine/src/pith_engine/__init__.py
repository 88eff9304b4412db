"""pith-engine."""
