"""`EPConfig`: every validation rule, the derived sizes, frozen-ness and the valid edges.

Every invalid value must raise :class:`EPConfigError` whose message names the field, the
value, the rule and a fix; the tests assert on those message fragments, so a message that
loses one of them fails here.
"""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError, EPError

#: DeepSeek-V3-like expert-parallel layer on 8 ranks.
DSV3 = dict(n_ranks=8, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=4096)


def cfg(**overrides) -> EPConfig:
    return EPConfig(**{**DSV3, **overrides})


def config_error(**overrides) -> str:
    """The message of the EPConfigError that ``cfg(**overrides)`` raises."""
    with pytest.raises(EPConfigError) as info:
        cfg(**overrides)
    return str(info.value)


def assert_fragments(message: str, *fragments: str) -> None:
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


# -- the error hierarchy ---------------------------------------------------------------------
def test_config_error_is_an_ep_error_and_a_value_error():
    with pytest.raises(EPConfigError) as info:
        cfg(top_k=0)
    assert isinstance(info.value, EPError)
    assert isinstance(info.value, ValueError)


# -- n_experts must be a multiple of n_ranks -------------------------------------------------
def test_n_experts_not_multiple_of_n_ranks_names_both_neighbours():
    msg = config_error(n_experts=250)
    assert_fragments(msg, "EPConfig.n_experts=250", "multiple of n_ranks (8)", "use 248 or 256")


def test_n_experts_below_n_ranks_suggests_only_the_multiple_above():
    # 3 experts on 4 ranks: the multiple below is 0, which is not a valid expert count.
    msg = config_error(n_ranks=4, n_experts=3, top_k=1)
    assert_fragments(msg, "EPConfig.n_experts=3", "multiple of n_ranks (4)", "use 4")
    assert "use 0" not in msg


@pytest.mark.parametrize("n_ranks", [1, 2, 8, 64])
def test_local_experts_beyond_the_placement_table_are_refused_with_the_largest_that_fits(n_ranks):
    """dispatch_wait keeps (n_ranks + 1) * n_local_experts int32 in shared memory (PLACEMENT_WORDS)."""
    from ep_runtime.core.config import PLACEMENT_WORDS

    most = PLACEMENT_WORDS // (n_ranks + 1) * n_ranks
    assert cfg(n_ranks=n_ranks, n_experts=most, top_k=1).n_local_experts == most // n_ranks
    msg = config_error(n_ranks=n_ranks, n_experts=most + n_ranks, top_k=1)
    assert_fragments(msg, f"EPConfig.n_experts={most + n_ranks}", f"exceeds {PLACEMENT_WORDS}",
                     f"use at most {most} experts on {n_ranks} ranks")
    assert most >= 2048  # every model we know of fits on any number of ranks


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(n_ranks=st.integers(2, 64), n_experts=st.integers(1, 1024))
def test_n_experts_fix_is_the_nearest_valid_multiples(n_ranks, n_experts):
    if n_experts % n_ranks == 0:
        assert cfg(n_ranks=n_ranks, n_experts=n_experts, top_k=1).n_local_experts == n_experts // n_ranks
        return
    msg = config_error(n_ranks=n_ranks, n_experts=n_experts, top_k=1)
    lo = n_experts - n_experts % n_ranks
    hi = lo + n_ranks
    fix = f"use {lo} or {hi}" if lo else f"use {hi}"
    assert_fragments(msg, f"EPConfig.n_experts={n_experts}", f"multiple of n_ranks ({n_ranks})", fix)
    # Both suggestions are valid.
    for suggestion in (lo, hi):
        if suggestion:
            cfg(n_ranks=n_ranks, n_experts=suggestion, top_k=1)


# -- type rules: ints must be ints (not bool, float, None, numpy scalars) ---------------------
INT_FIELDS = ("n_ranks", "n_experts", "top_k", "hidden", "max_tokens_per_rank", "pad_multiple")
OPTIONAL_INT_FIELDS = ("n_sms", "max_recv_rows")


@pytest.mark.parametrize("field", INT_FIELDS + OPTIONAL_INT_FIELDS)
@pytest.mark.parametrize("value, type_name", [(True, "bool"), (False, "bool"), (8.0, "float"),
                                              ("8", "str")])
def test_int_fields_reject_non_ints(field, value, type_name):
    msg = config_error(**{field: value})
    assert_fragments(msg, f"EPConfig.{field}={value!r}", "must be an int", f"got {type_name}",
                     f"pass int({field})")


@pytest.mark.parametrize("field", INT_FIELDS)
def test_required_int_fields_reject_none(field):
    msg = config_error(**{field: None})
    assert_fragments(msg, f"EPConfig.{field}=None", "must be an int", "got NoneType", f"pass int({field})")


@pytest.mark.parametrize("field", OPTIONAL_INT_FIELDS)
def test_optional_int_fields_accept_none(field):
    assert getattr(cfg(**{field: None}), field) is None


def test_numpy_integer_is_rejected_not_converted():
    msg = config_error(n_ranks=np.int64(8))
    assert_fragments(msg, "EPConfig.n_ranks=", "must be an int", "got int64", "pass int(n_ranks)")


# -- range rules -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, rule, fix", [
    ("n_ranks", 0, "n_ranks must be >= 1", "use the size of the expert-parallel group"),
    ("n_ranks", -2, "n_ranks must be >= 1", "use the size of the expert-parallel group"),
    ("n_experts", 0, "n_experts must be >= 1", "use the model's expert count"),
    ("hidden", 0, "hidden must be >= 1", "use the model's hidden size"),
    ("max_tokens_per_rank", 0, "max_tokens_per_rank must be >= 1",
     "use the largest batch one rank passes to dispatch"),
    ("n_sms", 0, "n_sms must be >= 1 or None", "use None to let the runtime choose"),
    ("pad_multiple", 0, "pad_multiple must be >= 1", "use 1 for no padding"),
    ("pad_multiple", -64, "pad_multiple must be >= 1", "use 1 for no padding"),
    ("max_recv_rows", 0, "max_recv_rows must be >= 1 or None", "use None for the worst case"),
    ("max_recv_rows", -1, "max_recv_rows must be >= 1 or None", "use None for the worst case"),
])
def test_range_rules(field, value, rule, fix):
    msg = config_error(**{field: value})
    assert_fragments(msg, f"EPConfig.{field}={value!r}", rule, fix)


def test_n_ranks_above_1024():
    msg = config_error(n_ranks=1025, n_experts=1025)
    assert_fragments(msg, "EPConfig.n_ranks=1025", "must be <= 1024", "a word per source rank in shared memory",
                     "split the group into expert-parallel groups of at most 1024 ranks")


def test_n_ranks_past_64_are_taken():
    assert EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=64, max_tokens_per_rank=2).n_ranks == 72


@pytest.mark.parametrize("top_k", [0, -1, 257])
def test_top_k_out_of_range(top_k):
    msg = config_error(top_k=top_k)
    assert_fragments(msg, f"EPConfig.top_k={top_k}", "must be in [1, n_experts=256]", "use the router's k")


# the built-in token formats (a test that registers one of its own adds it at the end of the list)
DTYPE_FIELDS = {"token_dtype": "('bfloat16', 'fp8_e4m3', 'fp8_e4m3_ue8m0'", "combine_dtype": "('bfloat16', 'float32')"}
DTYPE_VALUES = ["float16", "float32", "bf16", "BFloat16", None, np.dtype(ml_dtypes.bfloat16), ml_dtypes.bfloat16,
                np.dtype(np.float32)]


@pytest.mark.parametrize("field,allowed,value", [
    (field, allowed, value) for field, allowed in DTYPE_FIELDS.items() for value in DTYPE_VALUES
    if not (field == "combine_dtype" and isinstance(value, str) and value == "float32")])  # allowed there
def test_unsupported_dtypes(field, allowed, value):
    # a NumPy bfloat16 (float32) dtype compares equal to "bfloat16" ("float32") but is not the
    # string the config stores
    msg = config_error(**{field: value})
    assert_fragments(msg, f"EPConfig.{field}={value!r}", f"must be one of the strings {allowed}",
                     "use 'bfloat16'")


def test_combine_dtype_float32_is_accepted_and_doubles_the_partial_bytes():
    c = cfg(combine_dtype="float32")
    assert c.combine_dtype == "float32"
    assert (c.partial_bytes, cfg().partial_bytes) == (7168 * 4, 7168 * 2)
    assert c.token_bytes == cfg().token_bytes  # dispatch is unchanged
    assert cfg(combine_dtype="float32", token_dtype="fp8_e4m3").partial_bytes == 7168 * 4


@pytest.mark.parametrize("hidden,up", [(1, 4), (6, 8), (7170, 7172)])
def test_combine_dtype_float32_needs_hidden_a_multiple_of_4(hidden, up):
    msg = config_error(combine_dtype="float32", hidden=hidden)
    assert_fragments(msg, f"EPConfig.hidden={hidden} with combine_dtype='float32'", "must be a multiple of 4",
                     "8-byte words of 2 floats", f"pad hidden to {up}", "or use combine_dtype='bfloat16'")
    assert cfg(hidden=hidden).hidden == hidden  # bf16 partials take any hidden


@pytest.mark.parametrize("token_dtype", ["fp8_e4m3", "fp8_e4m3_ue8m0"])
@pytest.mark.parametrize("hidden", [100, 64, 7000])
def test_fp8_token_formats_need_hidden_a_multiple_of_128(token_dtype, hidden):
    msg = config_error(token_dtype=token_dtype, hidden=hidden)
    assert_fragments(msg, f"EPConfig.hidden={hidden} with token_dtype='{token_dtype}'", "multiple of 128",
                     "token_dtype='bfloat16' takes any hidden")


def test_fp8_token_bytes_are_the_bytes_sent():
    kw = dict(n_ranks=2, n_experts=8, top_k=2, hidden=7168, max_tokens_per_rank=4)
    assert EPConfig(**kw, token_dtype="fp8_e4m3").token_bytes == 7168 + 56 * 4          # codes + f32 scales
    assert EPConfig(**kw, token_dtype="fp8_e4m3_ue8m0").token_bytes == 7168 + 56        # the 8 B of padding unsent
    assert EPConfig(**{**kw, "hidden": 384}, token_dtype="fp8_e4m3_ue8m0").token_bytes == 384 + 3


def test_wait_timeout_accepts_numpy_reals():
    assert EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=8, max_tokens_per_rank=4,
                    wait_timeout_s=np.float32(1.5)).wait_timeout_s == 1.5


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, -math.inf, None, "10", True])
def test_wait_timeout_rejects_negative_non_finite_and_non_numbers(value):
    msg = config_error(wait_timeout_s=value)
    assert_fragments(msg, f"EPConfig.wait_timeout_s={value!r}", "must be a finite number of seconds >= 0",
                     "use 10.0 (or 0 to wait forever)")


@pytest.mark.parametrize("value", [0, 0.0, 0.25, 10, 3600.0])
def test_wait_timeout_accepts_finite_non_negative(value):
    assert cfg(wait_timeout_s=value).wait_timeout_s == value


def test_default_wait_timeout_is_finite_and_positive():
    assert 0 < EPConfig(**DSV3).wait_timeout_s < math.inf


# -- capacity beyond int32 row indices ---------------------------------------------------------
def test_worst_case_capacity_beyond_int32_names_max_tokens_per_rank():
    # 64 ranks x 2**25 tokens x min(top_k=1, L=1) = 2**31 rows > 2**31 - 1.
    msg = config_error(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=2**25)
    assert_fragments(msg, "EPConfig.max_tokens_per_rank=33554432", "gives 2147483648 expert-batch rows",
                     "more than int32 row indices allow", "set max_recv_rows to a smaller capacity")


def test_capacity_one_below_int32_limit_is_accepted():
    # 64 * (2**25 - 1) = 2**31 - 64 rows: fits.
    c = cfg(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=2**25 - 1)
    assert c.recv_rows_capacity == 2**31 - 64


def test_padding_can_push_the_worst_case_beyond_int32():
    # 64 ranks * (2**25 - 1) tokens = 2**31 - 64 real rows; one local expert, so padding adds
    # pad - 1 rows: 63 (pad 64) lands exactly on 2**31 - 1, 64 (pad 65) is one row too many.
    ok = cfg(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=2**25 - 1, pad_multiple=64)
    assert ok.worst_case_recv_rows == 2**31 - 1
    msg = config_error(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=2**25 - 1,
                       pad_multiple=65)
    assert_fragments(msg, "gives 2147483648 expert-batch rows", "more than int32 row indices allow")


def test_explicit_capacity_beyond_int32_names_max_recv_rows():
    msg = config_error(max_recv_rows=2**31)
    assert_fragments(msg, "EPConfig.max_recv_rows=2147483648", "gives 2147483648 expert-batch rows",
                     "more than int32 row indices allow", "set max_recv_rows to a smaller capacity")


def test_explicit_capacity_rescues_a_worst_case_beyond_int32():
    c = cfg(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=2**25, max_recv_rows=4096)
    assert c.recv_rows_capacity == 4096
    assert c.worst_case_recv_rows == 2**31


# -- derived properties ------------------------------------------------------------------------
def test_derived_sizes_deepseek_v3_like():
    c = EPConfig(**DSV3)
    assert c.n_local_experts == 32                       # 256 / 8
    assert c.token_bytes == 14336                        # 7168 bf16 values * 2 bytes
    assert c.routing_bytes == 64                         # 8 * (int32 id + float32 weight)
    assert c.bytes_per_message == 14400                  # 14336 + 64
    assert c.worst_case_recv_tokens == 32768             # 8 ranks * 4096 tokens
    assert c.worst_case_recv_rows == 262144              # 32768 * min(8, 32), no padding
    assert c.recv_rows_capacity == 262144


def test_worst_case_rows_with_padding():
    c = cfg(pad_multiple=128)
    # 32768 tokens * 8 local hits + 32 segments * 127 padding rows
    assert c.worst_case_recv_rows == 262144 + 4064
    assert c.recv_rows_capacity == 266208


def test_worst_case_rows_when_top_k_exceeds_local_experts():
    # 2 local experts, top-6: a token can hit at most 2 experts of one rank.
    c = EPConfig(n_ranks=4, n_experts=8, top_k=6, hidden=32, max_tokens_per_rank=10, pad_multiple=4)
    assert c.n_local_experts == 2
    assert c.worst_case_recv_tokens == 40               # 4 * 10
    assert c.worst_case_recv_rows == 40 * 2 + 2 * 3     # min(6, 2) hits + 2 segments * 3 padding


def test_max_recv_rows_overrides_capacity_but_not_worst_case():
    c = EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=16, pad_multiple=4,
                 max_recv_rows=50)
    assert c.worst_case_recv_rows == 2 * 16 * 2 + 4 * 3  # 76
    assert c.recv_rows_capacity == 50


def test_rank_of_expert():
    c = EPConfig(**DSV3)
    assert [c.rank_of_expert(e) for e in (0, 31, 32, 63, 128, 224, 255)] == [0, 0, 1, 1, 4, 7, 7]
    c4 = EPConfig(n_ranks=4, n_experts=8, top_k=2, hidden=8, max_tokens_per_rank=4)
    assert [c4.rank_of_expert(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_as_dict_round_trips():
    c = cfg(pad_multiple=64, max_recv_rows=1000, n_sms=20, wait_timeout_s=2.5)
    assert EPConfig(**c.as_dict()) == c
    assert c.as_dict()["pad_multiple"] == 64


# -- frozen ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["n_ranks", "top_k", "pad_multiple", "max_recv_rows"])
def test_config_is_frozen(field):
    c = EPConfig(**DSV3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(c, field, 1)
    assert c == EPConfig(**DSV3)


def test_equal_configs_hash_equal():
    assert hash(EPConfig(**DSV3)) == hash(EPConfig(**DSV3))
    assert len({EPConfig(**DSV3), EPConfig(**DSV3), cfg(top_k=4)}) == 2


# -- valid edge configs --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(n_ranks=2, n_experts=8, top_k=8, hidden=16, max_tokens_per_rank=4),        # top_k == n_experts
    dict(n_ranks=1, n_experts=1, top_k=1, hidden=1, max_tokens_per_rank=1),         # the smallest
    dict(n_ranks=1, n_experts=16, top_k=4, hidden=128, max_tokens_per_rank=64),     # one rank
    dict(n_ranks=64, n_experts=64, top_k=1, hidden=16, max_tokens_per_rank=8),      # 64 ranks
    dict(n_ranks=64, n_experts=256, top_k=256, hidden=16, max_tokens_per_rank=8),   # 64 ranks, all experts
    dict(n_ranks=8, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=4096, pad_multiple=1,
         max_recv_rows=1, n_sms=1, wait_timeout_s=0),
])
def test_valid_edge_configs_construct(kwargs):
    c = EPConfig(**kwargs)
    assert c.n_local_experts * c.n_ranks == c.n_experts
    assert 1 <= c.top_k <= c.n_experts
    assert c.recv_rows_capacity >= 1


def test_top_k_equal_to_n_experts_sizes():
    c = EPConfig(n_ranks=2, n_experts=8, top_k=8, hidden=16, max_tokens_per_rank=4)
    assert c.routing_bytes == 64
    assert c.worst_case_recv_rows == 2 * 4 * 4        # every token hits all 4 local experts
