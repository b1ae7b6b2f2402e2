"""Small helpers shared by several packages (process management, no kvledger logic)."""
