"""Pipeline parallelism with torch.distributed.pipelining: real 2- and 4-rank runs
(gloo on CPU), each launching tests/parallel/pp_worker.py once per rank.

A tiny Qwen3 (4 decoder layers), converted with zrw.convert, is split by layers into stages built
by hand (PipelineStage, one submodule per stage) and trained 3 steps x 4 micro-batches under
ScheduleGPipe, Schedule1F1B (2 stages on 2 ranks; 4 stages on 4 ranks) and
ScheduleInterleaved1F1B (4 stages on 2 ranks, 2 per rank), with both recipes, with activation
recompute (torch.utils.checkpoint around each decoder layer), with FP32 main_grad, and with the
stages' shapes given up front (no metadata inference); and ScheduleInterleavedZeroBubble, whose
input- and weight-gradient backward passes are separate torch.autograd.grad calls. Each rank
steps its own zrw.optim.AdamW over its stages' parameters after schedule.step(). What must hold,
per case:
  * release on == release off, bit for bit (every micro-batch's loss, every final weight);
  * each rank's converted weights are quantized exactly once per optimizer step (cache misses),
    however the schedule interleaves forwards and backwards, and every other use is a hit;
  * at the end of every schedule.step() each rank has released exactly 2 bytes per converted
    element it holds, every such weight is released, and no released storage was ever given
    bytes again (cache_stats()["restored"] == 0: the BF16-free step);
  * zrw.memory's counting allocator (installed before the model exists; bytes counted from the
    start of step 1, when both modes hold the BF16 weights): release on holds 2N bytes less
    than release off at the end of every schedule.step() and at the start of every step after
    the first (2N = that rank's converted BF16 bytes), its window peak is 2N lower, and its
    live bytes at the start of steps 2.. do not grow: no BF16 weight is allocated after step 1;
  * the losses and final weights equal the unsharded zrw run (the same model and micro-batches,
    the stages in sequence in one process, gradients divided by the micro-batch count as the
    schedules' scale_grads does) BIT FOR BIT: pipeline parallelism moves activations and their
    gradients between ranks unchanged (no reduction crosses ranks) and every schedule
    accumulates a stage's gradients in micro-batch order, so no FP32 reduction order differs.
    (Were it otherwise, the tolerance would be that of tests/parallel/test_parallel.py.)
In one process: pipeline() (tracing through torch.export) is refused with zrw's named error, and
torch.autograd.grad for the inputs alone leaves main_grad untouched (the zrw bug PipelineStage's
metadata inference exposed).
"""

import os
import statistics

import pytest
import torch
from torch import nn

import zrw
from helpers import ranks

pytest.importorskip("transformers")

WORKER = os.path.join(os.path.dirname(__file__), "pp_worker.py")
STEPS, MICRO = 3, 4

# The default run: every schedule (mxfp8 under each; mxfp8-32x32 under the interleaved and the
# zero-bubble ones), recompute under both a plain and an interleaved schedule, main_grad, static
# shapes; 4 stages (middle stages included) on 2 ranks with the interleaved schedules.
TWO_RANK = [
    "gpipe_mxfp8",
    "1f1b_mxfp8",
    "interleaved_mxfp8",
    "1f1b_mxfp8_recompute",
    "interleaved_32x32_recompute",
    "zero_bubble_32x32",
    "1f1b_mxfp8_main_grad",
    "gpipe_mxfp8_static",
]
# -m slow: the remaining schedule x recipe pairs, and 4 stages on 4 ranks (one each).
TWO_RANK_SLOW = ["gpipe_32x32", "1f1b_32x32", "interleaved_32x32"]
FOUR_RANK = ["1f1b_32x32_4stages"]
RECIPE = {
    name: "mxfp8-32x32" if "32x32" in name else "mxfp8"
    for name in TWO_RANK + TWO_RANK_SLOW + FOUR_RANK
}
# Bytes the counting allocator may see beside the 2N difference between the modes: gloo's
# threads drop a send's buffers at a moment of their own (a few hundred bytes seen). The
# smallest converted weight (k_proj, 32 x 64) holds 4 KiB of BF16, so no weight's BF16 storage
# fits in it.
SLACK = 4096


def _launch(tmp_path_factory, name, cases, world=2):
    """One launch of the worker on `world` ranks running `cases` one after the other."""
    flags = ["--cases", ",".join(cases), "--steps", str(STEPS), "--micro", str(MICRO)]
    return ranks.launch(WORKER, tmp_path_factory.mktemp(name), *flags, world=world)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "pp2", TWO_RANK)


@pytest.fixture(scope="module")
def two_ranks_slow(tmp_path_factory):
    return _launch(tmp_path_factory, "pp2s", TWO_RANK_SLOW)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "pp4", FOUR_RANK, world=4)


def last_rank_losses(runs):
    got = [r["losses"] for r in runs if r["losses"] is not None]
    assert len(got) == 1  # the rank holding the last stage
    return got[0]


def all_weights(runs):
    out = {}
    for r in runs:
        for k, v in r["weights"].items():
            assert k not in out or k.startswith("rotary_emb"), k  # each weight on one rank
            out[k] = v
    return out


def check_case(res, name, world):
    on, off = res[name]["on"], res[name]["off"]
    assert len(on) == len(off) == world
    # every stage on some rank, each once
    stages = sorted(s for r in on for s in r["stage_ids"])
    assert stages == list(range(len(stages))) and len(stages) in (world, 2 * world)

    # release on == release off, bit for bit
    losses = last_rank_losses(on)
    assert losses.shape == (STEPS * MICRO,)
    assert torch.equal(losses, last_rank_losses(off))
    w_on, w_off = all_weights(on), all_weights(off)
    assert w_on.keys() == w_off.keys()
    bad = [k for k in w_on if not torch.equal(w_on[k], w_off[k])]
    assert not bad, f"release on vs off: final weights differ in {bad}"

    for rank, (a, b) in enumerate(zip(on, off)):
        n2 = 2 * a["elements"]  # this rank's converted BF16 bytes
        assert a["elements"] == b["elements"] > 0 and a["n_weights"] > 0
        for mode, r in (("on", a), ("off", b)):
            log = r["log"]
            assert len(log) == STEPS, (mode, rank)
            # quantized once per optimizer step, whatever the schedule's order
            misses = [s["misses"] for s in log]
            assert misses == [r["n_weights"] * (i + 1) for i in range(STEPS)], (mode, rank)
            hits = [s["hits"] for s in log]
            assert all(h > 0 for h in hits), (mode, rank)
        for i, s in enumerate(a["log"]):
            assert s["released_bytes"] == n2, (rank, i, s)
            assert s["all_released"], (rank, i)
            assert s["restored"] == 0 and s["restored_bytes"] == 0, (rank, i, s)
        for i, s in enumerate(b["log"]):
            assert s["released_bytes"] == 0 and not s["all_released"], (rank, i)

        # zrw.memory: 2N less at the end of every schedule.step() and at the start of every
        # step after the first; the window peak (the schedule) 2N lower; no growth in steps 2..
        # mx_matmul's tile workspace (a constant that persists between GEMMs, at most 40 MiB) is
        # taken out: its size is that of the largest GEMM tiles the mode has met, which can
        # differ by 4 KiB between the modes and between runs. PipelineStage's metadata inference
        # (no shapes given) runs a later stage's forward on torch.empty_strided inputs, whose
        # garbage sometimes has a scale range that a BF16 product could leave, so that GEMM
        # takes the FP32 path (4-byte tiles and a product tile: bf16_exact). Its results are
        # discarded; the training GEMMs are the same in both modes.
        def ws(r):
            return [x["workspace"] for x in r["log"]]

        live = [
            x["live"] - wx - (y["live"] - wy)
            for x, y, wx, wy in zip(b["log"], a["log"], ws(b), ws(a))
        ]
        assert all(abs(d - n2) < SLACK for d in live), (rank, live, n2)
        # a step's start holds the workspace the previous step ended with
        starts = [x - y for x, y in zip(b["starts"], a["starts"])]
        starts[1:] = [d - wx + wy for d, wx, wy in zip(starts[1:], ws(b), ws(a))]
        assert starts[0] == 0  # the baseline (both modes start step 1 with the BF16 weights)
        assert all(abs(d - n2) < SLACK for d in starts[1:]), (rank, starts, n2)
        peaks = [
            x["peak"] - wx - (y["peak"] - wy)
            for x, y, wx, wy in zip(b["log"], a["log"], ws(b), ws(a))
        ]
        assert abs(statistics.median(peaks) - n2) < SLACK, (rank, peaks, n2)
        assert max(a["starts"][1:]) - min(a["starts"][1:]) < SLACK, (rank, a["starts"])

    # the unsharded zrw run: bit for bit (see the module docstring)
    ref = res["unsharded"][(RECIPE[name], "main_grad" in name)]
    assert torch.equal(losses, ref["losses"]), (losses - ref["losses"]).abs().max()
    assert ref["weights"].keys() == w_on.keys()
    bad = [k for k in w_on if not torch.equal(w_on[k], ref["weights"][k])]
    assert not bad, f"pipeline vs unsharded: final weights differ in {bad}"


@pytest.mark.parametrize("case", TWO_RANK)
def test_two_ranks(two_ranks, case):
    check_case(two_ranks, case, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_RANK_SLOW)
def test_two_ranks_other_recipe(two_ranks_slow, case):
    check_case(two_ranks_slow, case, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR_RANK)
def test_four_ranks(four_ranks, case):
    check_case(four_ranks, case, 4)


def test_schedules_interleave_differently(two_ranks):
    """The cases do run different orders: the interleaved schedule puts two stages on a rank
    (stages 0 and 2 on rank 0), and the hit counts (cache lookups) differ with the schedule's
    extra recompute forwards."""
    assert two_ranks["interleaved_mxfp8"]["on"][0]["stage_ids"] == [0, 2]
    assert two_ranks["1f1b_mxfp8"]["on"][0]["stage_ids"] == [0]
    plain = two_ranks["1f1b_mxfp8"]["on"][0]["log"][-1]["hits"]
    recompute = two_ranks["1f1b_mxfp8_recompute"]["on"][0]["log"][-1]["hits"]
    assert recompute > plain  # recompute's forwards are cache hits: no second quantization


# ---- one process -----------------------------------------------------------------------------


class Blocks(nn.Module):
    def __init__(self, mx=False):
        super().__init__()
        make = (
            (lambda: zrw.nn.MXLinear(64, 64, bias=False))
            if mx
            else (lambda: nn.Linear(64, 64, bias=False))
        )
        self.layers = nn.ModuleList([make() for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("how", ["convert", "mx_layers"])
def test_pipeline_tracing_is_refused(how):
    """pipeline() traces the model with torch.export. zrw's weight cache is eager-only: a traced
    graph would fix at trace time whether a weight is released (export's fake weights are not
    owned: never) and would hold zrw's autograd functions' forward ops only (no backward), so it
    could not train. zrw refuses inside the trace with a named error; pipelining re-raises it as
    its own "cannot capture your model as a full graph" error, with zrw's as the cause."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    zrw.cache.cache_clear()
    torch.manual_seed(0)
    if how == "convert":
        model = Blocks().to(torch.bfloat16)
        zrw.convert(model, "mxfp8")
    else:  # zrw layers built directly, as in a custom model
        model = Blocks(mx=True).to(torch.bfloat16)
    opt = zrw.optim.AdamW(model.parameters())
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot capture your model as a full graph") as ei:
        pipeline(model, mb_args=(x,), split_spec={"layers.2": SplitPoint.BEGINNING})
    cause = str(ei.value.__cause__)
    # a converted model's own forward pre-hook reads the cache first; zrw layers alone reach
    # the first layer's weight
    what = "zrw.cache.cache_stats" if how == "convert" else "zrw.cache.quant_and_release"
    assert cause.startswith(what), cause
    assert "cannot be traced by torch.export" in cause and "eager-only" in cause
    assert "PipelineStage(submodule" in cause and "instead of pipeline()" in cause
    # the trace cached and released nothing; the model trains eagerly as before
    weights = [layer.weight for layer in model.layers]
    assert zrw.cache.cache_stats()["entries"] == 0
    assert not any(zrw.cache.is_released(w) for w in weights)
    model(x).float().sum().backward()
    assert all(zrw.cache.is_released(w) for w in weights)
    opt.step()
    del opt
    zrw.cache.cache_clear()


def test_autograd_grad_for_inputs_leaves_main_grad_alone():
    """torch.autograd.grad(out, inputs) accumulates nothing into the parameters' .grad; zrw's
    FP32 main_grad must not get anything either. PipelineStage's metadata inference (its first
    step, without input/output shapes) runs exactly such a backward on empty inputs: before the
    fix, the stages after the first added that garbage to main_grad (NaN losses from step 2)."""
    torch.manual_seed(0)
    layer = zrw.nn.MXLinear(64, 64, bias=False, main_grad=True, dtype=torch.bfloat16)
    opt = zrw.optim.AdamW(layer.parameters())
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).float().sum(), [x])
    assert gx.shape == x.shape
    assert getattr(layer.weight, "main_grad", None) is None and layer.weight.grad is None
    y = layer(x).float().sum()
    y.backward(inputs=[x])  # backward(inputs=...) that leaves the weight out: the same
    assert getattr(layer.weight, "main_grad", None) is None
    # an ordinary backward accumulates it, each time
    layer(x).float().sum().backward()
    once = layer.weight.main_grad.clone()
    assert once.dtype == torch.float32 and once.abs().sum() > 0
    layer(x).float().sum().backward()
    assert torch.equal(layer.weight.main_grad, 2 * once)
    opt.zero_grad()
    del opt
    zrw.cache.cache_clear()
