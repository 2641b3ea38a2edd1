"""XXH3-64 in plain Python, written from the algorithm's description (xxhash's doc/xxhash_spec.md,
version 0.8), for the known-answer tests: an oracle that shares no code with the two
implementations fsdpkit runs (the C library vendored in third_party/xxhash, built into
`_rowhash`, and the one python-xxhash bundles). Slow (pure Python): meant for a few KiB.

    xxh3_64(data: bytes, seed: int = 0) -> int

Only the constants below come from the specification; each input-length class (0, 1-3, 4-8,
9-16, 17-128, 129-240, longer) has its own branch, as the specification describes them.
"""

from __future__ import annotations

M64 = (1 << 64) - 1

PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
PRIME64_4, PRIME64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1, PRIME_MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25

# The default 192-byte secret (kSecret).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
STRIPE_LEN, ACC_NB, SECRET_CONSUME_RATE = 64, 8, 8
MIDSIZE_MAX, MIDSIZE_START_OFFSET, MIDSIZE_LAST_OFFSET = 240, 3, 17
SECRET_SIZE_MIN, SECRET_LASTACC_START, SECRET_MERGEACCS_START = 136, 7, 11


def _u32(b: bytes, at: int) -> int:
    return int.from_bytes(b[at:at + 4], "little")


def _u64(b: bytes, at: int) -> int:
    return int.from_bytes(b[at:at + 8], "little")


def _swap32(x: int) -> int:
    return int.from_bytes((x & 0xFFFFFFFF).to_bytes(4, "little"), "big")


def _swap64(x: int) -> int:
    return int.from_bytes((x & M64).to_bytes(8, "little"), "big")


def _rotl64(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _mul128_fold64(a: int, b: int) -> int:
    p = (a & M64) * (b & M64)
    return (p ^ (p >> 64)) & M64


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * PRIME64_2) & M64
    h ^= h >> 29
    h = (h * PRIME64_3) & M64
    return h ^ (h >> 32)


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * PRIME_MX1) & M64
    return h ^ (h >> 32)


def _rrmxmx(h: int, length: int) -> int:
    h ^= _rotl64(h, 49) ^ _rotl64(h, 24)
    h = (h * PRIME_MX2) & M64
    h ^= (h >> 35) + length
    h = (h * PRIME_MX2) & M64
    return h ^ (h >> 28)


def _mix16(data: bytes, at: int, secret: bytes, s_at: int, seed: int) -> int:
    lo = _u64(data, at) ^ ((_u64(secret, s_at) + seed) & M64)
    hi = _u64(data, at + 8) ^ ((_u64(secret, s_at + 8) - seed) & M64)
    return _mul128_fold64(lo, hi)


def _len_0(seed: int) -> int:
    return _xxh64_avalanche(seed ^ _u64(SECRET, 56) ^ _u64(SECRET, 64))


def _len_1to3(data: bytes, seed: int) -> int:
    n = len(data)
    combined = (data[0] << 16) | (data[n >> 1] << 24) | data[n - 1] | (n << 8)
    bitflip = ((_u32(SECRET, 0) ^ _u32(SECRET, 4)) + seed) & M64
    return _xxh64_avalanche(combined ^ bitflip)


def _len_4to8(data: bytes, seed: int) -> int:
    n = len(data)
    seed ^= _swap32(seed) << 32
    bitflip = ((_u64(SECRET, 8) ^ _u64(SECRET, 16)) - seed) & M64
    value = (_u32(data, n - 4) + (_u32(data, 0) << 32)) & M64
    return _rrmxmx(value ^ bitflip, n)


def _len_9to16(data: bytes, seed: int) -> int:
    n = len(data)
    lo = _u64(data, 0) ^ (((_u64(SECRET, 24) ^ _u64(SECRET, 32)) + seed) & M64)
    hi = _u64(data, n - 8) ^ (((_u64(SECRET, 40) ^ _u64(SECRET, 48)) - seed) & M64)
    return _avalanche((n + _swap64(lo) + hi + _mul128_fold64(lo, hi)) & M64)


def _len_17to128(data: bytes, seed: int) -> int:
    n = len(data)
    acc = n * PRIME64_1
    pairs = [(0, 0)]  # (input offset from the front, secret offset): each with its mirror from the back
    if n > 32:
        pairs.append((16, 32))
    if n > 64:
        pairs.append((32, 64))
    if n > 96:
        pairs.append((48, 96))
    for front, s in pairs:
        acc += _mix16(data, front, SECRET, s, seed)
        acc += _mix16(data, n - front - 16, SECRET, s + 16, seed)
    return _avalanche(acc & M64)


def _len_129to240(data: bytes, seed: int) -> int:
    n = len(data)
    acc = n * PRIME64_1
    for i in range(8):
        acc += _mix16(data, 16 * i, SECRET, 16 * i, seed)
    acc = _avalanche(acc & M64)
    for i in range(8, n // 16):
        acc += _mix16(data, 16 * i, SECRET, 16 * (i - 8) + MIDSIZE_START_OFFSET, seed)
    acc += _mix16(data, n - 16, SECRET, SECRET_SIZE_MIN - MIDSIZE_LAST_OFFSET, seed)
    return _avalanche(acc & M64)


def _custom_secret(seed: int) -> bytes:
    out = bytearray()
    for i in range(len(SECRET) // 16):
        out += ((_u64(SECRET, 16 * i) + seed) & M64).to_bytes(8, "little")
        out += ((_u64(SECRET, 16 * i + 8) - seed) & M64).to_bytes(8, "little")
    return bytes(out)


def _accumulate_512(acc: list[int], data: bytes, at: int, secret: bytes, s_at: int) -> None:
    for i in range(ACC_NB):
        value = _u64(data, at + 8 * i)
        key = value ^ _u64(secret, s_at + 8 * i)
        acc[i ^ 1] = (acc[i ^ 1] + value) & M64
        acc[i] = (acc[i] + (key & 0xFFFFFFFF) * (key >> 32)) & M64


def _scramble(acc: list[int], secret: bytes, s_at: int) -> None:
    for i in range(ACC_NB):
        a = acc[i]
        a ^= a >> 47
        a ^= _u64(secret, s_at + 8 * i)
        acc[i] = (a * PRIME32_1) & M64


def _long(data: bytes, seed: int) -> int:
    n = len(data)
    secret = _custom_secret(seed)
    acc = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1]
    stripes_per_block = (len(secret) - STRIPE_LEN) // SECRET_CONSUME_RATE
    block_len = STRIPE_LEN * stripes_per_block
    blocks = (n - 1) // block_len
    for b in range(blocks):
        for s in range(stripes_per_block):
            _accumulate_512(acc, data, b * block_len + s * STRIPE_LEN, secret, s * SECRET_CONSUME_RATE)
        _scramble(acc, secret, len(secret) - STRIPE_LEN)
    stripes = ((n - 1) - block_len * blocks) // STRIPE_LEN
    for s in range(stripes):
        _accumulate_512(acc, data, blocks * block_len + s * STRIPE_LEN, secret, s * SECRET_CONSUME_RATE)
    _accumulate_512(acc, data, n - STRIPE_LEN, secret, len(secret) - STRIPE_LEN - SECRET_LASTACC_START)
    result = n * PRIME64_1
    for i in range(4):
        at = SECRET_MERGEACCS_START + 16 * i
        result += _mul128_fold64(acc[2 * i] ^ _u64(secret, at), acc[2 * i + 1] ^ _u64(secret, at + 8))
    return _avalanche(result & M64)


def xxh3_64(data: bytes, seed: int = 0) -> int:
    """XXH3-64 of `data` with `seed` (taken mod 2**64), as an unsigned int."""
    data, seed, n = bytes(data), seed & M64, len(data)
    if n == 0:
        return _len_0(seed)
    if n <= 3:
        return _len_1to3(data, seed)
    if n <= 8:
        return _len_4to8(data, seed)
    if n <= 16:
        return _len_9to16(data, seed)
    if n <= 128:
        return _len_17to128(data, seed)
    if n <= MIDSIZE_MAX:
        return _len_129to240(data, seed)
    return _long(data, seed)
