"""kvledger as a vLLM v1 KV connector (`--kv-transfer-config` with
`"kv_connector_module_path": "kvledger.integrations.vllm"`, `"kv_connector": "KvledgerConnector"`).

The connector class is imported lazily, so `kvledger.integrations.vllm.*` modules that do not
need vLLM (config, records, the scheduler and worker sides, the bench) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvledgerConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvledgerConnector":
        from kvledger.integrations.vllm.connector import KvledgerConnector

        return KvledgerConnector
    raise AttributeError(name)
