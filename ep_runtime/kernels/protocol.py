"""Protocol constants shared by the kernels and the host: the one module both sides import.

A leaf: it imports nothing of the project, so device code never depends on host policy
(``ep_runtime.core.config``, ``layout``, ``status``, ``plan``, ``runtime``) and the host reads the
same numbers the kernels were built with. docs/protocol.md explains each mechanism; the host
modules re-export what their users need (``ep_runtime.core.layout``, ``ep_runtime.core.status``).
"""

# -- sizes ------------------------------------------------------------------------------------

#: Buffer groups that alternate between calls (call ``n`` uses group ``n % 2``).
N_GROUPS = 2
#: The most ranks a runtime may span: a token's destination ranks are a 64-bit mask up to
#: MASK_RANKS ranks, an ascending list past them (ep_runtime/kernels/destinations.py); the
#: receive kernels' per-source words in shared memory grow with the rank count (4 KB at 1024).
MAX_RANKS = 1024
#: Ranks a destination mask holds (a bit each), and the per-source shared words every build of
#: this many ranks or fewer keeps (``DispatchVariant.rank_slots``).
MASK_RANKS = 64
#: The receive kernels keep a placement table of ``(n_ranks + 1) * (n_experts / n_ranks)`` int32
#: words in shared memory (each source's first row per local expert), 16 KB at most.
PLACEMENT_WORDS = 4096
#: A copying route-first dispatch_wait (the expanded layout in one launch) places in at most this
#: many blocks (the plan's ``placing_blocks``), each publishing its own ``dispatch_placed`` word.
MAX_COPY_PLACERS = 4
#: dispatch_signal and dispatch_route_signal after call n: ``(n + 1) << SIGNAL_TOKEN_BITS | T``,
#: the source's token count in the low bits, so the receiver has T with the signal it waits for
#: and the values still grow with every call (``>=`` tests the call).
SIGNAL_TOKEN_BITS = 32
#: Flags per partial row (``combine_row_flag``): a combine cuts each row into at most this many
#: parts, each flagged on arrival.
COMBINE_FLAG_PARTS = 16
#: Flags per token row (``dispatch_row_flag``): a landing dispatch cuts each token row into at most
#: this many parts, each flagged on arrival.
DISPATCH_FLAG_PARTS = 16
#: The hierarchical transport (ep_runtime/kernels/relay.py): a source's rows bound for another node, and a
#: proxy's sums bound home, cross in one put per (node, chunk of consecutive tokens), packed (the
#: chunk's tokens bound there, in token order) and flagged. A chunk holds RELAY_CHUNK_MIN tokens,
#: doubled while the batch still makes RELAY_CHUNK_SPREAD chunks, up to RELAY_CHUNK_MAX
#: (:func:`relay_chunk_tokens`).
RELAY_CHUNK_MIN = 8
RELAY_CHUNK_MAX = 32
RELAY_CHUNK_SPREAD = 128

# -- the status region (int64): the first device error, the first dropped slot, the trace words ---

STATUS_CODE, STATUS_KERNEL, STATUS_RANK, STATUS_PEER, STATUS_COUNTER, STATUS_EXPECTED, \
    STATUS_OBSERVED, STATUS_CALL = range(8)
#: Words of one record (the fields above).
STATUS_LEN = 8
#: Where the dropped-slot record starts: the first expert id outside ``[-1, n_experts)`` a
#: dispatch_async dropped (fields as the error record's). Unlike an error it stops no kernel: the
#: call completes on every rank with that slot masked, and the host raises it.
DROPPED_SLOT = STATUS_LEN
#: Where the trace words start (``ep_runtime/kernels/trace.py``: phase time stamps), and how many.
TRACE_BASE = 2 * STATUS_LEN
TRACE_LEN = 40
#: Expert id of a masked slot in ``topk_ids``: nothing is sent for it and it produces no row.
MASKED_SLOT = -1

#: Error codes (``status[STATUS_CODE]``).
ERR_NONE = 0
ERR_TIMEOUT = 1
ERR_CAPACITY = 2
ERR_BAD_EXPERT_ID = 3
ERR_DUPLICATE_EXPERT = 4
ERR_BAD_WEIGHT = 5
#: slot_values_async: the caller's values have fewer rows than the expert batch.
ERR_SHORT_ROWS = 6

#: Kernel ids (``status[STATUS_KERNEL]``).
KERNEL_DISPATCH_ASYNC = 1
KERNEL_DISPATCH_WAIT = 2
KERNEL_COMBINE_ASYNC = 3
KERNEL_COMBINE_WAIT = 4
KERNEL_VALIDATE_ROUTING = 5
KERNEL_DISPATCH_LAND = 6
KERNEL_SLOT_VALUES_ASYNC = 7
KERNEL_SLOT_VALUES_WAIT = 8
KERNEL_DISPATCH_RELAY = 9
KERNEL_COMBINE_RELAY = 10

#: Counter ids (``status[STATUS_COUNTER]``): what a timed-out wait was waiting for.
COUNTER_DISPATCH_SIGNAL = 1
COUNTER_RECV_ROWS = 3
COUNTER_TOKEN_CREDIT = 4
COUNTER_COMBINE_ROW_FLAG = 5
COUNTER_ROUTE_SIGNAL = 6
COUNTER_DISPATCH_ROW_FLAG = 7
COUNTER_DISPATCH_PLACED = 9
COUNTER_SLOT_SIGNAL = 10
COUNTER_RELAY_SIGNAL = 11
COUNTER_RELAY_FLAG = 12
COUNTER_RELAY_CHUNK = 13
COUNTER_COMBINE_CHUNK = 14

# -- counters in local regions ----------------------------------------------------------------

#: ``dispatch_async_sync`` (int64): finished blocks of the launch (the last resets it).
SYNC_TICKET = 0
#: ``dispatch_async_sync``: completed dispatch calls (call n, 0-based, sets n + 1).
SYNC_CALLS = 1
#: ``dispatch_async_sync``: blocks whose share of the routing went out (landing and split
#: route-first calls; the last resets it).
SYNC_ROUTE_TICKET = 2
#: ``dispatch_async_sync``: finished blocks of the slot_values_async launch (the last resets it).
SYNC_SLOT_TICKET = 3
SYNC_LEN = 4

#: ``receive_sync`` (int64): blocks of the current receive launch that read its call number
#: (the last resets it).
RECV_TICKET = 0
#: ``receive_sync``: receive calls so far (the receive kernel of call n sets n + 1).
RECV_CALLS = 1
#: ``receive_sync[RECV_CLAIMS + g]``: items dispatch_land of a call of group g has claimed.
RECV_CLAIMS = 2
RECV_LEN = 4

# -- peer-mapped regions ----------------------------------------------------------------------

#: Regions the kernels store into directly on peers (through NVLink mappings), in the row order
#: of the ``peer_bases`` table [len(PEER_REGIONS), R]: the address of each on every PE as mapped
#: on this one (0 for a PE not mapped: another node's). The ``PEER_*`` constants name the rows
#: in kernel code.
PEER_REGIONS = ("dispatch_tokens", "combine_partials", "dispatch_counts", "dispatch_topk_ids",
                "dispatch_topk_weights", "dispatch_ranks", "slot_values", "relay_partials")
(PEER_TOKENS, PEER_PARTIALS, PEER_COUNTS, PEER_IDS, PEER_WEIGHTS, PEER_RANKS, PEER_SLOTS,
 PEER_RELAY_PARTIALS) = range(len(PEER_REGIONS))

# -- FP8 codes ----------------------------------------------------------------------------------

#: Largest finite E4M3 magnitude.
E4M3_MAX = 448.0
#: E4M3's NaN code (magnitude bits; the sign bit may be set).
E4M3_NAN = 0x7F
#: UE8M0's NaN code.
UE8M0_NAN = 255
#: The batched layout's scales (``dispatch_batched``'s ``scales_form``): float32, per expert
#: ``[S, M]`` (column-major ``[M, S]``: what TMA-based FP8 GEMMs read; UE8M0 codes decoded), or
#: UE8M0 codes packed four to an int32, per expert ``[S / 4, M]`` int32 (DeepEP's ``use_ue8m0``).
BATCHED_SCALES_FLOAT = 0
BATCHED_SCALES_PACKED = 1


def relay_chunk_tokens(n_tokens):
    """Tokens a chunk of a source's batch of ``n_tokens`` holds under the hierarchical transport:
    8 up to 2047 tokens, 16 up to 4095, then 32 (``RELAY_CHUNK_*``). Large batches take few
    large puts (128 chunks at 4096 tokens); small ones still make enough chunks (16 at 128
    tokens) that every kernel's blocks share the work, a chunk a block. The kernels compile this
    function (``ep_runtime/kernels/nodes.chunk_tokens``); the host's traffic model calls it."""
    size = RELAY_CHUNK_MIN
    while size < RELAY_CHUNK_MAX and 2 * size * RELAY_CHUNK_SPREAD <= n_tokens:
        size *= 2
    return size


def relay_stage_rows(top_k, other_nodes):
    """Stage rows a token can take under the hierarchical transport: one for each other node it
    goes to, at most ``min(top_k, other_nodes)``. Chunk c of ``CH`` tokens stages its rows for the
    other nodes, node after node, from row ``c CH relay_stage_rows(...)`` of ``relay_stage`` (and
    the proxies' sums come home to the same rows of ``combine_sums``). The kernels compile this
    function (``ep_runtime/kernels/nodes.stage_rows``); the layout sizes both regions by it."""
    return min(top_k, other_nodes)


def signal_value(call: int, n_tokens: int) -> int:
    """The value a source sets dispatch_signal (and dispatch_route_signal) to for (0-based)
    ``call`` with ``n_tokens`` tokens."""
    return (call + 1) << SIGNAL_TOKEN_BITS | n_tokens
