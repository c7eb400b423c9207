"""Queries on a released weight, and the master registry under threads.

1. Any Tensor or storage query on a weight zrw released answers correctly or raises a Python
   error (the release poison, naming the weight), and never aborts the process. torch's
   `UntypedStorage.is_shared` let the poison's C++ exception escape (SIGABRT);
   zrw/_released_queries.py answers it. Every query runs in a forked child of one child
   process, each with a timeout, so that a crash or a hang fails its own test, not pytest.
2. The batch APIs of zrw.cache (restore_all, restore_weights, cache_states, master_of,
   register_master) stay correct while other threads build and tear down MasterWeights
   (restore_all raised "dictionary changed size during iteration").
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

import zrw
from helpers.mx_layer import BF16
from zrw import cache
from zrw.optim import MasterWeights

pytestmark = pytest.mark.usefixtures("clean_cache")

NAME = "0.weight"
POISON = "zrw: the BF16 storage of weight '{}' is released"

# What the child builds: a converted model under MasterWeights after one step and one more
# grad-mode forward (its weights are released again, state 2); `v` a released float32 weight
# (numpy and dlpack can read float32); `f` a frozen weight released for good (state 3).
_SETUP = """
import copy, io, json, multiprocessing.reduction, os, pickle, signal, sys
import torch, torch.multiprocessing, zrw
from zrw import cache
torch.set_num_threads(1)  # the queries run in forked children
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                            torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
zrw.convert(model)
opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2))
x = torch.randn(32, 64, dtype=torch.bfloat16)
model(x).float().sum().backward()
opt.step()
opt.zero_grad()
y = model(x)
w = model[0].weight
v = torch.nn.Parameter(torch.randn(64, 64))
cache.quant_and_release(v, name="v")
f = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16), requires_grad=False)
cache.quant_and_release(f, name="f", release_frozen=True)
states = [cache.cache_state(t) for t in (w, v, f)]
assert states == ["released", "released", "released_for_good"], states
"""

_RUN = """
def describe(r):
    if r is None or isinstance(r, (bool, int, float, str)):
        return r
    if isinstance(r, (tuple, list, torch.Size)) and all(isinstance(i, int) for i in r):
        return list(r)
    return type(r).__name__

results = {}
for q in json.loads(sys.argv[1]):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        signal.alarm(60)  # a hang ends as SIGALRM, reported as a crash
        try:
            out = {"ok": True, "value": describe(eval(q))}
        except BaseException as e:  # noqa: B036
            out = {"ok": False, "type": type(e).__name__, "msg": str(e)[:300]}
        os.write(wfd, json.dumps(out).encode())
        os._exit(0)
    os.close(wfd)
    chunks = []
    while True:
        b = os.read(rfd, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks)) if chunks else {}
    out["status"] = status
    results[q] = out
print("RESULTS" + json.dumps(results))
"""

# (query, expectation): ("value", v) answers v; ("answer",) answers anything; ("poison", name)
# raises RuntimeError with the release poison naming `name`; ("raises", type, text) raises
# torch's own error before any data is touched; ("no_crash",) answers or raises the poison.
QUERIES = [
    # is_shared: torch's binding aborted here (SIGABRT); a released storage is not shared.
    ("w.is_shared()", ("value", False)),
    ("w.detach().is_shared()", ("value", False)),
    ("w.untyped_storage().is_shared()", ("value", False)),
    ("w._typed_storage().is_shared()", ("value", False)),
    ("w._typed_storage()._is_shared()", ("value", False)),
    ("v.is_shared()", ("value", False)),
    ("f.is_shared()", ("value", False)),
    ("[p.is_shared() for p in model.parameters()]", ("value", [False, False])),
    # Metadata: answered without the data pointer.
    ("w.storage_offset()", ("value", 0)),
    ("w.untyped_storage().nbytes()", ("value", 64 * 64 * 2)),
    ("w.nbytes", ("value", 64 * 64 * 2)),
    ("w.element_size()", ("value", 2)),
    ("w.stride()", ("value", [64, 1])),
    ("w.shape", ("value", [64, 64])),
    ("w.is_contiguous()", ("value", True)),
    ("w.untyped_storage().element_size()", ("value", 1)),
    ("len(w.untyped_storage())", ("value", 64 * 64 * 2)),
    ("w.untyped_storage().device.type", ("value", "cpu")),
    ("w.untyped_storage().resizable()", ("answer",)),
    ("w.untyped_storage().__sizeof__()", ("answer",)),
    ("w.untyped_storage()._cdata", ("answer",)),
    ("hash(w.untyped_storage())", ("answer",)),
    ("w.untyped_storage().is_cuda", ("value", False)),
    ("w.untyped_storage().untyped() is not None", ("value", True)),
    ("type(w.storage()).__name__", ("value", "TypedStorage")),
    ("w[0].shape", ("value", [64])),
    # The data pointer, sharing, pinning: the named error.
    ("w.data_ptr()", ("poison", NAME)),
    ("w.untyped_storage().data_ptr()", ("poison", NAME)),
    ("w.share_memory_()", ("poison", NAME)),
    ("w.untyped_storage().share_memory_()", ("poison", NAME)),
    ("w._typed_storage().share_memory_()", ("poison", NAME)),
    ("w.untyped_storage()._share_filename_cpu_()", ("poison", NAME)),
    ("w.untyped_storage()._share_fd_cpu_()", ("poison", NAME)),
    ("w.untyped_storage()._get_shared_fd()", ("poison", NAME)),
    ("w.untyped_storage()._get_filename()", ("poison", NAME)),
    ("w.untyped_storage().filename", ("poison", NAME)),
    ("w.untyped_storage()._shared_incref()", ("poison", NAME)),
    ("w.untyped_storage()._shared_decref()", ("poison", NAME)),
    ("w.is_pinned()", ("poison", NAME)),
    ("w.untyped_storage().is_pinned()", ("poison", NAME)),
    ("w.pin_memory()", ("poison", NAME)),
    ("w.untyped_storage().pin_memory()", ("poison", NAME)),
    ("type(torch.multiprocessing.reductions.reduce_tensor(w)).__name__", ("value", "tuple")),
    ("multiprocessing.reduction.ForkingPickler.dumps(w)", ("poison", NAME)),
    ("torch.multiprocessing.reductions.reduce_storage(w.untyped_storage())", ("poison", NAME)),
    ("model.share_memory() is model", ("no_crash",)),
    # Copies, pickling, saving, printing.
    ("type(w.__reduce_ex__(2)).__name__", ("value", "tuple")),  # the data is pickled later
    ("w.untyped_storage().__reduce__()", ("poison", NAME)),
    ("type(copy.copy(w)).__name__", ("value", "Parameter")),  # shares w's storage
    ("copy.copy(w).sum()", ("poison", NAME)),
    ("copy.deepcopy(w)", ("poison", NAME)),
    ("w.untyped_storage().__copy__()", ("poison", NAME)),
    ("w.untyped_storage().__deepcopy__({})", ("poison", NAME)),
    ("pickle.dumps(w)", ("poison", NAME)),
    ("torch.save(w, io.BytesIO())", ("poison", NAME)),
    ("torch.save(w.untyped_storage(), io.BytesIO())", ("poison", NAME)),
    ("w.untyped_storage()._write_file(io.BytesIO(), False, True, 2)", ("poison", NAME)),
    ("repr(w)", ("poison", NAME)),
    ("str(w)", ("poison", NAME)),
    ("repr(w.untyped_storage())", ("poison", NAME)),
    ("w.clone()", ("poison", NAME)),
    ("w.untyped_storage().clone()", ("poison", NAME)),
    ("torch.UntypedStorage(64 * 64 * 2).copy_(w.untyped_storage())", ("poison", NAME)),
    # Reads and writes of the values.
    ("w.tolist()", ("poison", NAME)),
    ("w.untyped_storage().tolist()", ("poison", NAME)),
    ("bytes(w.untyped_storage())", ("poison", NAME)),
    ("w.untyped_storage()[0]", ("poison", NAME)),
    ("w.untyped_storage()[0:16]", ("poison", NAME)),
    ("w.storage().tolist()", ("poison", NAME)),
    ("w.numpy()", ("raises", "RuntimeError", "requires grad")),
    ("v.detach().numpy()", ("poison", "v")),
    ("v.detach().__array__()", ("poison", "v")),
    ("v.detach().__dlpack__()", ("poison", "v")),
    ("torch.utils.dlpack.to_dlpack(w.detach())", ("poison", NAME)),
    ("w.sum()", ("poison", NAME)),
    ("w[0].sum()", ("poison", NAME)),
    ("w.float()", ("poison", NAME)),
    ("w.equal(w)", ("poison", NAME)),
    ("f.sum()", ("poison", "f")),
    ("w.untyped_storage().fill_(0)", ("poison", NAME)),
    ("w.untyped_storage().resize_(10)", ("poison", NAME)),
    ("w.untyped_storage()._byteswap(2)", ("poison", NAME)),
    ("w.untyped_storage().copy_(torch.UntypedStorage(64 * 64 * 2))", ("poison", NAME)),
    ("w.detach().zero_()", ("poison", NAME)),
]


def _run_child(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def query_results():
    r = _run_child(_SETUP + _RUN, json.dumps([q for q, _ in QUERIES]))
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS")][-1]
    return json.loads(line[len("RESULTS") :])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the queries run in forked children")
@pytest.mark.parametrize("query,expect", QUERIES, ids=[q for q, _ in QUERIES])
def test_a_query_on_a_released_weight_answers_or_raises_the_named_error(
    query_results, query, expect
):
    out = query_results[query]
    assert out["status"] == 0 and "ok" in out, (
        f"{query} crashed the process (wait status {out['status']}): it must answer or raise"
    )
    kind = expect[0]
    if kind == "value":
        assert out["ok"] and out["value"] == expect[1], out
    elif kind == "answer":
        assert out["ok"], out
    elif kind == "poison":
        assert not out["ok"] and out["type"] == "RuntimeError", out
        assert out["msg"].startswith(POISON.format(expect[1])), out
    elif kind == "raises":
        assert not out["ok"] and out["type"] == expect[1] and expect[2] in out["msg"], out
    else:
        assert out["ok"] or out["msg"].startswith(POISON.format(NAME)), out


def test_is_shared_keeps_the_poison_and_answers_torch_everywhere_else():
    """is_shared neither reads nor clears the poison; the weight stays released and restores
    exactly; on any storage zrw did not release, is_shared is torch's own answer."""
    r = _run_child(
        _SETUP
        + """
        assert w.is_shared() is False and cache.cache_state(w) == "released"
        for read in (lambda: w.sum(), lambda: w.untyped_storage().data_ptr(),
                     lambda: w.share_memory_()):
            try:
                read()
            except RuntimeError as e:
                assert str(e).startswith("zrw: the BF16 storage of weight '0.weight'"), e
            else:
                raise AssertionError("a released weight was read")
        assert cache.cache_state(w) == "released"
        master = zrw.cache.master_of(w)
        cache.restore(w, "master")
        assert torch.equal(w.detach(), master.to(torch.bfloat16))
        assert w.is_shared() is False and w.untyped_storage().is_shared() is False
        w.share_memory_()
        assert w.is_shared() is True and w.untyped_storage().is_shared() is True
        assert torch.equal(w.detach(), master.to(torch.bfloat16))
        t = torch.randn(8)
        assert t.is_shared() is False and t.share_memory_().is_shared() is True
        assert torch.empty(8, device="meta").is_shared() is False
        assert torch.UntypedStorage(0).is_shared() is False
        print("PASS")
    """.replace("\n        ", "\n")
    )
    assert r.returncode == 0 and "PASS" in r.stdout, (
        f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    )


def test_the_patch_is_one_method_of_untyped_storage():
    from zrw import _released_queries

    assert torch.UntypedStorage.__dict__["is_shared"] is _released_queries._is_shared
    assert torch.UntypedStorage.is_shared.__name__ == "is_shared"
    _released_queries.install()  # idempotent
    assert torch.UntypedStorage.__dict__["is_shared"] is _released_queries._is_shared


# ------------------------------------------------------------------------------------------------
# Threads: the master registry against concurrent construction and teardown of optimizers.


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64, bias=False)
        self.b = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def test_batch_apis_while_other_threads_build_and_delete_master_weights():
    """restore_all("master"), restore_weights, cache_states and master_of in loops while two
    threads build MasterWeights (each registering its masters) and tear them down (with a
    released weight of their own, restored concurrently), and another thread's forward
    releases the model's weights again. Before the fix restore_all raised "dictionary changed
    size during iteration", and could restore a weight with a master by dequantization (lossy)
    when a forward released it again between its two passes."""
    torch.manual_seed(0)
    model = _Net().to(BF16)
    zrw.convert(model)
    opt = zrw.optim.attach(MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1))
    x = torch.randn(8, 64, dtype=BF16)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    params = list(model.parameters())
    masters = [cache.master_of(p) for p in params]
    assert all(m is not None for m in masters)

    deadline = time.monotonic() + 3.0
    errors = []
    counts = {"built": 0, "restore_all": 0, "restore_weights": 0}
    lock = threading.Lock()

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: B036
                with lock:
                    errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")

        return run

    def builder(seed):
        g = torch.Generator().manual_seed(seed)
        alive = []
        while time.monotonic() < deadline:
            ps = [torch.nn.Parameter(torch.randn(32, 32, generator=g).to(BF16)) for _ in range(8)]
            o = MasterWeights(torch.optim.SGD, ps, lr=0.1)
            cache.quant_and_release(ps[0], name=f"t{seed}")  # released, with a master
            alive.append((o, ps))
            if len(alive) > 16:
                del alive[:8]  # teardown: masters and weights die while others read
            with lock:
                counts["built"] += 1
            if counts["built"] % 16 == 0:
                gc.collect()
        alive.clear()

    def restorer():
        while time.monotonic() < deadline:
            model(x)  # grad mode: releases the model's weights again
            cache.restore_all("master")
            for p, m in zip(params, masters):
                assert cache.cache_state(p) == "none"
                assert torch.equal(p.detach(), m.to(BF16)), "restored from a wrong master"
            counts["restore_all"] += 1

    def restore_all_loop():
        while time.monotonic() < deadline:
            cache.restore_all("master")

    def reader():
        while time.monotonic() < deadline:
            for p, m in zip(params, masters):
                assert cache.master_of(p) is m
            cache.restore_weights([], "master")
            cache.cache_states(params)
            counts["restore_weights"] += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a race shows at once
    try:
        threads = [threading.Thread(target=guarded(builder), args=(i,)) for i in range(2)]
        threads += [
            threading.Thread(target=guarded(restorer)),
            threading.Thread(target=guarded(restore_all_loop)),
            threading.Thread(target=guarded(reader)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(switch)
    assert not errors, "\n".join(errors[:5])
    assert counts["restore_all"] > 0 and counts["built"] > 0, counts
    # The registry holds no entry of a weight that died.
    gc.collect()
    assert all(k() is not None for k in list(zrw.record._records.data))


def test_register_master_replaces_and_dies_with_the_weight():
    w = torch.nn.Parameter(torch.randn(4, 4).to(BF16))
    m1, m2 = torch.randn(4, 4), torch.randn(4, 4)
    cache.register_master(w, m1)
    assert cache.master_of(w) is m1
    cache.register_master(w, m2)
    assert cache.master_of(w) is m2
    del m2
    gc.collect()
    assert cache.master_of(w) is None  # weak: a dead master is gone
    alive = weakref.ref(w)
    del w
    gc.collect()
    assert alive() is None
    # a dead weight drops its entry
    assert all(k() is not None for k in list(zrw.record._records.data))
