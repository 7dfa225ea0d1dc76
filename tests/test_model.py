"""The backbone: loss at init, learning, causality, RoPE, RMSNorm gradients, sampling, config errors."""
import math

import pytest
import torch

import torch.nn.functional as F

import run_config
from model import GPT, GPTConfig, _rotate_real, apply_rope, attend, rope_table


def tiny(**kw):
    args = dict(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
    args.update(kw)
    return GPTConfig(**args)


def test_loss_at_init_is_near_ln_vocab():
    torch.manual_seed(0)
    model = GPT(tiny(n_embd=64, n_head=4))
    idx = torch.randint(0, 65, (8, 32))
    _, loss = model(idx, idx)
    assert abs(loss.item() - math.log(65)) < 0.05  # padded vocab rows never enter the softmax


def test_logits_cover_the_real_vocab_only():
    model = GPT(tiny())
    assert model.wte.weight.shape[0] == 65 and model.lm_head.weight.shape[0] == 65  # a small vocab: not padded
    for vocab, rows in ((50257, 50304), (65, 65), (1000, 1000), (4031, 4032), (4033, 4096)):
        assert GPTConfig(vocab_size=vocab).padded_vocab_size == rows  # padded where 64 x padding <= vocab
    logits, _ = model(torch.zeros(1, 5, dtype=torch.long))
    assert logits.shape == (1, 1, 65)  # inference: last position only
    logits, _ = model(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    assert logits.shape == (1, 5, 65)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99))
    x = torch.randint(0, 65, (4, 32))
    y = torch.randint(0, 65, (4, 32))
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_causal():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 65, (2, 32))
    t = 20
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % 65
    a, _ = model(x, x)
    b, _ = model(x2, x2)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    rot = rope_table(16, 64)
    q, k = torch.randn(16), torch.randn(16)

    def score(m, n):  # rotate q to position m and k to position n
        qm = apply_rope(q.view(1, 1, 1, 16), rot[m:m + 1])
        kn = apply_rope(k.view(1, 1, 1, 16), rot[n:n + 1])
        return (qm * kn).sum().item()
    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    # the real-arithmetic form used under torch.compile is the same rotation
    x = torch.randn(2, 64, 3, 16)
    pairs = x.reshape(2, 64, 3, 8, 2)
    real = _rotate_real(pairs, rope_table(16, 64).view(64, 1, 8, 2)).flatten(-2)
    assert torch.allclose(apply_rope(x, rope_table(16, 64)), real, atol=1e-6)
    # a rotation keeps the norm
    assert apply_rope(q.view(1, 1, 1, 16), rot[7:8]).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)



def test_rope_backward_is_the_inverse_rotation():
    """The eager rotation's hand-written backward (times the conjugate) against finite differences in
    float64, per position (a [T, ...] table) and per row (a [B, T, ...] table, MoD's compressed rows)."""
    torch.manual_seed(0)
    table = rope_table(8, 16).double()
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, table), (x,))
    rows = table[torch.randint(0, 16, (2, 16))]  # each row its own positions
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, rows), (x,))

def test_generate_same_seed_same_text():
    model = GPT(tiny()).eval()
    x = torch.zeros(1, 1, dtype=torch.long)

    def sample(seed):
        torch.manual_seed(seed)
        return model.generate(x, 40, temperature=1.0, top_k=10)
    a, b, c = sample(1), sample(1), sample(2)
    assert a.shape == (1, 41) and torch.equal(a, b) and not torch.equal(a, c)
    # the context is cropped to block_size, so sampling past it works
    assert model.generate(x, 40, temperature=0).shape == (1, 41)


def test_greedy_generate_picks_the_argmax():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 65, (1, 6))
    out = model.generate(x, 1, temperature=0)
    logits, _ = model(x)
    assert out[0, -1].item() == logits[0, -1].argmax().item()


def test_top_k_1_is_greedy_at_any_temperature():
    """top_k=1 leaves one candidate, the argmax: sampling then gives exactly the temperature=0 tokens."""
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 65, (4, 3))
    greedy = model.generate(x, 20, temperature=0)
    for temperature in (1.0, 5.0):
        assert torch.equal(model.generate(x, 20, temperature=temperature, top_k=1), greedy)


def test_sampled_tokens_are_in_the_top_k_of_their_step():
    """Every sampled token is among the k largest logits of its step, the logits recomputed by one
    full forward pass over the generated text (not the KV-cache path that sampled them)."""
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    k, prompt = 5, 4
    x = torch.randint(0, 65, (8, prompt))
    out = model.generate(x, 24, temperature=1.5, top_k=k)
    logits, _ = model(out[:, :-1], out[:, :-1])  # logits[:, t] predicts token t + 1
    logits = logits[:, prompt - 1:]
    picked = logits.gather(-1, out[:, prompt:, None]).squeeze(-1)
    kth = logits.topk(k, dim=-1).values[..., -1]
    assert (picked >= kth - 1e-5).all()
    # not trivially so: the draws spread over the top k, not just the argmax
    rank = (logits > picked[..., None]).sum(-1)
    assert (rank > 0).float().mean() > 0.3 and set(rank.flatten().tolist()) == set(range(k))


def known_logits_model(logits):
    """A model whose next-token logits are `logits` [V] whatever the context: every sublayer writes 0
    (c_proj = 0), every token embeds as the same unit-RMS row, and the head maps that row to logits."""
    V, d = logits.numel(), 16
    model = GPT(tiny(vocab_size=V, n_layer=1, n_embd=d, block_size=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.zero_()
        model.wte.weight.fill_(1.0)
        model.lm_head.weight.copy_(logits[:, None].expand(V, d) / d)  # <row, ones> = logit
    got, _ = model(torch.zeros(1, 3, dtype=torch.long))
    assert (got[0, -1] - logits).abs().max() < 1e-5
    return model


def test_sampling_frequencies_follow_softmax_of_logits_over_temperature():
    """With known logits l, one step over N = 20000 rows samples token i with probability
    softmax(l / T)_i (top_k: renormalised over the k largest, exactly 0 elsewhere): every frequency
    within 5 standard errors. T = 0 is the argmax, and T = 0.02 all but always the argmax too."""
    logits = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.5, 2.0, 1.0, -2.0])  # argmax 5, then 2, 6, 0
    model = known_logits_model(logits)
    N = 20000
    x = torch.zeros(N, 1, dtype=torch.long)
    assert (model.generate(x[:4], 3, temperature=0)[:, 1:] == 5).all()
    torch.manual_seed(0)
    assert (model.generate(x, 1, temperature=0.02)[:, 1] == 5).all()  # the runner-up: p ~ e^-25
    for temperature, top_k in ((0.5, None), (2.0, None), (2.0, 3)):
        p = torch.softmax(logits.double() / temperature, dim=0)
        if top_k is not None:
            p[[1, 3, 4, 0, 7]] = 0.0  # outside the top 3 (5, 2, 6)
            p /= p.sum()
        torch.manual_seed(1)
        freq = torch.bincount(model.generate(x, 1, temperature=temperature, top_k=top_k)[:, 1],
                              minlength=8).double() / N
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / N).sqrt()).all(), (temperature, top_k, freq, p)


def test_dropout_is_off_in_eval_and_random_in_training():
    """Every dropout site (the embedding, attention's probabilities, attention's and the MLP's outputs)
    is off in eval: a dropout=0.5 model gives bit-identical logits under different RNG states, equal to
    the dropout=0 model with the same weights. In training it draws from the RNG: other seeds, other
    logits; the same seed, the same ones."""
    torch.manual_seed(0)
    drop = GPT(tiny(dropout=0.5))
    plain = GPT(tiny())
    plain.load_state_dict(drop.state_dict())
    x = torch.randint(0, 65, (2, 32))

    def logits(model, seed):
        torch.manual_seed(seed)
        return model(x, x)[0]
    ref = logits(plain.eval(), 0)
    drop.eval()
    assert torch.equal(logits(drop, 1), ref) and torch.equal(logits(drop, 2), ref)
    drop.train()
    a, b = logits(drop, 1), logits(drop, 2)
    assert (a - b).abs().max() > 0.1 and (a - ref).abs().max() > 0.1
    assert torch.equal(logits(drop, 1), a)


def test_weight_decay_only_on_matrices():
    model = GPT(tiny())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_num_params_and_init():
    cfg = tiny(n_layer=3)
    model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert model.get_num_params(non_embedding=False) == total
    assert model.get_num_params() == total - model.wte.weight.numel()
    std = model.sublayers[1].c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.1)
    assert model.sublayers[1].c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_embd=30, n_head=4), "divisible by n_head"),
    (dict(residual="postnorm"), "valid: prenorm"),
    (dict(n_layer=0), "n_layer must be >= 1"),
    (dict(n_embd=24, n_head=8), "even for RoPE"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(tiny(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_attention_on_a_cpu_runs_in_fp32_under_bf16_autocast():
    """Under bf16 autocast on a CPU, attention runs on the bf16 q, k, v upcast to fp32 (torch's CPU kernel is
    several times slower in bf16), its output back in bf16: equal, values and gradients, to fp32 attention of the
    same inputs, and not to bf16 attention. An additive mask (MoD's biases) enters in fp32, not rounded to bf16."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).to(torch.bfloat16).requires_grad_() for _ in range(3))
    mask = torch.randn(2, 1, 16, 16) * 8 + torch.triu(torch.full((16, 16), float("-inf")), 1)

    def both(fn):
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return out, grads
    for m, causal in ((None, True), (mask, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, got_grads = both(lambda q, k, v: attend(q, k, v, m, 0.0, causal))
        want, want_grads = both(lambda q, k, v: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=m, is_causal=causal).to(torch.bfloat16))
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
        in_bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=None if m is None else m.to(torch.bfloat16),
                                                 is_causal=causal)
        assert not torch.equal(got, in_bf16)
        if m is not None:  # the mask rounded to bf16 first gives another result
            assert not torch.equal(got, F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=m.to(torch.bfloat16).float()).to(torch.bfloat16))


@pytest.mark.parametrize("native", [True, False])
def test_auto_picks_bf16_on_a_cpu_that_computes_it(native, monkeypatch):
    """dtype auto on a CPU, for training (cpu_bf16): bf16 autocast where the CPU multiplies bf16 natively, fp32
    where it would emulate it; sampling, tradeoff.py and bench.py (no cpu_bf16) and an explicit float32: fp32."""
    monkeypatch.setattr(run_config, "cpu_computes_bf16", lambda: native)
    device, dtype, autocast = run_config.pick_device("cpu", "auto", cpu_bf16=True)
    assert device.type == "cpu" and dtype == ("bfloat16" if native else "float32")
    assert isinstance(autocast, torch.autocast) == native
    assert run_config.pick_device("cpu", "auto").dtype == "float32"
    assert run_config.pick_device("cpu", "float32", cpu_bf16=True).dtype == "float32"
    assert run_config.pick_device("cpu", "float32").dtype == "float32"
    assert run_config.pick_device("cpu", "bfloat16").dtype == "bfloat16"
