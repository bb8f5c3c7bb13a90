"""Compile a kernel wrapper's launches for the H200 (sm_90) on a machine with no GPU, and read each
binary's registers and spill stack: `python tests/kernels/sm90.py` is run in a subprocess by
test_register_spills.py (the interpreter that the other kernel tests set up must not be on).

`resources(launch)` runs `launch()` (a kernel wrapper's `_launch(cfg, ...)` on CPU tensors of the
real shapes) with every JIT kernel's `run` replaced: each launch is bound and specialized exactly as
on a GPU (the JIT's own binder, for a CUDA sm_90 backend), compiled by triton.compile to a cubin,
and measured by the cuobjdump that ships with Triton (registers, spill stack; barriers, shared-memory and global
loads after the ticket, from the SASS), plus the shared memory it takes.
`python tests/kernels/sm90.py [qkv | conv | sample | small | attention | norm_linear | held | held_block]` prints one spec set's
(SPECS) as JSON; `compiled(spec_set)` runs that from a test.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _usage(cubin: bytes) -> dict:
    """REG and STACK (bytes of local memory per thread: spills) of the one kernel in `cubin`, and `after_ticket`:
    counts of the SASS instructions that wait on or move through shared memory (BAR: barriers, STS / LDS: shared
    stores and loads) and of global loads (LDG) after the kernel's first global atomic (a split-K kernel's ticket:
    what follows is the last program's epilogue), or in the whole kernel where it has none; and `code` (`_code`).
    One cuobjdump run."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(_CUOBJDUMP), "-res-usage", "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    assert found, f"no resource line in cuobjdump's output:\n{text}"
    return {"regs": int(found[1]), "stack": int(found[2]), "after_ticket": _after_ticket(text), "code": _code(text)}


def _code(sass: str) -> str:
    """`_usage`'s code: a digest of the kernel's instructions in order with every constant-bank-0 operand
    (c[0x0][...], where the kernel's parameters live) masked, so two builds that differ only in their parameter
    lists (a pointer one side takes and the other does not) have the same code, and any change of instruction,
    register or order gives another."""
    listing = "\n".join(m[1] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", sass))
    return hashlib.sha256(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", listing).encode()).hexdigest()[:10]


def _after_ticket(sass: str) -> dict[str, int]:
    """`_usage`'s after_ticket counts, from cuobjdump's SASS listing (LDGSTS: the pipeliner's async copies, cp.async;
    LDG: loads into registers)."""
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    if "ATOMG" in ops:
        ops = ops[ops.index("ATOMG") + 1:]
    return {op: ops.count(op) for op in ("BAR", "STS", "LDS", "LDG", "LDGSTS")}


def _compile_run(fn: JITFunction, records: list):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)

    def run(*args, grid, warmup, **kwargs):
        kwargs.pop("launch_pdl", None)  # a launch option, not a compile option
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                              specialization, options)
        # NOTE: without the launch's alignment facts (16-byte pointers, strides divisible by 16)
        # the loads do not vectorize and the same kernel compiles to 255 registers and spills
        pointers = [i for i, t in enumerate(signature.values()) if str(t).startswith("*")]
        assert all(attrs.get((i,)) for i in pointers), f"{fn.__name__}: unaligned pointer args"
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                                  options=options.__dict__)
        records.append({"kernel": fn.__name__, **_usage(compiled.asm["cubin"]), "shared": compiled.metadata.shared})

    return run


def resources(launch) -> list[dict]:
    """[{kernel, regs, stack, shared, after_ticket, code}] of each kernel launch that `launch()` makes, compiled for
    sm_90."""
    records: list[dict] = []
    with ExitStack() as stack:
        for module in [m for name, m in sys.modules.items() if name.startswith("q3tts.kernels")]:
            for value in vars(module).values():
                if isinstance(value, JITFunction):
                    stack.enter_context(mock.patch.object(value, "run", _compile_run(value, records)))
        launch()
    return records


H200_SMS = 132  # streaming multiprocessors: the tuner's split counts follow them


def _qkv_specs():
    """(name, launch) of each qkv kernel config the H200's tuner times (`qkv_candidates` with its SM
    count): the code predictor's (1.7B shapes, T = 1 and 2; 4 rows, and the one batch row that attends in
    one round of loads; rows gathered by id at 4 rows and at one) and the talker's (4 rows and one), the talker's
    from its rows (the first layer) and from row statistics (` stats`: every layer after the first)."""
    import torch

    from q3tts.kernels import code_predictor_attention as cpa, code_predictor_gemm, talker_qkv

    bf = dict(dtype=torch.bfloat16)
    heads, kv, d = 16, 8, 128
    n = (heads + 2 * kv) * d
    for hidden, name in ((1024, "cp"), (2048, "talker")):
        x, norm_w, w = torch.zeros(4, hidden, **bf), torch.ones(hidden, **bf), torch.zeros(n, hidden, **bf)
        qn, kn, cnt = torch.ones(d, **bf), torch.ones(d, **bf), torch.zeros(64, dtype=torch.int32)
        cos, sin = torch.zeros(64, d, **bf), torch.zeros(64, d, **bf)
        with mock.patch.object(code_predictor_gemm, "num_sms", lambda device: H200_SMS):
            configs = cpa.qkv_candidates(w, d)
        for cfg in configs:
            if name == "cp":
                cache = torch.zeros(4, 16, kv, d, **bf)  # 16 positions: the 1.7B's code groups
                table, ids = torch.zeros(2048, hidden, **bf), torch.zeros(4, dtype=torch.int64)
                # 1 row: `held_rows` FEW_ROWS; gathered: the passes after the first, rows by id from a table
                for t, rows, gather in ((1, 4, False), (2, 4, False), (1, 1, False), (1, 4, True), (1, 1, True)):
                    src = (table, ids[:rows], x[:rows]) if gather else (x[:rows], None, None)
                    yield (f"cp_qkv_attention T={t} rows={rows}{' gathered' if gather else ''} {cfg}",
                           functools.partial(cpa._launch, cfg, *src, norm_w, w, qn, kn, cos, sin, cache,
                                             cache.clone(), torch.zeros(rows, heads * d, **bf), cnt, 0, t, 1e-6,
                                             0.1))
            else:
                cache = torch.zeros(8, 16, kv, d, **bf)
                ids, stats = torch.arange(4, dtype=torch.int64), torch.zeros(4, hidden // 16)
                for rows, st in ((4, False), (4, True), (1, False), (1, True)):  # 1: `held_rows` rows, heads at once
                    yield f"talker_qkv rows={rows}{' stats' if st else ''} {cfg}", functools.partial(
                        talker_qkv._launch, cfg, x[:rows], norm_w, w, qn, kn, cos, sin, ids[:rows], ids[:rows], cache,
                        cache.clone(), torch.zeros(rows, heads * d, **bf), cnt, 1e-6, stats[:rows] if st else None)


def _conv_specs():
    """(name, launch) of the channels-last conv at the codec frame's 96-channel k7 shape, 64 rows (the config the
    H200's tuner picked there), with the input's history split off as the streaming decoder keeps it, and without;
    and that config unpipelined (num_stages 1, " L1")."""
    import torch

    from q3tts.kernels import conv1d

    bf = dict(dtype=torch.bfloat16)
    rows, c, k, t = 64, 96, 7, 1920
    tiles = conv1d.ChannelsLastTiles(128, 64, 32, 4, 3)
    x = torch.zeros(rows, t, c, **bf).transpose(1, 2)  # [B, C, T] channels-last: the new samples
    w = torch.zeros(c, k, c, **bf).permute(0, 2, 1)  # the kernel weight layout, input channels fastest
    history = torch.zeros(rows, k - 1, c, **bf).transpose(1, 2)
    whole = torch.zeros(rows, k - 1 + t, c, **bf).transpose(1, 2)  # history and new samples in one tensor
    bias = torch.zeros(c, **bf)
    yield "cl k7 history", lambda: conv1d._launch(x, w, bias, 1, None, t, history, tiles)
    yield "cl k7", lambda: conv1d._launch(whole, w, bias, 1, None, t, None, tiles)
    yield "cl k7 history L1", lambda: conv1d._launch(x, w, bias, 1, None, t, history, tiles._replace(num_stages=1))


def _sample_specs():
    """(name, launch) of each warp count `warp_candidates` offers the draw kernel, both modes, at the code
    predictor's vocabulary (2048) and the talker's (3072: a 4096-wide row; with and without its processors)."""
    import torch

    from q3tts.kernels import code_predictor_sampling as cs

    ones, top_k, flags = torch.ones(4), torch.ones(4, dtype=torch.int64), torch.zeros(4, dtype=torch.bool)

    def draw(vocab: int, topk: bool, warps: int, talker: bool) -> None:
        scores = cs.TalkerScores(torch.zeros(4, vocab, dtype=torch.bool), ones, top_k, 2150, 2, 2048) if talker else None
        with mock.patch.object(cs, "pick", lambda *_: warps):
            cs.sample(torch.zeros(4, vocab), ones, top_k, flags, ones, topk, 50, faults=flags.clone(), talker=scores)

    for vocab in (2048, 3072):
        for topk in (False, True):
            for talker in (False, True) if vocab == 3072 else (False,):  # the talker's draw runs its processors
                for warps in cs.warp_candidates(triton.next_power_of_2(vocab), topk, talker):
                    yield (f"sample V={vocab} topk={topk} warps={warps}{' talker' if talker else ''}",
                           lambda a=(vocab, topk, warps, talker): draw(*a))


def _small_specs():
    """(name, launch) of the decode step's small kernels: the talker's next input (`embed_sum`) at the 1.7B's
    shapes, 4 rows (a tuple argument of 15 tables), the uniforms (uint64 arithmetic), and the codec's state scatter
    (`scatter_rows`: tuple arguments of the released codec's 21 bf16 states, 4 rows)."""
    import torch

    from q3tts.kernels import code_predictor_embed as ce, scatter, splitmix

    bf, rows = dict(dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64)
    tables = tuple(torch.zeros(2048, 2048, **bf) for _ in range(15))
    yield "embed_sum", lambda: ce.embed_sum(torch.zeros(4, 2048, **bf), tables, torch.zeros(4, 15, dtype=torch.int64))
    yield "uniforms", lambda: splitmix.uniforms(rows, rows.clone(), 16)
    states = [(2, 512), (1024, 6), (1024, 6), (6, 1024), (1536, 1)] + [
        (c, 1) if k == 1 else (k, c) for c in (768, 384, 192, 96) for k in (6, 18, 54, 1)] + [(6, 96)]
    srcs = [torch.zeros(4, *shape, **bf) for shape in states]
    yield "scatter_rows", lambda: scatter.scatter_rows([torch.zeros(65, *shape, **bf) for shape in states], rows, srcs)


def _attention_specs():
    """(name, launch) of each decode attention config the tuner times (paged_attention._CANDIDATES), the talker's
    one launch and the two of paged_decode_attention, at the 1.7B talker's heads over the engine's block table at
    one row (640 pages of 16: 64 splits at 132 SMs)."""
    import torch

    from q3tts.kernels import paged_attention as pa, talker_attention as ta

    bf = dict(dtype=torch.bfloat16)
    heads, kv, d, pages = 16, 8, 128, 640
    q, cache = torch.zeros(1, heads, d, **bf), torch.zeros(pages, 16, kv, d, **bf)
    tables, lens = torch.zeros(1, pages, dtype=torch.int32), torch.full((1,), 300, dtype=torch.int32)
    cnt = torch.zeros(kv, dtype=torch.int32)
    for cfg in pa._CANDIDATES:
        with mock.patch.object(pa, "num_sms", lambda device: H200_SMS):
            yield f"talker_attention {cfg}", lambda c=cfg: ta._launch(c, q, cache, cache, tables, lens, 0.1, cnt,
                                                                      torch.zeros_like(q))
            yield f"paged_decode {cfg}", lambda c=cfg: pa._launch(c, q, cache, cache, tables, lens, 0.1,
                                                                  torch.zeros_like(q))


def _gemm_candidates(n: int, k: int):
    """The configs the H200's tuner times for a fused GEMM of n output columns over k (`candidates`)."""
    import torch

    from q3tts.kernels import code_predictor_gemm

    fits = lambda bn: n // bn if n % bn == 0 else None  # noqa: E731
    with mock.patch.object(code_predictor_gemm, "num_sms", lambda device: H200_SMS):
        return code_predictor_gemm.candidates(fits, k, torch.device("cpu"))


def _stats(rows_stats) -> dict:
    """The `stats` keyword of a GEMM launch: none where `rows_stats` is None, so a tree from before the row
    statistics builds the same spec (`perf/sass_ab.py`)."""
    return {} if rows_stats is None else {"stats": rows_stats}


def _norm_linear_specs(stats: bool = True):
    """(name, launch) of each config the H200's tuner times for the row-normalising GEMMs (norm + gate_up + SiLU,
    norm + head) at the 1.7B's code predictor and talker shapes, at one row (`held_rows`: its statistics over that
    row alone) and 4; the talker's norm + gate_up from row statistics (`stats_rstd`, ` stats`: it follows a
    residual launch) unless stats is False, every other from its rows."""
    import torch

    from q3tts.kernels import code_predictor_linear as cl

    bf = dict(dtype=torch.bfloat16)
    for name, hidden, inter, vocab in (("cp", 1024, 3072, 2048), ("talker", 2048, 6144, 3072)):
        x, norm_w, rows_stats = torch.zeros(4, hidden, **bf), torch.ones(hidden, **bf), torch.zeros(4, hidden // 16)
        for kernel, n, w, epilogue in (("gate_up", inter, torch.zeros(2 * inter, hidden, **bf), cl.SWIGLU),
                                       ("head", vocab, torch.zeros(vocab, hidden, **bf), cl.ROUND)):
            out_dtype = torch.float32 if epilogue == cl.ROUND else torch.bfloat16
            st = rows_stats if stats and (name, kernel) == ("talker", "gate_up") else None
            for cfg in _gemm_candidates(n, hidden):
                for rows in (1, 4):
                    yield f"{name} norm {kernel} rows={rows}{' stats' if st is not None else ''} {cfg}", \
                        functools.partial(cl._launch, cfg, x=x[:rows], w=w, out=torch.zeros(rows, n, dtype=out_dtype),
                                          prologue=cl.NORM, epilogue=epilogue, rows=rows, n=n, norm_w=norm_w, eps=1e-6,
                                          counters=torch.zeros(4096, dtype=torch.int32),
                                          **_stats(None if st is None else st[:rows]))


def _residual_specs():
    """(name, launch) of each config the H200's tuner times for the plain GEMMs with the residual epilogue (o_proj,
    down) at the 1.7B's code predictor and talker shapes, at one row; the talker's writing its output's row
    statistics (its next norm reads them)."""
    import torch

    from q3tts.kernels import code_predictor_linear as cl

    bf = dict(dtype=torch.bfloat16)
    for name, hidden, inter in (("cp", 1024, 3072), ("talker", 2048, 6144)):
        for kernel, k in (("o_proj", 2048), ("down", inter)):
            x, w, residual = torch.zeros(1, k, **bf), torch.zeros(hidden, k, **bf), torch.zeros(1, hidden, **bf)
            for cfg in _gemm_candidates(hidden, k):
                yield f"{name} {kernel} rows=1 {cfg}", functools.partial(
                    cl._launch, cfg, x=x, w=w, out=torch.zeros_like(residual), prologue=cl.PLAIN, epilogue=cl.RESIDUAL,
                    rows=1, n=hidden, residual=residual, counters=torch.zeros(4096, dtype=torch.int32),
                    **_stats(torch.zeros(1, hidden // 16) if name == "talker" else None))


def _held_specs():
    """(name, launch) of the one-row qkv, row-normalising and residual GEMM specs built as under programmatic
    launch: each program loads its weight tile into registers before the wait where the tile fits
    (`held_columns`)."""
    from q3tts.kernels import code_predictor_gemm

    with mock.patch.object(code_predictor_gemm, "programmatic_launch", lambda *_: True):
        for name, launch in itertools.chain(_qkv_specs(), _norm_linear_specs(), _residual_specs()):
            if "rows=1 " in name:
                yield f"held {name}", launch


def _held_block_specs():
    """(name, launch) of the row-block (BLOCK_M rows: 4 rows build as 16) qkv and row-normalising GEMM specs built
    as under programmatic launch, each norm from its rows and from row statistics (` stats`): the talker's qkv and
    norm + gate_up."""
    from q3tts.kernels import code_predictor_gemm

    with mock.patch.object(code_predictor_gemm, "programmatic_launch", lambda *_: True):
        for name, launch in itertools.chain(_qkv_specs(), _norm_linear_specs(), _norm_linear_specs(stats=False)):
            if name.startswith(("talker_qkv rows=4 ", "talker norm gate_up rows=4 ")):
                yield f"held {name}", launch


SPECS = {"qkv": _qkv_specs, "conv": _conv_specs, "sample": _sample_specs, "small": _small_specs,
         "attention": _attention_specs, "norm_linear": _norm_linear_specs, "held": _held_specs,
         "held_block": _held_block_specs}


def compiled(spec_set: str) -> dict[str, list[dict]]:
    """{spec: [{kernel, regs, stack, shared, after_ticket}]} of one of SPECS, compiled by this file run in a fresh
    interpreter without TRITON_INTERPRET (the tests that import this run with it on)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, spec_set], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


if __name__ == "__main__":
    specs = SPECS[sys.argv[1] if len(sys.argv) > 1 else "qkv"]
    print(json.dumps({name: resources(launch) for name, launch in specs()}))
