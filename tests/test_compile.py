"""The model under torch.compile, proven on a CPU: the kernels stay in the graph as the nanodepth::
custom ops (kernels='triton'; on CPU tensors the ops run their reference), compiled values and
gradients equal eager, Mixture-of-Depths compiles to one graph without recompiling, and AttnRes
keeps O(L) saved activations (its sources are read where they lie, never re-stacked)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import bench
from model import GPT, GPTConfig, RESIDUALS, VARIANTS, executed_fraction

pytest.importorskip("triton")
SHAPE = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)



def make_model(seed=0, **kw):
    """mhc with 3 Sinkhorn iterations, not the default 20: these tests are about compiling the model, and
    3 iterations still trace the loop (20 only unroll it further). Sinkhorn itself is tested at 20 in
    test_kernels.py and test_hc.py, and under compile alone in test_hc_reference_autograd_functions_*."""
    torch.manual_seed(seed)
    if kw.get("residual") == "mhc" and kw.get("mhc_res", "sinkhorn") == "sinkhorn":
        kw.setdefault("mhc_sinkhorn_repeat", 3)
    model = GPT(GPTConfig(**{**SHAPE, **kw}))
    model.stream.perturb(0.2, torch.Generator().manual_seed(seed))  # off init: every gain, query and mix matters
    return model


def batch(seed=1, B=2):
    return torch.randint(0, SHAPE["vocab_size"], (B, SHAPE["block_size"]), generator=torch.Generator().manual_seed(seed))


class Recorder:
    """A torch.compile backend that keeps Dynamo's FX graphs and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self):
        """The nanodepth:: ops called in the recorded graphs (by name: rms_norm, ...)."""
        return {str(n.target).split(".")[1] for gm in self.graphs for n in gm.graph.nodes
                if n.op == "call_function" and str(n.target).startswith("nanodepth.")}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


MOD_CASES = {
    "nag": dict(residual="nag", mod="nag", mod_rate=0.25),
    "router": dict(residual="prenorm", mod="router", mod_rate=0.25, mod_inference="threshold"),
    "router-attnres": dict(residual="attnres", mod="router", mod_rate=0.5),
    "skip_middle": dict(residual="sandwich", mod="skip_middle", mod_rate=0.25),
}


def loss_and_grads(model, run, idx):
    model.zero_grad(set_to_none=True)
    logits, loss = run(idx, idx)
    loss.backward()
    return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {**{r: dict(residual=r) for r in RESIDUALS}, **VARIANTS, **{f"mod-{c}": kw for c, kw in MOD_CASES.items()}}


class AOTRecorder(Recorder):
    """aot_eager, keeping Dynamo's graphs as Recorder does."""

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def declares_other_ops(variant):
    """Whether a variant's stream calls other custom ops than its mode's default does (mhc's birkhoff
    drops sinkhorn): only such a variant takes the triton path again, the others' ops are the mode's."""
    kw = VARIANTS[variant]
    return set(make_model(**kw).stream.ops) != set(make_model(residual=kw["residual"]).stream.ops)


@pytest.mark.parametrize("case,kernels", [(c, k) for c in CASES for k in ("torch", "triton")
                                           if k == "torch" or not c.startswith("mod-")
                                           and (c not in VARIANTS or declares_other_ops(c))])
def test_compiled_equals_eager(case, kernels):
    """Every residual mode on both kernel paths, MoD on the references, in one full graph: with
    kernels='triton' it keeps exactly the custom ops the mode declares, with kernels='torch' none (the
    plain references, which inductor can fuse). AOTAutograd traces the ops' fake implementations and
    registered backwards (triton), or the references' autograd.Functions (torch), and the compiled
    forward and backward must give eager's loss and every gradient. (On torch 2.11 the references'
    gradients upstream of a norm came back zero: kernels.cast.)"""
    model = make_model(**CASES[case], kernels=kernels)
    idx = batch()
    logits_e, loss_e, grads_e = loss_and_grads(model, model, idx)
    recorder = AOTRecorder()
    logits_c, loss_c, grads_c = loss_and_grads(model, torch.compile(model, backend=recorder, fullgraph=True), idx)
    assert len(recorder.graphs) == 1
    assert recorder.ops() == (set(model.stream.ops) if kernels == "triton" else set())
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_compiled_eval_equals_eager(residual):
    """Evals run the compiled module in eval mode under no_grad (train.py's estimate_loss): the
    default kernels (the references on CPU) trace there too, and give eager's logits."""
    model = make_model(residual=residual).eval()
    with torch.no_grad():
        logits_e, loss_e = model(batch(), batch())
        logits_c, loss_c = torch.compile(model, backend=Recorder(), fullgraph=True)(batch(), batch())
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", list(MOD_CASES))
def test_mod_compiles_to_one_graph_without_recompiling(case):
    """Training: top-k with a static k (nag, router) and skip_middle's gathering padded to T under
    compile make one full graph, compiled once over 5 steps whose routing differs; eval (thresholds
    tau, data-dependent in eager) one more graph, whose logits equal eager's."""
    model = make_model(**{**SHAPE, **MOD_CASES[case]})
    if case == "skip_middle":  # producers that saturate some tokens' gates from the start
        with torch.no_grad():
            for producer in model.mod.producers:
                producer.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    # Dynamo alone (recompiles and graph breaks are decided there); test_compiled_equals_eager
    # covers AOTAutograd's forward and backward
    compiled = torch.compile(model, backend=Recorder(), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        _, loss = compiled(batch(step), batch(step + 100))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.after_step()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"]
    if MOD_CASES[case]["mod"] != "skip_middle":
        assert not model.mod.tau.isnan().any()  # eval routes by thresholds from here on
    model.eval()
    executed = []
    with torch.no_grad():
        for step in range(3):
            idx = batch(50 + step, B=3)
            logits_c, loss_c, exec_c = compiled(idx, idx, executed=True)
            exec_c = executed_fraction(exec_c, idx.numel())
            logits_e, loss_e, exec_e = model(idx, idx, executed=True)
            executed.append(executed_fraction(exec_e, idx.numel()))
            torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
            assert exec_c == pytest.approx(executed[-1])  # the same routing, counted the same way
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    if model.config.mod_inference == "threshold" or model.config.mod != "router":  # (5 steps do not train a predictor)
        assert min(min(e) for e in executed) < 1.0  # some tokens really were routed around a sublayer


def saved_ratio(residual, compiled=False, dtype=torch.float32, n_layer=16):
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(0))
    saved = {}
    for r in ("prenorm", residual):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=n_layer, n_head=4, n_embd=128, residual=r))
        saved[r] = bench.saved_activation_bytes(model, idx, compiled, dtype)
    return saved[residual] / saved["prenorm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attnres_saved_activations_are_linear_in_depth(dtype):
    """16 layers: full AttnRes keeps 33 sources; re-stacking them at each sublayer saved 2.48x
    prenorm's activations. Read where they lie, they cost at most 1.5x; under bf16 autocast too
    (an fp32 embedding would promote every source, and save fp32 copies)."""
    assert saved_ratio("attnres", dtype=dtype) <= 1.5
    assert saved_ratio("block_attnres", dtype=dtype) <= 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hc_saved_activations(dtype):
    """16 layers: mhc and hc save each sublayer's n streams once (the projection, the pre-mix and the
    post-mix share that storage), within 1.6x prenorm in fp32 and under bf16 autocast (the streams
    in bf16). A read through torch.matmul saved a transposed copy of the streams: hc 1.74x."""
    assert saved_ratio("mhc", dtype=dtype) <= 1.6
    assert saved_ratio("hc", dtype=dtype) <= 1.6


def test_attnres_sources_stay_in_the_compute_dtype(monkeypatch):
    """Under bf16 autocast every source (the embedding included) reaches depth_attention in bf16."""
    import model as model_module
    seen, real = [], model_module.depth_attention

    def spy(sources, *args, **kw):
        seen.append({s.dtype for s in sources})
        return real(sources, *args, **kw)
    monkeypatch.setattr(model_module, "depth_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        make_model(residual="attnres")(batch(), batch())
    assert seen and all(s == {torch.bfloat16} for s in seen)


@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_every_mode_trains_under_bf16_autocast(residual):
    """bf16 autocast, as on a GPU: bf16 sublayer outputs meet fp32 norm weights (sandwich's post-norms,
    AttnRes's bf16 mix). The references and the ops (their CPU implementations) each give finite
    gradients in every parameter's dtype, and the same loss and gradients up to bf16 rounding."""
    results = {}
    for impl in ("torch", "triton"):
        model = make_model(residual=residual, kernels=impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(batch(), batch())
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for name, p in model.named_parameters():
            if p.grad is not None:
                assert p.grad.dtype == p.dtype and p.grad.isfinite().all(), (impl, name)
        results[impl] = loss, grads
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-2, atol=0)
    assert grads_k.keys() == grads_t.keys()
    for name in grads_t:  # bf16 rounding of the stream differs a little between the two paths
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=5e-2, atol=5e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_no_weight", "nag_update", "depth_attention"])
def test_reference_autograd_functions_compile_with_their_backward(kernel, dtype):
    """The references' hand-written autograd.Functions (RMSNormTorch, NAGUpdateTorch, DepthAttentionTorch) alone
    under torch.compile (aot_eager): each input's gradient equals eager's. On torch 2.11 a forward
    that returned a no-op .to() or a tensor updated in place gave every input a zero gradient."""
    from kernels import depth_attention, nag_update, rms_norm
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=gen).to(dtype).requires_grad_()
    q, w = (torch.randn(24, generator=gen).requires_grad_() for _ in range(2))
    coef = torch.randn(2, 5, 24, generator=gen)  # a loss whose gradient is not symmetric
    if kernel == "depth_attention":
        def f(x, q, w):
            return depth_attention([x, torch.tanh(x), x.square()], q, w, impl="torch")
    elif kernel == "nag_update":  # r: fp32 unit-RMS rows (nag keeps it fp32); u in the compute dtype
        def f(x, q, w):
            r = torch.tanh(x.float() + 1) * q
            r = r * torch.rsqrt(r.square().mean(-1, keepdim=True))
            r_new, log_gain = nag_update(r, x * w.to(dtype), torch.sigmoid(x.float().sum(-1, keepdim=True)), impl="torch")
            return r_new + log_gain
    else:
        def f(x, q, w):
            return rms_norm(x * q.to(dtype), None if kernel == "rms_norm_no_weight" else w, impl="torch")
    grads = []
    for run in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        (run(x, q, w).float() * coef).sum().backward()
        grads.append([t.grad.clone() for t in (x, q, w) if t.grad is not None])
        for t in (x, q, w):
            t.grad = None
    eager, compiled = grads
    assert len(compiled) == len(eager) == (2 if kernel == "rms_norm_no_weight" else 3)
    for g_c, g_e in zip(compiled, eager):
        assert g_e.abs().max() > 0.1  # a gradient worth comparing
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["mhc_pre_mix", "sinkhorn", "hc_post_mix", "hc_post_mix_shared"])
def test_hc_reference_autograd_functions_compile_with_their_backward(kernel, dtype):
    """The hyper-connection references' autograd.Functions (MHCPreMixTorch, SinkhornTorch,
    HCPostMixTorch, the latter with per-row and with shared coefficients) alone under torch.compile
    (aot_eager): the stream's and the fp32 parameters' gradients equal eager's."""
    from kernels import hc_post_mix, mhc_pre_mix, sinkhorn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 6, generator=gen).to(dtype).requires_grad_()  # n = 4 streams of width 6
    p = torch.randn(24, generator=gen).requires_grad_()  # fp32 parameters; K = n (n + 2) = 24
    if kernel == "mhc_pre_mix":
        def f(x, p):
            u, post, res = mhc_pre_mix(x, x.flatten(-2)[..., :24] * p.to(dtype), p[:3], p, impl="torch")
            return torch.cat((u.float(), post, res.flatten(-2)), -1)
    elif kernel == "sinkhorn":
        def f(x, p):
            logits = x.flatten(-2)[..., :16].unflatten(-1, (4, 4)).float() + p[:16].view(4, 4)
            return sinkhorn(logits, 5, impl="torch").flatten(-2)
    else:
        shared = kernel == "hc_post_mix_shared"

        def f(x, p):
            post = torch.sigmoid(p[:4]) if shared else torch.sigmoid(x.float().mean(-1))
            res = torch.softmax(p[8:].view(4, 4) if shared else x.float()[..., :4] * p[:4], -1)
            return hc_post_mix(x, x.sum(-2) * p[:6].to(dtype), post, res, impl="torch").flatten(-2)
    grads = []
    for run in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        out = run(x, p).float()
        (out * torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape)).sum().backward()
        grads.append([x.grad.clone(), p.grad.clone()])
        x.grad = p.grad = None
    for g_c, g_e in zip(*grads):
        assert g_e.abs().max() > 0.01  # a gradient worth comparing
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)
