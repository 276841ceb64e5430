"""The guard's compiles ahead, over the layers of a graph: every layer's tuning candidates at the example's sizes
by the compile workers at once (candidates_ahead); every layer's kernels at all the other sizes handed to the
workers in one batch once the example's are tuned, not waited for (others_ahead); and at each other size what is
left in compile_ahead's threads (sizes_ahead), each before the guard's check runs the layers one by one. Nothing
here is checked, chosen or kept: what fails is left to the check, which says so."""
from __future__ import annotations

import logging

import torch
from torch import fx

from accelc import compile_ahead, compile_workers, meta, tuning
from accelc.kernels import REFERENCES
from accelc.layer_runner import LayerRunner

log = logging.getLogger("accelc")


def _each_layer(gm, args, only, call) -> None:
    """The graph run layer by layer on `args`, eager's outputs flowing on; call(node, args, kwargs) for each
    layer in `only`, on its inputs there. A layer whose original let go of its float weights (the guard's
    release_original: gate and up packed into one weight, a batch norm folded, int8) flows on its op's PyTorch
    reference over the graph's own weights: its original, run, would raise on its meta tensors (the padding check
    of every gated-MLP LM and conv+BN model ran after that release, and compiled nothing ahead)."""
    def at_layer(runner, n, rw):
        a, kw = runner.fetch_args_kwargs_from_env(n)
        if rw.released and n.target in REFERENCES:
            eager = REFERENCES[n.target](*a, **kw)
        else:
            eager = (rw.original.forward if isinstance(rw.original, fx.GraphModule) else rw.original)(
                *runner.layer_inputs(rw))
        if n in only:
            call(n, a, kw)
        return eager

    with torch.no_grad():
        LayerRunner(gm, at_layer).run(*args)


def _launch_quietly(n, a, kw) -> None:
    """A layer's op called on its inputs, for what it compiles; a failure is the check's to say."""
    try:
        n.target(*a, **kw)
    except Exception as e:   # (the check says what is wrong, if anything)
        log.debug("accelc: %s not compiled ahead: %s", meta.rewrite_of(n).layer, e)


def sizes_ahead(gm, args, only, handed: bool = False) -> None:
    """The kernels of the layers in `only` launched on `args` with Triton compiling instead of running
    (compile_ahead.compiling_ahead): their compiles for these sizes (a new specialization for every size Triton
    tells apart: 1, a multiple of 16, another) in parallel, before the guard's check runs them one by one;
    first by the compile workers (candidates_ahead on these sizes: the threads then load them, and a compile that
    ends a worker is not made in this process: compile_workers.refuse_crashed; `handed`: others_ahead handed them
    over already). Nothing here is checked."""
    if not handed:
        candidates_ahead(gm, args, only)
    with compile_ahead.compiling_ahead() as ahead:
        if ahead:
            _each_layer(gm, args, only, _launch_quietly)


def candidates_ahead(gm, args, only, fill: bool = False) -> None:
    """Every layer's kernels on `args` compiled at once by the compile workers (accelc.compile_workers): the
    tuning candidates of a key not tuned yet, and the kernels of keys tuned or borrowed (tuning.serving), before
    the guard's checks or races run the layers one at a time (which then load them from Triton's disk cache): the
    layers in `only` launched on `args` once with each tuner handing over its candidates' compiles
    (tuning.collecting, which also leaves every tuner's choices and remembered calls as they were) and Triton
    compiling nothing (handing_over). Nothing here is checked, chosen or kept. fill: the main thread's offered
    work done while they compile (accelc.meanwhile; the guard's first wait)."""
    if not compile_workers.active():
        return
    try:
        compile_workers.compile_jobs(_collected(gm, args, only), fill=fill)
    except Exception as e:   # nothing here is a result: the races compile what they need
        log.debug("accelc: the layers' kernels not compiled ahead: %s", e)


def later_ahead(gm, inputs: list, only) -> "compile_workers.Pending | None":
    """The tuning candidates of the layers in `only` at each of `inputs` (sizes a later stage calls the graph at
    and races there: the padding check's padded sizes, buckets.padded_inputs) handed to the workers at once,
    not waited for: they compile while the guard's checks run, and the padding check's launches find them
    compiled (or wait for the one in flight). None where there are no workers or no inputs."""
    return _handed_over(gm, [("at a padded size", args) for args in inputs], only) if inputs else None


def others_ahead(gm, others, only) -> "compile_workers.Pending | None":
    """candidates_ahead on each of `others` ((label, inputs, sizes): the guard's other inputs) at once, without
    waiting: the workers compile the layers' kernels at those sizes, as the guard's checks there will serve them
    (tuning.serving), while the checks on the example run; None where there are no workers. A size the model does
    not run at hands over nothing (its check says so)."""
    with tuning.serving(say=False):
        return _handed_over(gm, [(label, args) for label, args, _ in others], only)


def _handed_over(gm, labelled: list, only) -> "compile_workers.Pending | None":
    """What the layers in `only` would compile at each (label, inputs), handed to the workers in one batch, not
    waited for; None where there are no workers. A size the model does not run at hands over nothing (what runs
    there says what is wrong)."""
    if not compile_workers.active():
        return None
    jobs: list = []
    for label, args in labelled:
        try:
            jobs += _collected(gm, args, only)
        except Exception as e:
            log.debug("accelc: the layers' kernels %s not compiled ahead: %s", label, e)
    return compile_workers.submit(jobs)


def _collected(gm, args, only) -> list:
    """What launching the layers in `only` on `args` would compile: each tuner's candidates (tuning.collecting)
    and the kernels launched (handing_over); nothing compiled or launched."""
    with tuning.collecting() as jobs, compile_workers.handing_over() as launched:
        _each_layer(gm, args, only, _launch_quietly)
    return jobs + launched
