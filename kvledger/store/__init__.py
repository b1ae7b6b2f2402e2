"""The block ledger: KV bytes of whole blocks by chain key, on disk (embedded) or on Redis (shared)."""
