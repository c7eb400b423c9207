"""zrw.ops.mx_quantize*_from_master: an FP32 master quantized as its bf16/fp16 parameter.

Every result must be, byte for byte, the existing op applied to ``master.to(param_dtype)`` (the
tensor the optimizer would write into the parameter) and the reference's result on it: the fused
kernel rounds each fp32 element to the parameter dtype the way torch's conversion does and
quantizes it in the same pass. Against the existing op the comparison is on every byte, the
elements of 0xFF blocks included (both kernels write the same fill there); against the reference
those elements are masked (docs/design.md §3 leaves them unspecified).

The masters are built from fp32 bit patterns where the rounding to the parameter dtype decides:
exact ties (low 16 bits 0x8000 for bf16, low 13 bits 0x1000 for fp16, odd and even kept bits,
fp16-subnormal ties), block amaxes that round up into the next binade or onto / past the 1.75
mantissa where "rceil" moves the scale, finite values that round to +-Inf (the block's scale
becomes 0xFF although the master is finite), fp32 subnormals, NaNs of either sign and any
payload, +-Inf and signed zeros, and randn spread over many binades. Each kind is built with its
blocks along K and along N.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from helpers import child_env, quant
from helpers.bitwise import same_bits
from helpers.quant import BLOCK, NAN_BYTE, as_bytes, assert_same_quantization, dtype_id, stable_seed
from zrw import ops
from zrw import reference as ref

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
BF16 = torch.bfloat16
FP16 = torch.float16

PARAM_DTYPES = (BF16, FP16)
FORMATS = [(e, m) for e in (E4M3, E5M2) for m in ops.SCALE_MODES]
LAYOUTS = ("dim-1", "dim-2", "dual", "block")
KINDS = ["randn", "ties", "amax_rounding", "overflow", "subnormal", "nonfinite"]
# Unaligned (N=47, K=113), 3-d, aligned, K past the kernels' column chunks (256 and 512; 2048
# with a partial last block on AVX-512), tiny.
SHAPES = [(47, 113), (3, 47, 113), (64, 96), (40, 600), (1, 1), (2, 33, 65), (33, 2100)]

# Block exponents (of 2) that keep the parameter's values finite and mostly normal.
EXP_RANGE = {BF16: (-120, 120), FP16: (-12, 13)}


# ------------------------------------------------------------------------------------------------
# masters


def f32_from_bits(bits):
    """fp32 values from non-negative int64 bit patterns (below 2^31)."""
    return bits.to(torch.int32).view(torch.float32)


def _amax_patterns(param_dtype):
    """fp32 mantissa fields (23 bits) of block amaxes where the rounding to param_dtype moves the
    scale: past the binade's top (round up into the next binade), onto 1.75 exactly (rceil's
    threshold: "floor" and "rceil" agree there) and just past it (rceil takes one more power)."""
    if param_dtype == BF16:
        return [
            0x7F8000,  # tie, odd kept bit: up into the next binade
            0x7FFFFF,  # above half: up into the next binade
            0x7F7FFF,  # below half: stays at the binade's top
            0x5F8000,  # tie, odd: up onto 1.75
            0x5FFFFF,  # up onto 1.75
            0x608000,  # tie, even: stays 1.75
            0x60C000,  # up to just past 1.75
        ]
    return [
        0x7FF000,  # tie, odd fp16 kept bit: up into the next binade
        0x7FFFFF,
        0x7FEFFF,  # below half: stays
        0x5FF000,  # tie, odd: up onto 1.75
        0x601000,  # tie, even: stays 1.75
        0x601001,  # up to just past 1.75
    ]


def make_master(kind, shape, dim, param_dtype, seed):
    """An fp32 master of ``shape`` whose blocks along ``dim`` are of ``kind`` (module docstring),
    built as rows of blocks (R, nblocks, 32) and moved into place."""
    gen = torch.Generator().manual_seed(seed)
    layout = quant.RowsOfBlocks(shape, dim)
    rows, nblocks = layout.rows, layout.nblocks
    lo, hi = EXP_RANGE[param_dtype]
    size = (rows, nblocks, BLOCK)

    def randint(low, high, s):
        return torch.randint(low, high + 1, s, generator=gen)

    def rand(s):
        return torch.rand(s, generator=gen)

    def sign(s):
        return torch.where(rand(s) < 0.5, -1.0, 1.0)

    def block_exponents():
        return randint(lo, hi, (rows, nblocks, 1))

    def randn_blocks():
        # randn (random low bits: no ties) spread over 2^-6..2^6 inside each block
        x = torch.randn(size, generator=gen) * torch.exp2(randint(-6, 0, size).float())
        return x * torch.exp2(block_exponents().float())

    def put_one(blocks, values):
        """values (rows, nblocks) at a random position of each block."""
        where = randint(0, BLOCK - 1, (rows, nblocks, 1))
        return blocks.scatter(-1, where, values.unsqueeze(-1))

    if kind == "randn":
        x = randn_blocks()
    elif kind == "ties":
        # Exact ties at the parameter dtype's rounding, odd and even kept bits alike.
        exp_field = (block_exponents() + randint(-5, 0, size) + 127).clamp(1, 254)
        if param_dtype == BF16:
            bits = (exp_field << 23) | (randint(0, 0x7F, size) << 16) | 0x8000
            x = f32_from_bits(bits)
        else:
            bits = (exp_field.clamp(127 - 14, 127 + 15) << 23) | (randint(0, 0x3FF, size) << 13)
            normal_ties = f32_from_bits(bits | 0x1000)
            # fp16 subnormal ties: (2k + 1) * 2^-25, halfway between k and k + 1 quanta.
            subnormal_ties = (2 * randint(0, 1023, size) + 1).float() * 2.0**-25
            x = torch.where(rand(size) < 0.25, subnormal_ties, normal_ties)
        x = x * sign(size)
    elif kind == "amax_rounding":
        patterns = torch.tensor(_amax_patterns(param_dtype))
        e = block_exponents().squeeze(-1)
        amax = f32_from_bits(
            ((e + 127) << 23) | patterns[randint(0, len(patterns) - 1, (rows, nblocks))]
        )
        body = torch.randn(size, generator=gen).clamp(-1.5, 1.5) * torch.exp2(e.float())[..., None]
        x = put_one(body, amax * sign((rows, nblocks)))
    elif kind == "overflow":
        # Finite masters whose parameter is +-Inf (the block's scale becomes 0xFF), and the
        # largest values that stay finite.
        if param_dtype == BF16:
            big = f32_from_bits(
                torch.tensor([0x7F7F8000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F0000, 0x7F7EC000])
            )
            body = torch.randn(size, generator=gen) * 2.0**120
        else:
            big = torch.tensor([65520.0, 65519.99609375, 65504.0, 70000.0, 1e30, 65519.0])
            body = torch.randn(size, generator=gen) * 2.0**12
        pick = big[randint(0, len(big) - 1, (rows, nblocks))]
        x = put_one(body, pick * sign((rows, nblocks)))
    elif kind == "subnormal":
        # fp32 subnormals (bf16: rounded into bf16 subnormals, ties included; fp16: to +-0),
        # blocks made only of them, and mixed with the parameter dtype's smallest normals.
        sub_bits = torch.where(
            rand(size) < 0.3, (randint(0, 0x7F, size) << 16) | 0x8000, randint(1, 0x7FFFFF, size)
        )
        sub = f32_from_bits(sub_bits)
        if param_dtype == BF16:
            small = torch.randn(size, generator=gen) * 2.0**-124
        else:
            small = torch.randn(size, generator=gen) * 2.0**-16  # fp16 subnormals and normals
        only_sub = (torch.arange(nblocks) % 2 == 0).view(1, nblocks, 1)
        x = torch.where(only_sub | (rand(size) < 0.5), sub, small) * sign(size)
    elif kind == "nonfinite":
        x = randn_blocks()
        # NaNs with every sign and payload edge: the canonical quiet one, the largest payloads
        # (0x7FFFFFFF, 0xFFFFFFFF: a rounding add would carry into the sign), signalling ones.
        nan_bits = [0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001, -0x007FFFFF, -0x00400000]
        nans = torch.tensor(nan_bits, dtype=torch.int32).view(torch.float32)
        special = torch.cat([nans, torch.tensor([math.inf, -math.inf, 1.0, 1.0, 1.0])])
        x = put_one(x, special[randint(0, len(special) - 1, (rows, nblocks))])
        x[:, :1, :] = torch.where(torch.arange(BLOCK) % 2 == 0, 0.0, -0.0)  # +-0 blocks
    else:
        raise AssertionError(kind)

    return layout.place(x)


# ------------------------------------------------------------------------------------------------
# the comparison, shared by the in-process tests and the ZRW_CPU_ISA children


def _fused_and_plain(master, layout, param_dtype, elem_dtype, scale_mode):
    """(fused op's outputs, the existing op's outputs on master.to(param_dtype), the reference's
    outputs on the same, the blocking dims of the (data, scale) pairs)."""
    param = master.to(param_dtype)
    fmt = (elem_dtype, scale_mode)
    if layout in ("dim-1", "dim-2"):
        dim = -1 if layout == "dim-1" else -2
        return (
            ops.mx_quantize_from_master(master, dim, param_dtype, *fmt),
            ops.mx_quantize(param, dim, *fmt),
            ref.mx_quantize(param, dim, *fmt),
            (dim,),
        )
    if layout == "dual":
        return (
            ops.mx_quantize_dual_from_master(master, param_dtype, *fmt),
            ops.mx_quantize_dual(param, *fmt),
            ref.mx_quantize_dual(param, *fmt),
            (-1, -2),
        )
    return (
        ops.mx_quantize_block_from_master(master, param_dtype, *fmt),
        ops.mx_quantize_block(param, *fmt),
        ref.mx_quantize_block(param, *fmt),
        (),
    )


def check_master(master, param_dtype, layouts=LAYOUTS, formats=FORMATS):
    """Every layout and format of one master: the fused op against the existing op (every byte)
    and against the reference (0xFF blocks' elements masked). Returns the mismatches."""
    failures = []
    for layout in layouts:
        for elem_dtype, scale_mode in formats:
            what = f"{tuple(master.shape)} {layout} {param_dtype} {elem_dtype} {scale_mode}"
            got, plain, spec, dims = _fused_and_plain(
                master, layout, param_dtype, elem_dtype, scale_mode
            )
            if not same_bits(got, plain):
                failures.append(f"{what}: differs from the existing op on master.to(param_dtype)")
            try:
                if layout == "block":
                    quant.assert_block_quantization_equal(got, spec, master.shape, what)
                else:
                    for i, d in enumerate(dims):
                        assert_same_quantization(
                            got[2 * i : 2 * i + 2], spec[2 * i : 2 * i + 2], d, what
                        )
            except AssertionError as e:
                failures.append(f"{what}: differs from the reference: {e}")
    return failures


# ------------------------------------------------------------------------------------------------
# byte for byte: the existing op on master.to(param_dtype), and the reference


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_from_master_equals_quantizing_the_rounded_parameter(kind, param_dtype, shape):
    for dim in (-1, -2):
        master = make_master(
            kind, shape, dim, param_dtype, seed=stable_seed(kind, shape, dim, str(param_dtype))
        )
        failures = check_master(master, param_dtype)
        assert not failures, "\n".join(failures[:8])


def test_the_masters_exercise_what_they_claim():
    # The adversarial masters really round the way the test needs (checked on torch's cast).
    for p in PARAM_DTYPES:
        ties = make_master("ties", (64, 96), -1, p, seed=1)
        low = ties.view(torch.int32) & (0xFFFF if p == BF16 else 0x1FFF)
        normal = ties.abs() >= (2.0**-126 if p == BF16 else 2.0**-14)
        assert (low[normal] == (0x8000 if p == BF16 else 0x1000)).all()
        rounded = ties.to(p).float()
        assert (rounded.abs() > ties.abs()).any() and (rounded.abs() < ties.abs()).any()
        over = make_master("overflow", (64, 96), -1, p, seed=2)
        assert over.isfinite().all() and over.to(p).isinf().any()
        amax = make_master("amax_rounding", (64, 96), -1, p, seed=3)
        # some block's amax moves into the next binade only after the rounding
        blocks = amax.view(64, 3, 32).abs().amax(-1)
        assert (torch.frexp(blocks.to(p).float())[1] != torch.frexp(blocks)[1]).any()
    sub = make_master("subnormal", (64, 96), -1, BF16, seed=4)
    assert ((sub != 0) & (sub.abs() < 2.0**-126)).any() and (sub.to(BF16) != 0).any()


# Hand-checked blocks (e4m3, one row of 32 along K).


def _row(values):
    x = torch.zeros(1, BLOCK)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


def test_bf16_ties_round_to_even_before_quantizing():
    # In bf16: 255.99 -> 256 (the block's amax moves up a binade: scale 2^0, not the 2^-1 of the
    # fp32 value); 1 + 2^-8 ties between 1 (even) and 1 + 2^-7 -> 1; 1 + 3 * 2^-8 ties between
    # 1 + 2^-7 (odd) and 1 + 2^-6 -> 1 + 2^-6; 1.0625 + 2^-20 -> 1.0625, an exact e4m3 tie
    # between 1 and 1.125 -> 1 (the fp32 value itself would round up to 1.125).
    x = _row([255.99, 1 + 2**-8, 1 + 3 * 2**-8, 1.0625 + 2**-20])
    assert x[0, :4].to(BF16).float().tolist() == [256.0, 1.0, 1 + 2**-6, 1.0625]
    data, scale = ops.mx_quantize_from_master(x, -1, BF16, E4M3, "floor")
    assert as_bytes(scale).tolist() == [[127]]
    assert data[0, :4].float().tolist() == [256.0, 1.0, 1.0, 1.0]
    ref_data, ref_scale = ref.mx_quantize(x.to(BF16), -1, E4M3, "floor")
    assert torch.equal(as_bytes(data), as_bytes(ref_data))
    assert torch.equal(as_bytes(scale), as_bytes(ref_scale))
    # Quantizing the fp32 values as they are gives other bytes: the rounding is not skipped.
    assert as_bytes(ops.mx_quantize(x, -1, E4M3, "floor")[1]).tolist() == [[126]]
    assert ops.mx_quantize(_row([448.0, 1.0625 + 2**-20]), -1)[0][0, 1].item() == 1.125


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=dtype_id)
def test_a_finite_master_that_rounds_to_inf_gives_a_nan_block(param_dtype):
    big = 3.4e38 if param_dtype == BF16 else 65520.0  # rounds to +Inf in param_dtype
    x = torch.ones(3, 64)
    x[1, 40] = big
    x[2, 3] = -big
    for elem_dtype, scale_mode in FORMATS:
        data, scale = ops.mx_quantize_from_master(x, -1, param_dtype, elem_dtype, scale_mode)
        normal = 127 - ref.ELEM_EMAX[elem_dtype]
        assert as_bytes(scale).tolist() == [
            [normal, normal],
            [normal, NAN_BYTE],
            [NAN_BYTE, normal],
        ]


def test_nan_and_inf_masters_give_nan_blocks_in_every_layout():
    x = torch.rand(64, 96) * 0.5 + 1.0  # amax in [1, 1.5): e4m3 scale byte 127 - 8
    x[5, 7] = math.nan
    x[40, 70] = -math.inf
    for p in PARAM_DTYPES:
        fwd = ops.mx_quantize_dual_from_master(x, p)
        assert as_bytes(fwd[1])[5, 0] == NAN_BYTE and as_bytes(fwd[1])[40, 2] == NAN_BYTE
        assert as_bytes(fwd[3])[0, 7] == NAN_BYTE and as_bytes(fwd[3])[1, 70] == NAN_BYTE
        _, block = ops.mx_quantize_block_from_master(x, p)
        assert as_bytes(block).tolist() == [[NAN_BYTE, 119, 119], [119, 119, NAN_BYTE]]


def test_fp16_subnormal_ties_round_to_even():
    # (2k + 1) * 2^-25 is halfway between fp16 subnormals k and k + 1: even k wins. The block's
    # amax 2^-14 gives an e5m2 scale of 2^-29, and e5m2 holds 2^-25 .. 2^-14 multiples exactly.
    x = _row([2.0**-14, 1 * 2.0**-25, 3 * 2.0**-25, 5 * 2.0**-25, -7 * 2.0**-25])
    data, _ = ops.mx_quantize_from_master(x, -1, FP16, E5M2, "floor")
    assert (data[0, :5].float() * 2.0**-29).tolist() == [
        2.0**-14,
        0.0,
        4 * 2.0**-25,
        4 * 2.0**-25,
        -8 * 2.0**-25,
    ]


def test_non_contiguous_and_empty_masters():
    master = make_master("ties", (70, 100), -1, BF16, seed=5)
    for view in (master.t(), master[::2, 1::3], master[3:, 5:]):
        for p in PARAM_DTYPES:
            got = ops.mx_quantize_from_master(view, 0, p, E5M2, "rceil")
            assert same_bits(got, ops.mx_quantize(view.to(p), 0, E5M2, "rceil"))
            got = ops.mx_quantize_dual_from_master(view, p, E4M3, "floor")
            assert same_bits(got, ops.mx_quantize_dual(view.to(p), E4M3, "floor"))
            got = ops.mx_quantize_block_from_master(view, p, E4M3, "rceil")
            assert same_bits(got, ops.mx_quantize_block(view.to(p), E4M3, "rceil"))
    empty = torch.empty(0, 64)
    for got, plain in (
        (ops.mx_quantize_from_master(empty), ops.mx_quantize(empty.to(BF16))),
        (ops.mx_quantize_dual_from_master(empty), ops.mx_quantize_dual(empty.to(BF16))),
        (ops.mx_quantize_block_from_master(empty), ops.mx_quantize_block(empty.to(BF16))),
    ):
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in plain]


def test_other_ranks_and_dims():
    # mx_quantize_from_master takes any rank >= 1 and any dim, as mx_quantize does.
    for shape, dim in (((100,), 0), ((3, 40, 5), 1), ((2, 3, 33, 7), 0), ((2, 3, 7, 33), -1)):
        master = make_master("amax_rounding", shape, dim, BF16, seed=6)
        for p in PARAM_DTYPES:
            got = ops.mx_quantize_from_master(master, dim, p, E4M3, "rceil")
            assert same_bits(got, ops.mx_quantize(master.to(p), dim, E4M3, "rceil"))
            assert_same_quantization(got, ref.mx_quantize(master.to(p), dim, E4M3, "rceil"), dim)


def test_reference_is_the_cast_then_the_reference_quantize():
    master = make_master("ties", (47, 113), -1, BF16, seed=7)
    for p in PARAM_DTYPES:
        param = master.to(p)
        pairs = [
            (
                ref.mx_quantize_from_master(master, 0, p, E5M2, "rceil"),
                ref.mx_quantize(param, 0, E5M2, "rceil"),
            ),
            (ref.mx_quantize_dual_from_master(master, p), ref.mx_quantize_dual(param)),
            (ref.mx_quantize_block_from_master(master, p), ref.mx_quantize_block(param)),
        ]
        for got, expected in pairs:
            assert same_bits(got, expected)


def test_matches_torchao_on_the_rounded_parameter():
    # torchao's to_mx on master.to(bf16) as an independent oracle, on the blocks where torchao
    # follows the spec (test_reference_torchao.py lists its departures).
    pytest.importorskip("torchao")
    from helpers import torchao_oracle as ao

    gen = torch.Generator().manual_seed(8)
    bf16_grid = ao.hard_input(64, 128, torch.float32, seed=9)
    # Random low bits, and exact bf16 ties, on top of values that torchao's cases make hard.
    noise = torch.randint(0, 1 << 16, bf16_grid.shape, generator=gen, dtype=torch.int32)
    noise[::3] = 0x8000
    master = ((bf16_grid.view(torch.int32) & ~0xFFFF) | noise).view(torch.float32)
    for elem_dtype, scale_mode in FORMATS:
        data, scale = ops.mx_quantize_from_master(master, -1, BF16, elem_dtype, scale_mode)
        ao_data, ao_scale = ao.torchao_quantize(master.to(BF16), elem_dtype, scale_mode)
        compared = ao.spec_following_blocks(scale, master.to(BF16))
        assert compared.float().mean() > 0.9
        assert torch.equal(as_bytes(scale)[compared], as_bytes(ao_scale)[compared])
        view = (64, -1, BLOCK)
        assert torch.equal(
            as_bytes(data).reshape(view)[compared], as_bytes(ao_data).reshape(view)[compared]
        )


# ------------------------------------------------------------------------------------------------
# every CPU kernel build (ZRW_CPU_ISA), each in its own process

ISA_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import zrw
    import test_quantize_from_master as t  # this file, on the PYTHONPATH the parent passes

    failures = []
    for kind in t.KINDS:
        for p in t.PARAM_DTYPES:
            for shape in ((47, 113), (2, 33, 600)):
                for dim in (-1, -2):
                    master = t.make_master(kind, shape, dim, p,
                                           seed=t.stable_seed("isa", kind, shape, dim, str(p)))
                    failures += t.check_master(master, p)
    if failures:
        print(len(failures), "mismatches, first:", *failures[:10], sep="\\n")
        sys.exit(1)
    print("ok", zrw._C.cpu_isa())
    """
)


@pytest.fixture(scope="module", autouse=True)
def isa_children():
    """One child per ISA this CPU runs, started when the module's first test runs so that they
    work while the other tests do; collected by the test at the end. {isa: Popen}."""
    flags = quant.cpu_flags()
    children = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for isa, need in quant.ISA_REQUIREMENTS.items():
        if need <= flags:
            children[isa] = subprocess.Popen(
                [sys.executable, "-c", ISA_SCRIPT],
                env=child_env(here, ZRW_CPU_ISA=isa),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    yield children
    for child in children.values():
        if child.poll() is None:
            child.kill()
        child.communicate()


@pytest.mark.parametrize("isa", list(quant.ISA_REQUIREMENTS))
def test_every_cpu_kernel_build_quantizes_masters_as_their_parameters(isa, isa_children):
    if isa not in isa_children:
        missing = quant.ISA_REQUIREMENTS[isa] - quant.cpu_flags()
        pytest.skip(f"this CPU lacks {sorted(missing)} for ZRW_CPU_ISA={isa}")
    stdout, stderr = isa_children[isa].communicate(timeout=600)
    assert isa_children[isa].returncode == 0, stdout + stderr
    assert stdout.strip().endswith(f"ok {isa}")


# ------------------------------------------------------------------------------------------------
# opcheck, fakes, torch.compile


def _opcheck_cases():
    gen = torch.Generator().manual_seed(10)
    w = make_master("ties", (40, 70), -1, BF16, seed=11)
    w_nan = w.clone()
    w_nan[3, 40] = math.nan
    w3 = torch.randn(2, 33, 65, generator=gen)
    cases = []
    for tag, m, p, e, s in (
        ("bf16", w, BF16, E4M3, "floor"),
        ("nan-fp16", w_nan, FP16, E5M2, "rceil"),
        ("3d", w3, BF16, E5M2, "floor"),
        ("t", w.t(), FP16, E4M3, "rceil"),
    ):
        cases.append((f"{tag}-dim-1", "mx_quantize_from_master", (m, -1, p, e, s)))
        cases.append((f"{tag}-dim0", "mx_quantize_from_master", (m, 0, p, e, s)))
        cases.append((tag, "mx_quantize_dual_from_master", (m, p, e, s)))
        cases.append((tag, "mx_quantize_block_from_master", (m, p, e, s)))
    cases.append(
        ("empty", "mx_quantize_from_master", (torch.empty(0, 64), -1, BF16, E4M3, "floor"))
    )
    return cases


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[f"{n}-{t}" for t, n, _ in OPCHECK_CASES])
def test_opcheck(case, fp8_aware_comparisons):
    _, name, args = case
    result = torch.library.opcheck(getattr(torch.ops.zrw, name).default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_meta_tensors_go_to_the_fake_kernels():
    m = torch.empty(3, 40, 70, device="meta")
    data, scale = ops.mx_quantize_from_master(m, 1, FP16, E5M2, "rceil")
    assert (data.device.type, data.shape, data.dtype) == ("meta", m.shape, E5M2)
    assert (scale.shape, scale.dtype) == ((3, 2, 70), E8M0)
    outs = ops.mx_quantize_dual_from_master(m)
    assert [tuple(t.shape) for t in outs] == [(3, 40, 70), (3, 40, 3), (3, 40, 70), (3, 2, 70)]
    assert [t.dtype for t in outs] == [E4M3, E8M0, E4M3, E8M0]
    data, block = ops.mx_quantize_block_from_master(m)
    assert data.shape == m.shape and block.shape == (3, 2, 3) and block.dtype == E8M0


def test_torch_compile_fullgraph_matches_eager():
    def fn(master):
        a = torch.ops.zrw.mx_quantize_from_master(master, -1, BF16, E4M3, "rceil")
        b = torch.ops.zrw.mx_quantize_dual_from_master(master, FP16, E5M2, "floor")
        c = torch.ops.zrw.mx_quantize_block_from_master(master, BF16, E4M3, "floor")
        return (*a, *b, *c)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    master = make_master("amax_rounding", (40, 70), -1, BF16, seed=12)
    assert same_bits(compiled(master), fn(master))


# ------------------------------------------------------------------------------------------------
# errors: named argument, expectation and what was found; the fakes refuse the same


X = torch.ones(4, 64)
W3 = torch.ones(2, 4, 64)
FOUND = {
    torch.bfloat16: "BFloat16",
    torch.float16: "Half",
    torch.float64: "Double",
    torch.float32: "Float",
    torch.int32: "Int",
    E4M3: "Float8_e4m3fn",
}


def found(dtype):
    return f"got ({FOUND[dtype]}|torch\\.{dtype_id(dtype)})$"


def _error_cases():
    single, dual, block = (
        ops.mx_quantize_from_master,
        ops.mx_quantize_dual_from_master,
        ops.mx_quantize_block_from_master,
    )
    cases = []
    for name, call in (
        ("mx_quantize_from_master", lambda m, *a: single(m, -1, *a)),
        ("mx_quantize_dual_from_master", dual),
        ("mx_quantize_block_from_master", block),
    ):
        op = rf"zrw\.{name}: "
        for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int32, E4M3):
            cases.append(
                (
                    f"{name}-master-{dtype_id(dtype)}",
                    lambda call=call, dtype=dtype: call(X.to(dtype)),
                    TypeError,
                    op
                    + r"master must be torch\.float32 \(the FP32 master weight\), "
                    + found(dtype),
                )
            )
        for dtype in (torch.float32, torch.float64, E4M3):
            cases.append(
                (
                    f"{name}-param-{dtype_id(dtype)}",
                    lambda call=call, dtype=dtype: call(X, dtype),
                    TypeError,
                    op + r"param_dtype must be torch\.bfloat16 or torch\.float16, " + found(dtype),
                )
            )
        cases.append(
            (
                f"{name}-elem-fp16",
                lambda call=call: call(X, BF16, torch.float16),
                TypeError,
                op + r"elem_dtype must be torch\.float8_e4m3fn or "
                r"torch\.float8_e5m2, " + found(torch.float16),
            )
        )
        cases.append(
            (
                f"{name}-scale-mode",
                lambda call=call: call(X, BF16, E4M3, "round"),
                ValueError,
                op + r'scale_mode must be "floor" or "rceil", got "round"$',
            )
        )
    for name, call in (
        ("mx_quantize_dual_from_master", dual),
        ("mx_quantize_block_from_master", block),
    ):
        op = rf"zrw\.{name}: master must be 2-d \(N, K\) or 3-d \(E, N, K\), got shape "
        cases += [
            (f"{name}-1d", lambda call=call: call(X[0]), ValueError, op + r"(\[64\]|\(64,\))$"),
            (
                f"{name}-4d",
                lambda call=call: call(W3[None]),
                ValueError,
                op + r"(\[1, 2, 4, 64\]|\(1, 2, 4, 64\))$",
            ),
            (
                f"{name}-0d",
                lambda call=call: call(torch.tensor(1.0)),
                ValueError,
                op + r"(\[\]|\(\))$",
            ),
        ]
    cases += [
        (
            "single-0d",
            lambda: single(torch.tensor(1.0)),
            IndexError,
            r"zrw\.mx_quantize_from_master: master must have at least one dimension, got a 0-d "
            r"tensor$",
        ),
        (
            "single-dim",
            lambda: single(X, 2),
            IndexError,
            r"zrw\.mx_quantize_from_master: dim must be in \[-2, 1\] for a 2-d master, got 2$",
        ),
    ]
    return cases


ERROR_CASES = _error_cases()


@pytest.mark.parametrize(
    "call, exc_type, pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_bad_argument_raises_naming_it(call, exc_type, pattern):
    with pytest.raises(exc_type, match=pattern):
        call()


@pytest.mark.parametrize(
    "op, args, exc_type, pattern",
    [
        (
            "mx_quantize_from_master",
            (torch.float16, -1, BF16, E4M3, "floor"),
            TypeError,
            r"master must be torch\.float32",
        ),
        (
            "mx_quantize_from_master",
            (torch.float32, 5, BF16, E4M3, "floor"),
            IndexError,
            r"dim must be in",
        ),
        (
            "mx_quantize_dual_from_master",
            (torch.float32, torch.float32, E4M3, "floor"),
            TypeError,
            r"param_dtype must be torch\.bfloat16 or torch\.float16",
        ),
        (
            "mx_quantize_block_from_master",
            (torch.float32, BF16, torch.int8, "floor"),
            TypeError,
            r"elem_dtype must be",
        ),
        (
            "mx_quantize_block_from_master",
            (torch.float32, BF16, E4M3, "ceil"),
            ValueError,
            r"scale_mode must be",
        ),
    ],
    ids=["master-dtype", "dim", "param-dtype", "elem-dtype", "scale-mode"],
)
def test_fake_kernels_refuse_bad_arguments(op, args, exc_type, pattern):
    master = torch.empty(4, 64, device="meta", dtype=args[0])
    with pytest.raises(exc_type, match=rf"zrw\.{op}: {pattern}"):
        getattr(ops, op)(master, *args[1:])
    with pytest.raises(ValueError, match=r"master must be 2-d"):
        ops.mx_quantize_dual_from_master(torch.empty(64, device="meta"))


def test_wrappers_name_a_wrong_typed_argument():
    with pytest.raises(
        TypeError,
        match=r"^zrw\.mx_quantize_from_master: master must be a "
        r"torch\.Tensor, got NoneType$",
    ):
        ops.mx_quantize_from_master(None)
    with pytest.raises(
        TypeError,
        match=r"^zrw\.mx_quantize_dual_from_master: param_dtype must "
        r"be a torch\.dtype, got str$",
    ):
        ops.mx_quantize_dual_from_master(X, "bf16")
    with pytest.raises(
        TypeError,
        match=r"^zrw\.mx_quantize_block_from_master: scale_mode must "
        r"be a str, got NoneType$",
    ):
        ops.mx_quantize_block_from_master(X, BF16, E4M3, None)


def test_a_master_requiring_grad_is_refused_under_grad_mode():
    master = X.clone().requires_grad_()
    with pytest.raises(
        RuntimeError,
        match=r"^zrw\.mx_quantize_dual_from_master is not "
        r"differentiable, but its argument master requires",
    ):
        ops.mx_quantize_dual_from_master(master)
    with torch.no_grad():
        got = ops.mx_quantize_dual_from_master(master)
    assert same_bits(got, ops.mx_quantize_dual_from_master(X))
