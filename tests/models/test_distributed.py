"""MindieSDBackend under torch.distributed context parallelism: 2 processes on CPU (gloo on 127.0.0.1).

Which paths are covered how:

- diffusers' Ulysses attention (``ContextParallelConfig(ulysses_degree=2)``, the ``native`` SDPA backend): the real
  tiny Flux and tiny Wan of the registry, whole-model ``torch.compile`` and ``compile_repeated_blocks``.
- diffusers' ring attention (``ring_degree=2``) cannot run on CPU: it merges partial results by their log-sum-exp,
  and no diffusers attention backend returns one on CPU (``native`` raises "Native attention does not support
  return_lse=True"; ``_native_flash`` calls an op with CUDA kernels only; the others need CUDA, an NPU or a Hub
  kernel). It is covered by a DiT block of this file (adaLN, RMSNorm of q and k, Flux RoPE, attention, gated
  residual, tanh-GELU MLP) with a sequence-sharded forward that runs ring attention as diffusers does (one
  all-gather of K and V, per-chunk attention with its log-sum-exp, diffusers' merge), and Ulysses as diffusers
  does (all-to-all from sequence- to head-sharding and back); the output is all-gathered.
- No fusion across a collective: aten graphs where a collective splits a fusable pattern (fake tensors, no
  process group needed).
- Device-graph capture (``aclgraph_with_compile``) of graphs containing collectives, with the simulated adapter:
  every rank captures its own graphs, in the same order, each capture running that rank's collectives.

Each check compares every rank with the single-process eager model (fp32: 1e-5 of the output's largest magnitude);
the fused counts of every rank with the single-process compile's (the DiT block and ``compile_repeated_blocks``:
a single-process compile in the same job; whole models: the registry's expected counts, which the single-process
compile gives in tests/models/test_models_e2e.py); and the collectives of the compiled graphs with those of the aten graph
before the passes. A ``MindieSDFallbackWarning`` fails the check. The 2 processes are started once for the file
(``World``) and run one job per check.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers")

from fusion_utils import FAMILIES, count_fused  # noqa: E402
from mindiesd import zoo  # noqa: E402
from mindiesd.benchmarks import common  # noqa: E402
from mindiesd.benchmarks import distributed as bench_distributed  # noqa: E402
from mindiesd.benchmarks.distributed import World, collectives_in, enable_context_parallel  # noqa: E402
from mindiesd.compilation import (  # noqa: E402
    CompilationConfig,
    MindieSDBackend,
    MindieSDFallbackWarning,
    SimulatedGraphAdapter,
    register_adapter,
)
from mindiesd.compilation.graph_log import graph_text  # noqa: E402
from diffusers.models.embeddings import apply_rotary_emb  # noqa: E402

WORLD_SIZE = 2
MAX_ERROR = 1e-5  # fp32, relative to the output's largest magnitude
c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------------------------------------- helpers


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _collective_lines(text: str) -> list:
    """The functional-collective calls of a printed graph (name, type, op and arguments but the tensor's name, which
    the passes may change: a view the tidying removed), in order."""
    return [re.sub(r"(\.default\()[^,)]+", r"\1<tensor>", line.strip().split(";")[0])
            for line in text.splitlines() if "torch.ops._c10d_functional." in line]


def _aten_collectives(log_dir: str) -> list:
    """The collective calls of every aten graph in a graph log, before freezing and the passes."""
    lines = []
    for graph in sorted(d for d in os.listdir(log_dir) if d.startswith("graph_")):
        with open(os.path.join(log_dir, graph, "00_aten.txt"), encoding="utf-8") as f:
            lines += _collective_lines(f.read())
    return lines


def _final_collectives(backend: MindieSDBackend) -> list:
    return [line for gm in backend.graphs for line in _collective_lines(graph_text(gm))]


def _fallbacks(caught) -> list:
    return [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]


def _first(output):
    """The model's first output, waited for: diffusers gathers the output with a functional all-gather that torch
    2.13 leaves pending (an ``AsyncCollectiveTensor``) until the values are read. A pipeline reads them at once; a
    test that kept one pending through another forward (run under the profiler) saw the wait crash in torch on a
    loaded machine, so each forward's output is waited for here, as a pipeline's step would."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _profiled_fused_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    calls = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("mindiesd::"))
    return result, {family: calls.get(family, 0) for family in FAMILIES}


def _fresh() -> None:
    CompilationConfig.reset()
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- the DiT block


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (eager returns an AsyncCollectiveTensor, tracing a tensor)."""
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The ranks' ``[B, S/world, D]`` shards joined along the sequence: gathered along dim 0, then concatenated,
    since torch 2.11's Dynamo cannot trace a functional all-gather along another dim (it skips the function
    that regroups the shards)."""
    gathered = _waited(funcol.all_gather_tensor(x.contiguous(), 0, group))
    return torch.cat(gathered.chunk(dist.get_world_size(group)), dim=1)


def _attention_with_lse(q, k, v):
    """Attention over ``[B, S, H, D]`` tensors and its log-sum-exp ``[B, S, H, 1]``, written out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    return out.transpose(1, 2), lse.transpose(1, 2)


def ring_attention(q, k, v, group):
    """diffusers' ring attention (rotate_method "allgather"): K and V of every rank in one all-gather, then each
    rank's chunk in turn, starting with its own, merged by log-sum-exp as ``TemplatedRingAttention`` does."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = _waited(funcol.all_gather_tensor(torch.cat([k.flatten(), v.flatten()]), 0, group)).chunk(world)
    out = lse = None
    for i in range(world):
        chunk = kv[(rank + i) % world]
        k_i, v_i = chunk[: k.numel()].reshape_as(k), chunk[k.numel():].reshape_as(v)
        o, l = _attention_with_lse(q, k_i, v_i)
        if out is None:
            out, lse = o, l
        else:
            out = out - torch.sigmoid(l - lse) * (out - o)
            lse = lse - F.logsigmoid(lse - l)
    return out


def ulysses_attention(q, k, v, group):
    """diffusers' Ulysses attention: all-to-all from sequence-sharded ``[B, S/N, H, D]`` to head-sharded
    ``[B, S, H/N, D]``, attention, and back, with the reshapes of ``TemplatedUlyssesAttention``."""
    world = dist.get_world_size(group)
    b, s, h, d = q.shape

    def to_heads(x):
        x = x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()
        x = _waited(funcol.all_to_all_single(x.flatten(), None, None, group)).reshape(x.shape)
        return x.flatten(0, 1).permute(1, 0, 2, 3).contiguous()

    q, k, v = (to_heads(x) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = out.reshape(b, world, s, h // world, d).permute(1, 3, 0, 2, 4).contiguous()
    out = _waited(funcol.all_to_all_single(out.flatten(), None, None, group)).reshape(out.shape)
    return out.flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def local_attention(q, k, v, group=None):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


ATTENTION = {None: local_attention, "ulysses": ulysses_attention, "ring": ring_attention}


class DiTBlock(torch.nn.Module):
    """One DiT block: adaLN modulation, q/k RMSNorm, Flux RoPE, attention, gated residual, tanh-GELU MLP.

    With ``cp`` ("ulysses" or "ring") the forward takes the whole sequence, as diffusers' context-parallel hooks
    do: each rank keeps its chunk of the tokens and of the RoPE tables, attention exchanges them across the group,
    and the output is all-gathered. Fused ops of one forward: norm_rope 2 (q and k, each normalised and rotated in
    one op), adalayernorm 1, fast_gelu 1, mul_add 1.
    """

    EXPECTED = {"rms_norm": 0, "rope": 0, "norm_rope": 2, "adalayernorm": 1, "glu": 0, "fast_gelu": 1, "mul_add": 1}
    #: The collectives of one context-parallel forward, in order (each followed by its wait): Ulysses exchanges
    #: q, k, v and the output, ring gathers K and V in one buffer; both gather the output.
    COLLECTIVES = {"ulysses": 4 * ["all_to_all_single"] + ["all_gather_into_tensor"],
                   "ring": 2 * ["all_gather_into_tensor"]}

    def __init__(self, dim: int = 64, heads: int = 4, cp=None, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.modulation = torch.nn.Linear(dim, 3 * dim)
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.norm_q = torch.nn.RMSNorm(dim // heads, eps=1e-6)
            self.norm_k = torch.nn.RMSNorm(dim // heads, eps=1e-6)
            self.proj = torch.nn.Linear(dim, dim)
            self.fc1 = torch.nn.Linear(dim, 4 * dim)
            self.fc2 = torch.nn.Linear(4 * dim, dim)
            for norm in (self.norm_q, self.norm_k):
                torch.nn.init.normal_(norm.weight, 1.0, 0.1)
        self.dim, self.heads, self.cp = dim, heads, cp

    def forward(self, x, temb, cos, sin):
        group = dist.group.WORLD if self.cp else None
        if self.cp:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            x, cos, sin = x.chunk(world, dim=1)[rank], cos.chunk(world, dim=0)[rank], sin.chunk(world, dim=0)[rank]
        b, s, _ = x.shape
        shift, scale, gate = self.modulation(F.silu(temb)).unsqueeze(1).chunk(3, dim=-1)
        h = F.layer_norm(x, (self.dim,), eps=1e-6) * (1 + scale) + shift
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.dim // self.heads).unbind(2)
        q = apply_rotary_emb(self.norm_q(q), (cos, sin), sequence_dim=1)
        k = apply_rotary_emb(self.norm_k(k), (cos, sin), sequence_dim=1)
        attn = ATTENTION[self.cp](q, k, v, group)
        x = x + gate * self.proj(attn.flatten(2))
        x = x + self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        if self.cp:
            x = gather_sequence(x, group)
        return x


def block_inputs(tokens: int = 32, dim: int = 64, heads: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    head_dim = dim // heads
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2, generator=g)[None, :]
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = angles.sin().repeat_interleave(2, dim=-1)
    return torch.randn(1, tokens, dim, generator=g), torch.randn(1, dim, generator=g), cos, sin


# ---------------------------------------------------------------------------------------------- jobs (each rank)


def job_environment():
    import mindiesd.compilation.config as config

    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "cache_env": os.environ.get(config.ENV_VAR), "cache_dir": CompilationConfig.cache_dir}


def job_dit_block(cp):
    """The block on the sequence shards of this rank (``cp`` attention), eager and compiled, against the
    single-process eager block; fused counts of the single-process compile and of this one."""
    _fresh()
    inputs = block_inputs()
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        single = DiTBlock()
        reference = single(*inputs)
        single_backend = MindieSDBackend(keep_graphs=True)
        torch.compile(single, backend=single_backend, fullgraph=True)(*inputs)
        torch._dynamo.reset()
        block = DiTBlock(cp=cp)
        eager = block(*inputs)
        backend = MindieSDBackend(CompilationConfig(graph_log_url=log_dir), keep_graphs=True)
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        out = compiled(*inputs)
        again = compiled(*inputs)
        aten = _aten_collectives(log_dir)
    return {
        "eager_error": _relative_error(eager, reference), "error": _relative_error(out, reference),
        "repeat_equal": torch.equal(out, again), "single_counts": count_fused(single_backend),
        "counts": count_fused(backend), "graphs": backend.report().graphs, "fallbacks": _fallbacks(caught),
        "report_fallbacks": list(backend.report().fallbacks), "aten_collectives": aten,
        "final_collectives": _final_collectives(backend), "collectives": collectives_in(backend.graphs),
    }


class _CollectiveLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the functional collectives that run (op name and communicator), waits left out."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            self.calls.append((func._opname, args[-1]))  # the last argument is the group name
        return func(*args, **(kwargs or {}))


class RecordingAdapter(SimulatedGraphAdapter):
    """The simulated device graph, recording per capture: this process's rank, the input shapes and the
    collectives its warm-up and capture ran."""

    def __init__(self):
        super().__init__()
        self.log = []

    def capture(self, fn, args, warmup):
        with _CollectiveLog() as collectives:
            result = super().capture(fn, args, warmup)
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 3]  # the tokens
        self.log.append({"rank": dist.get_rank(), "shapes": shapes, "collectives": collectives.calls})
        return result


def job_capture_with_collectives(cp):
    """``aclgraph_with_compile`` on the context-parallel block, through the recording adapter: two input
    signatures (32 and 64 tokens), called in the order 32, 64, 32, 64."""
    _fresh()
    adapter = RecordingAdapter()
    register_adapter("cpu", lambda device: adapter)
    try:
        block = DiTBlock(cp=cp)
        backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True), keep_graphs=True)
        compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
        errors = []
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for tokens in (32, 64, 32, 64):
                inputs = block_inputs(tokens)
                errors.append(_relative_error(compiled(*inputs), DiTBlock()(*inputs)))
        return {"log": adapter.log, "captures": adapter.captures, "replays": adapter.replays, "errors": errors,
                "runner_captures": [r.stats.captures for r in backend.runners],
                "runner_replays": [r.stats.replays for r in backend.runners],
                "counts": count_fused(backend), "fallbacks": _fallbacks(caught),
                "group": dist.group.WORLD.group_name}
    finally:
        register_adapter("cpu", None)


def _regional_case(name):
    """The tiny model for ``compile_repeated_blocks``; Flux with one single block, as in test_regional.py (a
    single block returns slices of its joint sequence, so a second one recompiles for other strides)."""
    case = zoo.build(name, "tiny")
    if name == "flux":
        case.model.single_transformer_blocks = case.model.single_transformer_blocks[:1]
    return case


def job_model(name):
    """Tiny registry model ``name`` under diffusers' Ulysses context parallelism on this rank: whole-model compile
    and ``compile_repeated_blocks``, against the single-process eager model and the single-process compiles."""
    _fresh()
    world_size = dist.get_world_size()
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        # one process: the eager references, and what the regional compile fuses (per block graph, per forward)
        case, single = zoo.build(name, "tiny"), _regional_case(name)
        reference, regional_reference = _first(case.model(**case.inputs)), _first(single.model(**single.inputs))
        single_backend = MindieSDBackend(keep_graphs=True)
        single.model.compile_repeated_blocks(backend=single_backend)
        single.model(**single.inputs)
        _, single_ran = _profiled_fused_calls(lambda: single.model(**single.inputs))
        result = {"expected": case.expected(), "single_regional_ran": single_ran,
                  "single_regional_matches": [dict(r.matches) for r in single_backend.report().records]}
        torch._dynamo.reset()

        # context parallel, the whole model compiled after one eager call: diffusers' split hook reads the
        # forward's signature with inspect on its first call, where Dynamo would break the graph (Wan: 7 graphs)
        enable_context_parallel(case.model, "ulysses", world_size)
        result["eager_error"] = _relative_error(_first(case.model(**case.inputs)), reference)
        backend = MindieSDBackend(CompilationConfig(graph_log_url=log_dir), keep_graphs=True)
        out = _first(torch.compile(case.model, backend=backend)(**case.inputs))
        report = backend.report()
        result.update(error=_relative_error(out, reference), counts={f: report.matches[f] for f in FAMILIES},
                      graphs=report.graphs,
                      aten_collectives=_aten_collectives(log_dir), final_collectives=_final_collectives(backend),
                      collectives=collectives_in(backend.graphs), report_fallbacks=list(report.fallbacks))
        torch._dynamo.reset()

        # context parallel, compile_repeated_blocks
        case = _regional_case(name)
        enable_context_parallel(case.model, "ulysses", world_size)
        regional = MindieSDBackend(keep_graphs=True)
        case.model.compile_repeated_blocks(backend=regional)
        first = _first(case.model(**case.inputs))
        second, ran = _profiled_fused_calls(lambda: _first(case.model(**case.inputs)))
        result.update(regional_error=_relative_error(first, regional_reference),
                      regional_repeat_equal=torch.equal(first, second), regional_ran=ran,
                      regional_matches=[dict(r.matches) for r in regional.report().records],
                      regional_collectives=collectives_in(regional.graphs),
                      regional_fallbacks=list(regional.report().fallbacks), fallbacks=_fallbacks(caught))
    torch._dynamo.reset()
    return result


def job_aot(name, folder):
    """Tiny registry model ``name`` under Ulysses context parallelism, its repeated blocks compiled ahead of time
    into ``folder`` (shared by the ranks): a first model stores this rank's artifacts, a second one loads them."""
    from mindiesd.compilation import aot_compile, aot_forwards

    _fresh()
    world_size = dist.get_world_size()
    result = {}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for round_ in ("first", "second"):
            torch._dynamo.reset()
            case = _regional_case(name)
            reference = _first(case.model(**case.inputs))
            enable_context_parallel(case.model, "ulysses", world_size)
            case.model._repeated_blocks = zoo.repeated_blocks(case.model)
            model = aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=folder)), regional=True)
            out = _first(model(**case.inputs))
            outcomes = sorted(o for f in aot_forwards(model) for o in f.outcomes.values())
            result[round_] = {"error": _relative_error(out, reference), "outcomes": outcomes,
                              "collectives": collectives_in([g for f in aot_forwards(model) for g in f.graphs()])}
        result["fallbacks"] = _fallbacks(caught)
    torch._dynamo.reset()
    return result


# ---------------------------------------------------------------------------------------------- the world


@pytest.fixture(scope="module")
def world():
    """Two processes in one gloo group, started once for this file; one thread each."""
    with World(WORLD_SIZE, "cpu", threads=1, env={"MINDIESD_CACHE_DIR": "off"}, timeout=240) as w:
        yield w


def _same_on_every_rank(results, key):
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), (key, values)
    return values[0]


def test_children_join_a_gloo_group_with_the_cache_off(world):
    results = world.run(job_environment, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["world_size"], r["backend"], r["cache_env"], r["cache_dir"]) == (2, "gloo", "off", None)


@pytest.mark.parametrize("cp", ["ulysses", "ring"])
def test_dit_block_sharded_over_two_ranks_matches_single_process(world, cp):
    results = world.run(job_dit_block, cp, timeout=180)
    for rank, r in enumerate(results):
        assert r["fallbacks"] == [] and r["report_fallbacks"] == [], (rank, r["fallbacks"])
        assert r["eager_error"] <= MAX_ERROR, (rank, r["eager_error"])
        assert r["error"] <= MAX_ERROR, (rank, r["error"])
        assert r["repeat_equal"]
        assert r["single_counts"] == DiTBlock.EXPECTED
        assert r["counts"] == r["single_counts"], (rank, r["counts"])
        assert r["graphs"] == 1
        # every collective of the aten graph is in the compiled graph, unchanged (same node, inputs, arguments)
        assert r["final_collectives"] == r["aten_collectives"] != []
    expected = Counter(DiTBlock.COLLECTIVES[cp]) + Counter(wait_tensor=len(DiTBlock.COLLECTIVES[cp]))
    assert _same_on_every_rank(results, "collectives") == dict(expected)


def test_device_graph_captures_with_collectives_are_per_rank_and_in_the_same_order(world):
    cp = "ulysses"  # both kinds of collective: all-to-all and all-gather
    results = world.run(job_capture_with_collectives, cp, timeout=180)
    for rank, r in enumerate(results):
        assert r["fallbacks"] == [], (rank, r["fallbacks"])
        assert max(r["errors"]) <= MAX_ERROR, (rank, r["errors"])
        assert r["counts"] == {f: 2 * n for f, n in DiTBlock.EXPECTED.items()}  # one graph per sequence length
        # each process captured its own graphs: one per signature, then replays
        assert (r["captures"], r["replays"]) == (2, 4)
        assert (r["runner_captures"], r["runner_replays"]) == ([1, 1], [2, 2])
        assert [c["rank"] for c in r["log"]] == [rank, rank]
        for capture in r["log"]:  # warm-up and capture each run the block's collectives, on the one communicator
            assert [op for op, _ in capture["collectives"]] == 2 * DiTBlock.COLLECTIVES[cp]
            assert {group for _, group in capture["collectives"]} == {r["group"]}
    # the same captures, in the same order, on every rank
    orders = [[(c["shapes"], c["collectives"]) for c in r["log"]] for r in results]
    assert orders[0] == orders[1]
    assert [c["shapes"][0][1] for c in results[0]["log"]] == [32, 64]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_diffusers_ulysses_compiled_on_two_ranks_matches_single_process(world, name):
    results = world.run(job_model, name, timeout=420)
    for rank, r in enumerate(results):
        assert r["fallbacks"] == [] and r["report_fallbacks"] == [] and r["regional_fallbacks"] == [], rank
        assert r["eager_error"] <= MAX_ERROR, (rank, r["eager_error"])
        # whole model: one graph, the fused counts of the single-process compile, the collectives untouched
        assert r["error"] <= MAX_ERROR, (rank, r["error"])
        assert r["graphs"] == 1
        assert r["counts"] == r["expected"], (rank, r["counts"])
        assert r["final_collectives"] == r["aten_collectives"] != []
        # compile_repeated_blocks: every block graph fuses what a block graph of the single-process regional
        # compile fuses, and a forward runs as many fused ops. (Wan's plan splits the sequence in a hook on
        # blocks.0: Dynamo compiles that split as a graph of its own, without fusable ops, and recompiles the
        # block body for the blocks after it.)
        assert r["regional_error"] <= MAX_ERROR, (rank, r["regional_error"])
        assert r["regional_repeat_equal"]
        fused_graphs = [m for m in r["regional_matches"] if any(m.values())]
        assert fused_graphs and all(m in r["single_regional_matches"] for m in fused_graphs), rank
        assert r["regional_ran"] == r["single_regional_ran"] and sum(r["regional_ran"].values()) > 0, rank
        assert r["regional_collectives"]["all_to_all_single"] > 0
    collectives = _same_on_every_rank(results, "collectives")
    assert collectives["all_to_all_single"] > 0 and collectives["all_gather_into_tensor"] == 1


@pytest.mark.slow
def test_context_parallel_ranks_store_and_load_artifacts_of_their_own(world, tmp_path):
    """Each rank keys its artifacts by its rank: the first model stores them, a second model loads them, with the
    all-to-all of Ulysses attention inside, and the output of the single-process eager model."""
    results = world.run(job_aot, "flux", str(tmp_path), timeout=420)
    for rank, r in enumerate(results):
        assert r["fallbacks"] == [], rank
        assert set(r["first"]["outcomes"]) <= {"stored", "shared"} and "stored" in r["first"]["outcomes"], r
        assert set(r["second"]["outcomes"]) <= {"loaded", "shared"} and "loaded" in r["second"]["outcomes"], r
        assert r["first"]["error"] <= MAX_ERROR and r["second"]["error"] <= MAX_ERROR, (rank, r)
        assert r["second"]["collectives"]["all_to_all_single"] > 0
    from mindiesd.compilation.storage import cache as graph_cache

    stored = sum(r["first"]["outcomes"].count("stored") for r in results)
    assert len(graph_cache.artifact_files(str(tmp_path))) == stored, "one set of artifacts per rank"


@pytest.mark.slow
def test_bench_rank_reports_every_rank_and_the_end_to_end_row(world):
    spec = {"models": ["wan"], "size": "tiny", "dtype": "fp32", "device": "cpu", "local_rank": None, "seed": 0,
            "cp": "ulysses", "iters": 2, "warmup": 0, "quiet": True}
    per_rank = world.run(bench_distributed.bench_rank, spec, timeout=300)
    rows = bench_distributed.summarize(per_rank)
    assert [row["rank"] for row in rows] == [0, 1, "all"]
    expected = zoo.build("wan", "tiny").expected()
    for row in rows:
        assert {f: row[f] for f in FAMILIES} == expected
        assert row["max_rel_err"] <= MAX_ERROR and row["fallbacks"] == 0
        assert row["collectives"]["all_to_all_single"] > 0
    table = bench_distributed.format_table(rows, markdown=True)
    assert table.count("\n") == 4 and "| all " in table and "a2a=" in table


# ---------------------------------------------------------------------------------------------- one process


def _graph(fn, *shapes):
    """The aten graph of ``fn`` on fake tensors (collectives need no process group to be traced)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        gm = make_fx(fn)(*(torch.empty(shape) for shape in shapes))
    gm.graph.eliminate_dead_code()  # as aot's graphs are: no unused outputs of layer_norm left
    gm.recompile()
    return gm


def _gathered(x):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD_SIZE, "0"))


def _reduced(x):
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", "0"))


def _tanh_gelu(x, inner=lambda t: t):
    return 0.5 * x * (1.0 + torch.tanh(inner(0.7978845608028654 * (x + 0.044715 * x * x * x))))


#: name -> (function, input shapes, fused counts): a collective inside a pattern, and the same pattern without
#: it (or wholly on one side of it), which fuses.
SPLIT_PATTERNS = {
    "rms_norm, mean of the gathered x": (
        lambda x, w: x * torch.rsqrt((_gathered(x) ** 2).mean(-1, keepdim=True) + 1e-6) * w, [(1, 4, 8), (8,)], {}),
    "rms_norm, mean of the all-reduced x": (
        lambda x, w: x * torch.rsqrt((_reduced(x) ** 2).mean(-1, keepdim=True) + 1e-6) * w, [(4, 8), (8,)], {}),
    "rms_norm, all-reduced mean": (
        lambda x, w: x * torch.rsqrt(_reduced((x * x).mean(-1, keepdim=True)) + 1e-6) * w, [(4, 8), (8,)], {}),
    "rms_norm, without the collective": (
        lambda x, w: x * torch.rsqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * w, [(4, 8), (8,)], {"rms_norm": 1}),
    "rms_norm of the gathered x": (
        lambda x, w: (lambda g: g * torch.rsqrt((g * g).mean(-1, keepdim=True) + 1e-6) * w)(_gathered(x)),
        [(4, 8), (8,)], {"rms_norm": 1}),
    "mul_add, all-reduced product": (lambda x, y, z: _reduced(x * y) + z, [(4, 8)] * 3, {}),
    "mul_add, without the collective": (lambda x, y, z: x * y + z, [(4, 8)] * 3, {"mul_add": 1}),
    "fast_gelu, all-reduced tanh argument (x + 0.044715 x^3 before it fuses as mul_add)": (
        lambda x: _tanh_gelu(x, _reduced), [(4, 8)], {"mul_add": 1}),
    "fast_gelu, without the collective": (lambda x: _tanh_gelu(x), [(4, 8)], {"fast_gelu": 1}),
    "adalayernorm, gathered norm (the modulation after it fuses as mul_add)": (
        lambda x, scale, shift: _gathered(F.layer_norm(x, (8,), eps=1e-6)) * (1 + scale) + shift,
        [(4, 8), (8,), (8,)], {"mul_add": 1}),
    "adalayernorm, without the collective": (
        lambda x, scale, shift: F.layer_norm(x, (8,), eps=1e-6) * (1 + scale) + shift,
        [(4, 8), (8,), (8,)], {"adalayernorm": 1}),
}


@pytest.mark.parametrize("name", list(SPLIT_PATTERNS))
def test_no_pass_fuses_across_a_collective(name):
    from mindiesd.compilation.graph_log import GraphLog
    from mindiesd.compilation.pass_manager import PassManager

    fn, shapes, fused = SPLIT_PATTERNS[name]
    gm = _graph(fn, *shapes)
    collectives = _collective_lines(graph_text(gm))
    counts = PassManager(list(FAMILIES), "cpu").run(gm, GraphLog(None, 0))
    assert counts == {f: fused.get(f, 0) for f in FAMILIES}
    assert _collective_lines(graph_text(gm)) == collectives, "every collective stays as it was"


# ---------------------------------------------------------------------------------------------- the bench CLI


def _bench_args(*argv):
    from mindiesd.__main__ import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_bench_world_size_options_and_their_errors(monkeypatch, capsys):
    args = _bench_args("--model", "flux", "--world-size", "2")
    assert (args.world_size, args.cp) == (2, "ulysses")
    assert getattr(_bench_args("--model", "flux"), "world_size", None) is None
    assert _bench_args("distributed", "--world-size", "3").world_size == 3
    with pytest.raises(SystemExit):
        _bench_args("--world-size", "1")
    progress = common.QuietProgress()
    for argv, message in [
        (("--world-size", "2", "--cp", "ring"), "--cp ring cannot run on cpu"),
        (("--world-size", "2", "--model", "sd3"), "no context-parallel plan in diffusers, left out: sd3"),
    ]:
        err = io.StringIO()
        assert bench_distributed.run(_bench_args(*argv), io.StringIO(), err, progress) == 2
        assert message in err.getvalue()
    with pytest.raises(SystemExit):
        _bench_args("--world-size", "2", "--capture")
    assert "unrecognized arguments: --capture" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = io.StringIO()
    assert bench_distributed.run(_bench_args("--world-size", "2"), io.StringIO(), err, progress) == 2
    assert "the launcher started 3 processes" in err.getvalue()


def test_launched_world_reads_the_launcher_variables():
    assert bench_distributed.launched_world({}) is None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert bench_distributed.launched_world(env) == (3, 4, 1, 2)
    assert bench_distributed.launched_world({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2, 1, 2)


def test_summarize_takes_the_slowest_rank_per_iteration():
    def row(rank, eager, compiled):
        return {"rank": rank, "model": "flux", "size": "tiny", "dtype": "fp32", "cp": "ulysses", "threads": 1,
                "compile_s": 1.0 + rank, "max_rel_err": 1e-7 * (rank + 1), "eager_rel_err": 0.0, "graphs": 1,
                "fallbacks": 0, "collectives": {"all_to_all_single": 4}, **{f: 1 for f in common.FAMILIES},
                "samples": {"eager": eager, "mindiesd": compiled}, "eager_ms": 0.0, "mindiesd_ms": 0.0}

    rows = bench_distributed.summarize([[row(0, [10, 30, 10], [5, 5, 9])], [row(1, [20, 10, 10], [6, 4, 4])]])
    total = rows[-1]
    assert (total["rank"], total["eager_ms"], total["mindiesd_ms"]) == ("all", 20, 6)
    assert (total["compile_s"], total["max_rel_err"], total["collectives"]) == (2.0, 2e-7, {"all_to_all_single": 4})
    assert "samples" not in rows[0]


def job_crash():
    """A rank that dies of a signal, as a native crash would."""
    import faulthandler

    faulthandler._sigsegv()


def test_a_rank_that_crashes_is_named_and_leaves_its_python_stack(capfd):
    """The error names the rank and its exit code; faulthandler wrote the rank's Python stack to its stderr."""
    with World(1, "cpu", threads=1, env={"MINDIESD_CACHE_DIR": "off"}, timeout=60) as crashing:
        with pytest.raises(bench_distributed.DistributedJobError, match=r"rank 0 \(exit code -11\) died"):
            crashing.run(job_crash, timeout=60)
    stderr = capfd.readouterr().err
    assert "Segmentation fault" in stderr and "job_crash" in stderr, stderr[-2000:]
