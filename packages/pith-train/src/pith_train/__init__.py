"""pith-train."""
