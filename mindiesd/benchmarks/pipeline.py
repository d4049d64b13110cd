"""``mindiesd bench pipeline NAME``: a whole diffusers pipeline (Flux, SD3, Wan), eager against compiled.

The pipeline (``FluxPipeline``, ``StableDiffusion3Pipeline`` or ``WanPipeline``) is assembled from small parts,
so nothing is downloaded: the transformer of the model registry (``mindiesd.zoo``, tiny or mid, seeded random
weights), a small VAE built from a config (``AutoencoderKL`` with the transformer's latent channels for Flux and
SD3, ``AutoencoderKLWan`` for Wan), ``FlowMatchEulerDiscreteScheduler`` with its default config, and no text
encoders or tokenizers: the prompt embeddings are seeded random tensors of the shapes the transformer takes,
passed as ``prompt_embeds=`` (with the pooled and the negative ones where the pipeline reads them).

Variants, each the same denoising steps from the same seeded latents, the VAE decoding the result:

* ``eager``; ``mindiesd``: ``pipe.transformer = torch.compile(pipe.transformer, backend=MindieSDBackend())``;
* with the step cache, ``eager+cache`` and ``mindiesd+cache``: diffusers' FirstBlockCache on the transformer
  (``transformer.enable_cache(FirstBlockCacheConfig(threshold=...))``), for the transformers that support it.

A ``callback_on_step_end`` records the time at the end of every step, so the first step (which compiles) is
reported apart from the steady ones, and the number of graphs the backend compiled so far: those compiled after
the first step are the recompilations the steady state costs. Errors are ``max |a - b| / max |b|`` of the final
latents and of the decoded image (or video) against the variant named in ``vs``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

import torch
import torch._dynamo

from .. import zoo
from ..compilation.report import plural
from .common import (
    DTYPE_NAMES, DTYPES, FAMILIES, Progress, QuietProgress, add_cache_options, add_run_options, bounded, complain,
    environment, footer, make_backend, max_relative_error, positive_float, resolve_cache_dir, session, write_json,
)
from .table import format_rows
from .timing import synchronize

__all__ = [
    "PIPELINES",
    "DEFAULT_STEPS",
    "DEFAULT_CACHE_THRESHOLD",
    "PipelineCase",
    "build_pipeline",
    "step_cache_unsupported",
    "run_pipeline_bench",
    "format_table",
    "plot_steps",
    "add_arguments",
    "run",
]

#: ``bench pipeline`` choices: registry names of the core models.
PIPELINES = ("flux", "sd3", "wan")
#: Denoising steps per size when ``--steps`` is not given.
DEFAULT_STEPS = {"tiny": 4, "mid": 8}
#: FirstBlockCache's threshold on the relative change of the first block's residual between forwards. The
#: registry's random weights change it by 15-55 % per step (Wan, Flux), far more than trained weights do, so with
#: diffusers' default of 0.05 the cache would never skip a block here; at 0.6 it skips some forwards.
DEFAULT_CACHE_THRESHOLD = 0.6

_PLOT_HINT = "--plot needs matplotlib; install it with: pip install 'mindiesd[plot]'"


# ---------------------------------------------------------------- building


@dataclass
class PipelineCase:
    """A ready-to-run diffusers pipeline and the keyword arguments of its ``__call__`` (prompt embeddings, size).

    ``transformer`` is the registry case the pipeline's transformer comes from; its ``expected()`` gives the fused
    ops per family one forward of the transformer contains.
    """

    name: str
    size: str
    pipe: Any
    call_kwargs: Dict[str, Any]
    transformer: zoo.Case
    seed: int = 0

    @property
    def device(self) -> torch.device:
        return next(self.transformer.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def expected(self) -> Dict[str, int]:
        """The fused ops per family one forward of the transformer contains (``zoo``'s derivation)."""
        return self.transformer.expected()

    def __call__(self, steps: int, callback: Optional[Callable[..., Dict[str, Any]]] = None) -> torch.Tensor:
        """Run ``steps`` denoising steps from the seeded latents; the decoded image (or video) as a tensor."""
        with torch.no_grad():
            return self.pipe(
                **self.call_kwargs,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(self.seed),
                output_type="pt",
                return_dict=False,
                callback_on_step_end=callback,
            )[0]


def _seeded(seed: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the global RNG seeded, leaving the caller's RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def _kl_vae(diffusers: Any, latent_channels: int) -> Any:
    """A two-level ``AutoencoderKL``: a scale factor of 2 from pixels to latents."""
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=32,
        # Flux and SD3 decode (latents / scaling_factor) + shift_factor, so both must be set
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )


def _wan_vae(diffusers: Any, latent_channels: int) -> Any:
    """A three-level ``AutoencoderKLWan``: 4x spatial and 2x temporal compression, declared in its config.

    The released Wan VAE compresses 8x and 4x; the pipeline reads both factors from the config, so the smaller
    VAE only shrinks the decoded video, not the transformer's latent geometry.
    """
    return diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        scale_factor_spatial=4,
        scale_factor_temporal=2,
    )


def _negative(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A seeded random tensor shaped like ``like``, standing for the embeddings of an empty negative prompt."""
    return torch.randn(like.shape, generator=generator).to(device=like.device, dtype=like.dtype)


def _flux(diffusers: Any, case: zoo.Case, generator: torch.Generator):
    rows, cols = zoo.entry("flux").sizes[case.size].shapes["grid"]
    # Flux packs 2x2 patches of VAE latents into one token of in_channels = 4 * latent channels
    vae = _kl_vae(diffusers, case.model.config.in_channels // 4)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=case.model,
    )
    pixels = 2 * pipe.vae_scale_factor  # per token side: the 2x2 packing times the VAE's factor
    kwargs = dict(
        prompt_embeds=case.inputs["encoder_hidden_states"],
        pooled_prompt_embeds=case.inputs["pooled_projections"],
        height=rows * pixels,
        width=cols * pixels,
    )
    return pipe, kwargs


def _sd3(diffusers: Any, case: zoo.Case, generator: torch.Generator):
    vae = _kl_vae(diffusers, case.model.config.in_channels)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=case.model, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None,
    )
    side = case.inputs["hidden_states"].shape[-1] * pipe.vae_scale_factor
    text, pooled = case.inputs["encoder_hidden_states"], case.inputs["pooled_projections"]
    # classifier-free guidance (the default guidance_scale 7) runs the negative embeddings in the same batch
    kwargs = dict(
        prompt_embeds=text,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=_negative(text, generator),
        negative_pooled_prompt_embeds=_negative(pooled, generator),
        height=side,
        width=side,
    )
    return pipe, kwargs


def _wan(diffusers: Any, case: zoo.Case, generator: torch.Generator):
    _, channels, frames, rows, cols = case.inputs["hidden_states"].shape
    vae = _wan_vae(diffusers, channels)
    pipe = diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        transformer=case.model,
    )
    text = case.inputs["encoder_hidden_states"]
    # classifier-free guidance (the default guidance_scale 5) calls the transformer again with the negative ones
    kwargs = dict(
        prompt_embeds=text,
        negative_prompt_embeds=_negative(text, generator),
        height=rows * pipe.vae_scale_factor_spatial,
        width=cols * pipe.vae_scale_factor_spatial,
        num_frames=(frames - 1) * pipe.vae_scale_factor_temporal + 1,
    )
    return pipe, kwargs


_BUILDERS = {"flux": _flux, "sd3": _sd3, "wan": _wan}


def _check_name(name: str) -> None:
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; choose one of: {', '.join(PIPELINES)}")


def build_pipeline(
    name: str,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PipelineCase:
    """The diffusers pipeline of registry model ``name`` at ``size``, built from small parts (module docstring).

    The transformer and its prompt embeddings come from ``zoo.build(name, size, dtype=dtype, seed=seed,
    device=device)``; the VAE is seeded with ``seed`` too. Diffusers' own progress bar is off.
    """
    _check_name(name)
    case = zoo.build(name, size, dtype=dtype, seed=seed, device=device)
    import diffusers  # zoo.build has made sure it is installed

    generator = torch.Generator().manual_seed(seed + 1)
    pipe, kwargs = _seeded(seed, lambda: _BUILDERS[name](diffusers, case, generator))
    with zoo._quiet_fp32_cast_warning():  # diffusers' notice on every ModelMixin.to(dtype)
        pipe.vae.to(device=device, dtype=dtype)
    pipe.vae.eval()
    pipe.set_progress_bar_config(disable=True)
    return PipelineCase(name=name, size=size, pipe=pipe, call_kwargs=kwargs, transformer=case, seed=seed)


def step_cache_unsupported(name: str) -> Optional[str]:
    """Why diffusers cannot run FirstBlockCache on pipeline ``name``'s transformer, or None where it can."""
    _check_name(name)
    diffusers = zoo._import_diffusers()
    cls = getattr(diffusers, zoo.entry(name).cls)
    if not callable(getattr(cls, "enable_cache", None)):
        return f"diffusers {diffusers.__version__}: {cls.__name__} has no enable_cache (it is no CacheMixin)"
    return None


# ---------------------------------------------------------------- running


class _StepProgress:
    """One progress step per denoising step (then one for the decode), advanced from the step callback."""

    def __init__(self, progress: Progress, label: str, steps: int, first_note: str = ""):
        self.progress, self.label, self.steps, self.first_note = progress, label, steps, first_note
        self._current: Optional[contextlib.AbstractContextManager] = None

    def _enter(self, label: str) -> None:
        self._current = self.progress.step(label)
        self._current.__enter__()

    def _leave(self, exc_info=(None, None, None)) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.__exit__(*exc_info)

    def advance(self, index: int) -> None:
        """Step ``index`` (from 0) ended: finish its line and start the next step's, or the decode's."""
        self._leave()
        if index + 1 < self.steps:
            self._enter(f"{self.label}: step {index + 2}/{self.steps}")
        else:
            self._enter(f"{self.label}: decoding")

    def __enter__(self) -> "_StepProgress":
        self._enter(f"{self.label}: step 1/{self.steps}{self.first_note}")
        return self

    def __exit__(self, *exc_info) -> None:
        self._leave(exc_info)


class _CacheDecisions:
    """Records FirstBlockCache's decision on every transformer forward: run the remaining blocks, or reuse.

    The decision is made by the head block's hook in a method diffusers runs outside the compiled graph
    (``torch.compiler.disable``); a recording wrapper is set on that hook instance for the duration, so eager and
    compiled runs are counted alike without changing what is traced.
    """

    def __init__(self, transformer: torch.nn.Module):
        from diffusers.hooks.first_block_cache import FBCHeadBlockHook

        hooks = [hook for module in transformer.modules()
                 for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()
                 if isinstance(hook, FBCHeadBlockHook)]
        if len(hooks) != 1:
            raise RuntimeError(f"expected one FirstBlockCache head hook on the transformer, found {len(hooks)}")
        self.hook = hooks[0]
        self.decisions: List[bool] = []

    def __enter__(self) -> "_CacheDecisions":
        decide = self.hook._should_compute_remaining_blocks

        @torch.compiler.disable
        def recording(residual: torch.Tensor) -> bool:
            compute = decide(residual)
            self.decisions.append(compute)
            return compute

        self.hook._should_compute_remaining_blocks = recording
        return self

    def __exit__(self, *exc_info) -> None:
        del self.hook._should_compute_remaining_blocks  # the class's method again

    @property
    def reused(self) -> int:
        """Forwards whose remaining blocks were skipped (their cached residual reused)."""
        return self.decisions.count(False)


@dataclass
class _Run:
    """What one pipeline call produced and how long it took."""

    latents: torch.Tensor
    output: torch.Tensor
    step_ends: List[float]  # seconds from the call to the end of each step
    total_s: float
    graphs_per_step: Optional[List[int]] = None  # graphs the backend had compiled by the end of each step
    forwards: Optional[int] = None
    reused: Optional[int] = None
    backend: Any = None
    warm: Optional["_Run"] = None  # compiled variants: a second call of the compiled pipeline (the steady state)

    @property
    def step_ms(self) -> List[float]:
        """Milliseconds of each step; the first counts from the call (setup, and compile where there is one)."""
        ends = [0.0] + self.step_ends
        return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]

    @property
    def decode_s(self) -> float:
        """Seconds after the last step: the VAE's decode and the output's post-processing."""
        return self.total_s - self.step_ends[-1]

    @property
    def steady_steps(self) -> List[int]:
        """Indices (from 0) of the steps after the first and after the last one that compiled a graph."""
        counts = self.graphs_per_step or []
        compiled = [i for i in range(1, len(counts)) if counts[i] > counts[i - 1]]
        return list(range(max(compiled, default=0) + 1, len(self.step_ends)))


def _run(case: PipelineCase, steps: int, progress: Progress, label: str, backend: Any = None,
         decisions: Optional[_CacheDecisions] = None) -> _Run:
    """One pipeline call of ``steps`` steps, timed per step; ``backend`` is the one the transformer compiles with."""
    device = case.device
    ends: List[float] = []
    counts: List[int] = []
    seen: Dict[str, Any] = {}

    with _StepProgress(progress, label, steps, " (compiles)" if backend is not None else "") as step_progress:

        def on_step_end(pipe: Any, index: int, timestep: Any, tensors: Dict[str, Any]) -> Dict[str, Any]:
            synchronize(device)
            ends.append(time.perf_counter() - start)
            if backend is not None:
                counts.append(backend.report().graphs)
            if index == steps - 1:
                seen["latents"] = tensors["latents"].detach().clone()
            step_progress.advance(index)
            return {}

        start = time.perf_counter()
        output = case(steps, on_step_end)
        synchronize(device)
        total_s = time.perf_counter() - start
    if len(ends) != steps:
        raise RuntimeError(f"{case.name}: the pipeline ran {len(ends)} of {plural(steps, 'step')}")
    result = _Run(latents=seen["latents"], output=output, step_ends=ends, total_s=total_s, backend=backend,
                  graphs_per_step=counts if backend is not None else None)
    if decisions is not None:
        result.forwards, result.reused = len(decisions.decisions), decisions.reused
    return result


def _compiled_run(case: PipelineCase, steps: int, progress: Progress, label: str,
                  backend_factory: Callable[[], Any], decisions: Optional[_CacheDecisions]) -> _Run:
    """``_run`` with ``pipe.transformer`` compiled (cold: Dynamo reset first), then a second call of the compiled
    pipeline (``warm``: its steady state, past the first calls of every graph); the eager transformer restored
    after."""
    transformer = case.pipe.transformer
    backend = backend_factory()
    torch._dynamo.reset()
    case.pipe.transformer = torch.compile(transformer, backend=backend)
    try:
        first = _run(case, steps, progress, label, backend, decisions)
        if decisions is not None:
            decisions.decisions.clear()
        first.warm = _run(case, steps, progress, f"{label} again", backend, decisions)
        return first
    finally:
        case.pipe.transformer = transformer


def _variants(case: PipelineCase, steps: int, progress: Progress, step_cache: bool, cache_threshold: float,
              backend_factory: Callable[[], Any]) -> Dict[str, _Run]:
    """The runs of every variant, by name, after one untimed eager step (first-call costs of the process)."""
    tag = f"{case.name}/{case.size}"
    with progress.step(f"{tag} warm-up: one eager step, untimed"):
        case(1)
    runs = {"eager": _run(case, steps, progress, f"{tag} eager")}
    runs["mindiesd"] = _compiled_run(case, steps, progress, f"{tag} mindiesd", backend_factory, None)
    if step_cache:
        from diffusers.hooks import FirstBlockCacheConfig

        transformer = case.pipe.transformer
        transformer.enable_cache(FirstBlockCacheConfig(threshold=cache_threshold))
        try:
            with _CacheDecisions(transformer) as decisions:
                runs["eager+cache"] = _run(case, steps, progress, f"{tag} eager+cache", None, decisions)
            with _CacheDecisions(transformer) as decisions:
                runs["mindiesd+cache"] = _compiled_run(case, steps, progress, f"{tag} mindiesd+cache",
                                                       backend_factory, decisions)
        finally:
            transformer.disable_cache()
    return runs


#: Variant -> the variant its error and speed-up are measured against.
_VERSUS = {"mindiesd": "eager", "eager+cache": "eager", "mindiesd+cache": "eager+cache"}


def _row(case: PipelineCase, variant: str, run: _Run, runs: Dict[str, _Run], steps: int) -> Dict[str, Any]:
    """The result row of ``variant`` (keys as :func:`run_pipeline_bench` describes them)."""
    warm = run.warm if run.warm is not None else run
    step_ms = warm.step_ms
    row: Dict[str, Any] = {
        "pipeline": case.name,
        "size": case.size,
        "dtype": DTYPE_NAMES.get(case.dtype, str(case.dtype).replace("torch.", "")),
        "variant": variant,
        "vs": _VERSUS.get(variant),
        "steps": steps,
        "total_s": run.total_s,
        "warm_s": warm.total_s,
        "decode_s": warm.decode_s,
        "decode_share": warm.decode_s / warm.total_s if warm.total_s > 0 else None,
        "first_step_s": run.step_ms[0] / 1e3,
        "step_ms": statistics.median(step_ms[1:]),
        "step_ms_all": step_ms,
        "steady_steps": [i + 1 for i in warm.steady_steps],
        "speedup": None,
        "latent_err": None,
        "decoded_err": None,
        "reused": None if warm.forwards is None else f"{warm.reused}/{warm.forwards}",
        "recompiles": None,
        "graphs": None,
        "fallbacks": None,
        **{family: None for family in FAMILIES},
    }
    reference = runs.get(row["vs"])
    if reference is not None:
        if warm.steady_steps:
            row["speedup"] = statistics.median(reference.step_ms[i] / step_ms[i] for i in warm.steady_steps)
        row["latent_err"] = max_relative_error(run.latents, reference.latents)
        row["decoded_err"] = max_relative_error(run.output, reference.output)
    if run.backend is not None:
        report = run.backend.report()
        row["graphs_per_step"] = run.graphs_per_step
        row["graphs"] = report.graphs
        row["recompiles"] = run.graphs_per_step[-1] - run.graphs_per_step[0]
        row["warm_recompiles"] = report.graphs - run.graphs_per_step[-1]
        row["warm_latent_err"] = max_relative_error(warm.latents, run.latents)
        row.update({family: int(report.matches.get(family, 0)) for family in FAMILIES})
        row["fallback_reasons"] = [str(reason) for reason in report.fallbacks]
        row["fallbacks"] = len(row["fallback_reasons"])
        row["expected_per_forward"] = case.expected()
    return row


def run_pipeline_bench(
    name: str,
    size: str = "tiny",
    *,
    steps: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    step_cache: bool = False,
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    progress: Optional[Progress] = None,
    backend_factory: Optional[Callable[[], Any]] = None,
) -> List[Dict[str, Any]]:
    """Run pipeline ``name`` eager and compiled (and, with ``step_cache``, both with FirstBlockCache); one row each.

    Every variant runs ``steps`` denoising steps (default: ``DEFAULT_STEPS[size]``) from the same seeded latents
    and decodes them. A row holds: ``total_s`` (the call, decode included), ``first_step_s`` (from the call to the
    end of the first step: setup, and the compile of compiled variants), ``warm_s`` (a second call: compiled
    variants run twice, and their steady-state figures come from the second call), ``step_ms`` (median of the later
    steps), ``step_ms_all``, ``steady_steps`` (1-based: the steps after the first and after the last one that
    compiled), ``decode_s`` (of the second call for compiled variants: the seconds after the last step, the VAE's
    decode and the output's post-processing) and ``decode_share`` (its share of that call);
    against the variant named in ``vs``: ``speedup`` (median over the steady steps of its ms over this one's, step
    by step, so that with the cache skipped steps are compared with skipped steps), ``latent_err`` and
    ``decoded_err`` (max relative error of the final latents and of the decoded output); for compiled variants
    ``graphs`` (compiled by the backend), ``graphs_per_step`` (compiled by the end of each step), ``recompiles``
    (compiled after the first step of the first call), ``warm_recompiles`` (during the second call, 0 when the
    compile is complete), ``warm_latent_err`` (second call against the first), ``fallbacks`` (graphs running unfused) with ``fallback_reasons``, the fused
    ops per family the backend inserted over all its graphs and ``expected_per_forward`` (the registry's count for
    one forward); with the cache ``reused`` ("k/n": forwards out of n whose remaining blocks the cache skipped).

    ``backend_factory`` makes the backend of each compiled variant (default: ``MindieSDBackend()``). Raises
    ValueError when ``step_cache`` is asked of a pipeline whose transformer diffusers cannot cache
    (:func:`step_cache_unsupported`).
    """
    _check_name(name)
    steps = DEFAULT_STEPS.get(size, 4) if steps is None else steps
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first step compiles), got {steps}")
    if step_cache and (reason := step_cache_unsupported(name)) is not None:
        raise ValueError(f"no step cache for {name}: {reason}")
    progress = progress if progress is not None else QuietProgress()
    with progress.step(f"building the {name}/{size} pipeline ({DTYPE_NAMES.get(dtype, dtype)})"):
        case = build_pipeline(name, size, dtype=dtype, device=device, seed=seed)
    try:
        runs = _variants(case, steps, progress, step_cache, cache_threshold, backend_factory or make_backend)
    finally:
        torch._dynamo.reset()
    return [_row(case, variant, run, runs, steps) for variant, run in runs.items()]


# ---------------------------------------------------------------- output

_COLUMNS = (
    "pipeline", "size", "dtype", "variant", "vs", "total_s", "first_step_s", "warm_s", "step_ms", "decode_s",
    "decode_share", "speedup",
    "latent_err", "decoded_err", "reused", "recompiles", "warm_recompiles", "graphs", "fallbacks", *FAMILIES,
)
_HEADERS = {"first_step_s": "first_s", "decode_share": "decode_%", "warm_recompiles": "warm_recomp", "adalayernorm": "adaln", "fast_gelu": "gelu", "fallbacks": "fallback"}
_LEFT = ("pipeline", "size", "dtype", "variant", "vs")


def _cell(column: str, value: Any) -> str:
    """One table cell: "-" for what does not apply to the row."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if column.endswith("_err"):
        return f"{value:.1e}"
    if column == "speedup":
        return f"{value:.2f}x"
    if column == "decode_share":
        return f"{100 * value:.0f}%"
    if column.endswith("_s"):
        return f"{value:.2f}"
    return f"{value:.1f}"


def format_table(rows: Sequence[Dict[str, Any]], markdown: bool = False) -> str:
    """The rows as an aligned plain-text table, or as a Markdown table (``reused`` only where a row has it)."""
    columns = [c for c in _COLUMNS if c != "reused" or any(row.get("reused") is not None for row in rows)]
    return format_rows(rows, columns, _LEFT, headers=_HEADERS, cell=_cell, markdown=markdown)


def plot_steps(rows: Sequence[Dict[str, Any]], path: str) -> None:
    """Write a PNG of the milliseconds of every step, one line per variant (log scale: step 1 compiles).

    Raises ImportError naming ``pip install 'mindiesd[plot]'`` when matplotlib is missing.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_PLOT_HINT) from exc
    figure = Figure(figsize=(7, 4.2), layout="constrained")
    axes = figure.subplots()
    for row in rows:
        times = row["step_ms_all"]
        axes.plot(range(1, len(times) + 1), times, marker="o", label=row["variant"])
    first = rows[0]
    axes.set_yscale("log")
    axes.set_xlabel("denoising step")
    axes.set_ylabel("ms per step (compiled: their second call)")
    axes.set_title(f"{first['pipeline']}/{first['size']} {first['dtype']}: eager vs mindiesd per step")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)


# ---------------------------------------------------------------- CLI


_steps_arg = bounded(int, 2, reason="the first step compiles")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``bench pipeline`` on ``parser``."""
    parser.add_argument(
        "pipeline",
        choices=PIPELINES,
        metavar="PIPELINE",
        help="the model whose whole diffusers pipeline runs: flux (FluxPipeline), sd3 (StableDiffusion3Pipeline) "
        "or wan (WanPipeline)",
    )
    add_run_options(parser)
    add_cache_options(parser)
    parser.add_argument(
        "--steps",
        type=_steps_arg,
        default=None,
        metavar="N",
        help=f"denoising steps per variant (default: {DEFAULT_STEPS['tiny']} tiny, {DEFAULT_STEPS['mid']} mid)",
    )
    parser.add_argument(
        "--step-cache",
        action="store_true",
        help="also run both with diffusers' FirstBlockCache on the transformer (flux, wan; diffusers has none "
        "for SD3's transformer)",
    )
    parser.add_argument(
        "--cache-threshold",
        type=positive_float,
        default=DEFAULT_CACHE_THRESHOLD,
        metavar="T",
        help=f"FirstBlockCache threshold with --step-cache (default: {DEFAULT_CACHE_THRESHOLD})",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="also write a PNG of the ms of every step per variant (needs pip install 'mindiesd[plot]')",
    )


def _summary(rows: Sequence[Dict[str, Any]], env: Dict[str, Any]) -> str:
    steps, threads = rows[0]["steps"], env["threads"]
    lines = [
        f"torch {env['torch']}, diffusers {env['diffusers']}, {plural(threads, 'thread')}; "
        f"{plural(steps, 'denoising step')} per variant, then the VAE decode",
        footer(env),
        "total_s: the whole first call; first_s: from the call to the end of step 1 (compile included); "
        "warm_s: a second call (compiled variants; eager runs once, after an untimed step); "
        "step_ms: median of steps 2..N of that call; decode_s, decode_%: the seconds after the last step of that call "
        "(the VAE decode, left eager by the transformer's compile, and post-processing) and their share of it",
        "against the variant in 'vs': speedup = median of its ms / this ms, step by step, over the steps after "
        "the last that compiled; latent_err, decoded_err = max |a-b| / max |b|",
        "recompiles: graphs the backend compiled after step 1 of the first call; warm_recomp: during the second; "
        "graphs, fused counts: over every graph it compiled",
    ]
    if any(row.get("reused") is not None for row in rows):
        lines.append("reused: transformer forwards whose remaining blocks FirstBlockCache skipped")
    return "\n".join(lines)


def run(args: argparse.Namespace, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> int:
    """Execute ``bench pipeline``; returns the process exit status (2: unusable options or missing packages)."""
    stdout, stderr, progress = session(args, stdout, stderr)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            complain(stderr, _PLOT_HINT)
            return 2
    step_cache = args.step_cache
    try:
        if step_cache and (reason := step_cache_unsupported(args.pipeline)) is not None:
            complain(stderr, f"--step-cache left out for {args.pipeline}: {reason}")
            step_cache = False
        with contextlib.ExitStack() as stack:
            cache_dir = resolve_cache_dir(args, stack)
            rows = run_pipeline_bench(
                args.pipeline,
                args.size,
                steps=args.steps,
                dtype=DTYPES[args.dtype],
                device=args.device,
                seed=args.seed,
                step_cache=step_cache,
                cache_threshold=args.cache_threshold,
                progress=progress,
                backend_factory=lambda: make_backend(cache_dir),
            )
    except ImportError as exc:
        complain(stderr, str(exc))
        return 2
    except Exception as exc:
        complain(stderr, f"{args.pipeline}/{args.size} pipeline failed: {type(exc).__name__}: {exc}")
        return 1
    env = environment(args.device)
    stdout.write(format_table(rows, markdown=args.markdown) + "\n\n" + _summary(rows, env) + "\n")
    stdout.flush()
    for row in rows:
        for reason in row.get("fallback_reasons", ()):
            complain(stderr, f"{row['variant']} ran a graph unfused: {reason}")
    if args.json:
        write_json(args.json, {"environment": env, "rows": rows})
    if args.plot:
        plot_steps(rows, args.plot)
    return 0
