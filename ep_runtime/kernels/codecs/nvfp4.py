"""The ``nvfp4`` codec: E2M1 codes, two a byte, an E4M3 scale per 16 elements and the tensor's
float32 global scale in every message (the NVFP4 format of :mod:`ep_runtime.core.formats`,
whose docstring states the rule; this module gives the same bits).

A message is ``S = H / 16`` code words (uint64: element ``16 b + i`` of the token in bits ``4 i
.. 4 i + 3`` of word ``b``, the bytes of the format's packed codes), the ``S`` scale bytes from
byte ``PB = 8 S``, the global scale's 4 bytes at ``G = PB + S`` (aligned: S is a multiple of 4),
then padding to ``MW`` words (never written or sent). The sender encodes a token part, a run of
whole blocks, a block per lane (its 4 bf16 words in, one code word and one scale byte out)
straight into every destination's slot where the transport stores (``tp.DIRECT``), else into a
stage row it then puts; pre-quantized codes and scales move as they are. The receiver lays a
message's scales out for the expanded layout, row- or column-major, and its global scale after
them (:func:`make_receiver`). See :mod:`ep_runtime.kernels.codecs` for the interface.

The global scale reaches the sender as ``token_global_scale_u8``, a float32's 4 bytes: the
caller's, or the one the runtime computed on the stream first (:func:`make_global_scale`:
``tensor_amax``, then ``global_scale_of_amax``). Pre-quantized input sends it as it is.

No hardware conversion: sm_90 has none to E2M1 (``cvt.rn.satfinite.e2m1x2.f32`` is sm_100's),
and one E4M3 scale per 16 elements is converted in software (:func:`e4m3_saturated_bits`).
"""

import functools
from types import SimpleNamespace

from ep_runtime.core.nvfp4_rule import E2M1_THRESHOLDS, NVFP4_GLOBAL_BYTES, NVFP4_GLOBAL_RANGE
from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import bf16_to_f32, f32_bits, f32_word_at, word_f32
from ep_runtime.kernels.block import group_max_u32, part_bounds, part_words, row_parts, warp_geometry, warp_sync
from ep_runtime.kernels.cuda_api import cuda, float32, inlined, int32, int64, kernel_jit, uint32, uint64
from ep_runtime.kernels.destinations import no_listed
from ep_runtime.kernels.fp8 import bf16_abs_max4, e4m3_bits, e4m3_value
from ep_runtime.kernels.protocol import E4M3_NAN, PEER_TOKENS
from ep_runtime.kernels.vec import address_of, load_pair, pairs_aligned, store_u8_at, store_u32_at, store_word_at

#: bf16 words (4 values each) of a 16-element block; a block's codes are one uint64 word.
BLOCK_WORDS = 4
#: Bytes of the global scale after the block scales.
GLOBAL_BYTES = NVFP4_GLOBAL_BYTES
#: A message is computed (encoded) from the caller's bf16 token, or taken pre-quantized.
RAW = False
ENCODES = True

#: float32 bits of 448, the largest E4M3 magnitude: larger quotients saturate to it.
_F32_BITS_448 = 0x43E00000
#: E4M3 code of 448.
_E4M3_SATURATED = 0x7E
#: The E2M1 rounding thresholds (ep_runtime/core/nvfp4_rule.py): a tie goes up at T1, T3, T5.
(_T0, _), (_T1, _), (_T2, _), (_T3, _), (_T4, _), (_T5, _), (_T6, _) = E2M1_THRESHOLDS
assert [up for _, up in E2M1_THRESHOLDS] == [False, True, False, True, False, True, False]


@cuda.jit(device=True)
def e2m1_code(q):
    """E2M1 code (uint32, 0..15) of float32 ``q`` (not NaN): the nearest of 0, 0.5, 1, 1.5, 2, 3,
    4, 6, ties to the even code, above 6 saturated to 6, the sign bit kept (as
    ``formats.e2m1_codes``: the count of thresholds ``|q|`` passes)."""
    a = abs(float32(q))
    c = uint32(0)
    if a > float32(_T0):
        c += uint32(1)
    if a >= float32(_T1):
        c += uint32(1)
    if a > float32(_T2):
        c += uint32(1)
    if a >= float32(_T3):
        c += uint32(1)
    if a > float32(_T4):
        c += uint32(1)
    if a >= float32(_T5):
        c += uint32(1)
    if a > float32(_T6):
        c += uint32(1)
    return c | ((f32_bits(q) >> uint32(28)) & uint32(8))


@cuda.jit(device=True)
def e4m3_saturated_bits(x):
    """E4M3 code (uint32) of float32 ``x``: ``e4m3_bits`` (round to nearest even), but magnitudes
    above 448 (inf included) saturate to 448 with the sign, and NaN gives 0x7F (as
    ``formats.e4m3_saturated``)."""
    u = f32_bits(x)
    a = u & uint32(0x7FFFFFFF)
    if a > uint32(0x7F800000):
        return uint32(E4M3_NAN)
    if a > uint32(_F32_BITS_448):
        return ((u >> uint32(24)) & uint32(0x80)) | uint32(_E4M3_SATURATED)
    return e4m3_bits(x)


@cuda.jit(device=True)
def e2m1_word(word, m):
    """uint64 of the four E2M1 codes of ``x * m`` for the bf16 values ``x`` of uint64 ``word``,
    value i's code in bits ``4 i ..`` (bits 16 and up zero)."""
    s = float32(m)
    return uint64(e2m1_code(word_f32(word, 0) * s) | (e2m1_code(word_f32(word, 1) * s) << uint32(4))
                  | (e2m1_code(word_f32(word, 2) * s) << uint32(8)) | (e2m1_code(word_f32(word, 3) * s) << uint32(12)))


@cuda.jit(device=True)
def encode_block(w0, w1, w2, w3, six_g, g):
    """``(codes uint64, scale code uint32)`` of a 16-element block (bf16 words ``w0..w3``, value
    ``4 k + i`` in bits ``16 i`` of word k) under global scale ``g`` (``six_g = 6 g``, rounded once):
    a block holding inf or NaN gets scale 0x7F and zero codes; else the scale is
    ``e4m3_saturated(amax / six_g)``, ``m = 1 / (S g)`` (0 where not finite) and each code
    ``e2m1(x * m)``: formats.py's rule, step for step."""
    a = bf16_abs_max4(w0, w1, w2, w3)
    if a >= uint32(0x7F80):  # inf or NaN (magnitude patterns order NaN above inf)
        return uint64(0), uint32(E4M3_NAN)
    code = e4m3_saturated_bits(bf16_to_f32(a) / float32(six_g))
    p = e4m3_value(code) * float32(g)
    m = float32(0.0)
    if p != float32(0.0):  # (1 / 0 is inf: m 0 all the same)
        m = float32(1.0) / p
        if (f32_bits(m) & uint32(0x7FFFFFFF)) >= uint32(0x7F800000):
            m = float32(0.0)
    codes = e2m1_word(w0, m) | (e2m1_word(w1, m) << uint64(16)) | (e2m1_word(w2, m) << uint64(32)) \
        | (e2m1_word(w3, m) << uint64(48))
    return codes, code


@cuda.jit(device=True)
def global_scale_bits(token_global_scale_u8):
    """The global scale's float32 bits (uint32) from its 4 bytes (little-endian)."""
    g = token_global_scale_u8
    return uint32(g[0]) | (uint32(g[1]) << uint32(8)) | (uint32(g[2]) << uint32(16)) | (uint32(g[3]) << uint32(24))


@cuda.jit(device=True)
def store_block(at0, PB, b, codes, scale, peer_bases, sent, slot):
    """Block ``b``'s code word and scale byte into a message: at byte address ``at0`` (a local
    row) when ``sent`` is zero, else into the slot (byte ``slot`` past ``peer_bases[PEER_TOKENS,
    d]``) of every PE d whose bit is set in ``sent``."""
    if sent == uint64(0):
        store_word_at(at0, b, uint64(codes))
        store_u8_at(at0 + uint64(PB), b, uint32(scale))
    else:
        for d in range(peer_bases.shape[1]):
            if (sent >> uint64(d)) & uint64(1):
                at = peer_bases[PEER_TOKENS, d] + slot
                store_word_at(at, b, uint64(codes))
                store_u8_at(at + uint64(PB), b, uint32(scale))


@cuda.jit(device=True)
def store_global(at0, G, bits, peer_bases, sent, slot):
    """The global scale's bits at byte ``G`` of a message (addressed as :func:`store_block`)."""
    if sent == uint64(0):
        store_u32_at(at0 + uint64(G), 0, bits)
    else:
        for d in range(peer_bases.shape[1]):
            if (sent >> uint64(d)) & uint64(1):
                store_u32_at(peer_bases[PEER_TOKENS, d] + slot + uint64(G), 0, bits)


@cuda.jit(device=True)
def store_block_listed(at0, PB, b, codes, scale, peer_bases, dl, slot):
    """:func:`store_block` of a build with destination lists: at ``at0`` when the list ``dl`` is
    empty, else into the slot of every PE it lists."""
    if no_listed(dl):
        store_word_at(at0, b, uint64(codes))
        store_u8_at(at0 + uint64(PB), b, uint32(scale))
    for x in range(1, dl[0] + 1):
        at = peer_bases[PEER_TOKENS, dl[x]] + slot
        store_word_at(at, b, uint64(codes))
        store_u8_at(at + uint64(PB), b, uint32(scale))


@cuda.jit(device=True)
def store_global_listed(at0, G, bits, peer_bases, dl, slot):
    """:func:`store_global` of a build with destination lists (addressed as
    :func:`store_block_listed`)."""
    if no_listed(dl):
        store_u32_at(at0 + uint64(G), 0, bits)
    for x in range(1, dl[0] + 1):
        store_u32_at(peer_bases[PEER_TOKENS, dl[x]] + slot + uint64(G), 0, bits)


def make_sender(spec, threads: int, tp, destinations, lands: bool) -> SimpleNamespace:
    """The nvfp4 codec's sender (:mod:`ep_runtime.kernels.codecs`), a token's destinations a
    mask or, where the transport was built with destination lists (``tp.LISTED``), a list (the
    ``*_listed`` functions). Its messages land whole: it flags no parts (``lands`` is the
    receiver's concern)."""
    warp, warps = warp_geometry(threads)
    DIRECT = tp.DIRECT
    # a constant the compiler prunes on: the mask builds keep their code in place
    LISTED = tp.LISTED
    no_dests = tp.no_dests
    to_block, to_global = (store_block_listed, store_global_listed) if LISTED else (store_block, store_global)

    @cuda.jit(device=True)
    def write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, b0, b1, S, src_pairs, at0, peer_bases,
                   sent, slot, lane):
        """Every lane of one warp: blocks ``[b0, b1)`` of token ``t``'s message, a block per lane
        (encoded from the bf16 words of ``tokens[t]``, loaded as word pairs where ``src_pairs``;
        or, ``prequantized`` nonzero, the caller's code words and scale bytes), and with the
        first part the global scale, stored as :func:`store_block` says."""
        PB = S * 8
        bits = global_scale_bits(token_global_scale_u8)
        g = f32_word_at(uint64(bits), 0)
        six_g = float32(6.0) * g
        row = tokens[t]
        for b in range(b0 + lane, b1, warp):
            if prequantized != 0:
                to_block(at0, PB, b, row[b], token_scales[t, b], peer_bases, sent, slot)
            else:
                w = b * BLOCK_WORDS
                if src_pairs:
                    p = load_pair(row, w)
                    q = load_pair(row, w + 2)
                    codes, scale = encode_block(p[0], p[1], q[0], q[1], six_g, g)
                else:
                    codes, scale = encode_block(row[w], row[w + 1], row[w + 2], row[w + 3], six_g, g)
                to_block(at0, PB, b, codes, scale, peer_bases, sent, slot)
        if b0 == 0 and lane == 0:
            to_global(at0, PB + S, bits, peer_bases, sent, slot)

    @cuda.jit(device=True)
    def put_message(tokens, token_scales, token_global_scale_u8, prequantized, rows, rows_u8, stage, stage_u8, me, t,
                    b0, b1, S, d):
        """Every lane of one warp: blocks ``[b0, b1)`` of token ``t``'s message (staged in
        ``stage[t]``, or the caller's codes and scales) put into row ``[me, t]`` of PE ``d``: a
        whole staged message in one put, a part as its codes and scales (and the first part the
        global scale)."""
        PB = S * 8
        G = PB + S
        if prequantized == 0 and b0 == 0 and b1 == S:
            shmem.put_nbi_warp(rows_u8[me, t, 0:G + GLOBAL_BYTES], stage_u8[t, 0:G + GLOBAL_BYTES], d)
        elif prequantized == 0:
            shmem.put_nbi_warp(rows[me, t, b0:b1], stage[t, b0:b1], d)
            shmem.put_nbi_warp(rows_u8[me, t, PB + b0:PB + b1], stage_u8[t, PB + b0:PB + b1], d)
            if b0 == 0:
                shmem.put_nbi_warp(rows_u8[me, t, G:G + GLOBAL_BYTES], stage_u8[t, G:G + GLOBAL_BYTES], d)
        else:  # straight from the caller's arrays
            shmem.put_nbi_warp(rows[me, t, b0:b1], tokens[t, b0:b1], d)
            shmem.put_nbi_warp(rows_u8[me, t, PB + b0:PB + b1], token_scales[t, b0:b1], d)
            if b0 == 0:
                shmem.put_nbi_warp(rows_u8[me, t, G:G + GLOBAL_BYTES], token_global_scale_u8[0:GLOBAL_BYTES], d)

    @cuda.jit(device=True)
    def put_part(tokens, token_scales, token_global_scale_u8, prequantized, rows, rows_u8, stage, stage_u8, me, t, b0,
                 b1, S, sent, R):
        """Every lane of one warp: :func:`put_message` to every PE whose bit is set in ``sent``."""
        for d in range(R):
            if (sent >> uint64(d)) & uint64(1):
                put_message(tokens, token_scales, token_global_scale_u8, prequantized, rows, rows_u8, stage, stage_u8,
                            me, t, b0, b1, S, d)

    @cuda.jit(device=True)
    def blocks_of(tokens, prequantized):
        """Blocks of a token: ``tokens`` holds bf16 words (4 a block) or code words (1 a block)."""
        if prequantized != 0:
            return tokens.shape[1]
        return tokens.shape[1] // BLOCK_WORDS

    @inlined
    def send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage, stage_u8,
                  row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        """Every thread of a token block: a warp per part of a token (a run of whole blocks, at
        least one per lane: ``row_parts``), encoded once (or the caller's codes and scales,
        pre-quantized) and stored into the slot of every PE with one of its experts where the
        transport stores (``DIRECT``); else encoded into stage row t and put (or put from the
        caller's arrays). Returns whether the rows went as plain stores."""
        tid = cuda.threadIdx.x
        lane = tid % warp
        all_warps = token_blocks * warps
        S = blocks_of(tokens, prequantized)
        parts = row_parts(T, S, all_warps, warp)
        span = part_words(S, parts, warp)  # blocks per part
        src_pairs = pairs_aligned(tokens)
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T * parts:
            t, b0, b1 = part_bounds(i, parts, span, S)
            sent = uint64(0)
            if b0 < b1:
                sent = destinations(ids_base + uint64(4 * t * K), K, L, R, me, uint64(0), ids_l)  # bit d: to d
            if sent != 0:  # (a token whose slots are all masked goes nowhere: zero would mean the stage row)
                if DIRECT:
                    slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
                    write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, b0, b1, S, src_pairs,
                               uint64(0), peer_bases, sent, slot, lane)
                else:
                    if prequantized == 0:
                        write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, b0, b1, S, src_pairs,
                                   address_of(stage[t]), peer_bases, uint64(0), uint64(0), lane)
                        warp_sync()  # the part is staged before the warp's puts read it
                    put_part(tokens, token_scales, token_global_scale_u8, prequantized, rows, rows_u8, stage, stage_u8,
                             me, t, b0, b1, S, sent, R)
            i += all_warps
        return DIRECT

    @inlined
    def send_rows_listed(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage,
                         stage_u8, row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        """:func:`send_rows` of a build with destination lists: the same parts and messages, each
        to every PE of the token's list."""
        tid = cuda.threadIdx.x
        lane = tid % warp
        all_warps = token_blocks * warps
        S = blocks_of(tokens, prequantized)
        parts = row_parts(T, S, all_warps, warp)
        span = part_words(S, parts, warp)  # blocks per part
        src_pairs = pairs_aligned(tokens)
        none = cuda.local.array(1, int32)  # the empty list: write into the stage row
        none[0] = 0
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T * parts:
            t, b0, b1 = part_bounds(i, parts, span, S)
            if b0 < b1:
                dl = destinations(ids_base + uint64(4 * t * K), K, L, R, me, uint64(0), ids_l)
                if no_dests(dl):
                    pass  # a token whose slots are all masked goes nowhere
                elif DIRECT:
                    slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
                    write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, b0, b1, S, src_pairs,
                               uint64(0), peer_bases, dl, slot, lane)
                else:
                    if prequantized == 0:
                        write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, b0, b1, S, src_pairs,
                                   address_of(stage[t]), peer_bases, none, uint64(0), lane)
                        warp_sync()  # the part is staged before the warp's puts read it
                    for x in range(1, dl[0] + 1):
                        put_message(tokens, token_scales, token_global_scale_u8, prequantized, rows, rows_u8, stage,
                                    stage_u8, me, t, b0, b1, S, dl[x])
            i += all_warps
        return DIRECT

    @inlined
    def pack_row(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane, mbuf, peer_bases, held, lo,
                 hi):
        """Every lane of one warp: token ``t``'s message (encoded here, or the caller's codes and
        scales) into the local row ``row``."""
        S = blocks_of(tokens, prequantized)
        if LISTED:
            none = cuda.local.array(1, int32)  # the empty list: write into the row
            none[0] = 0
            write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, 0, S, S, pairs_aligned(tokens),
                       address_of(row), peer_bases, none, uint64(0), lane)
        else:
            write_part(tokens, token_scales, token_global_scale_u8, prequantized, t, 0, S, S, pairs_aligned(tokens),
                       address_of(row), peer_bases, uint64(0), uint64(0), lane)

    return SimpleNamespace(MBUF_WORDS=1, HELD_WORDS=1, send_rows=send_rows_listed if LISTED else send_rows,
                           pack_row=pack_row)


@functools.lru_cache(maxsize=None)
def make_receiver(spec, threads: int) -> SimpleNamespace:
    """The nvfp4 codec's receiver: a message's ``XB = S + 4`` bytes after its codes laid out for
    expert row ``r`` of ``C``: the S scale bytes at ``r S + k`` (row-major) or ``k C + r``
    (``col_major`` nonzero), the global scale's 4 bytes at ``C S + 4 r`` (the float32 ``[C]``
    after the ``[C S]`` scales: ``layout.expert_scales_regions``)."""
    warp, _ = warp_geometry(threads)

    @cuda.jit(device=True)
    def store_extras(src8, P, XB, expert_scales8, r, C, col_major, lane, zero):
        """Every lane of one warp: the extras of the message ``src8`` (from byte ``P``; zeros when
        ``zero`` is nonzero, for padding rows) into expert row ``r``."""
        S = XB - GLOBAL_BYTES
        for k in range(lane, XB, warp):
            if k >= S:  # the global scale's bytes
                dst = C * S + GLOBAL_BYTES * r + (k - S)
            elif col_major != 0:
                dst = k * C + r
            else:
                dst = r * S + k
            expert_scales8[dst] = 0 if zero != 0 else src8[P + k]

    @cuda.jit(device=True)
    def lay_out(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane):
        """Every lane of a warp: the message's scales and global scale into expert row ``r``."""
        store_extras(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane, 0)

    @cuda.jit(device=True)
    def zero(XB, expert_scales_u8, r, C, col_major, lane):
        """Every lane of a warp: padding row ``r``'s scales and global scale, zero."""
        store_extras(expert_scales_u8, 0, XB, expert_scales_u8, r, C, col_major, lane, 1)

    return SimpleNamespace(lay_out=lay_out, zero=zero)


@functools.lru_cache(maxsize=None)
def make_global_scale(threads: int) -> SimpleNamespace:
    """The rule's global scale of a call's bf16 tokens, on the device, for a caller who passes
    none (``EPRuntime.dispatch_async``): ``tensor_amax`` (the whole grid) folds the largest
    finite magnitude into ``token_amax``, then ``global_scale_of_amax`` (one thread) turns it
    into ``token_global_scale`` and resets ``token_amax`` for the next call. Both run on the
    stream before dispatch_async (no host read: graph-safe)."""
    warp, _ = warp_geometry(threads)

    @kernel_jit(threads)
    def tensor_amax(tokens, valid_tokens, use_valid, token_amax):
        """Fold the largest finite bf16 magnitude pattern (``bits & 0x7FFF`` below 0x7F80) of the
        first T rows of ``tokens`` [Tc, W] uint64 words (4 values each; T = Tc, or ``min(Tc,
        valid_tokens[0])`` when use_valid, int64, is nonzero) into ``token_amax[0]`` (uint32,
        atomic max: a warp's maximum a warp). Every thread of the grid."""
        buf = cuda.shared.array(threads, int64)  # the simulator's scratch of group_max_u32
        W = tokens.shape[1]
        T = tokens.shape[0]
        if use_valid != 0:
            T = max(0, min(T, valid_tokens[0]))
        m = uint32(0)
        i = cuda.grid(1)
        while i < T * W:
            word = uint64(tokens[i // W, i % W])
            for j in range(4):
                v = uint32((word >> uint64(16 * j)) & uint64(0x7FFF))
                if v < uint32(0x7F80) and v > m:
                    m = v
            i += cuda.gridDim.x * threads
        m = group_max_u32(m, warp, buf)  # every lane
        if cuda.threadIdx.x % warp == 0 and m != uint32(0):
            cuda.atomic.max(token_amax, 0, m)

    @kernel_jit(threads)
    def global_scale_of_amax(token_amax, token_global_scale):
        """Thread 0: ``token_global_scale[0]`` = the amax of ``token_amax[0]`` (a bf16 magnitude
        pattern) over 2688, or 1.0 for 0 (IEEE division: formats.nvfp4_global_scale's); then
        ``token_amax[0]`` = 0."""
        if cuda.grid(1) == 0:
            a = token_amax[0]
            g = float32(1.0)
            if a != uint32(0):
                g = bf16_to_f32(a) / float32(NVFP4_GLOBAL_RANGE)
            token_global_scale[0] = g
            token_amax[0] = 0

    return SimpleNamespace(tensor_amax=tensor_amax, global_scale_of_amax=global_scale_of_amax)
