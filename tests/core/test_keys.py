import os
import subprocess
import sys

import numpy as np
import pytest

from kvledger import ModelSpec, chain_keys
from kvledger.core import KEY_BYTES, extend_chain, root_key

SPEC = ModelSpec.preset("deepseek-v4.1-flash")
TOKENS = [(i * 7919) % 49152 for i in range(1000)]


def test_one_key_per_full_block():
    keys = chain_keys(TOKENS, SPEC)
    assert len(keys) == 1000 // 128 == 7
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    assert chain_keys(TOKENS[:127], SPEC) == []


def test_keys_of_a_prefix_are_a_prefix():
    assert chain_keys(TOKENS[:300], SPEC) == chain_keys(TOKENS, SPEC)[:2]


def test_a_change_invalidates_its_block_and_every_later_one():
    changed = list(TOKENS)
    changed[300] += 1  # block 2
    a, b = chain_keys(TOKENS, SPEC), chain_keys(changed, SPEC)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


def test_namespaces_never_share_a_key():
    a = set(chain_keys(TOKENS, SPEC, "tenant-a"))
    b = set(chain_keys(TOKENS, SPEC, "tenant-b"))
    assert not a & b
    assert chain_keys(TOKENS, SPEC) == chain_keys(TOKENS, SPEC, "default")


def test_models_never_share_a_key():
    assert not set(chain_keys(TOKENS, SPEC)) & set(chain_keys(TOKENS, ModelSpec.preset("tiny-v4")))


def test_root_fields_are_length_prefixed():
    # ("ab", "c") and ("a", "bc") style ambiguities must not collide
    assert root_key(SPEC, "ab") != root_key(SPEC, "a") and root_key(SPEC, "") != root_key(SPEC, "default")


def test_extend_chain_continues_a_chain():
    keys = chain_keys(TOKENS[:512], SPEC)
    more = extend_chain(keys[-1], TOKENS[512:], SPEC.block_size)
    assert keys + more == chain_keys(TOKENS, SPEC)


def test_numpy_and_list_inputs_agree():
    for dtype in (np.uint32, np.int64, np.int32):
        assert chain_keys(np.array(TOKENS, dtype=dtype), SPEC) == chain_keys(TOKENS, SPEC)


@pytest.mark.parametrize("bad", [[1, -1] * 64, [2**32] * 128, np.array([-1] * 128), [1.5] * 128, np.zeros((2, 128))])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(ValueError):
        chain_keys(bad, SPEC)


def test_golden_key():
    """A change here invalidates every stored block: bump FORMAT_VERSION with it."""
    keys = chain_keys(list(range(256)), ModelSpec.preset("smollm2-135m"), "golden")
    assert keys[0].hex() == GOLDEN[0] and keys[1].hex() == GOLDEN[1]


GOLDEN = (
    "ea56ba4030d25699423817a7bb069e04",
    "e607bfd240f37a6fe7be2224bfd0fe25",
)


def test_keys_are_identical_across_interpreters():
    code = ("import sys; from kvledger import ModelSpec, chain_keys; "
            "print(','.join(k.hex() for k in chain_keys([(i * 7919) % 49152 for i in range(1000)], "
            "ModelSpec.preset('deepseek-v4.1-flash'), 'tenant-a')))")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                check=True, timeout=60).stdout.strip())
    assert outs == {",".join(k.hex() for k in chain_keys(TOKENS, SPEC, "tenant-a"))}


def test_the_c_chain_matches_the_reference_loop():
    from kvledger.core import keys as k

    assert k._chain_c is not None, "the C accelerator was not built (needs gcc and OpenSSL headers)"
    rng = np.random.default_rng(7)
    for n_tokens in (0, 127, 128, 129, 4096 + 5):
        raw = k.token_bytes(rng.integers(0, 2**32, size=n_tokens, dtype=np.uint64).astype(np.uint32))
        parent = bytes(rng.integers(0, 256, size=16, dtype=np.uint8))
        assert k._chain_c(parent, raw, 512) == k.extend_chain_py(parent, raw, 512)
    with pytest.raises(ValueError):
        k._chain_c(b"short", raw, 512)


def test_any_namespace_gets_a_key_and_valid_ones_keep_theirs():
    keys = {root_key(SPEC, ns) for ns in ("\ud800", "\udfff", "x" * (1 << 20), "", "é")}
    assert len(keys) == 5
    # 'surrogatepass' changes nothing for a valid string: the golden key above still holds
    assert chain_keys(list(range(256)), ModelSpec.preset("smollm2-135m"), "golden")[0].hex() == GOLDEN[0]
    with pytest.raises(ValueError):
        root_key(SPEC, b"bytes")


def test_any_cache_salt_gets_a_namespace():
    from kvledger.core.keys import salted_namespace

    names = {salted_namespace("t", salt) for salt in ("\ud800", "x" * (1 << 17), "é", "e\u0301")}
    assert len(names) == 4 and all(n.startswith("t#salt-") for n in names)
    assert len({root_key(SPEC, n) for n in names}) == 4


# --- a published public prefix (rule 12) ---------------------------------------------------------------------------

def _prompt(spec, blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * spec.block_size + 7).astype(np.uint32)


def test_a_public_prefix_is_one_chain_for_every_tenant_and_what_follows_it_is_each_tenants_own():
    from kvledger.core import chain_keys

    spec = SPEC
    prompt = _prompt(spec, 5, 0)
    a = chain_keys(prompt, spec, "tenant-a", public_blocks=2)
    b = chain_keys(prompt, spec, "tenant-b", public_blocks=2)
    assert a[:2] == b[:2]                                   # the public blocks: shared
    assert not set(a[2:]) & set(b[2:])                      # the same text after them: never shared
    assert not set(a) & set(chain_keys(prompt, spec, "tenant-a"))   # unpublished, the tenant's chain throughout


def test_no_namespace_names_the_public_root():
    from kvledger.core import PUBLIC_NAMESPACE, public_root

    spec = SPEC
    assert public_root(spec) not in {root_key(spec, ns) for ns in ("", "public", PUBLIC_NAMESPACE, "default")}
    assert public_root(spec) != public_root(ModelSpec.preset("tiny-v4"))   # per model, as every root


@pytest.mark.parametrize("have", [0, 1, 2, 3, 5])
def test_a_chain_continued_from_any_block_is_the_chain_made_at_once(have):
    from kvledger.core import chain_keys, continue_chain

    spec = SPEC
    prompt = _prompt(spec, 5, 1)
    whole = chain_keys(prompt, spec, "t", public_blocks=2)
    assert continue_chain(prompt, spec, "t", whole[:have], public_blocks=2) == whole
    assert continue_chain(prompt, spec, "t", whole[:have], public_blocks=2, upto=max(have, 4)) == whole[:max(have, 4)]
