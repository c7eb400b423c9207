"""Hostile user actions: one test (or a small parametrized group) per class of actions that could
break the contract.

Each test asserts the contract (docs/design.md §5: whatever a user does through PyTorch's public
API, training with release on gives bit for bit what release off gives, or the call raises a
named error before it changes anything; no FP8 copy is ever served stale), on the tiny model of
tests/helpers/user_actions.py. The classes:

  1  a weight in two optimizers (overlapping parameter sets; a trunk shared by two models)
  2  freeze / unfreeze with release_frozen=True (between steps and mid-step)
  3  no optimizer at all: `.data` writes and in-place updates between forwards
  4  resume order: optimizer state loaded before (or after) the model's
  5  state_dict(keep_vars=True): live Parameters, and loading it back changes nothing
  6  main_grad: model.zero_grad() clears it; a failed clipped step retried is undisturbed
  7  torch's optimizer API: state-dict hooks; copy.deepcopy of the optimizer (and model)
  8  frozen bases released for good: save_safetensors / iter_state_dict follow state_dict()
  9  torch.multiprocessing.spawn with a converted, released model
  10 quant_and_release on a meta Parameter is refused; batch restores keep working
  11 torch.compile(fullgraph=True): the error names zrw, not dynamo's generic message
  12 mx_matmul with K >= 2^33: refused at once (or works), never minutes then OOM
  13 no `_zrw_*` attribute on torch objects (structural: greps the package)
"""

import copy
import gc
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import zrw
from helpers.bitwise import assert_bitwise, assert_bitwise_dicts
from helpers.user_actions import BF16, Tiny, assert_step_fails_inside, batch, loss_of, snapshot
from zrw import cache
from zrw.optim import MasterWeights, attach

ROOT = Path(__file__).resolve().parents[2]
CONVERTED = ("up.weight", "down.weight", "head.weight")

pytestmark = pytest.mark.usefixtures("clean_cache")


def tiny(release, seed=0, **convert_kw):
    torch.manual_seed(seed)
    model = Tiny().to(BF16)
    zrw.convert(model, release=release, skip=("embed",), **convert_kw)
    return model


def train_step(model, opts, seed, micro=1):
    losses = []
    for i in range(micro):
        loss = loss_of(model, 100 * seed + i)
        (loss / micro).backward()
        losses.append(loss.detach())
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    return losses


def run_steps(model, opts, steps, losses=(), micro=1):
    """train_step for each of `steps` after `losses` (those of earlier steps): the run's losses
    and final state dict."""
    losses = list(losses)
    for s in steps:
        losses += train_step(model, opts, s, micro=micro)
    return torch.stack(losses), snapshot(model)


def fresh_runs(run, *variants):
    """run(*args) for each args of `variants`, each from an empty weight cache."""
    results = []
    for args in variants:
        cache.cache_clear()
        results.append(run(*args))
    return results


# --- 1. A weight in two optimizers ------------------------------------------------------------


def _overlapping_run(release):
    model = tiny(release)
    ps = dict(model.named_parameters())
    first = zrw.optim.AdamW([ps["up.weight"], ps["down.weight"], ps["norm.weight"]], lr=1e-2)
    try:
        second = zrw.optim.AdamW(
            [ps["down.weight"], ps["head.weight"], ps["up.weight"], ps["up.bias"]], lr=5e-3
        )
    except ValueError as e:
        return "refused", str(e)
    return run_steps(model, (first, second), range(4))


class _Head(nn.Module):
    def __init__(self, trunk, out):
        super().__init__()
        self.trunk = trunk
        self.out = nn.Linear(64, out)

    def forward(self, x):
        return self.out(self.trunk(x))


def _shared_trunk_run(release):
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(BF16)
    a = _Head(trunk, 32).to(BF16)
    b = _Head(trunk, 16).to(BF16)
    zrw.convert(a, release=release)
    zrw.convert(b, release=release)
    opt_a = zrw.optim.AdamW(a.parameters(), lr=1e-2)
    try:
        opt_b = zrw.optim.AdamW(b.parameters(), lr=1e-2)
    except ValueError as e:
        return "refused", str(e)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 64, generator=g).to(BF16) for _ in range(4)]
    losses = []
    for x in xs:
        for m, o in ((a, opt_a), (b, opt_b)):
            loss = m(x).float().pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
    return torch.stack(losses), {
        **{f"a.{k}": v for k, v in snapshot(a).items()},
        **{f"b.{k}": v for k, v in snapshot(b).items()},
    }


@pytest.mark.parametrize(
    "run", [_overlapping_run, _shared_trunk_run], ids=["overlapping_sets", "shared_trunk"]
)
def test_a_weight_in_two_optimizers_trains_as_release_off_or_is_refused(run):
    """Each optimizer's step sees the other's update (release on == off over 4 steps), or the
    second optimizer's construction raises a ValueError naming the shared parameter, in both
    modes."""
    on, off = fresh_runs(run, (True,), (False,))
    if on[0] == "refused" or off[0] == "refused":
        assert on[0] == off[0] == "refused", ("refused in one mode only", on[0], off[0])
        assert re.search(r"(up|down|trunk\.\d)\.(weight|bias)", on[1]), on[1]
        return
    assert_bitwise(on[0], off[0], "losses")
    assert_bitwise_dicts(on[1], off[1], "final")


# --- 2. Freeze / unfreeze with release_frozen=True --------------------------------------------


def _freeze_run(release, keep_released, where):
    model = tiny(release, release_frozen=True)
    opt = attach(
        MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2, keep_released=keep_released)
    )
    w = model.up.weight
    losses = []
    for s in range(5):
        if where == "between":
            if s == 1:
                w.requires_grad_(False)
            if s == 3:
                w.requires_grad_(True)
        for i in range(2):
            loss = loss_of(model, 100 * s + i)
            (loss / 2).backward()
            losses.append(loss.detach())
            if where == "inside" and i == 0:
                if s == 1:
                    w.requires_grad_(False)
                if s == 3:
                    w.requires_grad_(True)
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), snapshot(model)


@pytest.mark.parametrize("keep_released", [True, False])
@pytest.mark.parametrize("where", ["between", "inside"])
def test_freeze_then_unfreeze_with_release_frozen_trains_as_release_off(keep_released, where):
    on, off = fresh_runs(_freeze_run, (True, keep_released, where), (False, keep_released, where))
    assert_bitwise(on[0], off[0], "losses")
    assert_bitwise_dicts(on[1], off[1], "final")


# --- 3. No optimizer at all -------------------------------------------------------------------


def _fresh_forward(model, ids):
    """The forward of a freshly converted copy holding model's current values."""
    torch.manual_seed(123)
    fresh = Tiny().to(BF16)
    fresh.load_state_dict(snapshot(model))
    zrw.convert(fresh, release=False, skip=("embed",))
    return fresh(ids)


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("write", ["data_add", "data_assign", "no_grad_inplace"])
def test_without_an_optimizer_every_forward_sees_the_current_weights(release, write):
    model = tiny(release)
    for s in range(3):
        ids = batch(s)
        out = model(ids)
        assert_bitwise(out, _fresh_forward(model, ids), f"step {s} forward")
        out.float().logsumexp(-1).mean().backward()
        for n, p in model.named_parameters():
            p.grad = None
            if n not in CONVERTED:
                continue
            delta = torch.full_like(p.detach(), 2.0**-6)
            if write == "data_add":
                p.data.add_(delta)
            elif write == "data_assign":
                p.data = p.data.clone() * 0.75 + delta
            else:
                with torch.no_grad():
                    p.add_(delta)


# --- 4. Resume order --------------------------------------------------------------------------


def _resume_runs(release, order):
    model = tiny(release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        train_step(model, (opt,), s)
    saved_model = snapshot(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    straight = []
    for s in range(2, 4):
        straight += train_step(model, (opt,), s)
    straight_final = snapshot(model)

    cache.cache_clear()
    fresh = tiny(release, seed=1)
    fresh_opt = zrw.optim.AdamW(fresh.parameters(), lr=1e-2)
    if order == "optimizer_first":
        fresh_opt.load_state_dict(copy.deepcopy(saved_opt))
        fresh.load_state_dict(saved_model)
    else:
        fresh.load_state_dict(saved_model)
        fresh_opt.load_state_dict(copy.deepcopy(saved_opt))
    resumed = []
    for s in range(2, 4):
        resumed += train_step(fresh, (fresh_opt,), s)
    return (torch.stack(straight), straight_final), (torch.stack(resumed), snapshot(fresh))


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("order", ["optimizer_first", "model_first"])
def test_resume_in_either_order_equals_the_uninterrupted_run(release, order):
    (l1, f1), (l2, f2) = _resume_runs(release, order)
    assert_bitwise(l1, l2, "losses after resume")
    assert_bitwise_dicts(f1, f2, "final")


# --- 5. state_dict(keep_vars=True) ------------------------------------------------------------


def _keep_vars_run(release, load_back):
    model = tiny(release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_step(model, (opt,), 0, micro=2)
    params = dict(model.named_parameters())
    sd = model.state_dict(keep_vars=True)
    for k in CONVERTED:
        assert sd[k] is params[k], f"state_dict(keep_vars=True)[{k!r}] is not the Parameter"
    if load_back:
        model.load_state_dict(sd)
    return run_steps(model, (opt,), range(1, 3), losses, micro=2)


@pytest.mark.parametrize("release", [True, False])
def test_state_dict_keep_vars_gives_live_parameters_and_loading_it_back_changes_nothing(release):
    plain, loaded = fresh_runs(_keep_vars_run, (release, False), (release, True))
    assert_bitwise(plain[0], loaded[0], "losses")
    assert_bitwise_dicts(plain[1], loaded[1], "final")


def test_a_held_keep_vars_dict_does_not_go_stale():
    model = tiny(True)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, (opt,), 0)
    sd = model.state_dict(keep_vars=True)
    train_step(model, (opt,), 1)
    now = snapshot(model)
    for k in CONVERTED:
        assert sd[k] is dict(model.named_parameters())[k], k
        assert_bitwise(model.state_dict()[k], now[k], k)


# --- 6. main_grad -----------------------------------------------------------------------------


def _discard_run(release, discard):
    model = tiny(release, main_grad=True)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_step(model, (opt,), 0)
    if discard:
        loss_of(model, 999).backward()  # a micro-batch thrown away with model.zero_grad()
        model.zero_grad()
        for n, p in model.named_parameters():
            g = getattr(p, "main_grad", None)
            assert g is None or not g.any(), f"{n}.main_grad survives model.zero_grad()"
    return run_steps(model, (opt,), range(1, 3), losses)


@pytest.mark.parametrize("release", [True, False])
def test_model_zero_grad_clears_main_grad(release):
    ref, got = fresh_runs(_discard_run, (release, False), (release, True))
    assert_bitwise(ref[0], got[0], "losses")
    assert_bitwise_dicts(ref[1], got[1], "final")


def _clipped_run(release, main_grad, fault):
    model = tiny(release, main_grad=main_grad)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    norms = []
    for s in range(3):
        loss = loss_of(model, s) * 50  # a gradient norm well above 0.5: the step clips
        loss.backward()
        if fault and s == 1:
            assert_step_fails_inside(opt)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms, snapshot(model)


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("main_grad", [True, False])
def test_a_failed_clipped_step_retried_gives_the_undisturbed_step(release, main_grad):
    ref_norms, ref = _clipped_run(release, main_grad, fault=False)
    assert all(n > 0.5 for n in ref_norms), ref_norms  # the clipping is exercised
    cache.cache_clear()
    norms, got = _clipped_run(release, main_grad, fault=True)
    assert norms == ref_norms
    assert_bitwise_dicts(ref, got, "after the retried step")


# --- 7. torch's optimizer API -----------------------------------------------------------------


def _hook_log(opt):
    log = []
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre", o)))

    def sd_post(o, sd):
        log.append(("sd_post", o, sd))
        sd = dict(sd)
        sd["added_by_hook"] = 1
        return sd

    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        log.append(("load_pre", o, sd))
        sd = dict(sd)
        sd.pop("added_by_hook", None)
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post", o)))
    return log


@pytest.mark.parametrize("make", ["torch", "zrw"])
def test_optimizer_state_dict_hooks_run(make):
    """As on torch's AdamW: each hook runs once per call, receives the optimizer (the post
    hook the dict being returned), and what a hook returns replaces the dict."""
    model = tiny(True)
    if make == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        zrw.optim.attach(opt, fill="dequant")
    else:
        opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, (opt,), 0)
    log = _hook_log(opt)
    sd = opt.state_dict()
    assert [e[0] for e in log] == ["sd_pre", "sd_post"], [e[0] for e in log]
    assert all(e[1] is opt for e in log)
    assert isinstance(log[1][2], dict) and "added_by_hook" not in log[1][2]
    assert sd.get("added_by_hook") == 1, "the post hook's returned dict is the state dict"
    opt.load_state_dict(sd)
    assert [e[0] for e in log] == ["sd_pre", "sd_post", "load_pre", "load_post"], [
        e[0] for e in log
    ]
    assert log[2][1] is opt and log[2][2].keys() == sd.keys() and log[3][1] is opt


def test_deepcopy_of_the_optimizer_alone_steps_like_the_original():
    """copy.deepcopy(opt) copies its parameters too (as torch's does): given the same
    gradients, the copy's steps give the original's values bit for bit."""
    model = tiny(True)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, (opt,), 0)
    twin = copy.deepcopy(opt)
    mine = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in twin.param_groups for p in g["params"]]
    assert len(mine) == len(theirs) and all(a is not b for a, b in zip(mine, theirs))
    names = {id(p): n for n, p in model.named_parameters()}
    for s in range(1, 3):
        loss_of(model, s).backward()
        for a, b in zip(mine, theirs):
            b.grad = None if a.grad is None else a.grad.clone()
        opt.step()
        twin.step()
        opt.zero_grad()
        twin.zero_grad()
        now = model.state_dict()
        for a, b in zip(mine, theirs):
            assert_bitwise(now[names[id(a)]], b, f"step {s} {names[id(a)]}")


@pytest.mark.parametrize("release", [True, False])
def test_deepcopy_of_model_and_optimizer_steps_like_the_original(release):
    model = tiny(release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, (opt,), 0)
    twin, twin_opt = copy.deepcopy((model, opt))
    assert all(
        p is q
        for p, q in zip(twin.parameters(), (p for g in twin_opt.param_groups for p in g["params"]))
    )
    for s in range(1, 3):
        a = train_step(model, (opt,), s)
        b = train_step(twin, (twin_opt,), s)
        assert_bitwise(torch.stack(a), torch.stack(b), f"step {s} losses")
        assert_bitwise_dicts(snapshot(model), snapshot(twin), f"step {s}")


# --- 8. Frozen bases released for good --------------------------------------------------------


def _frozen_base():
    model = tiny(True, release_frozen=True)
    for n in ("up", "down"):
        getattr(model, n).weight.requires_grad_(False)
    opt = zrw.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, (opt,), 0)
    loss_of(model, 1).backward()  # a training forward: the frozen weights are released
    for n in ("up", "down"):
        assert cache.cache_state(getattr(model, n).weight) is cache.CacheState.RELEASED_FOR_GOOD
    return model, opt


def test_checkpoint_saves_follow_state_dict_for_frozen_weights_released_for_good(tmp_path):
    from safetensors.torch import load_file

    model, _ = _frozen_base()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.state_dict()
        streamed = {k: v.clone() for k, v in zrw.checkpoint.iter_state_dict(model)}
        zrw.checkpoint.save_safetensors(model, tmp_path / "m.safetensors")
    assert_bitwise_dicts(expected, streamed, "iter_state_dict")
    assert_bitwise_dicts(expected, load_file(str(tmp_path / "m.safetensors")), "save_safetensors")


def test_checkpoint_saves_raise_under_frozen_values_raise_as_state_dict_does(tmp_path):
    model, _ = _frozen_base()
    with zrw.checkpoint.frozen_values("raise"):
        with pytest.raises(Exception) as sd_err:
            model.state_dict()
        with pytest.raises(type(sd_err.value)):
            dict(zrw.checkpoint.iter_state_dict(model))
        with pytest.raises(type(sd_err.value)):
            zrw.checkpoint.save_safetensors(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


# --- 9. Processes -----------------------------------------------------------------------------


def _spawned(rank, model, expected_path, started_path):
    Path(started_path).touch()
    expected = torch.load(expected_path)
    got = model.state_dict()
    for k, v in expected.items():
        if not torch.equal(
            got[k].view(torch.int16) if v.dtype == BF16 else got[k],
            v.view(torch.int16) if v.dtype == BF16 else v,
        ):
            raise AssertionError(f"spawned child: {k} differs")


@pytest.mark.parametrize("release", [True, False])
def test_spawn_with_a_converted_model_works_or_is_refused_by_name(release, tmp_path):
    model = tiny(release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, (opt,), 0)
    loss_of(model, 1).backward()  # weights released mid-step too
    expected, started = tmp_path / "expected.pt", tmp_path / "started"
    torch.save(snapshot(model), expected)
    try:
        torch.multiprocessing.spawn(_spawned, args=(model, str(expected), str(started)), nprocs=1)
    except RuntimeError as e:
        if not release or "zrw" not in str(e) or started.exists():
            raise
        return
    assert started.exists()


# --- 10. A meta Parameter ---------------------------------------------------------------------


def test_quant_and_release_refuses_a_meta_parameter_and_batch_restores_still_work():
    w = nn.Parameter(torch.empty(64, 64, device="meta"))
    try:
        with pytest.raises((RuntimeError, ValueError, TypeError), match="meta"):
            cache.quant_and_release(w, "mxfp8")
        assert not cache.is_cached(w)
        cache.restore_all()
        cache.restore_all("master")
        cache.cache_clear()
    finally:
        del w
        gc.collect()


# --- 11. torch.compile(fullgraph=True) --------------------------------------------------------


def test_compile_fullgraph_error_names_zrw():
    model = tiny(True)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as err:
        compiled(batch(0))
    msg = str(err.value)
    head = msg.split("from user code")[0]  # dynamo's explanation, before the user stack
    assert "non-Tensor" not in msg and "cache_stats" not in head, head
    # "zrw" in the explanation, or the function dynamo refused is one of zrw's
    refused = re.findall(r"<function (\w+) at", head)
    zrw_functions = {
        n
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith("zrw")
        for n in vars(m)
        if callable(vars(m)[n])
        and getattr(vars(m)[n], "__module__", "")
        and str(getattr(vars(m)[n], "__module__", "")).startswith("zrw")
    }
    assert "zrw" in head or set(refused) & zrw_functions, head


# --- 12. mx_matmul with a very long K ---------------------------------------------------------

_LONG_K = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    import torch, zrw
    K = 1 << 33
    # stride-0 views: no 8 GiB operand is allocated
    a = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e4m3fn).expand(2, K)
    s = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu).expand(2, K // 32)
    t = time.monotonic()
    try:
        out = zrw.ops.mx_matmul(a, s, a, s)
    except Exception as e:
        print("RAISED", type(e).__name__, round(time.monotonic() - t, 3), str(e)[:400])
    else:
        print("OK", round(time.monotonic() - t, 3), bool((out == 0).all()))
""")


def test_mx_matmul_with_k_of_2_to_the_33_is_refused_at_once_or_works():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-c", _LONG_K], capture_output=True, text=True, timeout=300, env=env
    )
    line = (r.stdout.strip().splitlines() or [""])[-1]
    assert r.returncode == 0, r.stderr[-2000:]
    if line.startswith("OK"):
        assert line.endswith("True"), line
        return
    _, kind, seconds, msg = line.split(" ", 3)
    assert kind in ("RuntimeError", "ValueError"), line
    assert "allocate" not in msg and "memory" not in msg.lower(), f"an OOM, not a refusal: {line}"
    assert re.search(r"\bK\b", msg), f"the error does not name K: {line}"
    assert float(seconds) < 2.0, line


# --- 13. No `_zrw_*` attribute on torch objects -----------------------------------------------


def test_no_zrw_attribute_is_set_on_torch_objects():
    hits = []
    for f in sorted((ROOT / "python" / "zrw").rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"(?<![A-Za-z0-9])_zrw_", line):  # not is_zrw_layer
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, f"{len(hits)} uses of _zrw_ attributes:\n" + "\n".join(hits[:40])


def test_unfreezing_a_weight_released_for_good_without_a_master_is_refused_by_name():
    """No FP32 master keeps the value of a frozen weight released for good (the optimizer was
    built over the other parameters only): requiring grad again is refused at its next use,
    naming the weight, and nothing changes; building an optimizer over it is refused too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    zrw.convert(model, "mxfp8", release=True, release_frozen=True)
    base = model[0].weight
    base.requires_grad_(False)
    opt = zrw.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 64).to(torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    assert cache.cache_state(base) is cache.CacheState.RELEASED_FOR_GOOD
    base.requires_grad_(True)
    with pytest.raises(
        RuntimeError,
        match=r"weight '0\.weight' was released for good while "
        r"frozen .*no FP32 master",
    ):
        model(x)
    assert cache.cache_state(base) is cache.CacheState.RELEASED_FOR_GOOD
    with pytest.raises(
        RuntimeError,
        match=r"MasterWeights: params\[0\] \('0\.weight'.*is "
        r"released and has no FP32 master",
    ):
        zrw.optim.AdamW([base], lr=1e-2)
    cache.restore_frozen(model)  # the way out the error names: lossy, then trainable
    model(x).float().sum().backward()
    assert base.grad is not None
