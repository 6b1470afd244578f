"""Megatron-core's MoE layer with the flex token dispatcher on ep_runtime, against Megatron's own
all-to-all dispatcher, on the same weights and inputs.

    torchrun --nproc-per-node 2 examples/megatron_moe.py --device cuda --backend both
    mpirun -np 2 python examples/megatron_moe.py --device cuda --backend both
    bash tests/gpu/mps_run.sh 2 sh -c 'mpirun -np 2 $EP_MPIRUN_ARGS python3 examples/megatron_moe.py \
        --device cuda --dist-backend gloo'                                  # 2 ranks sharing one GPU
    torchrun --nproc-per-node 2 examples/megatron_moe.py --device cpu    # the simulator, gloo

Pinned: megatron-core 0.16.1 (``pip install megatron-core==0.16.1 --no-deps``; it needs torch,
numpy and packaging; no TransformerEngine, apex or DeepEP).

Every rank of a torch.distributed job (the expert-parallel group is the world: tensor and pipeline
parallel 1, ``expert_model_parallel_size`` = world size) builds Megatron-core ``MoELayer``s
(``TopKRouter``, ``SequentialMLP`` experts of Megatron's local ``ColumnParallelLinear`` /
``RowParallelLinear``: the spec of ``get_moe_module_spec(use_te=False)``, which needs neither
TransformerEngine nor grouped_gemm) with the same weights: the reference with
``moe_token_dispatcher_type="alltoall"`` (Megatron's permute + torch.distributed all-to-all), and
one per backend with ``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend``
``"deepep"`` or ``"hybridep"``: Megatron-core's own ``fused_a2a``, unmodified, on
ep_runtime's DeepEP layer (``deep_ep.Buffer``: the dense layout; ``deep_ep.HybridEPBuffer``:
the expanded one). ``import deep_ep`` gives the layer after the install step (``python -m
ep_runtime deep-ep install``); the script makes sure of it in its own process with
:func:`ep_runtime.megatron.fused_a2a` before Megatron-core's MoE modules are imported. The
layer opens the group's ep_runtime session itself (:func:`ep_runtime.shmem.session_for` over
the group Megatron-core passes to ``deep_ep.Buffer``).

The config: hidden 256, ffn 512 (SwiGLU), 8 experts, top-2, 96 tokens per rank, bf16 parameters
and activations, router in float32 (``moe_router_dtype="fp32"``: DeepEP and HybridEP take float32
probabilities), no aux loss, no shared experts, no token dropping. Weights: the router the same on
every rank; expert e's weights drawn from (seed, e), so each rank's experts differ and a token
sent to the wrong rank or expert shows.

Checked on every rank: the forward output, the input gradient and every parameter gradient (the
router's all-reduced over the group, as data parallelism would), each as ``max|G - R| <= tol *
max|R|`` against the reference R, then 5 SGD steps on both from the same start, the global loss
of each step compared as ``|l - l_ref| <= LOSS_TOL * |l_ref|``.

Tolerances. Both layers run the same Megatron code on the same bf16 values except for the
dispatch and combine, so they can differ only where bf16 rounds differently: Megatron's combine
adds a token's top-k expert rows in bf16 (unpermute's ``scatter_add``, one rounding per add),
ep_runtime's in float32 with one rounding at the end (the same value for top-2: the exact sum of
two bf16 values, rounded once); and an expert's GEMMs may see its rows in another order or batch
size (other float32 accumulation orders, so other bf16 roundings of the weight gradients). bf16
keeps 8 significant bits (unit roundoff 2**-8 relative to a value, at most 2**-8 of the tensor's
largest magnitude): the forward output differs by at most ~2 roundings and a gradient by a chain
of about 6 (the output gradient's dispatch, the expert backward's two GEMMs and SwiGLU in bf16,
the dispatch backward's top-k sum, the probability path into the router), so ``FWD_TOL = 2**-6``
(1.6%, 4 roundings) and ``GRAD_TOL = 2**-5`` (3.1%, 8 roundings) leave a margin, while a misrouted
token, a wrong or missing probability or a lost gradient path gives errors of the order of the
values themselves (a 5% error in the dispatched probabilities alone fails every row). A loss is
a mean over 2 x 96 x 256 squared errors, in which rounding differences average out, so
``LOSS_TOL = 2**-8`` (0.4%) per step. (On the simulator every tensor and loss comes out bitwise
equal: the flex paths hand each expert its rows in the all-to-all path's order, source rank then
token, and the probabilities' gradients travel home exactly.)

Without TransformerEngine (CPU or GPU), Megatron-core 0.16.1's router raises ``NameError`` (see
:func:`no_te_shims`); the script defines the missing name so the router takes its torch branch.
CPU (``--device cpu``, the simulator): Megatron-core 0.16.1 hard-codes CUDA in the reference's
all-to-all dispatcher, in tensor_parallel's collectives and in the router; the script replaces
those calls with host equivalents that change no value and no communication (:func:`cpu_shims`
lists each, file:line). ``torch.compile`` (Megatron's ``jit_fuser``) is off unless ``--compile``
(:func:`compile_off`).

Prints a table per backend (max error / tolerance per tensor, the 5 losses) and PASS or FAIL
(exit code 0 or 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import zlib

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS, STEPS = 256, 512, 8, 2, 96, 5
LR, SEED = 0.5, 1234
FWD_TOL, GRAD_TOL, LOSS_TOL = 2.0**-6, 2.0**-5, 2.0**-8
MEGATRON_VERSION = "0.16.1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("deepep", "hybridep", "both"), default="both")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--ffn", type=int, default=FFN, help="each expert's FFN width (SwiGLU)")
    p.add_argument("--experts", type=int, default=EXPERTS)
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--steps", type=int, default=STEPS, help="training steps whose losses are compared")
    p.add_argument("--init-method", default="env://", help="torch.distributed init_method")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend (default: nccl on cuda, gloo on cpu; gloo on cuda for several "
                        "ranks sharing one GPU, which NCCL refuses)")
    p.add_argument("--compile", action="store_true", help="keep Megatron's torch.compile (jit_fuser) on")
    p.add_argument("--port", type=int, default=None, help="MASTER_PORT when the launcher sets none (default 29531)")
    return p.parse_args(argv)


def job_env(port: int | None) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's variables or Open MPI's (mpirun), and the
    rendezvous address torch.distributed's env:// reads (defaults 127.0.0.1:29531)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    elif "PMI_RANK" in env:  # MPICH / Hydra
        rank, world = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
        local = int(env.get("MPI_LOCALRANKID", rank))
    else:
        rank, world, local = 0, 1, 0
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(port or 29531))
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(world), str(local)
    return rank, world, local


# -- CPU: Megatron-core 0.16.1's CUDA-only calls on the path of this layer ---------------------------
class _HostStream:
    """A stream on the host: work is done when the call returns, so waiting is a no-op."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _TorchWith:
    """``torch`` as one module sees it, with some attributes replaced (``cuda``)."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)


def cpu_shims() -> list[str]:
    """Make Megatron-core 0.16.1's MoE layer run on a CPU-only torch. Each one replaces a CUDA call
    with its host equivalent; none changes a value, a routing decision or a communication:

    1. ``megatron/core/transformer/moe/token_dispatcher.py:445`` (the reference's
       ``MoEAlltoAllTokenDispatcher.__init__``) creates ``torch.cuda.Stream()`` for its
       device-to-host copies of the split sizes, and ``_maybe_dtoh_and_synchronize``
       (:871-899) switches to it with ``torch.cuda.current_stream()`` / ``torch.cuda.stream()``
       and waits on its event: with CPU tensors there is nothing to copy asynchronously (the
       values are on the host when the call returns; item 3), so the stream, the switch and the
       wait are no-ops (:class:`_HostStream`).
    2. ``megatron/core/tensor_parallel/mappings.py:91,141,148,181,442`` allocate the outputs of
       the all-gathers and all-to-alls (the reference dispatcher's token counts and tokens) on
       ``torch.cuda.current_device()``; ``megatron/core/transformer/moe/router.py:88-92``
       (``Router.gating``) moves a CPU router weight to ``torch.cuda.current_device()`` before
       every gating. In those modules ``torch.cuda.current_device()`` answers the CPU, where
       the inputs are.
    3. ``megatron/core/transformer/moe/moe_utils.py:1093`` (``maybe_move_tensor_to_cpu``) converts
       the all-to-all split sizes to NumPy (``as_numpy=True``, token_dispatcher.py:879-887) only
       for CUDA tensors; CPU tensors stay tensors, which ``torch.distributed.all_to_all_single``
       refuses as split sizes (``TypeError``: it takes a sequence of ints). In token_dispatcher,
       CPU tensors are converted as CUDA ones are.

    Each module sees ``torch`` with only ``torch.cuda`` replaced (:class:`_TorchWith`).
    """
    import types

    import torch
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import router, token_dispatcher

    host = _HostStream()
    cuda = types.SimpleNamespace(current_device=lambda: torch.device("cpu"), Stream=_HostStream,
                                 current_stream=lambda device=None: host, stream=lambda stream=None: host)
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host
    for module in (token_dispatcher, mappings, router):
        module.torch = _TorchWith(cuda=cuda)
    on_device = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return on_device(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    return [("torch.cuda.{current_device,Stream,current_stream,stream} on the host in "
             "token_dispatcher, tensor_parallel.mappings, router"),
            "token_dispatcher.maybe_move_tensor_to_cpu: as_numpy for CPU tensors too"]


def compile_off() -> list[str]:
    """``torch.compile`` off (``torch._dynamo.config.disable``; ``--compile`` keeps it): Megatron's
    ``jit_fuser`` (``megatron/core/jit.py``: ``torch.compile``) wraps
    ``MoEFlexTokenDispatcher.dispatch_preprocess`` (token_dispatcher.py:1403: reshapes of the
    routing map and ``torch.topk``) and the experts' SwiGLU helpers (not on this path:
    ``bias_activation_fusion=False``). The first call would compile with Inductor (C++ on a CPU:
    minutes on a small machine; Triton and a host compiler on a GPU); eager gives the same values."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    return ["torch.compile off (Megatron's jit_fuser runs eagerly)"]


def no_te_shims() -> list[str]:
    """Megatron-core 0.16.1 without TransformerEngine (CPU or GPU): the router's gating GEMM
    (``megatron/core/transformer/moe/moe_utils.py:1192``, ``RouterGatingLinearFunction.forward``,
    and :1225 in its backward) tests ``te_general_gemm is not None``, a name only the module's
    ``try: from megatron.core.extensions.transformer_engine import ...`` (:22-38) defines: its
    ``except ImportError`` leaves it undefined, so every router forward raises ``NameError``. Defining
    it as ``None`` selects the module's own torch fallback (``torch.mm`` in the router dtype), the
    branch the code has for this case."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    moe_utils.te_general_gemm = None
    return ["moe_utils.te_general_gemm = None (no TransformerEngine)"]


# -- the layers ------------------------------------------------------------------------------------
def make_config(dispatcher: str, backend: str | None, args, world: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"moe_flex_dispatcher_backend": backend} if backend else {}
    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=4, num_moe_experts=args.experts, moe_router_topk=args.top_k,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_router_dtype="fp32", moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        moe_permute_fusion=False, moe_router_fusion=False, moe_shared_expert_intermediate_size=None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=world,
        sequence_parallel=False, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, **extra)


def build_layer(config):
    """Megatron's MoELayer with the local (no TransformerEngine) MoE spec: TopKRouter, SequentialMLP."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return MoELayer(config, spec.submodules)


def is_expert_param(name: str) -> bool:
    return name.startswith("experts.")


def set_weights(layer, rank: int) -> None:
    """The router from (SEED, name), the same on every rank; global expert e's weights from
    (SEED, e, name); each normal with std 1/sqrt(fan_in), rounded to the parameter's dtype."""
    import torch

    L = layer.num_local_experts
    for name, p in layer.named_parameters():
        key = name
        if name.startswith("experts.local_experts."):
            local, rest = name[len("experts.local_experts."):].split(".", 1)
            key = f"expert{rank * L + int(local)}.{rest}"
        g = torch.Generator().manual_seed(zlib.crc32(f"{SEED}:{key}".encode()))
        w = torch.randn(p.shape, generator=g, dtype=torch.float32) / p.shape[-1] ** 0.5
        with torch.no_grad():
            p.copy_(w.to(p.dtype))


def rank_inputs(rank: int, tokens: int, hidden: int):
    """This rank's hidden states [S, 1, H] and regression target, bf16."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1 + rank)
    x = torch.randn(tokens, 1, hidden, generator=g).bfloat16()
    target = torch.randn(tokens, 1, hidden, generator=g).bfloat16()
    return x, target


def step(layer, x, target, world: int, group):
    """Forward, the job's mean squared error (this rank's share), backward; the router's gradient
    (replicated over the group) summed over it, as data parallelism would. Returns (output, input
    gradient, global loss)."""
    import torch.distributed as dist

    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    loss = ((out.float() - target.float()) ** 2).mean() / world
    loss.backward()
    for name, p in layer.named_parameters():
        if not is_expert_param(name) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return out.detach(), x.grad.detach(), float(total)


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| in float32."""
    ref, got = ref.float(), got.float()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def compare(ref_layer, layer, x, target, world, group, steps: int) -> dict:
    """One checked step, then ``steps`` SGD steps on both layers from the same start."""
    import torch

    out_r, dx_r, _ = step(ref_layer, x, target, world, group)
    out_f, dx_f, _ = step(layer, x, target, world, group)
    rows = [("output", rel_err(out_f, out_r), FWD_TOL), ("input grad", rel_err(dx_f, dx_r), GRAD_TOL)]
    grads_r = dict(ref_layer.named_parameters())
    for name, p in layer.named_parameters():
        rows.append((f"grad {name}", rel_err(p.grad, grads_r[name].grad), GRAD_TOL))
    losses = []
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref_layer, layer)]
    for _ in range(steps):
        pair = []
        for m, opt in zip((ref_layer, layer), opts):
            pair.append(step(m, x, target, world, group)[2])
            opt.step()
        losses.append(tuple(pair))
    return {"rows": rows, "losses": losses}


#: The layer's calls counted per backend (Megatron-core calls them from its fused_a2a).
COUNTED = {"deepep": ("Buffer", ("dispatch", "combine")),
           "hybridep": ("HybridEPBuffer", ("dispatch_with_permute", "combine_with_unpermute"))}


def count_calls(calls: dict) -> None:
    """Count the calls Megatron-core's fused_a2a makes into ep_runtime's DeepEP layer (its
    ``deep_ep.Buffer`` and ``deep_ep.HybridEPBuffer`` methods, wrapped here)."""
    import ep_runtime.deep_ep as layer

    for cls_name, methods in COUNTED.values():
        cls = getattr(layer, cls_name)
        for name in methods:
            method = getattr(cls, name)

            def counted(*a, _method=method, _name=f"{cls_name}.{name}", **kw):
                calls[_name] = calls.get(_name, 0) + 1
                return _method(*a, **kw)

            setattr(cls, name, counted)


def table(backend: str, per_rank: list[dict]) -> tuple[bool, str]:
    """The report of one backend over every rank's results: (passed, text)."""
    header = (f"flex/{backend} (ep_runtime) vs alltoall (Megatron), {len(per_rank)} ranks: "
              f"max|G - R| / max|R|, the largest over the ranks")
    ok, lines = True, [header]
    for i, (name, _, tol) in enumerate(per_rank[0]["rows"]):
        err = max(r["rows"][i][1] for r in per_rank)
        ok &= err <= tol
        lines.append(f"  {name:<48} {err:10.3e}  tol {tol:.3e}  {'ok' if err <= tol else 'FAIL'}")
    lines.append(f"  {'step':<6}{'loss alltoall':>16}{'loss flex':>16}{'rel diff':>12}")
    for i, (l_ref, l_flex) in enumerate(per_rank[0]["losses"]):  # global losses, the same on every rank
        d = abs(l_flex - l_ref) / abs(l_ref)
        ok &= d <= LOSS_TOL
        lines.append(f"  {i + 1:<6}{l_ref:16.6f}{l_flex:16.6f}{d:12.3e}  {'ok' if d <= LOSS_TOL else 'FAIL'}")
    calls = [r["calls"] for r in per_rank]
    lines.append(f"  ep_runtime calls per rank: {calls[0]}" + ("" if all(c == calls[0] for c in calls)
                                                                else f" (differ: {calls})"))
    return ok, "\n".join(lines)


def run(args, rank: int, world: int, local: int) -> dict:
    """Every backend's comparison on this rank (torch.distributed initialized): ``{"ok": bool,
    "backends": {backend: {"rows", "losses", "calls", "seconds"}}}``; rank 0 prints the tables."""
    from ep_runtime import megatron as ep_megatron

    fused_a2a = ep_megatron.fused_a2a()  # `import deep_ep` gives the layer, before Megatron-core's MoE modules read it
    import megatron.core
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    import ep_runtime
    from ep_runtime.shmem import session_for

    t0 = time.perf_counter()
    shims = no_te_shims() + (cpu_shims() if args.device == "cpu" else []) + ([] if args.compile else compile_off())
    calls: dict = {}
    count_calls(calls)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=world)
    group = parallel_state.get_expert_model_parallel_group()
    if rank == 0:
        print(f"megatron-core {megatron.core.__version__} (pinned {MEGATRON_VERSION}), its fused_a2a on "
              f"{fused_a2a.Buffer.__module__}, ep_runtime "
              f"{ep_runtime.__version__} ({os.path.dirname(ep_runtime.__file__)}), torch {torch.__version__}; "
              f"{world} ranks on {args.device}; hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
              f"top-{args.top_k}, {args.tokens} tokens per rank, bf16, router fp32, {args.steps} SGD steps "
              f"(lr {LR})", flush=True)
        for s in shims:
            print(f"  shim: {s}", flush=True)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    x, target = (t.to(device) for t in rank_inputs(rank, args.tokens, args.hidden))
    ref = build_layer(make_config("alltoall", None, args, world))
    set_weights(ref, rank)
    start = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}
    backends = ("deepep", "hybridep") if args.backend == "both" else (args.backend,)
    result = {"ok": True, "backends": {}}
    try:
        for backend in backends:
            ref.load_state_dict(start)
            flex = build_layer(make_config("flex", backend, args, world))
            flex.load_state_dict(start)
            ref.to(device), flex.to(device)
            calls.clear()
            tb = time.perf_counter()
            got = compare(ref, flex, x, target, world, group, args.steps)
            got.update(calls=dict(calls), seconds=time.perf_counter() - tb)
            result["backends"][backend] = got
            per_rank = [None] * world
            dist.all_gather_object(per_rank, got)
            ok, text = table(backend, per_rank)
            result["ok"] &= ok
            if rank == 0:
                print(f"{text}\n  ({backend}: {max(r['seconds'] for r in per_rank):.1f} s)", flush=True)
        # the session the layer opened over the group Megatron's flex dispatcher passes (its expert tensor x
        # model group); Megatron-core keeps its buffers (fused_a2a's) until the process ends
        session_for(parallel_state.get_expert_tensor_and_model_parallel_group()).close()
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        print(f"{'PASS' if result['ok'] else 'FAIL'} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, local = job_env(args.port)
    if args.device == "cpu":  # the simulator; set before numba is imported (by ep_runtime)
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())  # (ranks may share a GPU: MPS)
    else:
        torch.set_num_threads(1)
    backend = args.dist_backend or ("nccl" if args.device == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=args.init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        return 0 if run(args, rank, world, local)["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
