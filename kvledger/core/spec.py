"""Model descriptions: what a model's KV looks like to the two ledgers.

A `ModelSpec` says, per model, how big one 128-token block of block-ledger KV is,
how big one sliding-window snapshot is, and which kinds of attention its layers
use. Everything is in bytes and tokens. Nothing here knows about weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from enum import StrEnum

# The model `kvledger serve`, `entrypoint`, `engine` and `up` run when none is named; `kvledger diff`
# and `kvledger plan` default to it too, so their figures are the ones a newcomer's server reports.
DEFAULT_MODEL = "smollm2-135m"
# The model DESIGN.md's figures are for: the store, state and cluster benchmarks and the demo's plan size by it.
PUBLISHED_MODEL = "deepseek-v4.1-flash"
# DESIGN.md: a 128K-token V4 prompt takes 13 s to first token without a hit.
PUBLISHED_PREFILL_TOKENS_PER_S = 131_072 / 13
PUBLISHED_PREFILL_SOURCE = "published in DESIGN.md: 128K tokens in 13 s"


class LayerKind(StrEnum):
    """The attention of one layer, as the ledgers see it.

    SWA  sliding-window only: its KV is state, never history.
    CSA  compressed sparse attention: one entry per `csa_ratio` tokens plus indexer K
         (history), next to a sliding-window branch (state).
    HCA  heavily compressed attention: one entry per `hca_ratio` tokens (history),
         next to a sliding-window branch (state).
    FULL plain full attention (Llama): every token's K and V are history.
    """

    SWA = "swa"
    CSA = "csa"
    HCA = "hca"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The KV geometry of one model.

    Invariants (checked at construction):
      - `block_size` is a multiple of every compression ratio (lcm(4, 128) = 128 for V4);
      - a model has a sliding window iff it has SWA/CSA/HCA layers;
      - `swa_stored_layers` <= number of layers; the remaining layers' windows are the
        dropped region of a snapshot (YoCo consumer layers, rebuilt by recompute).
    """

    name: str
    layers: tuple[LayerKind, ...]
    block_size: int
    window: int | None            # sliding window in tokens; None: no sliding-window layers
    backtrack: int                # speculative rollback slack in tokens (also absorbs the decode copy overshoot)
    kv_bytes_per_token: int       # block-ledger main KV of all layers, bytes per token
    indexer_bytes_per_token: int  # indexer K of all layers, bytes per token (0: none, or not published)
    swa_stored_layers: int        # layers whose window a snapshot keeps
    swa_bytes_per_token: int      # sliding-window KV of one layer, bytes per token
    csa_ratio: int | None = None
    hca_ratio: int | None = None
    prefill_store_extra: int = 0  # extra ring tokens a prefill engine keeps to store at a 128 boundary
    yoco_keep: int = 0            # extra ring tokens kept for the YoCo truncation anchor
    description: str = ""
    # Rule 3′: the truncated-window fallback is taken by default only by a model trained for it (V4's
    # YoCo). Every other windowed model resumes exactly, from the latest snapshot at or below L1. Not KV
    # geometry: not in the fingerprint.
    approximate_fallback: bool = False
    # First-order prefill throughput (tokens/s) and where the figure comes from: what `kvledger plan`
    # prices a cold prefill at (its --prefill-tps overrides it). None: not known (plan falls back to
    # DESIGN.md's published V4 rate). Neither is KV geometry, so neither is in the fingerprint.
    prefill_tokens_per_s: float | None = None
    prefill_source: str = ""
    # SHA-256 (hex) of the weights of a model served from a path ("": a preset, whose name says which
    # weights). When set it stands in the fingerprint for the name: two paths to one file are one model and
    # share blocks; two files of one geometry never do (rule 1).
    weights: str = ""

    def __post_init__(self) -> None:
        assert self.layers, "a model has layers"
        assert self.block_size > 0
        assert self.backtrack >= 0
        windowed = any(k is not LayerKind.FULL for k in self.layers)
        assert windowed == (self.window is not None), "window set iff windowed layers exist"
        if self.window is not None:
            assert self.window > 0 and 0 < self.swa_stored_layers <= len(self.layers)
        for ratio in (self.csa_ratio, self.hca_ratio):
            assert ratio is None or self.block_size % ratio == 0, "block must align every compression ratio"
        if self.csa_ratio and self.hca_ratio:
            assert self.block_size == math.lcm(self.csa_ratio, self.hca_ratio)
        assert self.prefill_tokens_per_s is None or self.prefill_tokens_per_s > 0

    # --- presets ---------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A built-in spec by name; `ValueError` lists the known names."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(_PRESETS))}") from None

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(sorted(_PRESETS))

    # --- geometry --------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def has_swa(self) -> bool:
        """True when a prefix hit needs a sliding-window snapshot (or a replay) to be exact."""
        return self.window is not None

    @property
    def windowed_layers(self) -> int:
        """Layers with a sliding window (every kind but FULL): the windows a snapshot could keep."""
        return sum(1 for k in self.layers if k is not LayerKind.FULL)

    @property
    def reserve_tokens(self) -> int:
        """R of rules 3 and 3′: prompt tokens at the end that are always computed.

            | model                                   | R      | why                                      |
            |-----------------------------------------|--------|------------------------------------------|
            | a snapshot drops some windows (V4 YoCo) | W + K  | the dropped windows are rebuilt from the |
            |   swa_stored_layers < windowed_layers   | (134)  | last W + K tokens, recomputed            |
            | a snapshot keeps every window (Gemma 3) | 1      | the snapshot at L1 restores all exactly  |
            | no sliding window (Llama)               | 1      | the last token is always computed        |
        """
        dropped = self.window is not None and self.swa_stored_layers < self.windowed_layers
        return self.window + self.backtrack if dropped else 1

    @property
    def max_copy_overshoot(self) -> int:
        """How far past a block boundary a decode replica copy may run (rule 4): backtrack − 1."""
        return max(self.backtrack - 1, 0)

    def inference_ring(self) -> int:
        """Sliding-window ring of a decoding sequence: window + backtrack (134 for V4); 0 without SWA."""
        return self.window + self.backtrack if self.window is not None else 0

    def kvstore_ring(self, extra_state: bool = True) -> int:
        """Ring of a prefill engine that stores snapshots at 128 boundaries (396 for V4)."""
        extra = self.prefill_store_extra + self.yoco_keep if extra_state and self.window is not None else 0
        return self.inference_ring() + extra

    def state_size_to_disk(self) -> int:
        """Bytes of one snapshot: stored layers × inference ring × bytes per token per layer."""
        return self.swa_stored_layers * self.inference_ring() * self.swa_bytes_per_token

    def bytes_per_token(self) -> int:
        """Block-ledger bytes per token: main KV plus indexer K."""
        return self.kv_bytes_per_token + self.indexer_bytes_per_token

    def all_layers_bytes_per_token(self) -> int:
        """K and V of every layer for one token, the windowed ones included: what a store without a state ledger
        keeps per cached token (the baseline the state ledger is measured against)."""
        return self.kv_bytes_per_token + self.windowed_layers * self.swa_bytes_per_token

    def block_bytes(self) -> int:
        """Bytes of one block on the block ledger (main KV + indexer K of `block_size` tokens)."""
        return self.block_size * self.bytes_per_token()

    def layer_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kind in self.layers:
            counts[kind.value] = counts.get(kind.value, 0) + 1
        return counts

    def fingerprint(self) -> str:
        """A stable hex digest of everything that shapes this model's KV (part of every chain key): the
        geometry, and the name of a preset or the weights digest of a model served from a path."""
        fields = asdict(self)
        fields["layers"] = [k.value for k in self.layers]
        for not_geometry in ("description", "prefill_tokens_per_s", "prefill_source", "approximate_fallback"):
            fields.pop(not_geometry)
        fields.pop("name" if self.weights else "weights")   # presets: their fingerprints as before the field
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canon).hexdigest()[:32]


def _v4_layers(n_layers: int, n_swa_only: int) -> tuple[LayerKind, ...]:
    """V4 layout: `n_swa_only` sliding-window layers, then CSA and HCA interleaved (CSA first)."""
    rest = n_layers - n_swa_only
    return (LayerKind.SWA,) * n_swa_only + tuple(LayerKind.CSA if i % 2 == 0 else LayerKind.HCA for i in range(rest))


def _tiny_v4() -> ModelSpec:
    """V4's structure at toy size, for the reference engine.

    8 layers (2 SWA, then CSA/HCA × 3); per layer: sliding-window latent 64 × fp16 = 128 B/token;
    compressed entry 64 × fp16 = 128 B; CSA indexer key 32 × fp16 = 64 B per entry.
    Block-ledger bytes per token: 3 CSA × 128/4 + 3 HCA × 128/128 = 99 (main), 3 × 64/4 = 48 (indexer).
    The first 4 layers' windows are stored; the last 4 are YoCo consumers (dropped region).
    """
    layers = _v4_layers(8, 2)
    csa, hca, entry, idx_entry = 4, 128, 128, 64
    n_csa = layers.count(LayerKind.CSA)
    n_hca = layers.count(LayerKind.HCA)
    main = n_csa * entry // csa + n_hca * entry // hca
    indexer = n_csa * idx_entry // csa
    return ModelSpec(
        name="tiny-v4", layers=layers, block_size=math.lcm(csa, hca), window=128, backtrack=6,
        kv_bytes_per_token=main, indexer_bytes_per_token=indexer,
        swa_stored_layers=4, swa_bytes_per_token=128, csa_ratio=csa, hca_ratio=hca,
        prefill_store_extra=128, yoco_keep=134,
        description="DeepSeek-V4 structure at toy size (reference engine)",
        # docs/engine.md "kvledger bench ttft": a cold 32,768-token prompt in 47.0 s on the 2-core CPU reference
        # engine (2026-11-30, a loaded machine)
        prefill_tokens_per_s=32_768 / 47.0,
        prefill_source="measured: 32,768 tokens cold in 47 s on the CPU reference engine",
    )


def _gemma3_270m() -> ModelSpec:
    """Gemma 3 270M (DESIGN.md, "Rules 3–4 for other hybrid models").

    18 layers, 5 sliding-window (W = 512) then 1 full attention, three times (full at 5, 11, 17);
    1 KV head × 256 dims; K and V in bf16: 2 × 256 × 2 = 1,024 B per token per layer.
    Block ledger: the 3 full layers, 3 × 1,024 B = 3,072 B per token, 393,216 B per block.
    A snapshot keeps all 15 windowed layers (nothing dropped, so R = 1): 15 × (512 + 6) × 1,024 B
    = 7,956,480 B. The prefill ring holds one block more than a window, so the snapshot at
    c = p = ⌊(L − 1)/B⌋·B ≥ L − 128 still lies in it at the end of prefill: 518 + 128 = 646.
    Exact resume only (rule 3′): the truncated-window fallback is not what the model was trained for.
    """
    layers = tuple(LayerKind.FULL if (i + 1) % 6 == 0 else LayerKind.SWA for i in range(18))
    per_layer = 2 * 1 * 256 * 2   # (K, V) × 1 KV head × 256 dims × bf16
    return ModelSpec(
        name="gemma3-270m", layers=layers, block_size=128, window=512, backtrack=6,
        kv_bytes_per_token=layers.count(LayerKind.FULL) * per_layer, indexer_bytes_per_token=0,
        swa_stored_layers=layers.count(LayerKind.SWA), swa_bytes_per_token=per_layer,
        prefill_store_extra=128,
        description="Gemma 3 270M (5 sliding-window : 1 full, W = 512, 1 KV head × 256, bf16 KV)",
        approximate_fallback=False,
        # tests/engine/models/test_gemma3.py's prompt: 726 tokens cold in 4.6 s on the 2-core CPU reference engine,
        # 1 torch thread (2026-12-02, load ≈ 1); `kvledger bench ttft --model gemma3-270m` is to measure it at 4K-32K
        prefill_tokens_per_s=726 / 4.6,
        prefill_source="measured: 726 tokens cold in 4.6 s on the CPU reference engine",
    )


_PRESETS: dict[str, ModelSpec] = {
    "deepseek-v4.1-flash": ModelSpec(
        name="deepseek-v4.1-flash",
        layers=_v4_layers(43, 2),
        block_size=math.lcm(4, 128),
        window=128,
        backtrack=6,
        kv_bytes_per_token=890,       # published global KV (FP4 caching, cross-layer reuse)
        indexer_bytes_per_token=0,    # indexer K is not published: block_bytes() is a lower bound
        swa_stored_layers=20,
        swa_bytes_per_token=528,      # MXFP8 sliding-window KV, per layer
        csa_ratio=4,
        hca_ratio=128,
        prefill_store_extra=128,
        yoco_keep=134,
        description="DeepSeek-V4.1-Flash (published figures; indexer K not included)",
        approximate_fallback=True,
        prefill_tokens_per_s=PUBLISHED_PREFILL_TOKENS_PER_S,
        prefill_source=PUBLISHED_PREFILL_SOURCE,
    ),
    "tiny-v4": _tiny_v4(),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        layers=(LayerKind.FULL,) * 30,
        block_size=128,
        window=None,
        backtrack=0,
        kv_bytes_per_token=30 * 2 * 3 * 64 * 2,  # layers × (K, V) × 3 KV heads × 64 dims × bf16
        indexer_bytes_per_token=0,
        swa_stored_layers=0,
        swa_bytes_per_token=0,
        description="SmolLM2-135M (Llama, full attention, GQA 3 KV heads × 64, bf16 KV)",
        # issue 18: a cold ~2K-token chat prompt took ~2.5 s in `kvledger serve` on the 2-core CPU
        # reference engine, i.e. about 800 tokens/s. The rate moves with threads and load (`kvledger bench
        # ttft --tokens 2048`, 1 torch thread on the shared machine, 2026-12-01: 8.7 s) and falls for
        # longer prompts (attention); `kvledger plan --prefill-tps` overrides it.
        prefill_tokens_per_s=800.0,
        prefill_source="measured: ~2K tokens cold in ~2.5 s on the CPU reference engine",
    ),
    "gemma3-270m": _gemma3_270m(),
}
