"""`BufferLayout`: every region's shape, dtype, size and offset against figures worked out by
hand (the arithmetic is written out below, never taken from the layout's own formulas), for a
DeepSeek-V3-like layer and a small padded one; plus alignment, non-overlap, totals, the group
dimension, `describe()`, owners and `region()`'s error.
"""

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import MAX_COPY_PLACERS, BufferLayout

MiB = 1 << 20

#: (a) DeepSeek-V3-like: R=8, E=256 (L=32), K=8, H=7168, T=4096, pad 1, C = worst case.
DSV3 = EPConfig(n_ranks=8, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=4096)
#: (b) small: R=2, E=8 (L=4), K=2, H=64, T=16, pad 4, C = 50 (worst case would be 76).
SMALL = EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=16, pad_multiple=4,
                 max_recv_rows=50)

u16, i32, i64, u64, f32 = (np.dtype(t) for t in ("uint16", "int32", "int64", "uint64", "float32"))

# Expected tables: name -> (shape, dtype, nbytes, offset), in allocation order.
# Offsets: each region starts at the end of the previous one rounded up to 256 bytes.

# (a) C = 8 ranks * 4096 tokens * min(8, 32) = 262144 rows.
DSV3_SYMMETRIC = {
    # [R, T, H] u16 (one buffer, no group axis): 8 * 4096 * 7168 * 2 B = 469,762,048 B (448 MiB)
    "dispatch_tokens": ((8, 4096, 7168), u16, 469_762_048, 0),
    # [G, R, T, K] i32: 2 * 8 * 4096 * 8 * 4 B = 2,097,152 B; starts at 469,762,048
    "dispatch_topk_ids": ((2, 8, 4096, 8), i32, 2_097_152, 469_762_048),
    # [G, R, T, K] f32: 2,097,152 B; 469,762,048 + 2,097,152 = 471,859,200
    "dispatch_topk_weights": ((2, 8, 4096, 8), f32, 2_097_152, 471_859_200),
    # [G, R, L + 1] i32: 2 * 8 * 33 * 4 B = 2112 B; 471,859,200 + 2,097,152 = 473,956,352
    "dispatch_counts": ((2, 8, 33), i32, 2112, 473_956_352),
    # [G, R, T, K] i32: 2,097,152 B; 473,956,352 + 2112 = 473,958,464 -> round up to 256: 473,958,656
    "dispatch_ranks": ((2, 8, 4096, 8), i32, 2_097_152, 473_958_656),
    # [G, R] u64: 2 * 8 * 8 B = 128 B; 473,958,656 + 2,097,152 = 476,055,808
    "dispatch_signal": ((2, 8), u64, 128, 476_055_808),
    # [G, R] u64: 128 B; 476,055,808 + 128 = 476,055,936 -> 476,056,064
    "dispatch_route_signal": ((2, 8), u64, 128, 476_056_064),
    # [G, R, T, H] u16: 939,524,096 B; 476,056,064 + 128 = 476,056,192 -> 476,056,320
    "combine_partials": ((2, 8, 4096, 7168), u16, 939_524_096, 476_056_320),
    # [R] u64 (monotonic credits, no group axis): 64 B; 476,056,320 + 939,524,096 = 1,415,580,416
    "dispatch_token_credit": ((8,), u64, 64, 1_415_580_416),
    # [R, T, 16] u64 (monotonic part flags): 8 * 4096 * 16 * 8 = 4,194,304 B; 1,415,580,480 -> 1,415,580,672
    "combine_row_flag": ((8, 4096, 16), u64, 4_194_304, 1_415_580_672),
    # [R, T, 16] u64 (monotonic token-part flags): 4,194,304 B; 1,415,580,672 + 4,194,304 = 1,419,774,976
    "dispatch_row_flag": ((8, 4096, 16), u64, 4_194_304, 1_419_774_976),
    # [4] u64 (a copying route-first dispatch_wait's placed flags, one a placing block): 32 B;
    # 1,419,774,976 + 4,194,304 = 1,423,969,280
    "dispatch_placed": ((4,), u64, 32, 1_423_969_280),
    # [G, T, K] f32 (home slots, not per source): 2 * 4096 * 8 * 4 = 262,144 B; 1,423,969,312 -> 1,423,969,536
    "slot_values": ((2, 4096, 8), f32, 262_144, 1_423_969_536),
    # [G, R] u64: 128 B; 1,423,969,536 + 262,144 = 1,424,231,680
    "slot_signal": ((2, 8), u64, 128, 1_424_231_680),
    # the hierarchical transport's slot values from other nodes: [G, R, T, K] f32: 2 * 8 * 4096 * 8 * 4 =
    # 2,097,152 B; 1,424,231,680 + 128 -> 1,424,231,936
    "slot_across": ((2, 8, 4096, 8), f32, 2_097_152, 1_424_231_936),
    # [R, T, K] f32 (staged for their puts): 1,048,576 B; 1,424,231,936 + 2,097,152 = 1,426,329,088
    "slot_stage": ((8, 4096, 8), f32, 1_048_576, 1_426_329_088),
    # the hierarchical transport's, sized for the most other nodes (one PE a node: X = 7): [G, X, N, L + 1]
    # i32, N = 1: 2 * 7 * 1 * 33 * 4 = 1848 B; 1,426,329,088 + 1,048,576 = 1,427,377,664
    "relay_counts": ((2, 7, 1, 33), i32, 1848, 1_427_377_664),
    # [G, R] u64: 128 B; 1,427,377,664 + 1848 = 1,427,379,512 -> 1,427,379,712
    "relay_signal": ((2, 8), u64, 128, 1_427_379_712),
    # [X N, T, H] u16 (one buffer, no group axis), X N = 7 * 1 (a proxy's partial senders: the
    # other nodes' PEs of this one): 7 * 4096 * 7168 * 2 = 411,041,792 B; 1,427,379,712 + 128 -> 1,427,379,968
    "relay_partials": ((7, 4096, 7168), u16, 411_041_792, 1_427_379_968),
    # [X N, T, 16] u64: 3,670,016 B; 1,427,379,968 + 411,041,792 = 1,838,421,760
    "relay_flag": ((7, 4096, 16), u64, 3_670_016, 1_838_421_760),
    # the packed chunks, sized for the most other nodes (X = 7) and the most chunks (8 tokens each:
    # C = 4096 / 8 = 512): the stage [T min(K, X), H] u16 (a token goes to at most min(8, 7) other
    # nodes): 28672 * 7168 * 2 = 411,041,792 B; 1,838,421,760 + 3,670,016 = 1,842,091,776
    "relay_stage": ((28672, 7168), u16, 411_041_792, 1_842_091_776),
    # the proxy's rows [X, T, H] u16: + 411,041,792 = 2,253,133,568
    "relay_rows": ((7, 4096, 7168), u16, 411_041_792, 2_253_133_568),
    # [X, C] u64: 7 * 512 * 8 = 28,672 B; + 411,041,792 = 2,664,175,360
    "relay_chunk_flag": ((7, 512), u64, 28_672, 2_664_175_360),
    # [X, T, H] u16 (bf16 partials): 411,041,792 B; + 28,672 = 2,664,204,032
    "relay_sums": ((7, 4096, 7168), u16, 411_041_792, 2_664_204_032),
    # [R, C] u64: 32,768 B; + 411,041,792 = 3,075,245,824
    "combine_chunk_flag": ((8, 512), u64, 32_768, 3_075_245_824),
    # the proxies' sums kept by sender, as the chunks' rows were staged: [G, T min(K, X), H] u16:
    # 2 * 28672 * 7168 * 2 = 822,083,584 B; 3,075,245,824 + 32,768 = 3,075,278,592
    "combine_sums": ((2, 28672, 7168), u16, 822_083_584, 3_075_278_592),
}
# 3,075,278,592 + 822,083,584 = 3,897,362,176 (256-byte aligned)
DSV3_SYMMETRIC_BYTES = 3_897_362_176

DSV3_LOCAL = {
    # [4] i64: 32 B at 0
    "dispatch_async_sync": ((4,), i64, 32, 0),
    # [4] i64: 32 B; 32 -> 256
    "receive_sync": ((4,), i64, 32, 256),
    # [2] i32: 8 B; 256 + 32 -> 512
    "combine_wait_claims": ((2,), i32, 8, 512),
    # [T, K] i32: 4096 * 8 * 4 = 131,072 B; 512 + 8 -> 768
    "dispatch_send_ranks": ((4096, 8), i32, 131_072, 768),
    # [R, L + 1] i32: 8 * 33 * 4 = 1056 B; 768 + 131,072 = 131,840
    "dispatch_send_counts": ((8, 33), i32, 1056, 131_840),
    # [R, T, H] u16: 8 * 4096 * 7168 * 2 = 469,762,048 B; 131,840 + 1056 = 132,896 -> 133,120
    "combine_stage": ((8, 4096, 7168), u16, 469_762_048, 133_120),
    # [R, T, K] i32: 8 * 4096 * 8 * 4 = 1,048,576 B; 133,120 + 469,762,048 = 469,895,168
    "token_rows": ((8, 4096, 8), i32, 1_048_576, 469_895_168),
    # [C, H] u16: 262144 * 7168 * 2 = 3,758,096,384 B (3584 MiB); 469,895,168 + 1,048,576 = 470,943,744
    "expert_x": ((262144, 7168), u16, 3_758_096_384, 470_943_744),
    # [L + 1] i32: 33 * 4 = 132 B; 470,943,744 + 3,758,096,384 = 4,229,040,128
    "row_offsets": ((33,), i32, 132, 4_229_040_128),
    # [L] i32: 32 * 4 = 128 B; 4,229,040,128 + 132 -> 4,229,040,384
    "expert_counts": ((32,), i32, 128, 4_229_040_384),
    # [C] i32: 262144 * 4 = 1,048,576 B; 4,229,040,384 + 128 -> 4,229,040,640
    "row_src_rank": ((262144,), i32, 1_048_576, 4_229_040_640),
    # + 1,048,576 = 4,230,089,216
    "row_src_token": ((262144,), i32, 1_048_576, 4_230_089_216),
    # + 1,048,576 = 4,231,137,792
    "row_src_k": ((262144,), i32, 1_048_576, 4_231_137_792),
    # [C] f32; + 1,048,576 = 4,232,186,368
    "row_weight": ((262144,), f32, 1_048_576, 4_232_186_368),
    # [C] i32 (compact gather index); + 1,048,576 = 4,233,234,944
    "row_gather": ((262144,), i32, 1_048_576, 4_233_234_944),
    # [R] i32: 32 B; + 1,048,576 = 4,234,283,520
    "recv_tokens": ((8,), i32, 32, 4_234_283_520),
    # [56] i64: 448 B (8 error words, 8 dropped-slot words, TRACE_LEN 40 trace words);
    # 4,234,283,520 + 32 -> 4,234,283,776
    "status": ((56,), i64, 448, 4_234_283_776),
    # [1] i64 (the hierarchical transport's relay ticket): 8 B; 4,234,283,776 + 448 -> 4,234,284,288
    "relay_sync": ((1,), i64, 8, 4_234_284_288),
    # [G, T, X] i32 (each token's packed row per other node): 2 * 4096 * 7 * 4 = 229,376 B;
    # 4,234,284,288 + 8 -> 4,234,284,544
    "relay_slot": ((2, 4096, 7), i32, 229_376, 4_234_284_544),
    # the dense layout's rows, N = R T = 32768: [N, H] u16: 32768 * 7168 * 2 = 469,762,048 B;
    # 4,234,284,544 + 229,376 = 4,234,513,920
    "dense_x": ((32768, 7168), u16, 469_762_048, 4_234_513_920),
    # [N, K] i32: 32768 * 8 * 4 = 1,048,576 B; 4,234,513,920 + 469,762,048 = 4,704,275,968
    "dense_topk_idx": ((32768, 8), i32, 1_048_576, 4_704_275_968),
    # [N, K] f32; + 1,048,576 = 4,705,324,544
    "dense_topk_weights": ((32768, 8), f32, 1_048_576, 4_705_324_544),
    # [N] i32: 131,072 B; + 1,048,576 = 4,706,373,120
    "dense_slot": ((32768,), i32, 131_072, 4_706_373_120),
    # [R, T] i32: 131,072 B; + 131,072 = 4,706,504,192
    "slot_dense_row": ((8, 4096), i32, 131_072, 4_706_504_192),
    # [R] i32: 32 B; + 131,072 = 4,706,635,264
    "dense_source_rows": ((8,), i32, 32, 4_706_635_264),
    # the batched layout's rows, M = R T = 32768 per local expert: [L M, H] u16: 1,048,576 * 7168 * 2 =
    # 15,032,385,536 B; 4,706,635,264 + 32 -> 4,706,635,520
    "batched_x": ((1_048_576, 7168), u16, 15_032_385_536, 4_706_635_520),
    # [L] i32: 128 B; 4,706,635,520 + 15,032,385,536 = 19,739,021,056
    "batched_counts": ((32,), i32, 128, 19_739_021_056),
    # [L, M] i32: 4,194,304 B; + 128 -> 19,739,021,312
    "batched_src_token": ((32, 32768), i32, 4_194_304, 19_739_021_312),
    # [L, R] i64: 2048 B; + 4,194,304 = 19,743,215,616
    "batched_layout_range": ((32, 8), i64, 2048, 19_743_215_616),
    # [R, T, K] i32: 8 * 4096 * 8 * 4 = 1,048,576 B; + 2048 = 19,743,217,664
    "batched_token_rows": ((8, 4096, 8), i32, 1_048_576, 19_743_217_664),
    # [L M] f32: 4,194,304 B; + 1,048,576 = 19,744,266,240
    "batched_row_weight": ((1_048_576,), f32, 4_194_304, 19_744_266_240),
}
# 4,234,284,544 + 229,376 = 4,234,513,920 (256-byte aligned)
DSV3_LOCAL_BYTES = 19_748_460_544  # 19,744,266,240 + 4,194,304

SMALL_SYMMETRIC = {
    # [R, T, H] u16: 2 * 16 * 64 * 2 = 4096 B at 0
    "dispatch_tokens": ((2, 16, 64), u16, 4096, 0),
    # [G, R, T, K] i32: 2 * 2 * 16 * 2 * 4 = 512 B at 4096
    "dispatch_topk_ids": ((2, 2, 16, 2), i32, 512, 4096),
    # f32, 512 B; 4096 + 512 = 4608
    "dispatch_topk_weights": ((2, 2, 16, 2), f32, 512, 4608),
    # [G, R, L + 1] i32: 2 * 2 * 5 * 4 = 80 B; 4608 + 512 = 5120
    "dispatch_counts": ((2, 2, 5), i32, 80, 5120),
    # [G, R, T, K] i32: 512 B; 5120 + 80 -> 5376
    "dispatch_ranks": ((2, 2, 16, 2), i32, 512, 5376),
    # [G, R] u64: 2 * 2 * 8 = 32 B; 5376 + 512 = 5888
    "dispatch_signal": ((2, 2), u64, 32, 5888),
    # [G, R] u64: 32 B; 5888 + 32 -> 6144
    "dispatch_route_signal": ((2, 2), u64, 32, 6144),
    # [G, R, T, H] u16: 8192 B; 6144 + 32 -> 6400
    "combine_partials": ((2, 2, 16, 64), u16, 8192, 6400),
    "dispatch_token_credit": ((2,), u64, 16, 14592),  # 6400 + 8192 = 14592
    "combine_row_flag": ((2, 16, 16), u64, 4096, 14848),  # [R, T, 16] u64; 14592 + 16 -> 14848
    "dispatch_row_flag": ((2, 16, 16), u64, 4096, 18944),  # [R, T, 16] u64; 14848 + 4096 = 18944
    "dispatch_placed": ((4,), u64, 32, 23040),  # [4] u64; 18944 + 4096 = 23040
    "slot_values": ((2, 16, 2), f32, 256, 23296),  # [G, T, K] f32: 2 * 16 * 2 * 4 = 256 B; 23040 + 32 -> 23296
    "slot_signal": ((2, 2), u64, 32, 23552),  # [G, R] u64: 32 B; 23296 + 256 = 23552
    "slot_across": ((2, 2, 16, 2), f32, 512, 23808),  # [G, R, T, K] f32: 512 B; 23552 + 32 -> 23808
    "slot_stage": ((2, 16, 2), f32, 256, 24320),  # [R, T, K] f32: 256 B; 23808 + 512 = 24320
    "relay_counts": ((2, 1, 1, 5), i32, 40, 24576),  # [G, X, N, L + 1] i32, X = N = 1: 40 B; 24320 + 256 = 24576
    "relay_signal": ((2, 2), u64, 32, 24832),  # [G, R] u64; 24576 + 40 = 24616 -> 24832
    "relay_partials": ((1, 16, 64), u16, 2048, 25088),  # [X N, T, H] u16, X N = 1: 2048 B; 24832 + 32 -> 25088
    "relay_flag": ((1, 16, 16), u64, 2048, 27136),  # [X N, T, 16] u64: 2048 B; 25088 + 2048 = 27136
    "relay_stage": ((16, 64), u16, 2048, 29184),  # [T min(K, X), H] u16, X = 1: 2048 B; 27136 + 2048 = 29184
    "relay_rows": ((1, 16, 64), u16, 2048, 31232),  # 29184 + 2048 = 31232
    "relay_chunk_flag": ((1, 2), u64, 16, 33280),  # [X, C] u64, C = 16 / 8: 16 B; 31232 + 2048 = 33280
    "relay_sums": ((1, 16, 64), u16, 2048, 33536),  # 33280 + 16 -> 33536
    "combine_chunk_flag": ((2, 2), u64, 32, 35584),  # 33536 + 2048 = 35584
    "combine_sums": ((2, 16, 64), u16, 4096, 35840),  # [G, T min(K, X), H] u16: 4096 B; 35584 + 32 -> 35840
}
SMALL_SYMMETRIC_BYTES = 39936  # 35840 + 4096 = 39936 (256-byte aligned)

SMALL_LOCAL = {
    "dispatch_async_sync": ((4,), i64, 32, 0),
    "receive_sync": ((4,), i64, 32, 256),  # 32 -> 256
    "combine_wait_claims": ((2,), i32, 8, 512),  # 256 + 32 -> 512
    # [T, K] i32: 16 * 2 * 4 = 128 B; 512 + 8 -> 768
    "dispatch_send_ranks": ((16, 2), i32, 128, 768),
    # [R, L + 1] i32: 2 * 5 * 4 = 40 B; 768 + 128 = 896 -> 1024
    "dispatch_send_counts": ((2, 5), i32, 40, 1024),
    # [R, T, H] u16: 2 * 16 * 64 * 2 = 4096 B; 1024 + 40 -> 1280
    "combine_stage": ((2, 16, 64), u16, 4096, 1280),
    # [R, T, K] i32: 2 * 16 * 2 * 4 = 256 B; 1280 + 4096 = 5376
    "token_rows": ((2, 16, 2), i32, 256, 5376),
    # [C, H] u16 with C = max_recv_rows = 50: 50 * 64 * 2 = 6400 B; 5376 + 256 = 5632
    "expert_x": ((50, 64), u16, 6400, 5632),
    # [L + 1] i32: 5 * 4 = 20 B; 5632 + 6400 = 12032
    "row_offsets": ((5,), i32, 20, 12032),
    # [L] i32: 16 B; 12032 + 20 -> 12288
    "expert_counts": ((4,), i32, 16, 12288),
    # [C] i32: 50 * 4 = 200 B; 12288 + 16 -> 12544
    "row_src_rank": ((50,), i32, 200, 12544),
    # 12544 + 200 -> 12800
    "row_src_token": ((50,), i32, 200, 12800),
    # 12800 + 200 -> 13056
    "row_src_k": ((50,), i32, 200, 13056),
    # [C] f32; 13056 + 200 -> 13312
    "row_weight": ((50,), f32, 200, 13312),
    # [C] i32 (compact gather index); 13312 + 200 -> 13568
    "row_gather": ((50,), i32, 200, 13568),
    # [R] i32: 8 B; 13568 + 200 -> 13824
    "recv_tokens": ((2,), i32, 8, 13824),
    # [56] i64: 448 B; 13824 + 8 -> 14080
    "status": ((56,), i64, 448, 14080),
    "relay_sync": ((1,), i64, 8, 14592),  # [1] i64; 14080 + 448 = 14528 -> 14592
    "relay_slot": ((2, 16, 1), i32, 128, 14848),  # [G, T, X] i32: 128 B; 14592 + 8 -> 14848
    # the dense layout's rows, N = R T = 32: [N, H] u16: 32 * 64 * 2 = 4096 B; 14848 + 128 -> 15104
    "dense_x": ((32, 64), u16, 4096, 15104),
    "dense_topk_idx": ((32, 2), i32, 256, 19200),  # [N, K] i32: 256 B; 15104 + 4096 = 19200
    "dense_topk_weights": ((32, 2), f32, 256, 19456),  # 19200 + 256 = 19456
    "dense_slot": ((32,), i32, 128, 19712),  # [N] i32: 128 B; 19456 + 256 = 19712
    "slot_dense_row": ((2, 16), i32, 128, 19968),  # [R, T] i32: 128 B; 19712 + 128 -> 19968
    "dense_source_rows": ((2,), i32, 8, 20224),  # [R] i32: 8 B; 19968 + 128 -> 20224
    # the batched layout's rows, M = R T = 32 per local expert: [L M, H] u16: 128 * 64 * 2 = 16384 B;
    # 20224 + 8 -> 20480
    "batched_x": ((128, 64), u16, 16384, 20480),
    "batched_counts": ((4,), i32, 16, 36864),  # [L] i32: 16 B; 20480 + 16384 = 36864
    "batched_src_token": ((4, 32), i32, 512, 37120),  # [L, M] i32: 512 B; 36864 + 16 -> 37120
    "batched_layout_range": ((4, 2), i64, 64, 37632),  # [L, R] i64: 64 B; 37120 + 512 = 37632
    "batched_token_rows": ((2, 16, 2), i32, 256, 37888),  # [R, T, K] i32: 256 B; 37632 + 64 -> 37888
    "batched_row_weight": ((128,), f32, 512, 38144),  # [L M] f32: 512 B; 37888 + 256 = 38144
}
SMALL_LOCAL_BYTES = 38656  # 38144 + 512

CASES = {
    "dsv3": (DSV3, DSV3_SYMMETRIC, DSV3_SYMMETRIC_BYTES, DSV3_LOCAL, DSV3_LOCAL_BYTES),
    "small": (SMALL, SMALL_SYMMETRIC, SMALL_SYMMETRIC_BYTES, SMALL_LOCAL, SMALL_LOCAL_BYTES),
}
CASE_IDS = list(CASES)


@pytest.fixture(params=CASE_IDS)
def case(request):
    cfg, sym, sym_bytes, loc, loc_bytes = CASES[request.param]
    return BufferLayout(cfg), sym, sym_bytes, loc, loc_bytes


def test_hand_tables_are_self_consistent():
    """Guard the hand-written tables themselves: nbytes = prod(shape) * itemsize."""
    for _, sym, _, loc, _ in CASES.values():
        for name, (shape, dtype, nbytes, _) in {**sym, **loc}.items():
            assert int(np.prod(shape, dtype=np.int64)) * dtype.itemsize == nbytes, name


def test_region_names_and_order(case):
    layout, sym, _, loc, _ = case
    assert [r.name for r in layout.symmetric_regions] == list(sym)
    assert [r.name for r in layout.local_regions] == list(loc)
    assert len(layout.regions) == len(sym) + len(loc)


def test_region_shape_dtype_nbytes_offset(case):
    layout, sym, _, loc, _ = case
    for heap, table, symmetric in (("symmetric", sym, True), ("local", loc, False)):
        for name, (shape, dtype, nbytes, offset) in table.items():
            r = layout.region(name)
            got = (r.shape, r.dtype, r.nbytes, r.offset, r.symmetric)
            assert got == (shape, dtype, nbytes, offset, symmetric), f"{heap} region {name}: {got}"


def test_totals(case):
    layout, _, sym_bytes, _, loc_bytes = case
    assert layout.symmetric_bytes == sym_bytes
    assert layout.local_bytes == loc_bytes


def test_dsv3_totals_in_mib():
    # [R, T, H] bf16 received tokens (one buffer: 448 MiB) and two groups of combine partials
    # (896 MiB), plus 4 MiB of routing (ids and weights), 2 MiB of ranks, 4 MiB of combine part
    # flags, 4 MiB of token part flags, 0.25 MiB of slot values and a few KiB; the hierarchical
    # transport's relay partials (392 MiB, 7 senders) and their flags (3.5 MiB), its packed chunks for 7
    # other nodes: staged rows, received rows and staged sums (392 MiB each) and their flags, and
    # its slot values from other nodes (2 MiB) and staged for them (1 MiB), and, for its builds that keep
    # partials by sender, the proxies' sums (784 MiB: a chunk's rows for 7 other nodes in turn).
    layout = BufferLayout(DSV3)
    assert 3716.80 < layout.symmetric_bytes / MiB < 3716.82
    # combine_stage 448 MiB + expert_x 3584 MiB + token_rows 1 MiB + 5 row arrays of 1 MiB
    # + the sender's 0.125 MiB of staged ranks, 0.22 MiB of packed-row slots and a few KiB
    # + the dense layout's rows (448 MiB), their top-k ids and weights (1 MiB each) and maps (0.25 MiB).
    # + the batched layout's rows (14336 MiB at T = 4096: L R T rows), their source tokens and weights (4 MiB
    # each), batched token rows (1 MiB) and ranges.
    assert 18833.5 < layout.local_bytes / MiB < 18833.7


def test_a_plan_allocates_a_subset_of_every_region_in_the_same_order():
    """Under a plan the layout keeps the regions it uses, in the same order, each at the end of
    the previous one it keeps: a runtime serving the compact layout on NVLink (route first, in
    chunks, stores) drops the expanded batch (3584 MiB), the puts' staging (448 MiB), the
    sender's ranks and the landing flags."""
    from ep_runtime.core.plan import Topology, choose_plan

    cfg = EPConfig(**{**DSV3.as_dict(), "layouts": "compact"})
    plan = choose_plan(cfg, Topology.nvlink_gpus(8))
    layout = BufferLayout(cfg, plan)
    every = [r.name for r in BufferLayout(cfg).regions]
    kept = [r.name for r in layout.regions]
    assert kept == [n for n in every if n in kept]
    assert set(every) - set(kept) == {"dispatch_ranks", "dispatch_row_flag", "dispatch_send_ranks",
                                      "dispatch_send_counts", "combine_stage", "expert_x", "relay_counts",
                                      "relay_signal", "relay_partials", "relay_flag", "relay_sync", "relay_stage",
                                      "relay_rows", "relay_chunk_flag", "relay_sums", "combine_chunk_flag",
                                      "combine_sums",
                                      "relay_slot", "slot_across", "slot_stage", "dense_x", "dense_topk_idx",
                                      "dense_topk_weights", "dense_slot", "slot_dense_row", "dense_source_rows",
                                      "batched_x", "batched_counts", "batched_src_token", "batched_layout_range",
                                      "batched_token_rows", "batched_row_weight"}
    # 4038.35 MiB (every region but the dense and batched layouts') less 3584 + 448 + 0.125 + 0.22 + 0.001: the
    # token rows (1 MiB), 5 row arrays and a few KiB
    assert 6 < layout.local_bytes / MiB < 6.01
    assert layout.region("token_rows").offset == 768  # after the three counters, nothing staged
    assert set(layout.absent()) == set(every) - set(kept) | {"dispatch_send_stage", "expert_scales",
                                                              "token_global_scale", "dense_scales",
                                                              "batched_scales"}


@pytest.mark.parametrize("heap", ["symmetric", "local"])
def test_offsets_aligned_and_disjoint(case, heap):
    layout, *_ = case
    regions = layout.symmetric_regions if heap == "symmetric" else layout.local_regions
    total = layout.symmetric_bytes if heap == "symmetric" else layout.local_bytes
    assert total % 256 == 0
    spans = sorted((r.offset, r.offset + r.nbytes, r.name) for r in regions)
    for lo, hi, name in spans:
        assert lo % 256 == 0, f"{name} at {lo} is not 256-byte aligned"
        assert 0 <= lo < hi <= total, f"{name} [{lo}, {hi}) outside [0, {total})"
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        assert hi <= lo, f"{a} ends at {hi}, after {b} starts at {lo}"


def test_symmetric_regions_have_leading_group_dimension(case):
    layout, *_ = case
    assert layout.symmetric_regions, "no symmetric regions"
    for r in layout.symmetric_regions:
        if r.name == "dispatch_token_credit":  # monotonic over calls by design: [R], no group axis
            assert r.shape == (layout.cfg.n_ranks,), r.shape
            continue
        if r.name == "dispatch_placed":  # this rank's own monotonic flags, one a placing block: no group or rank axis
            assert r.shape == (MAX_COPY_PLACERS,), r.shape
            continue
        if r.name == "slot_values":  # [G, T, K]: this rank's own tokens' slots (one writer each), no rank axis
            assert r.shape == (2, layout.cfg.max_tokens_per_rank, layout.cfg.top_k), r.shape
            continue
        if r.name in ("relay_partials", "relay_flag"):  # [X N, T, ...]: a proxy's senders (one PE a node here)
            assert r.shape[:2] == (layout.cfg.n_ranks - 1, layout.cfg.max_tokens_per_rank), r.shape
            continue
        if r.name in ("dispatch_tokens", "combine_row_flag", "dispatch_row_flag"):
            # [R, T, ...], no group axis: one buffer guarded by the credits (the relay's: by the
            # next dispatch's signals); row flags monotonic over calls (call numbers)
            assert r.shape[:2] == (layout.cfg.n_ranks, layout.cfg.max_tokens_per_rank), r.shape
            continue
        if r.name == "slot_stage":  # [R, T, K]: staged for blocking puts, reused every call
            assert r.shape == (layout.cfg.n_ranks, layout.cfg.max_tokens_per_rank, layout.cfg.top_k), r.shape
            continue
        if r.name in ("relay_rows", "relay_sums"):  # [X, T, ...]: one buffer per other node
            assert r.shape[1] == layout.cfg.max_tokens_per_rank, r.shape
            continue
        if r.name in ("relay_stage", "combine_sums"):  # [(G,) T min(K, X), ...]: a chunk's rows node after node
            cfg = layout.cfg
            rows = r.shape[0] if r.name == "relay_stage" else r.shape[1]
            assert rows == cfg.max_tokens_per_rank * min(cfg.top_k, cfg.n_ranks - 1), r.shape
            continue
        if r.name == "combine_chunk_flag":  # [R, C]: monotonic chunk flags
            assert r.shape == (layout.cfg.n_ranks, -(-layout.cfg.max_tokens_per_rank // 8)), r.shape
            continue
        if r.name == "relay_chunk_flag":  # [X, C]: monotonic chunk flags, a row per source (other node)
            assert r.shape == (layout.cfg.n_ranks - 1, -(-layout.cfg.max_tokens_per_rank // 8)), r.shape
            continue
        if r.name == "relay_counts":  # [G, X, N, L + 1]: a source (other node) a row, one PE a node here
            assert r.shape == (2, layout.cfg.n_ranks - 1, 1, layout.cfg.n_experts // layout.cfg.n_ranks + 1)
            continue
        assert r.shape[0] == 2, f"{r.name} {r.shape}: no leading group dimension 2"
        assert r.shape[1] == layout.cfg.n_ranks, f"{r.name} {r.shape}: second dimension is not the source rank"


def test_every_region_has_writer_readers_and_doc(case):
    layout, *_ = case
    for r in layout.regions:
        assert isinstance(r.writer, str) and r.writer, f"{r.name}: no writer"
        assert isinstance(r.readers, tuple) and r.readers and all(r.readers), f"{r.name}: no readers"
        assert r.doc, f"{r.name}: no doc"


#: Symmetric only so the signal waits (and the simulator's) accept it: written by this rank's own
#: kernel, for its own blocks.
SELF_SIGNALLED = {"dispatch_placed"}
#: Symmetric only so that a remote transport can read a put's source from the registered heap:
#: the hierarchical transport's staged chunks, written by this rank for its own puts.
SELF_STAGED = {"relay_stage": "dispatch_async", "relay_sums": "combine_relay", "slot_stage": "slot_values_async"}


def test_symmetric_regions_are_written_by_peers(case):
    layout, *_ = case
    for r in layout.symmetric_regions:
        if r.name in SELF_SIGNALLED:
            assert "peers" not in r.writer and r.readers == ("dispatch_wait",), f"{r.name}: {r.writer!r} {r.readers}"
            continue
        if r.name in SELF_STAGED:
            assert r.writer == SELF_STAGED[r.name] and r.readers == (r.writer,), f"{r.name}: {r.writer!r} {r.readers}"
            continue
        assert "peers" in r.writer, f"{r.name}: writer {r.writer!r}"


def test_sentinel_inits():
    layout = BufferLayout(SMALL)
    # -1 marks "no expert id" / "no row" / "padding"; everything else starts at 0.
    minus_one = {"dispatch_topk_ids", "token_rows", "row_src_rank", "row_src_token", "row_src_k", "row_gather",
                 "relay_slot", "dense_topk_idx", "dense_slot", "slot_dense_row", "batched_src_token",
                 "batched_token_rows"}
    for r in layout.regions:
        assert r.init == (-1 if r.name in minus_one else 0), f"{r.name} init {r.init}"


def test_describe_lists_every_region_and_totals(case):
    layout, _, sym_bytes, _, loc_bytes = case
    text = layout.describe()
    lines = text.splitlines()
    assert max(map(len, lines)) < 120, max(lines, key=len)
    for r in layout.regions:
        matching = [ln for ln in lines if ln.split()[:1] == [r.name]]
        assert len(matching) == 1, f"describe() has {len(matching)} lines for {r.name}"
        ln = matching[0]
        assert ln.split()[1] == ("sym" if r.symmetric else "loc")
        assert str(r.shape) in ln and r.dtype.name in ln
        assert f"{r.nbytes / MiB:.3f}" in ln, f"{r.name}: MiB missing in {ln!r}"
        assert r.writer in ln
    assert f"symmetric {sym_bytes / MiB:.3f} MiB, local {loc_bytes / MiB:.3f} MiB" in text


def test_describe_dsv3_figures():
    text = BufferLayout(DSV3).describe()
    assert "448.000" in text          # dispatch_tokens (and combine_stage)
    assert "896.000" in text          # combine_partials
    assert "3584.000" in text         # expert_x
    assert "392.000" in text          # relay_stage (min(K, X) = 7 rows a token), relay_rows, relay_sums (7 other nodes)
    # 3,897,362,176 / 2**20 = 3716.8142; 19,748,460,544 / 2**20 = 18833.5996
    assert "symmetric 3716.814 MiB, local 18833.600 MiB" in text


def test_region_unknown_name_raises_key_error():
    layout = BufferLayout(SMALL)
    with pytest.raises(KeyError) as info:
        layout.region("expert_y")
    assert "expert_y" in str(info.value)
    assert "expert_x" in str(info.value)   # lists the regions that exist


def test_capacity_follows_max_recv_rows_only_in_row_regions():
    """Changing max_recv_rows resizes exactly the [C]-shaped regions, nothing symmetric."""
    a = BufferLayout(SMALL)
    b = BufferLayout(EPConfig(**{**SMALL.as_dict(), "max_recv_rows": 76}))
    changed = {r.name for r in a.regions if r.shape != b.region(r.name).shape}
    assert changed == {"expert_x", "row_src_rank", "row_src_token", "row_src_k", "row_weight", "row_gather"}
    assert a.symmetric_bytes == b.symmetric_bytes
    assert b.region("expert_x").shape == (76, 64)   # 2 * 16 * 2 + 4 * 3


def test_layout_is_pure():
    assert BufferLayout(SMALL).regions == BufferLayout(SMALL).regions


def test_dispatch_signal_value_carries_the_call_and_the_token_count():
    from ep_runtime.core.layout import SIGNAL_TOKEN_BITS, dispatch_signal_value

    assert dispatch_signal_value(0, 0) == 1 << 32
    assert dispatch_signal_value(0, 4096) == (1 << 32) + 4096
    assert dispatch_signal_value(6, 1) == (7 << SIGNAL_TOKEN_BITS) | 1
    # every later call's value is larger, whatever the token counts
    assert dispatch_signal_value(1, 0) > dispatch_signal_value(0, (1 << 31) - 1)
