"""kvledger under other serving engines: `kvledger.integrations.vllm` is a vLLM v1 KV connector."""
