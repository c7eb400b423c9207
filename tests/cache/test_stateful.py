"""A model-based test of the cache lifecycle (docs/design.md §5), as a hypothesis
RuleBasedStateMachine.

Two copies of the tiny model of tests/helpers/user_actions.py (embedding and norm outside zrw's
layers; up, down and head converted) are built from the same seed,
one converted with release=True and one with release=False, each with its own
zrw.optim.MasterWeights(torch.optim.AdamW) attached. Hypothesis draws the configuration
(recipe, release_frozen, main_grad, keep_released, max_grad_norm) and then a sequence of user
actions, each applied identically to both copies:

  micro_batch       a training forward + backward (a micro-batch of the current step)
  step              every optimizer's step() (then the next micro-batch starts a new step)
  failing_step      a step whose inner optimizer raises (a step pre-hook on opt.inner): both
                    raise, and the gradients (.grad and main_grad) come back unchanged
  zero_grad         opt.zero_grad(set_to_none=True/False)
  model_zero_grad   model.zero_grad(): clears .grad and main_grad
  between_action    each action of helpers.user_actions.BETWEEN (loads, casts, apply, evals,
                    zero_grad variants, optimizer state round trip, tie, save/load, deepcopy),
                    with no micro-batch pending
  inside_action     each action of helpers.user_actions.INSIDE, between two micro-batches
  freeze            requires_grad_(False/True) of a converted weight, at any time
  data_write        `p.data.add_(d)` or `p.data = p.data.clone() * x` on a converted weight
                    between steps
  second_optimizer  a zrw.optim.AdamW over some parameters the first optimizer also owns
  resume            load the checkpoint taken at initialization: optimizer state first, or
                    model first; the masters then hold the saved masters exactly
  keep_vars         model.state_dict(keep_vars=True) (its converted weights are the live
                    Parameters) loaded back at once, or held and loaded back later
  deepcopy_optimizer copy.deepcopy(opt): the copy's state dict equals the original's
  deepcopy_all      (model, optimizers) = copy.deepcopy((model, optimizers)): the copies hold
                    the same values and masters, and training goes on with them

After every action the invariants hold: the two copies' losses and state dicts are bit for bit
equal, or both raised the same exception type and neither changed (one exception: a `.data`
write to a weight that is released with release on may be refused there with an error that
names the weight, the documented release poison; the release-off copy then skips it); and every
cached FP8 copy of a converted weight (what a use would be served now, read side-effect free
under torch.inference_mode()) equals the quantization of the weight's current value (the
weight itself, or bf16 of its FP32 master when it is released).

Budget: derandomized, 20 examples of at most 15 actions in CI (about 15-20 s on 2 shared cores).
ZRW_STATEFUL_EXAMPLES=5000 (and ZRW_STATEFUL_STEPS=30) runs thousands by hand;
ZRW_STATEFUL_RANDOM=1 draws new sequences instead of the fixed ones; ZRW_STATEFUL_SHRINK=1
shrinks a failing sequence to a minimal one (off by default: it can take minutes).
"""

import copy
import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import zrw
from helpers.bitwise import assert_bitwise, assert_bitwise_dicts
from helpers.user_actions import BETWEEN, BF16, INSIDE, Tiny, loss_of, snapshot
from zrw import cache, lifecycle
from zrw.optim import MasterWeights, attach

CONVERTED = ("up", "down", "head")
BETWEEN_NAMES = sorted(n for n in BETWEEN if n != "fault_step")
INSIDE_NAMES = sorted(INSIDE)


def _flat_masters(sd):
    return [m for ms in sd["masters"] for m in ms]


class World:
    """One copy of the model with its optimizers, and what the actions need (ctx)."""

    def __init__(self, release, cfg):
        torch.manual_seed(0)
        self.model = Tiny().to(BF16)
        zrw.convert(
            self.model,
            cfg["recipe"],
            release=release,
            skip=("embed",),
            release_frozen=cfg["release_frozen"],
            main_grad=cfg["main_grad"],
        )
        self.opt = attach(
            MasterWeights(
                torch.optim.AdamW,
                self.model.parameters(),
                lr=1e-2,
                keep_released=cfg["keep_released"],
                max_grad_norm=cfg["max_grad_norm"],
            )
        )
        self.opts = [self.opt]
        self.ctx = {}
        self.held = None

    def weight(self, name):
        return getattr(self.model, name).weight

    def grads(self):
        out = {}
        for n, p in self.model.named_parameters():
            for kind in ("grad", "main_grad"):
                g = getattr(p, kind, None)
                if g is not None:
                    out[f"{n}.{kind}"] = g.detach().clone()
        return out


def _named_refusal(weight, e, name):
    """A `.data` write refused with release on: the weight is released (and stays so: nothing
    changed) and the error names it (the release poison, docs/design.md §5)."""
    return cache.is_released(weight) and name in str(e) and "zrw" in str(e)


class ReleaseOnEqualsOff(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.worlds = {}
        self.micro = 0  # micro-batches since the last successful step
        self.left = False  # a weight left the optimizer: its checkpoint no longer fits it
        self.cfg = {"release_frozen": True}  # (build sets it)
        self.last = None  # what the last action returned in each world, compared

    # -- running one action in both worlds ------------------------------------------------

    def both(self, what, fn, refusable=None):
        """fn(world) in the release-on world, then in the release-off one. Both return equal
        results, or both raise the same exception type and change nothing. `refusable(world,
        exc)`: an exception the release-on world may raise alone (the off world skips)."""
        out = {}
        for release in (True, False):
            w = self.worlds[release]
            before = snapshot(w.model)
            try:
                with cache.verify():  # every use compares the copy it is served
                    out[release] = ("ok", fn(w))
            except (AssertionError, cache.StaleCopyError):
                raise  # a check of this test inside the action, not the user's exception
            except Exception as e:  # compared between the two worlds
                after = snapshot(w.model)
                assert_bitwise_dicts(
                    before,
                    after,
                    f"{what} raised {type(e).__name__}: {e} "
                    f"(release={release}), and changed the model",
                )
                out[release] = ("raised", type(e), str(e)[:300])
                if release and refusable is not None and refusable(w, e):
                    return None
        on, off = out[True], out[False]
        assert on[0] == off[0], f"{what}: release on {on}, release off {off}"
        if on[0] == "raised":
            assert on[1] is off[1], f"{what}: release on raised {on}, release off {off}"
            return None
        if isinstance(on[1], torch.Tensor):
            assert_bitwise(on[1], off[1], what)
        else:
            assert on[1] == off[1], f"{what}: release on gave {on[1]!r}, off {off[1]!r}"
        return on[1]

    # -- configuration ----------------------------------------------------------------------

    @initialize(
        recipe=st.sampled_from(["mxfp8", "mxfp8-32x32"]),
        release_frozen=st.booleans(),
        main_grad=st.booleans(),
        keep_released=st.booleans(),
        max_grad_norm=st.sampled_from([None, 0.5]),
    )
    def build(self, recipe, release_frozen, main_grad, keep_released, max_grad_norm):
        cache.cache_clear()
        cfg = dict(
            recipe=recipe,
            release_frozen=release_frozen,
            main_grad=main_grad,
            keep_released=keep_released,
            max_grad_norm=max_grad_norm,
        )
        self.cfg = cfg
        self.worlds = {True: World(True, cfg), False: World(False, cfg)}

        def first_step(w):  # the checkpoint the loads and `resume` go back to
            loss = loss_of(w.model, 0)
            loss.backward()
            w.opt.step()
            w.opt.zero_grad()
            w.ctx["saved"] = snapshot(w.model)
            w.ctx["opt_saved"] = copy.deepcopy(w.opt.state_dict())
            return loss.detach()

        self.both("first step", first_step)

    def teardown(self):
        self.worlds = {}
        cache.cache_clear()

    # -- training ---------------------------------------------------------------------------

    @rule(seed=st.integers(0, 3))
    def micro_batch(self, seed):
        def fwd_bwd(w):
            loss = loss_of(w.model, 100 * seed + self.micro)
            (loss / 2).backward()
            return loss.detach()

        self.both(f"micro-batch {seed}", fwd_bwd)
        self.micro += 1

    @rule()
    def step(self):
        def step(w):
            for o in w.opts:
                o.step()

        self.both("step", step)
        self.micro = 0

    @precondition(lambda self: self.micro > 0)
    @rule()
    def failing_step(self):
        def fail(w):
            grads = w.grads()

            def boom(*_):
                raise RuntimeError("injected")

            h = w.opt.inner.register_step_pre_hook(boom)
            try:
                w.opt.step()
            except RuntimeError as e:
                assert "injected" in str(e), e
            else:
                raise AssertionError("the injected failure did not reach step()")
            finally:
                h.remove()
            assert_bitwise_dicts(grads, w.grads(), "gradients handed back by a failed step")

        self.both("failing step", fail)

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        def zero(w):
            for o in w.opts:
                o.zero_grad(set_to_none=set_to_none)

        self.both(f"opt.zero_grad(set_to_none={set_to_none})", zero)

    @rule()
    def model_zero_grad(self):
        def zero(w):
            w.model.zero_grad()
            for n, p in w.model.named_parameters():
                g = getattr(p, "main_grad", None)
                assert g is None or not g.any(), f"{n}.main_grad survives model.zero_grad()"

        self.both("model.zero_grad()", zero)

    # -- the user actions of helpers.user_actions ---------------------------------------------

    @precondition(lambda self: self.micro == 0)
    @rule(name=st.sampled_from(BETWEEN_NAMES))
    def between_action(self, name):
        def act(w):
            BETWEEN[name](w.model, w.opt, w.ctx)
            if name == "tie":
                w.held = None

        self.both(f"between steps: {name}", act)

    @precondition(lambda self: self.micro > 0)
    @rule(name=st.sampled_from(INSIDE_NAMES))
    def inside_action(self, name):
        self.both(f"inside a step: {name}", lambda w: INSIDE[name](w.model, w.opt, w.ctx))

    # -- hostile user actions ------------------------------------------------------------------

    @rule(which=st.sampled_from(CONVERTED), trainable=st.booleans())
    def freeze(self, which, trainable):
        def flip(w):
            w.weight(which).requires_grad_(trainable)

        self.both(f"{which}.weight.requires_grad_({trainable})", flip)

    @precondition(lambda self: self.micro == 0)
    @rule(which=st.sampled_from(CONVERTED), how=st.sampled_from(["add_", "assign"]))
    def data_write(self, which, how):
        def write(w):
            p = w.weight(which)
            if how == "add_":
                p.data.add_(2.0**-7)
            else:
                p.data = p.data.clone() * 0.75

        self.both(
            f"{which}.weight .data {how}",
            write,
            refusable=lambda w, e: _named_refusal(w.weight(which), e, f"{which}.weight"),
        )

    @precondition(
        lambda self: self.micro == 0 and all(len(w.opts) == 1 for w in self.worlds.values())
    )
    @rule()
    def second_optimizer(self):
        def add(w):
            m = w.model
            try:
                second = zrw.optim.AdamW([m.down.weight, m.head.weight, m.norm.bias], lr=5e-3)
            except ValueError as e:  # refused by name at construction: allowed
                assert "down.weight" in str(e) or "head.weight" in str(e), e
                return "refused"
            w.opts.append(second)
            return "built"

        self.both("a second optimizer over shared parameters", add)

    @precondition(lambda self: self.micro == 0 and not self.left)
    @rule(order=st.sampled_from(["optimizer_first", "model_first"]))
    def resume(self, order):
        def load(w):
            if order == "optimizer_first":
                w.opt.load_state_dict(copy.deepcopy(w.ctx["opt_saved"]))
                w.model.load_state_dict(w.ctx["saved"])
            else:
                w.model.load_state_dict(w.ctx["saved"])
                w.opt.load_state_dict(copy.deepcopy(w.ctx["opt_saved"]))
            for i, (a, b) in enumerate(
                zip(_flat_masters(w.opt.state_dict()), _flat_masters(w.ctx["opt_saved"]))
            ):
                assert_bitwise(a, b, f"master {i} after loading the checkpoint ({order})")

        self.both(f"resume ({order})", load)

    @precondition(lambda self: self.micro == 0)
    @rule(hold=st.booleans())
    def keep_vars(self, hold):
        def take(w):
            sd = w.model.state_dict(keep_vars=True)
            for n in CONVERTED:
                assert sd[f"{n}.weight"] is w.weight(n), (
                    f"state_dict(keep_vars=True)['{n}.weight'] is not the Parameter"
                )
            if hold:
                w.held = sd
            else:
                before = snapshot(w.model)
                w.model.load_state_dict(sd)
                assert_bitwise_dicts(
                    before, snapshot(w.model), "after loading a keep_vars dict back"
                )

        self.both(f"state_dict(keep_vars=True) {'held' if hold else 'loaded back'}", take)

    @precondition(
        lambda self: self.micro == 0 and all(w.held is not None for w in self.worlds.values())
    )
    @rule()
    def load_held_keep_vars(self):
        def load(w):
            before = snapshot(w.model)
            w.model.load_state_dict(w.held)
            assert_bitwise_dicts(before, snapshot(w.model), "after loading a held keep_vars dict")

        self.both("load a held state_dict(keep_vars=True)", load)

    @precondition(lambda self: self.micro == 0)
    @rule()
    def detach_attach(self):
        def again(w):
            for o in w.opts:
                zrw.optim.detach(o)  # released weights come back exactly
                attach(o)

        self.both("zrw.optim.detach(opt) then attach(opt)", again)

    @rule(how=st.sampled_from(["restore", "restore_all", "cache_clear"]))
    def restore_weights(self, how):
        def bring_back(w):
            if how == "restore":
                for n in CONVERTED:
                    p = w.weight(n)
                    if cache.is_released(p) and cache.master_of(p) is not None:
                        cache.restore(p, "master")
            elif how == "restore_all":
                cache.restore_all("master")
            else:
                cache.cache_clear("master")

        self.both(f"zrw.cache {how} from the masters", bring_back)

    # Not with release_frozen: a weight without a master frozen and released for good keeps only
    # its FP8 copy, and its state_dict() value is that copy, by design (docs/guarantees.md).
    @precondition(lambda self: self.micro == 0 and not self.cfg["release_frozen"])
    @rule(which=st.sampled_from(CONVERTED))
    def leave_optimizer(self, which):
        def drop(w):
            p = w.weight(which)
            for o in w.opts:
                for g in o.param_groups:
                    g["params"][:] = [q for q in g["params"] if q is not p]

        self.both(f"{which}.weight removed from the optimizers' param groups", drop)
        self.left = True

    @rule()
    def deepcopy_optimizer(self):
        def dup(w):
            twin = copy.deepcopy(w.opt)
            mine, theirs = w.opt.state_dict(), twin.state_dict()
            for i, (a, b) in enumerate(zip(_flat_masters(mine), _flat_masters(theirs))):
                assert_bitwise(a, b, f"deepcopy(opt): master {i}")

        self.both("copy.deepcopy(opt)", dup)

    @precondition(lambda self: self.micro == 0)
    @rule()
    def deepcopy_all(self):
        def dup(w):
            model, opts = copy.deepcopy((w.model, w.opts))
            for k, (mine, theirs) in enumerate(zip(w.opts, opts)):
                for i, (a, b) in enumerate(
                    zip(_flat_masters(mine.state_dict()), _flat_masters(theirs.state_dict()))
                ):
                    assert_bitwise(a, b, f"deepcopy: optimizer {k}, master {i}")
            assert_bitwise_dicts(snapshot(w.model), snapshot(model), "deepcopy: the model copy")
            w.model, w.opts, w.opt = model, opts, opts[0]
            w.held = None

        self.both("(model, opts) = copy.deepcopy((model, opts))", dup)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def release_on_equals_off(self):
        if not self.worlds:
            return
        assert_bitwise_dicts(
            snapshot(self.worlds[True].model),
            snapshot(self.worlds[False].model),
            "release on vs off: state_dict",
        )

    @invariant()
    def cached_copies_are_current(self):
        for release, w in self.worlds.items():
            for mod in w.model.modules():
                for pname in getattr(mod, "zrw_quantized", None) or ():
                    p = getattr(mod, pname)
                    if not cache.is_cached(p):
                        continue
                    state = cache.cache_state(p)
                    if state.released:
                        master = cache.master_of(p)
                        if master is None:
                            continue  # its FP8 copy is its only value
                        value = master.detach().to(p.dtype)
                    else:
                        value = p.detach()
                    recipe = zrw.get_recipe(mod.recipe)
                    with torch.inference_mode():  # what a use would be served now, side-effect free
                        served = cache.quant_and_release(
                            p,
                            recipe.cache_layout,
                            False,
                            elem_dtype=recipe.elem_dtype,
                            scale_mode=recipe.scale_mode,
                        )
                    if recipe.cache_layout == "mxfp8":
                        want = zrw.ops.mx_quantize_dual(value, recipe.elem_dtype, recipe.scale_mode)
                        got = (served.fwd.data, served.fwd.scale, served.bwd.data, served.bwd.scale)
                    else:
                        want = zrw.ops.mx_quantize_block(
                            value, recipe.elem_dtype, recipe.scale_mode
                        )
                        got = (served.fwd.data, served.block_scale)
                    name = cache.weight_name(p) or pname
                    for i, (a, b) in enumerate(zip(got, want)):
                        assert_bitwise(
                            a,
                            b,
                            f"release={release}: cached FP8 copy of {name} ({state}) "
                            f"is stale (tensor {i})",
                        )


# The rules that cause each event of docs/design.md §5 (zrw.lifecycle.EVENTS).
EVENT_RULES = {
    "use": ["micro_batch", "inside_action", "freeze"],
    "boundary": ["detach_attach"],
    "drop_before_step": ["step", "failing_step"],
    "write_back": ["step", "failing_step", "resume"],
    "next_step": ["step"],
    "take_into_master": ["data_write", "resume", "second_optimizer", "between_action"],
    "restore": ["restore_weights"],
    "restore_value": ["between_action", "inside_action"],
    "restore_all": ["restore_weights"],
    "assign": ["between_action", "resume"],
    "invalidate": ["between_action", "data_write"],
    "clear": ["restore_weights"],
    "hold_for_write": ["between_action", "inside_action"],
    "tie": ["between_action"],
    "own": ["detach_attach", "second_optimizer"],
    "disown": ["detach_attach"],
    "add_master": ["second_optimizer", "detach_attach"],
    "leave": ["leave_optimizer"],
    "copied": ["deepcopy_optimizer", "deepcopy_all"],
}


# Events no rule can cause while release on must equal release off bit for bit, each with why
# and where it is tested instead.
NO_RULE = {
    # only a frozen weight released for good WITHOUT a master reaches it, whose one value is its
    # lossy FP8 copy: tests/cache/test_hostile_actions.py and tests/hf/test_peft.py test it
    "fill_frozen": "lossy by design",
}


def test_every_lifecycle_event_has_a_rule():
    events = set(EVENT_RULES) | set(NO_RULE)
    assert events == set(lifecycle.EVENTS), events ^ set(lifecycle.EVENTS)
    for event, rules in EVENT_RULES.items():
        assert rules, event
        for r in rules:
            assert callable(getattr(ReleaseOnEqualsOff, r, None)), (event, r)


ReleaseOnEqualsOff.TestCase.settings = settings(
    max_examples=int(os.environ.get("ZRW_STATEFUL_EXAMPLES", "20")),
    stateful_step_count=int(os.environ.get("ZRW_STATEFUL_STEPS", "15")),
    derandomize=os.environ.get("ZRW_STATEFUL_RANDOM") is None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # Shrinking a failing sequence can take minutes: by hand only (ZRW_STATEFUL_SHRINK=1).
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([Phase.shrink] if os.environ.get("ZRW_STATEFUL_SHRINK") else []),
)
TestReleaseOnEqualsOff = ReleaseOnEqualsOff.TestCase
