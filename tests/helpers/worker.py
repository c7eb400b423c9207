"""The rank side of the multi-rank tests: what every worker script (tests/parallel/*_worker.py,
tests/fsdp/*_worker.py) shares, so that each keeps only what it tests. helpers.ranks is the other
side: the test that launches the ranks and loads what rank 0 wrote.

  parser()        the common flags: --rank --world --port --out (filled in by ranks.launch),
                  --recipe --steps --micro-batches (alias --micro) --lr, and --run FLAGS
                  (repeatable): several runs, each its flags on top of the command line's, in
                  one launch (each_run)
  main(body, ..)  a worker's entry point: one thread, the gloo process group (env:// on
                  127.0.0.1), body(args) on every rank, rank 0 saves its result to --out, then
                  teardown; an exception prints its traceback and ends the rank with status 1
                  at once (the other ranks' collectives then fail instead of waiting)
  mesh()          a CPU DeviceMesh (1-D, or named dimensions)
  batches()       seeded inputs: the same on every rank and in every mode
  master_weights  zrw.optim.MasterWeights over a torch optimizer, with zrw's boundary attached
  train()         steps x micro-batches, loss / micro-batches backward, the optimizer step:
                  the losses (averaged over a process group's ranks) and the bytes all-gathered
                  per step
  mean_square_loss()       a loss_of for train(): the mean square of the model's output
  train_in_one_process()   the single-process reference run on the whole batch
  release_modes   the same run with release off and on (the comparison every worker makes)
  full(), full_weights(), masters_by_name()   what the tests compare, as plain FP32 tensors
  count_gathered_bytes()   the tests' own count of the all-gathered bytes
"""

import argparse
import contextlib
import os
import shlex
import sys
import traceback
import warnings

import torch
import torch.distributed as dist


def parser(doc=None, *, world=2, recipe="mxfp8", steps=3, micro_batches=2, lr=1e-3):
    """The flags every worker takes; the worker adds its own. The defaults are the workers'
    usual ones: 3 steps x 2 micro-batches."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=world)
    ap.add_argument("--port", type=int, default=29555)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default=recipe)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument(
        "--micro-batches", "--micro", dest="micro_batches", type=int, default=micro_batches
    )
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="FLAGS",
        help="one run's flags on top of the command line's (repeatable): the runs "
        "go one after the other in one launch, rank 0 saves the list of their "
        "results; without --run, the command line's run",
    )
    return ap


def each_run(run, ap):
    """A body for main(): run(args) once per --run, with that run's flags parsed (by `ap`) on
    top of the command line's, the list of results; without --run, run(args) alone."""

    def body(args):
        if not args.run:
            return run(args)
        return [run(ap.parse_args(sys.argv[1:] + shlex.split(flags))) for flags in args.run]

    return body


def main(body, args, *, distributed=True, quiet=True, hf=False):
    """Run body(args) on this rank and leave: rank 0 (or a single process) saves what body
    returned to args.out. distributed: inside the gloo process group of args.world ranks
    (destroyed after a barrier); quiet: warnings ignored (a worker that records warnings
    catches them itself); hf: transformers' logging limited to errors.

    The process leaves with os._exit, without the interpreter's teardown, where gloo's worker
    threads now and then abort a run that passed ("terminate called without an active
    exception": a torch/gloo teardown race, not zrw's)."""
    code = 0
    try:
        torch.set_num_threads(1)
        if quiet:
            warnings.filterwarnings("ignore")
        if hf:
            import transformers

            transformers.logging.set_verbosity_error()
        if distributed:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(args.port),
                RANK=str(args.rank),
                WORLD_SIZE=str(args.world),
                LOCAL_RANK=str(args.rank),
            )
            dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
        out = body(args)
        if args.rank == 0:
            torch.save(out, args.out)
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def mesh(*shape, names=None):
    """A CPU DeviceMesh over the process group: mesh(world), or mesh(dp, tp, names=(...))."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def batches(n, make, seed=1):
    """n inputs make(generator) from one generator seeded with `seed`: every rank and every
    mode gets the same ones (a rank takes its part)."""
    g = torch.Generator().manual_seed(seed)
    return [make(g) for _ in range(n)]


def master_weights(params, lr, cls=torch.optim.AdamW, **kw):
    """zrw.optim.MasterWeights(cls) with the optimizer boundary attached."""
    import zrw

    return zrw.optim.attach(zrw.optim.MasterWeights(cls, params, lr=lr, **kw))


def mean_square_loss(model, data, micro_batches, rows=slice(None), dtype=None):
    """A loss_of for train(): the mean square of `model`'s output on micro-batch mb of step s,
    data[s * micro_batches + mb] (its `rows`, cast to `dtype` if given)."""

    def loss_of(s, mb):
        x = data[s * micro_batches + mb][rows]
        return model(x if dtype is None else x.to(dtype)).float().pow(2).mean()

    return loss_of


def train_in_one_process(model, opt, data, args):
    """The single-process reference run: args.steps steps of args.micro_batches micro-batches of
    the whole batch (BF16 inputs), mean_square_loss; the losses."""
    loss_of = mean_square_loss(model, data, args.micro_batches, dtype=torch.bfloat16)
    return train(opt, range(args.steps), args.micro_batches, loss_of)[0]


def train(
    opt,
    steps,
    micro_batches,
    loss_of,
    *,
    group=None,
    world=1,
    gathered=None,
    context=None,
    after_backward=None,
):
    """For each step in `steps` (indices): for each micro-batch mb, loss_of(step, mb) (its loss)
    divided by micro_batches, backward; then opt.step() and opt.zero_grad().

    Returns (losses, per_step): every micro-batch's divided loss as a float (with `group`:
    all-reduced over it and divided by `world`, the ranks' mean) and, with `gathered` (what
    count_gathered_bytes() yields), the bytes all-gathered in each step, else [].
    context(step, mb): a context manager around the micro-batch's forward and backward (DDP's
    no_sync); after_backward(step, mb): called after each backward."""
    losses, per_step = [], []
    for step in steps:
        before = gathered["bytes"] if gathered is not None else 0
        for mb in range(micro_batches):
            with context(step, mb) if context is not None else contextlib.nullcontext():
                loss = loss_of(step, mb) / micro_batches
                loss.backward()
            if after_backward is not None:
                after_backward(step, mb)
            t = loss.detach().float().clone()
            if group is not None:
                dist.all_reduce(t, group=group)
            losses.append(t.item() / world)
        if gathered is not None:
            per_step.append(gathered["bytes"] - before)
        opt.step()
        opt.zero_grad()
    return losses, per_step


def release_modes(run, modes=("off", "on")):
    """{mode: run(release)} for release off and on, in that order."""
    return {mode: run(mode == "on") for mode in modes}


def full(t):
    """A parameter or gradient as a plain FP32 tensor: a DTensor's full tensor (a collective:
    every rank calls it), detached and copied."""
    from zrw.parallel import is_dtensor

    t = t.detach()
    return (t.full_tensor() if is_dtensor(t) else t).float().clone()


def full_weights(model):
    """Every parameter by name, full and FP32 (see full)."""
    return {n: full(p) for n, p in model.named_parameters()}


def masters_by_name(model, opt):
    """A MasterWeights optimizer's FP32 masters by the model's parameter names."""
    masters = [m for group in opt.masters for m in group]
    return {n: m.detach().clone() for (n, _), m in zip(model.named_parameters(), masters)}


@contextlib.contextmanager
def count_gathered_bytes():
    """The tests' own count of all-gathered bytes, independent of zrw's (zrw.testing has its
    own): for the block, wraps the process group's all-gather entry points
    (ProcessGroup.all_gather_single, what FSDP2 calls, and _allgather_base). Yields a dict
    with "bytes" (output bytes: what the rank receives, its own shard included) and "sizes"
    (each collective's output bytes, in call order), updated as collectives run."""
    from torch.distributed import ProcessGroup

    counts = {"bytes": 0, "sizes": []}
    # What the class itself holds is put back: for pybind's methods a descriptor, where
    # getattr(ProcessGroup, meth) gives the plain function, which set back on the class would
    # no longer bind `self` (every collective after the block would then fail).
    saved = {}
    for meth in ("all_gather_single", "_allgather_base"):
        orig = getattr(ProcessGroup, meth, None)
        if orig is None:
            continue
        saved[meth] = ProcessGroup.__dict__[meth]

        def wrapper(self, out, inp, *a, _orig=orig, **k):
            n = out.numel() * out.element_size()
            counts["bytes"] += n
            counts["sizes"].append(n)
            return _orig(self, out, inp, *a, **k)

        setattr(ProcessGroup, meth, wrapper)
    try:
        yield counts
    finally:
        for meth, orig in saved.items():
            setattr(ProcessGroup, meth, orig)
