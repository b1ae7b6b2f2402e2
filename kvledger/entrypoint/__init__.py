"""The entrypoint: tokenization, CHECK before routing, the HTTP API."""
