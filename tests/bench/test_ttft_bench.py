"""`kvledger bench ttft` side by side in one run: what each run kind reuses and computes, and which are exact."""

import torch

from kvledger.bench.ttft_bench import measure

torch.set_num_threads(1)   # `--threads 1`: the suite shares its machine, where a second thread spins


def test_each_run_kind_reuses_what_its_rule_says(tmp_path):
    """tiny-v4 (W = 128, R = 134), 1,024 tokens, checkpoints every 256: cap 768; the latest checkpoint below it
    is 512; the fallback truncates at 640 (and reports it); the exact kinds answer as cold."""
    r = measure("tiny-v4", 1024, "cpu", str(tmp_path), repeat=1, period=256, chunk=1024, greedy=4)
    got = {k: (v["n"], v["hit_kind"], v["cached_tokens"], v["computed_tokens"]) for k, v in r["runs"].items()}
    assert got == {"stored": (1, "miss", 0, 1024), "cold": (1, "miss", 0, 1024), "hit": (1, "snapshot", 768, 256),
                   "device": (1, "snapshot", 768, 256), "periodic": (1, "snapshot", 512, 512),
                   "fallback": (1, "fallback", 640, 384), "replay": (1, "replay", 768, 384)}
    for kind in ("cold", "hit", "periodic"):
        assert r["runs"][kind]["greedy_match"] and r["runs"][kind]["logits_max_rel_err"] <= 1e-3, kind
    assert r["runs"]["fallback"]["logits_max_rel_err"] > 1e-3   # windows truncated: not the cold answer
    assert r["runs"]["hit"]["ttft_s"] > 0 and r["hit_over_cold"] == r["runs"]["hit"]["over_cold"]
    b = r["bytes"]   # rule 4: c = 768, p = 896; checkpoints at 256, 512
    assert (b["stored_tokens"], b["snapshots_rule4"], b["snapshots_checkpoints"]) == (1024, 2, 2)
    assert b["block_disk_bytes"] >= 8 * 18_816   # 8 blocks of 18,816 B and the segments' metadata
    assert b["per_stored_token_rule4"] == (b["block_disk_bytes"] + 2 * 68_608) / 1024


def test_a_full_attention_model_has_no_windowed_kinds_and_a_serial_baseline(tmp_path):
    """SmolLM2: cold, hit, device, and serial, the hit with streaming off (its forward after the whole fetch); the
    page cache dropped before each hit (--drop-cache), so the fetch reads the disk."""
    r = measure("smollm2-135m", 512, "cpu", str(tmp_path), repeat=1, chunk=512, greedy=2, drop_cache=True,
                stream_hits=True)
    assert list(r["runs"]) == ["stored", "cold", "hit", "device", "serial"] and r["runs"]["hit"]["hit_kind"] == "full"
    hit = r["runs"]["hit"]   # a prompt of whole blocks, all stored: L − 1 reused, the last token computed
    assert (hit["cached_tokens"], hit["computed_tokens"]) == (511, 1) and hit["greedy_match"]
    assert hit["split"]["fetch_s"] > 0 and hit["split"]["streamed"]
    device = r["runs"]["device"]   # the same hit with its blocks still in the engine: nothing fetched
    assert (device["cached_tokens"], device["computed_tokens"]) == (511, 1) and device["greedy_match"]
    assert device["split"]["fetch_s"] == 0 and device["logits_max_rel_err"] == hit["logits_max_rel_err"]
    serial = r["runs"]["serial"]   # the same hit, its forward once every block is in: the same answer
    assert not serial["split"]["streamed"] and serial["split"]["fetch_s"] > 0 and serial["greedy_match"]
    assert serial["logits_max_rel_err"] == hit["logits_max_rel_err"] and r["drop_cache"]
    assert r["streamed_over_serial"] == hit["ttft_s"] / serial["ttft_s"]
    f = r["floor"]   # a streamed hit: the longer of a plain read of the hit's 4 blocks and the device run
    assert f["read_s"] > 0 and f["streamed"] and f["floor_s"] == max(f["read_s"], device["ttft_s"])
    assert f["serial_floor_s"] == f["read_s"] + f["device_ttft_s"]
    assert f["hit_over_floor"] == hit["ttft_s"] / f["floor_s"]
