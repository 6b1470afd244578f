"""The execution plan (ep_runtime.core.plan), without a simulator: the rules and their reasons, the
overrides (arguments and EP_RUNTIME_PLAN) and the errors naming the rule, the grids, the regions
a plan allocates, and the one environment variable left to choose an algorithm."""

from __future__ import annotations

import itertools
import pathlib
import re
from types import SimpleNamespace

import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.plan import (LAND_SMS, PLAN_ENV, ExpandedCopy, Plan, Receiver, Topology, Transport, agree,
                                  choose_plan, merged_overrides, parse_overrides)

H100x2 = Topology.nvlink_gpus(2)


def cfg(T: int = 4096, layouts="both", token_dtype="bfloat16", **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=T,
                              token_dtype=token_dtype, layouts=layouts), **changes})


# -- the rules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T, layouts, token_dtype, receiver, copy", [
    (1, "both", "bfloat16", "route_first", "in_wait"),
    (128, "both", "bfloat16", "route_first", "in_wait"),
    (128, "compact", "bfloat16", "route_first", "none"),
    (256, "both", "bfloat16", "wait", "dispatch_copy"),
    (1023, "both", "bfloat16", "wait", "dispatch_copy"),
    (1024, "both", "bfloat16", "land", "in_land"),
    (4096, "both", "bfloat16", "land", "in_land"),
    (4096, "expanded", "bfloat16", "land", "in_land"),
    (4096, "compact", "bfloat16", "route_first_chunked", "none"),
    (1024, "compact", "bfloat16", "route_first_chunked", "none"),
    (1, "both", "fp8_e4m3", "route_first", "dispatch_copy"),
    (128, "both", "fp8_e4m3", "route_first", "dispatch_copy"),
    (128, "compact", "fp8_e4m3_ue8m0", "route_first", "none"),
    (129, "both", "fp8_e4m3", "wait", "dispatch_copy"),
    (128, "expanded", "fp8_e4m3", "route_first", "dispatch_copy"),
    (511, "both", "fp8_e4m3", "wait", "dispatch_copy"),
    (512, "both", "fp8_e4m3", "route_first_chunked", "dispatch_copy"),
    (4096, "compact", "fp8_e4m3_ue8m0", "route_first_chunked", "none"),
])
def test_the_rules_on_an_nvlink_host(T, layouts, token_dtype, receiver, copy):
    plan = choose_plan(cfg(T, layouts, token_dtype), H100x2)
    assert (plan.receiver.value, plan.expanded_copy.value) == (receiver, copy)
    assert plan.transport is Transport.STORES and plan.pdl and plan.threads == 512 and plan.grid == 132
    assert plan.layouts == cfg(T, layouts).layouts
    reasons = dict(r.split(": ", 1) for r in plan.reasons)
    assert reasons["receiver"] and reasons["transport"] and reasons["expanded_copy"], plan.reasons


@pytest.mark.parametrize("T, layouts, receiver", [
    (128, "compact", "route_first"),  # FP8, compact: route first up to 128 tokens at any rank count
    (128, "expanded", "wait"),  # 4 x 128 = 512 received tokens > 256: placing first delays dispatch_copy
    (128, "both", "wait"),
    (64, "expanded", "route_first"),  # 4 x 64 = 256
    (1, "both", "route_first"),
])
def test_fp8_routes_first_in_the_expanded_layout_only_while_few_tokens_are_received(T, layouts, receiver):
    plan = choose_plan(cfg(T, layouts, "fp8_e4m3", n_ranks=4), Topology.nvlink_gpus(4))
    assert plan.receiver.value == receiver, plan.reasons
    if receiver == "wait":
        assert "512 > 256 tokens received" in dict(r.split(": ", 1) for r in plan.reasons)["receiver"]


def test_serving_both_layouts_says_what_it_trades():
    both = choose_plan(cfg(4096), H100x2)
    assert "trade: serving both layouts, the compact one lands too" in both.describe()
    assert "trade" not in choose_plan(cfg(4096, "compact"), H100x2).describe()
    assert "trade" not in choose_plan(cfg(128), H100x2).describe()


@pytest.mark.parametrize("topology, changes, receiver, why", [
    (Topology.nvlink_gpus(1), {"n_ranks": 1}, "wait", "one rank"),
    (H100x2, {"n_sms": 32}, "wait", "EPConfig.n_sms"),
    (Topology(2, True, 132, pdl=False), {}, "wait", "no PDL"),
    (Topology(2, True, 2, pdl=False, simulated=True), {}, "wait", "simulator"),
])
def test_no_early_receiver_without_free_sms_pdl_or_peers(topology, changes, receiver, why):
    plan = choose_plan(cfg(128, n_experts=256 if changes.get("n_ranks", 2) == 2 else 128, **changes), topology)
    assert plan.receiver.value == receiver and why in dict(r.split(": ", 1) for r in plan.reasons)["receiver"]
    assert plan.receiver_sms == 0 and plan.dispatch_async_grid == plan.grid
    # combine_wait starts early wherever SMs are left free and PDL is on, whatever the ranks
    assert plan.combine_wait_sms == (24 if topology.pdl and "n_sms" not in changes else 0)


def test_unmapped_peers_take_the_puts():
    remote = Topology(2, peers_mapped=False, sm_count=132, pdl=True)
    assert choose_plan(cfg(4096), remote).transport is Transport.PUTS
    assert choose_plan(cfg(4096), remote).receiver is Receiver.LAND
    assert choose_plan(cfg(128), remote).receiver is Receiver.WAIT  # route first stores the routing
    assert choose_plan(cfg(4096, token_dtype="fp8_e4m3"), remote).receiver is Receiver.WAIT


def test_the_simulator_plan():
    plan = choose_plan(cfg(16, hidden=64, n_experts=8, top_k=2), Topology(2, True, 0, False, True))
    assert (plan.threads, plan.grid, plan.pdl, plan.receiver) == (8, 2, False, Receiver.WAIT)


def test_grids_and_sm_splits():
    land = choose_plan(cfg(4096), H100x2)
    assert land.receiver_sms == LAND_SMS and land.dispatch_async_grid == 132 - 48 and land.dispatch_wait_grid == 132
    first = choose_plan(cfg(128), H100x2)
    assert (first.placing_blocks, first.dispatch_async_grid, first.dispatch_wait_grid) == (2, 130, 2)
    chunked = choose_plan(cfg(4096, "compact"), H100x2)
    assert (chunked.placing_blocks, chunked.dispatch_async_grid, chunked.dispatch_wait_grid) == (4, 128, 4)
    assert land.combine_async_grid("compact") == 132 - 24 and land.combine_async_grid("expanded") == 132 - 8
    big = choose_plan(cfg(4096), H100x2, {"receiver_sms": 100})
    assert big.dispatch_async_grid == 66  # landing keeps at least half the grid for its own copy


# -- overrides ----------------------------------------------------------------------------------------
def test_overrides_win_and_derived_fields_follow_them():
    plan = choose_plan(cfg(4096), H100x2, {"receiver": "route_first_chunked"})
    assert plan.receiver is Receiver.ROUTE_FIRST_CHUNKED and plan.expanded_copy is ExpandedCopy.DISPATCH_COPY
    assert plan.placing_blocks == 4 and "receiver: set by override" in plan.reasons
    assert choose_plan(cfg(128), H100x2, {"pdl": "0"}).receiver is Receiver.WAIT
    assert choose_plan(cfg(4096), H100x2, {"receiver": "wait"}).receiver_sms == 0


def test_override_strings():
    assert parse_overrides(" receiver = land, pdl=0,receiver_sms=64 ") == {
        "receiver": Receiver.LAND, "pdl": False, "receiver_sms": 64}
    assert parse_overrides("") == {}


@pytest.mark.parametrize("text, match", [
    ("recever=land", "unknown plan field 'recever'; overridable fields: transport, receiver"),
    ("receiver=fast", "receiver='fast'; expected one of wait, land, route_first, route_first_chunked"),
    ("pdl=maybe", "pdl='maybe'; expected 1 or 0"),
    ("receiver_sms=-3", "receiver_sms='-3'; expected an integer >= 0"),
    ("receiver", "'receiver' is not key=value"),
])
def test_bad_override_strings_are_refused_naming_the_key(text, match):
    with pytest.raises(EPConfigError, match=re.escape(match)):
        parse_overrides(text)


@pytest.mark.parametrize("overrides, rule", [
    ({"receiver": "route_first", "transport": "puts"}, "plan rule 'receiver'"),
    ({"receiver": "wait", "expanded_copy": "in_land"}, "plan rule 'expanded_copy'"),
    ({"expanded_copy": "none"}, "plan rule 'expanded_copy'"),
    ({"receiver": "wait", "placing_blocks": 2}, "plan rule 'placing_blocks'"),
    ({"receiver_sms": 132}, "plan rule 'receiver_sms'"),
    ({"share_from_tokens": 0}, "plan rule 'thresholds'"),
])
def test_impossible_combinations_name_the_rule(overrides, rule):
    with pytest.raises(EPConfigError, match=re.escape(rule)):
        choose_plan(cfg(4096), H100x2, overrides)


def test_impossible_for_the_format_or_topology():
    with pytest.raises(EPConfigError, match="in_wait needs a route-first receiver and bf16"):
        choose_plan(cfg(128, token_dtype="fp8_e4m3"), H100x2, {"receiver": "route_first", "expanded_copy": "in_wait"})
    with pytest.raises(EPConfigError, match="transport=stores needs every PE's heap mapped"):
        choose_plan(cfg(128), Topology(2, False, 132, True), {"transport": "stores"})
    with pytest.raises(EPConfigError, match="pdl=1 needs compute capability 9.0"):
        choose_plan(cfg(128), Topology(2, True, 132, False), {"pdl": 1})


def test_the_environment_string_merges_with_the_arguments(monkeypatch):
    monkeypatch.setenv(PLAN_ENV, "receiver=land")
    assert merged_overrides({"pdl": True}) == {"receiver": Receiver.LAND, "pdl": True}
    assert merged_overrides({"receiver": "land"}) == {"receiver": Receiver.LAND}
    with pytest.raises(EPConfigError, match="set the same plan fields to different values"):
        merged_overrides({"receiver": "wait"})
    monkeypatch.setenv(PLAN_ENV, "bogus=1")
    with pytest.raises(EPConfigError, match=f"{PLAN_ENV}: unknown plan field 'bogus'"):
        merged_overrides({})


# -- records --------------------------------------------------------------------------------------------
def test_describe_is_a_narrow_table_with_the_reasons():
    text = choose_plan(cfg(4096, "compact"), H100x2).describe()
    assert max(map(len, text.splitlines())) < 120, text
    assert "receiver                   route_first_chunked" in text and "compact layout only" in text
    assert "grids: dispatch_async 128, dispatch_wait 4" in text


def test_plans_compare_by_their_choices_not_their_reasons():
    a = choose_plan(cfg(4096), H100x2)
    b = choose_plan(cfg(4096), H100x2, {"receiver": "land"})
    assert a == b and a.reasons != b.reasons and a.as_dict() == b.as_dict()
    assert a.as_dict()["receiver"] == "land" and a.as_dict()["layouts"] == ["expanded", "compact"]


def test_every_rank_must_choose_the_same_plan():
    mine = choose_plan(cfg(4096), H100x2)
    other = choose_plan(cfg(4096), H100x2, {"receiver": "wait"})
    session = SimpleNamespace(rank=0, allgather_object=lambda obj: [obj, (other.as_dict(), other.describe())])
    with pytest.raises(EPConfigError) as info:
        agree(mine, session)
    assert "differs from rank 1's" in str(info.value)
    assert "receiver                   land" in str(info.value) and "receiver                   wait" in str(info.value)
    agree(mine, SimpleNamespace(rank=0, allgather_object=lambda obj: [obj, obj]))


# -- regions ----------------------------------------------------------------------------------------------
def test_a_plan_allocates_only_the_regions_it_uses():
    def regions(c, overrides=None):
        return {r.name for r in BufferLayout(c, choose_plan(c, H100x2, overrides)).regions}

    compact = BufferLayout(cfg(4096, "compact"), choose_plan(cfg(4096, "compact"), H100x2))
    both = BufferLayout(cfg(4096), choose_plan(cfg(4096), H100x2))
    assert not compact.has("expert_x") and both.has("expert_x")
    assert both.local_bytes - compact.local_bytes >= 65536 * 7168 * 2  # the expanded batch: 0.9 GiB
    assert "combine_stage" not in regions(cfg(4096)) and "combine_stage" in regions(cfg(4096), {"transport": "puts"})
    assert "dispatch_ranks" not in regions(cfg(4096, "compact")) and "dispatch_ranks" in regions(cfg(4096))
    assert "dispatch_row_flag" in regions(cfg(4096)) and "dispatch_row_flag" not in regions(cfg(128))
    assert "dispatch_route_signal" not in regions(cfg(256))
    assert "dispatch_placed" in regions(cfg(128)) and "dispatch_placed" not in regions(cfg(4096))
    assert set(compact.absent()) >= {"expert_x", "dispatch_ranks", "combine_stage"}
    assert "not allocated under this plan: " in compact.describe()


def test_whole_plans_are_checked_against_the_config():
    plan = choose_plan(cfg(4096), H100x2)
    from ep_runtime.core.plan import check_plan

    with pytest.raises(EPConfigError, match="plan rule 'layouts'"):
        check_plan(plan, cfg(4096, "compact"), H100x2)
    assert isinstance(plan, Plan)


# -- the environment ------------------------------------------------------------------------------------
def test_at_most_four_environment_variables_and_one_chooses_algorithms():
    root = pathlib.Path(__file__).resolve().parents[1]
    names = set()
    for path in list((root / "ep_runtime").rglob("*.py")):
        names |= set(re.findall(r"EP_RUNTIME_[A-Z0-9_]+", path.read_text()))
    assert names <= {"EP_RUNTIME_PLAN", "EP_RUNTIME_KERNEL_CACHE", "EP_RUNTIME_TRACE", "EP_RUNTIME_FAST_LAUNCH"}, names


def test_the_default_plans_table_in_the_docs_is_the_rules_output():
    """docs/plans.md lists the default plans of an H100/H200 host; it must be what choose_plan
    gives now (regenerate with ``python -m ep_runtime.tools.plans --table``)."""
    from pathlib import Path

    from ep_runtime.tools.plans import plans_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "plans.md").read_text()
    assert plans_table() in doc, "docs/plans.md's default plans table is stale: python -m ep_runtime.tools.plans --table"


@pytest.mark.parametrize("sm_count", [2, 3, 8, 16, 32, 48, 66, 100, 132])
def test_every_default_plan_builds_on_any_sm_count(sm_count):
    """The early receivers' SM figures (measured on 132 SMs) take the same share of a smaller
    grid (4 ranks sharing one H100 under MPS see 32 SMs; MIG slices), never all of it: every
    default plan passes check_plan, its senders keep at least half the grid, and on 132 SMs the
    figures are the measured ones."""
    from ep_runtime.core.plan import COMBINE_WAIT_SMS, COMBINE_WAIT_SMS_EXPANDED, fitted_sms

    for R, dtype, T, layouts in itertools.product((2, 4), ("bfloat16", "fp8_e4m3"), (1, 128, 1024, 4096),
                                                 ("expanded", "compact", "both")):
        cfg = EPConfig(n_ranks=R, n_experts=8 * R, top_k=4, hidden=7168, max_tokens_per_rank=T, token_dtype=dtype,
                       layouts=layouts)
        plan = choose_plan(cfg, Topology(R, True, sm_count, True, True))
        label = f"{sm_count} SMs, {R} ranks, {dtype}, T={T}, {layouts}: {plan.summary()}"
        assert 0 < plan.receiver_sms < plan.grid or plan.receiver_sms == 0, label
        assert plan.dispatch_async_grid >= (plan.grid + 1) // 2, label
        for layout in ("expanded", "compact"):
            assert plan.combine_async_grid(layout) >= (plan.grid + 1) // 2, label
        if plan.receiver is Receiver.LAND:
            assert plan.receiver_sms == fitted_sms(LAND_SMS, sm_count), label
        if sm_count == 132 and plan.grid == 132:  # (a tiny batch takes fewer blocks, none left free)
            assert plan.combine_wait_sms == COMBINE_WAIT_SMS, label
            assert plan.combine_wait_sms_expanded == COMBINE_WAIT_SMS_EXPANDED, label
            assert plan.receiver is not Receiver.LAND or plan.receiver_sms == LAND_SMS, label
    assert [fitted_sms(LAND_SMS, g) for g in (2, 32, 66, 132)] == [1, 12, 24, 48]
