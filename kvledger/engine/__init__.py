"""Reference engine: models, device block pool, state slots, scheduler, fetcher process, layer-wise swap-in.

`api` holds the records the server and the entrypoint use (no torch import); `engine.Engine` runs them."""
