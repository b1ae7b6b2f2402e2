"""Reference engine: models, device block pool, state slots, scheduler, fetcher, layer-wise swap-in."""
