import hashlib
import struct
import subprocess
import sys

import pytest
from kvrelay.kvstore.block_key import block_keys, extend_block_keys
from kvrelay.kvstore.block_spec import BlockSpec

SPEC = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4, model_fingerprint="m")


def test_golden_values_pin_the_key_spec():
    fp = SPEC.fingerprint
    assert fp.hex() == hashlib.sha256(
        b"kvrelay.spec.v1|layers=2|kv_heads=2|head_dim=16|block=4|dtype=float32|model=m"
    ).hexdigest()
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size_tokens=4, spec_fingerprint=fp, salt=b"t1")
    assert len(keys) == 2  # the partial tail block gets no key
    k0 = hashlib.sha256(
        b"kvrelay.block.v1" + fp + struct.pack("<I", 2) + b"t1" + struct.pack("<4I", 1, 2, 3, 4)
    ).digest()
    k1 = hashlib.sha256(b"kvrelay.block.v1" + k0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert keys == [k0, k1]
    # Literal pin: a change to the hashing scheme must change this test on purpose.
    golden = block_keys([0, 1, 2, 3], block_size_tokens=4, spec_fingerprint=b"\x00" * 32)
    assert golden[0].hex() == hashlib.sha256(
        b"kvrelay.block.v1" + b"\x00" * 32 + b"\x00\x00\x00\x00" + bytes.fromhex("00000000010000000200000003000000")
    ).hexdigest()
    assert golden[0].hex() == "3c840ef0edf356874d0b19734004848e38be72fe9f24d5d23e00fd3f708da272"


def test_a_one_plane_latent_spec_names_its_layout_and_sizes_its_blocks():
    """MLA (DeepSeek): one plane of one row per token and layer; a two-plane spec keeps the v1 text."""
    latent = BlockSpec(num_layers=2, num_kv_heads=1, head_dim=40, block_size_tokens=4, model_fingerprint="m",
                       num_planes=1)
    assert latent.block_shape == (2, 1, 1, 4, 40) and latent.block_bytes == 2 * 40 * 4 * 4
    assert latent.token_bytes == 2 * 40 * 4
    assert latent.fingerprint.hex() == hashlib.sha256(
        b"kvrelay.spec.v1|layers=2|kv_heads=1|head_dim=40|block=4|dtype=float32|model=m|planes=1").hexdigest()
    assert BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4, model_fingerprint="m",
                     num_planes=2).fingerprint == SPEC.fingerprint
    with pytest.raises(ValueError, match="num_planes must be 2 .K and V. or 1 .a latent., got 3"):
        BlockSpec(num_layers=2, num_kv_heads=1, head_dim=40, num_planes=3)


def test_salt_and_fingerprint_separate_keys_and_chain_names_whole_prefix():
    fp = SPEC.fingerprint
    toks = list(range(8))
    a = block_keys(toks, block_size_tokens=4, spec_fingerprint=fp, salt=b"a")
    b = block_keys(toks, block_size_tokens=4, spec_fingerprint=fp, salt=b"b")
    other = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4, model_fingerprint="n")
    c = block_keys(toks, block_size_tokens=4, spec_fingerprint=other.fingerprint, salt=b"a")
    assert not set(a) & set(b) and not set(a) & set(c)
    d = block_keys([9, 9, 9, 9] + toks[4:], block_size_tokens=4, spec_fingerprint=fp, salt=b"a")
    assert d[1] != a[1]  # same second block, different first block


def test_extend_matches_full_computation():
    fp = SPEC.fingerprint
    toks = list(range(100, 123))
    keys = block_keys(toks[:9], block_size_tokens=4, spec_fingerprint=fp)
    extend_block_keys(keys, toks, block_size_tokens=4, spec_fingerprint=fp)
    assert keys == block_keys(toks, block_size_tokens=4, spec_fingerprint=fp)


def test_out_of_range_token_is_named():
    with pytest.raises(ValueError, match="token ids must be integers"):
        block_keys([1, 2, 3, 2**32], block_size_tokens=4, spec_fingerprint=SPEC.fingerprint)


def test_same_tokens_same_keys_in_separate_processes():
    code = (
        "from kvrelay.kvstore.block_key import block_keys; from kvrelay.kvstore.block_spec import BlockSpec;"
        "s = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4, model_fingerprint='m');"
        "print(','.join(k.hex() for k in block_keys(list(range(40)), block_size_tokens=4,"
        " spec_fingerprint=s.fingerprint, salt=b'x')))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip()
        for seed in (1, 2)
    }
    here = ",".join(k.hex() for k in block_keys(list(range(40)), block_size_tokens=4,
                                                spec_fingerprint=SPEC.fingerprint, salt=b"x"))
    assert outs == {here}
