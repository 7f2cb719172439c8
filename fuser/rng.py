"""Random numbers inside kernels: ``rand_like`` as a Philox4x32-10 counter-based generator.

A counter-based generator needs no state per thread: random op ``r`` of a launch numbers its elements and draws
element ``i`` from the Philox block of counter ``(i / E, r, offset)`` under key ``seed``, where a block of four
32-bit words serves ``E`` consecutive elements: ``E = 4`` for float32 (word ``i % 4``), ``E = 8`` for float16 and
bfloat16 results (16 bits each: the high half of word ``(i / 2) % 4`` for even ``i``, the low half for odd; their
11 and 8 bits fit a half) and ``E = 2`` for float64 (words ``2 (i % 2)`` and the next). So any thread computes any
element, the vector and scalar paths agree, and the values do not depend on the inputs' layouts. A CUDA thread's
vector of 8 float16 elements computes one block, not eight (ten rounds of multiplies each: the float16/bfloat16
dropout's bound; four words a block would be two blocks, and half the random bits unused). ``(seed, offset)`` come
from torch's own generator at each launch (:func:`launch_state`), so ``torch.manual_seed`` makes runs repeatable
and two launches differ. The numbers are not the ones eager's ``rand_like`` draws (its kernels number their
elements differently); their distribution is the same: uniform on ``[0, 1)``, on a grid the result dtype holds
exactly (2^-24 for float32, 2^-53 for float64, 2^-11 for float16, 2^-8 for bfloat16), so 1.0 never appears.

Algorithm: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11).
"""
from __future__ import annotations

import re
from typing import Sequence

import torch

# C for both targets: the prelude defines FZ_FN (function qualifiers), the backend's RNG snippet FZ_MULHI
# (the high 32 bits of a*b)
PHILOX = r"""
// Philox4x32-10: ten rounds of two 32x32->64 multiplies and a key schedule
FZ_FN void fz_philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
  for (int round = 0; round < 10; ++round) {
    const unsigned int hi0 = FZ_MULHI(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
    const unsigned int hi1 = FZ_MULHI(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
    const unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
}
// block b of random op r: counter (b, r, offset); r takes the top byte of the block's high word
FZ_FN void fz_philox_at(unsigned int c[4], const unsigned int* st, unsigned int r, unsigned long long b) {
  c[0] = (unsigned int)b; c[1] = (unsigned int)(b >> 32) | (r << 24); c[2] = st[2]; c[3] = st[3];
  fz_philox(c, st[0], st[1]);
}
FZ_FN unsigned int fz_word(const unsigned int c[4], unsigned int j) {  // c[j] by selects (no local-memory array)
  return j == 0 ? c[0] : j == 1 ? c[1] : j == 2 ? c[2] : c[3];
}
// a word as uniform on [0, 1) with `bits` random bits (<= 24: exact in float, and in half/bfloat16 for 11/8 bits)
FZ_FN float fz_bits_f(unsigned int w, int bits) { return (float)(w >> (32 - bits)) * (1.0f / (float)(1u << bits)); }
// two words as uniform on [0, 1) in double (53 bits)
FZ_FN double fz_bits_d(unsigned int a, unsigned int b) {
  return (double)(((unsigned long long)a << 21) ^ (b >> 11)) * (1.0 / 9007199254740992.0);
}
// element i: word i % 4 of block i / 4; for `bits` <= 16 (float16, bfloat16) half i % 2 of word (i / 2) % 4 of block
// i / 8, the high half first (shifted to the top, where fz_bits_f takes its bits). Consecutive elements share a block
// (a vector loop computes its vector's blocks once: vector_words)
FZ_FN float fz_uniform_f(const unsigned int* st, unsigned int r, unsigned long long i, int bits) {
  const unsigned int h = bits <= 16 ? 1u : 0u;  // log2 of the elements a word
  unsigned int c[4];
  fz_philox_at(c, st, r, i >> (2u + h));
  return fz_bits_f(fz_word(c, (unsigned int)(i >> h) & 3u) << (((unsigned int)i & h) * 16u), bits);
}
// element i in double: words 2 * (i % 2) and the next of block i / 2
FZ_FN double fz_uniform_d(const unsigned int* st, unsigned int r, unsigned long long i) {
  unsigned int c[4];
  fz_philox_at(c, st, r, i >> 1);
  const unsigned int j = ((unsigned int)i & 1u) * 2u;
  return fz_bits_d(fz_word(c, j), fz_word(c, j + 1u));
}
"""

# a random op's call in a kernel body (the op table's rand_like template, its index still @IDX@)
_CALL = re.compile(r"fz_uniform_([fd])\(fz_rs, (\d+), @IDX@(?:, (\d+))?\)")


def elements_per_block(kind: str, bits: int) -> int:
    """Elements one Philox block (four words) serves: 2 in double (``kind`` "d"), 8 for a result of at most 16
    bits (two a word), else 4."""
    return 2 if kind == "d" else 8 if bits <= 16 else 4


def vector_words(body: Sequence[str], vec: int, vector: str, k: str) -> tuple[list[str], list[str]]:
    """A CUDA vector loop's random numbers drawn a block at a time: (lines that compute the Philox blocks of
    vector ``vector`` (elements ``vector * vec`` to ``vector * vec + vec - 1``), once, into ``fz_w<r>``; ``body``
    with each random op's call reading element ``k``'s words there). Without it, each of a vector's elements
    computes the block that it shares with others (the compiler does not merge them). A vector shorter than a block
    computes its block and picks its words by selects (``fz_word``). ``body`` unchanged and no lines where neither
    the vector nor the block is a whole number of the other."""
    calls = {}
    for line in body:
        for kind, r, bits in _CALL.findall(line):
            calls[int(r)] = elements_per_block(kind, int(bits or 53))
    if not calls or any(vec % e and e % vec for e in calls.values()):
        return [], list(body)
    lines = []
    for r, e in sorted(calls.items()):
        if vec >= e:
            blocks = vec // e
            lines.append(f"unsigned int fz_w{r}[{4 * blocks}];")
            lines += [f"fz_philox_at(fz_w{r} + {4 * q}, fz_rs, {r}u, (unsigned long long)({vector}) * {blocks}u + {q}u);"
                      for q in range(blocks)]
        else:  # part of one block: the vector's first element's place in it
            first = f"(unsigned long long)({vector}) * {vec}u"
            lines += [f"unsigned int fz_w{r}[4];", f"fz_philox_at(fz_w{r}, fz_rs, {r}u, {first} / {e}u);",
                      f"const unsigned int fz_j{r} = (unsigned int)({first} % {e}u);"]

    def words(m: re.Match) -> str:
        r, e = m.group(2), calls[int(m.group(2))]
        j = k if vec >= e else f"(fz_j{r} + {k})"  # the element's place in its block(s)
        word = (lambda w: f"fz_w{r}[{w}]") if vec >= e else (lambda w: f"fz_word(fz_w{r}, {w})")
        if m.group(1) == "d":
            return f"fz_bits_d({word(f'2 * {j}')}, {word(f'2 * {j} + 1')})"
        if e == 8:  # vec and the first element even: the half is k's
            return f"fz_bits_f({word(f'{j} >> 1')} << (({k} & 1) * 16), {m.group(3)})"
        return f"fz_bits_f({word(j)}, {m.group(3)})"

    return lines, [_CALL.sub(words, line) for line in body]


# bits per result dtype: the dtype's significand, so every value is exact and below 1
BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
N_STATE = 4  # float slots after the kernel's float arguments: seed low/high, offset low/high (uint32 each)
MAX_RANDOM_OPS = 256  # r must fit the counter's top byte


def _words(x: int) -> list[float]:
    return [float(x & 0xFFFFFFFF), float((x >> 32) & 0xFFFFFFFF)]


def state_words(seed: int, offset: int) -> list[float]:
    """The launch state a kernel reads from its last :data:`N_STATE` float slots: key ``seed`` and counter
    word ``offset`` (64 bits each) as uint32 values, low word first, exact in the kernel's double slots."""
    return _words(seed) + _words(offset)


def can_draw(device: torch.device) -> bool:
    """False while the current CUDA stream captures a graph: torch's generator refuses to give its offset then
    (a replay must advance it, which a value baked into the launch cannot), so a random group falls back and
    eager's ops, which capture, draw the numbers."""
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def launch_state(device: torch.device) -> list[float]:
    """(seed, offset) for one launch as four uint32 values (exact in the kernel's double slots), taken from
    torch's default generator of ``device``, which advances so that the next launch gets fresh numbers."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # torch's Philox offsets move in steps of 4
        return state_words(gen.initial_seed(), offset)
    # the CPU generator (a Mersenne twister) has no offset: draw a fresh 63-bit seed and offset from it
    seed, offset = torch.empty(2, dtype=torch.int64).random_().tolist()
    return state_words(seed, offset)
