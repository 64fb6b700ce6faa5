/* crc32c kernels of the verified copy: a chunk's crc32c (Castagnoli, bit-reflected), alone or
 * while the chunk is copied, by the fastest way this CPU has.
 *
 * - "fold": AVX-512 with VPCLMULQDQ (x86-64 server cores of recent years). 256 bytes at a
 *   time are loaded into four 512-bit registers, stored to the target, and folded into four
 *   accumulators by carry-less multiplication: each 128-bit lane, a polynomial over GF(2),
 *   is moved 256 bytes on (multiplied by x^2048 modulo the polynomial, in two 64-by-32-bit
 *   products) and the next 256 bytes added. The bytes are checked in the registers they are
 *   copied through: one read of memory, at the speed of a plain copy. What the accumulators
 *   hold at the end is, as a message of 256 bytes, the same crc's worth as everything folded
 *   into them; the crc32 instruction finishes it.
 * - "insn": the SSE4.2 crc32 instruction over three interleaved streams, their registers
 *   joined by multiplying in GF(2); a copy runs memcpy a block at a time, then checks the
 *   block where it landed while it is still in the core's cache.
 *
 * Every function works on the crc register, not inverted: a chunk's crc32c is
 * ~f(..., 0xffffffff).
 */
#ifndef FLASHCKPT_CRC32C_H
#define FLASHCKPT_CRC32C_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CRC_INSN 1
#include <immintrin.h>
#else
#define HAVE_CRC_INSN 0
#endif

#define POLY 0x82f63b78u /* Castagnoli, bit-reflected */
#define STREAM 4096      /* bytes of each of the three streams the crc instruction interleaves */
#define BLOCK (128u << 10) /* "insn" copies: bytes copied, then checked in cache, at a time */
#define FOLD_MIN 512     /* fewer bytes: the crc instruction alone is as fast */
#define STREAM_MIN (1u << 20) /* chunks this large are stored past the caches */

/* a * b modulo the polynomial, in the reflected representation (x^0 is the top bit). */
static uint32_t gf2_mul(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return product;
}

/* x^(8 n) modulo the polynomial: what shifting a crc register past n zero bytes multiplies by. */
static uint32_t x_pow_8n(uint64_t n) {
    uint32_t result = 1u << 31, square = 1u << 23; /* x^0 and x^8 */
    while (n) {
        if (n & 1)
            result = gf2_mul(square, result);
        square = gf2_mul(square, square);
        n >>= 1;
    }
    return result;
}

/* x^k modulo the polynomial as the 64-bit operand of a carry-less multiplication whose
 * other operand is a reflected 64-bit lane: bit 63 - i holds x^i (so the product lands at
 * the lane's own alignment, with no shift). */
static uint64_t fold_constant(unsigned k) {
    uint64_t normal = 1; /* x^k mod P in the normal representation: bit i holds x^i */
    for (unsigned i = 0; i < k; i++) {
        normal <<= 1;
        if (normal >> 32 & 1)
            normal ^= 0x11edc6f41ull;
    }
    uint64_t reflected = 0;
    for (int i = 0; i < 32; i++)
        if (normal >> i & 1)
            reflected |= 1ull << (63 - i);
    return reflected;
}

static uint32_t shift_one, shift_two; /* past one stream of a block, and past two */
static uint64_t fold_first, fold_second; /* a lane's first and second 8 bytes, 256 bytes on */
static int have_insn, have_fold, use_fold;

#if HAVE_CRC_INSN
__attribute__((target("sse4.2"))) static uint32_t crc_insn(const uint8_t *p, size_t n,
                                                         uint32_t reg) {
    uint64_t a = reg;
    while (n >= 3 * STREAM) {
        uint64_t b = 0, c = 0;
        for (size_t i = 0; i < STREAM; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + STREAM + i, 8);
            memcpy(&z, p + 2 * STREAM + i, 8);
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            c = _mm_crc32_u64(c, z);
        }
        a = gf2_mul(shift_two, (uint32_t)a) ^ gf2_mul(shift_one, (uint32_t)b) ^ (uint32_t)c;
        p += 3 * STREAM;
        n -= 3 * STREAM;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t x;
        memcpy(&x, p, 8);
        a = _mm_crc32_u64(a, x);
    }
    uint32_t r = (uint32_t)a;
    for (; n; n--, p++)
        r = _mm_crc32_u8(r, *p);
    return r;
}

/* "insn" copy: a block at a time, memcpy'd, then checked where it landed. */
static uint32_t copy_crc_insn(uint8_t *dst, const uint8_t *src, size_t n, uint32_t reg) {
    for (size_t p = 0; p < n; p += BLOCK) {
        size_t m = n - p < BLOCK ? n - p : BLOCK;
        memcpy(dst + p, src + p, m);
        reg = crc_insn(dst + p, m, reg);
    }
    return reg;
}

#define FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2")))

/* One accumulator moved 256 bytes on, plus the next 256 bytes' share ``x``. */
#define FOLD(acc, k, x)                                                                        \
    _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00),                          \
                              _mm512_clmulepi64_epi128(acc, k, 0x11), x, 0x96)

FOLD_TARGET static uint32_t fold_end(const __m512i acc[4], const uint8_t *tail, size_t n) {
    uint8_t folded[256];
    for (int i = 0; i < 4; i++)
        _mm512_storeu_si512(folded + 64 * i, acc[i]);
    return crc_insn(tail, n, crc_insn(folded, sizeof folded, 0));
}

/* The crc register after ``n`` bytes (at least FOLD_MIN) copied from ``src`` to ``dst``, or
 * only read where ``dst`` is NULL. The register enters by being added to the first bytes. */
FOLD_TARGET static uint32_t fold_crc(uint8_t *dst, const uint8_t *src, size_t n, uint32_t reg) {
    const __m512i k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_second,
                                                            (long long)fold_first));
    __m512i acc[4];
    for (int i = 0; i < 4; i++)
        acc[i] = _mm512_loadu_si512(src + 64 * i);
    if (dst)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_si512(dst + 64 * i, acc[i]);
    acc[0] = _mm512_xor_si512(acc[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    /* Large chunks with a target aligned as a tensor's are stored past the caches. */
    const int stream = dst && n >= STREAM_MIN && ((uintptr_t)dst & 63) == 0;
    size_t p = 256;
    for (; p + 256 <= n; p += 256) {
        __m512i x[4];
        for (int i = 0; i < 4; i++)
            x[i] = _mm512_loadu_si512(src + p + 64 * i);
        for (int i = 0; dst && i < 4; i++) {
            if (stream)
                _mm512_stream_si512((void *)(dst + p + 64 * i), x[i]);
            else
                _mm512_storeu_si512(dst + p + 64 * i, x[i]);
        }
        for (int i = 0; i < 4; i++)
            acc[i] = FOLD(acc[i], k, x[i]);
    }
    if (stream)
        _mm_sfence();
    if (dst)
        memcpy(dst + p, src + p, n - p);
    return fold_end(acc, src + p, n - p);
}
#endif

/* The crc register after the ``n`` bytes at ``p``. */
static uint32_t crc_any(const uint8_t *p, size_t n, uint32_t reg) {
#if HAVE_CRC_INSN
    if (use_fold && n >= FOLD_MIN)
        return fold_crc(NULL, p, n, reg);
    return crc_insn(p, n, reg);
#else
    return reg;
#endif
}

/* Copy ``n`` bytes from ``src`` to ``dst`` and return the crc register after them. */
static uint32_t copy_crc(uint8_t *dst, const uint8_t *src, size_t n, uint32_t reg) {
#if HAVE_CRC_INSN
    if (use_fold && n >= FOLD_MIN)
        return fold_crc(dst, src, n, reg);
    return copy_crc_insn(dst, src, n, reg);
#else
    memcpy(dst, src, n);
    return reg;
#endif
}

/* Ready the constants and find what this CPU has; "fold" is used where it can be. */
static void crc_init(void) {
    shift_one = x_pow_8n(STREAM);
    shift_two = x_pow_8n(2 * STREAM);
    /* A lane's first 8 bytes are its x^127..x^64, its second x^63..x^0 (reflected): moving
     * it 2048 bits on multiplies them by x^(2048 + 64) and x^2048; the products come out of
     * the instruction one bit short, which the constants' one power less makes up. */
    fold_first = fold_constant(2048 + 64 - 1);
    fold_second = fold_constant(2048 - 1);
#if HAVE_CRC_INSN
    __builtin_cpu_init();
    have_insn = __builtin_cpu_supports("sse4.2");
    have_fold = have_insn && __builtin_cpu_supports("avx512f") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
#endif
    use_fold = have_fold;
}

#endif
