"""lightning_pipe.models: blocks against independently written reference math (float64, forward
and backward), masks, the tied head, recomputation, the size registry and Lightning training."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.lightning.stage import check_no_outside_parameters, find_pipeline
from lightning_pipe.models import (
    BYTE_VOCAB_SIZE,
    MASK_ID,
    MODEL_CONFIGS,
    PAD_ID,
    CausalLM,
    Embedding,
    LMHead,
    MaskedLM,
    MLMHead,
    ModelConfig,
    ResidualAttentionBlock,
    ResidualFFNBlock,
    build_bert,
    build_gpt,
    count_parameters,
    get_model_config,
    warmup_cosine,
)

TOL = 1e-10
TINY = ModelConfig(vocab_size=23, n_layer=2, n_head=2, d_model=8, max_seq_len=12)


# ---------------------------------------------------------------- reference math, written out


def ref_layer_norm(x, w, b, eps=1e-5):
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ref_linear(x, w, b=None):
    y = torch.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def ref_softmax(s):
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def ref_attention(x, p, n_head, causal, mask=None):
    """softmax(Q K^T / sqrt(hd) + M) V per head; M = -inf at future keys and padded keys."""
    B, T, d = x.shape
    hd = d // n_head
    qkv = ref_linear(x, p["qkv.weight"], p["qkv.bias"])
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    heads = []
    for h in range(n_head):
        sl = slice(h * hd, (h + 1) * hd)
        s = q[..., sl] @ k[..., sl].transpose(-1, -2) / math.sqrt(hd)  # (B, T, T)
        m = torch.zeros(B, T, T, dtype=x.dtype)
        if causal:
            for i in range(T):
                m[:, i, i + 1 :] = -math.inf
        if mask is not None:
            m = m.masked_fill((mask == 0)[:, None, :].expand(B, T, T), -math.inf)
        heads.append(ref_softmax(s + m) @ v[..., sl])
    return ref_linear(torch.cat(heads, -1), p["proj.weight"], p["proj.bias"])


def ref_attention_block(x, p, n_head, causal, mask=None):
    a = {k[len("attn.") :]: v for k, v in p.items() if k.startswith("attn.")}
    return x + ref_attention(ref_layer_norm(x, p["ln.weight"], p["ln.bias"]), a, n_head, causal, mask)


def ref_ffn_block(x, p):
    h = ref_layer_norm(x, p["ln.weight"], p["ln.bias"])
    h = ref_gelu(ref_linear(h, p["mlp.fc.weight"], p["mlp.fc.bias"]))
    return x + ref_linear(h, p["mlp.proj.weight"], p["mlp.proj.bias"])


def ref_embedding(ids, p, norm):
    T = ids.shape[1]
    onehot = F.one_hot(ids, p["token.weight"].shape[0]).to(p["token.weight"].dtype)
    h = onehot @ p["token.weight"] + p["position.weight"][:T]
    return ref_layer_norm(h, p["norm.weight"], p["norm.bias"]) if norm else h


def ref_lm_head(x, p):
    return ref_linear(ref_layer_norm(x, p["ln.weight"], p["ln.bias"]), p["weight"])


def ref_mlm_head(x, p):
    h = ref_layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    h = ref_gelu(ref_linear(h, p["dense.weight"], p["dense.bias"]))
    h = ref_layer_norm(h, p["ln.weight"], p["ln.bias"])
    return ref_linear(h, p["weight"], p["bias"])


# ---------------------------------------------------------------- helpers


def randomize(module, seed=0):
    """Non-trivial values everywhere (LayerNorm gains/biases too), float64."""
    g = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module


def output_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def check_against_reference(block, ref, inputs, float_input=None):
    """Forward and backward of `block(inputs)` equal `ref(inputs, params)` within TOL."""
    names = [n for n, _ in block.named_parameters()]
    params = [p for _, p in block.named_parameters()]
    leaves = params + ([float_input] if float_input is not None else [])

    out = output_tensor(block(inputs))
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((out * g).sum(), leaves)

    ref_params = {n: p.detach().clone().requires_grad_() for n, p in zip(names, params)}
    ref_leaves = list(ref_params.values())
    ref_inputs = inputs
    if float_input is not None:
        ref_x = float_input.detach().clone().requires_grad_()
        ref_leaves.append(ref_x)
        ref_inputs = ref_x if not isinstance(inputs, tuple) else (ref_x, *inputs[1:])
    ref_out = ref(ref_inputs, ref_params)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), ref_leaves)

    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    for name, a, b in zip(names + ["input"], grads, ref_grads):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, name=name: f"grad of {name}: {m}")


def hidden(B=3, T=7, d=8, seed=1):
    return torch.randn(B, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def padding_mask(B=3, T=7):
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    return mask


# ---------------------------------------------------------------- blocks = reference math


@pytest.mark.parametrize("norm", [False, True], ids=["gpt", "bert"])
def test_embedding_matches_reference(norm):
    block = randomize(Embedding(23, 8, 12, norm=norm))
    ids = torch.randint(0, 23, (3, 7), generator=torch.Generator().manual_seed(0))
    check_against_reference(block, lambda i, p: ref_embedding(i, p, norm), ids)
    mask = padding_mask()
    h, m = block((ids, mask))
    assert m is mask  # the mask is passed on unchanged
    torch.testing.assert_close(h, block(ids), atol=0, rtol=0)


@pytest.mark.parametrize("recompute", [False, True])
def test_causal_attention_block_matches_reference(recompute):
    block = randomize(ResidualAttentionBlock(8, 2, causal=True, recompute=recompute))
    x = hidden()
    check_against_reference(block, lambda x, p: ref_attention_block(x, p, 2, causal=True), x, float_input=x)


@pytest.mark.parametrize("recompute", [False, True])
def test_masked_attention_block_matches_reference(recompute):
    block = randomize(ResidualAttentionBlock(8, 2, causal=False, recompute=recompute))
    x, mask = hidden(), padding_mask()
    check_against_reference(block, lambda xm, p: ref_attention_block(xm[0], p, 2, causal=False, mask=xm[1]), (x, mask), float_input=x)


def test_causal_attention_with_padding_matches_reference():
    block = randomize(ResidualAttentionBlock(8, 2, causal=True))
    x, mask = hidden(), padding_mask()
    check_against_reference(block, lambda xm, p: ref_attention_block(xm[0], p, 2, causal=True, mask=xm[1]), (x, mask), float_input=x)


@pytest.mark.parametrize("recompute", [False, True])
def test_ffn_block_matches_reference(recompute):
    block = randomize(ResidualFFNBlock(8, recompute=recompute))
    assert block.mlp.fc.out_features == 32  # d_ff = 4 * d_model
    x = hidden()
    check_against_reference(block, ref_ffn_block, x, float_input=x)
    x2, mask = hidden(seed=2), padding_mask()
    check_against_reference(block, lambda xm, p: ref_ffn_block(xm[0], p), (x2, mask), float_input=x2)


def test_heads_match_reference():
    weight = torch.nn.Parameter(torch.randn(23, 8))
    x = hidden()
    check_against_reference(randomize(LMHead(8, weight)), ref_lm_head, x, float_input=x)
    x2 = hidden(seed=3)
    check_against_reference(randomize(MLMHead(8, weight)), lambda xm, p: ref_mlm_head(xm[0], p), (x2, padding_mask()), float_input=x2)


def test_whole_gpt_matches_reference_composition():
    model = randomize(build_gpt(TINY))
    ids = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(4))
    p = dict(model.named_parameters(remove_duplicate=False))

    def sub(i):
        return {k[len(f"{i}.") :]: v for k, v in p.items() if k.startswith(f"{i}.")}

    h = ref_embedding(ids, sub(0), norm=False)
    for layer in range(TINY.n_layer):
        h = ref_attention_block(h, sub(1 + 2 * layer), TINY.n_head, causal=True)
        h = ref_ffn_block(h, sub(2 + 2 * layer))
    torch.testing.assert_close(model(ids), ref_lm_head(h, sub(len(model) - 1)), atol=TOL, rtol=0)


# ---------------------------------------------------------------- masks


def test_gpt_is_causal():
    model = randomize(build_gpt(TINY)).eval()
    ids = torch.randint(0, 23, (2, 10), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 6] = (ids[:, 6] + 1) % 23
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)  # the past does not see the future
    assert (a[:, 6:] - b[:, 6:]).abs().amax(-1).min() > 1e-6  # and the change is visible from there on


def test_bert_padding_mask_excludes_padded_keys():
    model = randomize(build_bert(TINY)).eval()
    ids = torch.randint(0, 23, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = padding_mask()
    changed = torch.where(mask == 0, (ids + 5) % 23, ids)  # new ids at padded positions only
    a, b = model((ids, mask)), model((changed, mask))
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=0, rtol=0)
    # without the mask the same change does reach the other tokens (bidirectional attention)
    full = torch.ones_like(mask)
    assert (model((ids, full))[real] - model((changed, full))[real]).abs().max() > 1e-6


def test_bert_activations_carry_the_mask_and_an_all_padding_row_stays_finite():
    model = build_bert(TINY)
    ids = torch.full((2, 5), 3)
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1] = 0
    x = (ids, mask)
    for block in list(model)[:-1]:
        x = block(x)
        assert isinstance(x, tuple) and x[1] is mask and x[0].dtype == torch.float32
    logits = model[-1](x)
    assert logits.shape == (2, 5, TINY.vocab_size) and torch.isfinite(logits).all()


# ---------------------------------------------------------------- tied embedding


@pytest.mark.parametrize("build", [build_gpt, build_bert])
def test_head_weight_is_the_embedding_weight(build):
    model = build(TINY)
    assert model[-1].weight is model[0].token.weight
    model.double()  # dtype conversion keeps one parameter object
    assert model[-1].weight is model[0].token.weight
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    assert count_parameters(model) == sum(p.numel() for p in unique.values())
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    n_all = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert n_all - count_parameters(model) == TINY.vocab_size * TINY.d_model  # counted once, not twice


def test_tied_gradient_is_the_sum_of_embedding_and_head_contributions():
    """What the pipeline strategy does across stages: sum the two blocks' gradients."""
    model = randomize(build_gpt(TINY))
    ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(0))
    w = model[0].token.weight
    loss = model(ids).square().mean()
    (g_tied,) = torch.autograd.grad(loss, w)

    # untie: the embedding and the head use two copies of the weight
    w_emb = w.detach().clone().requires_grad_()
    w_head = w.detach().clone().requires_grad_()
    h = F.embedding(ids, w_emb) + model[0].position(torch.arange(6))
    for block in list(model)[1:-1]:
        h = block(h)
    loss2 = F.linear(model[-1].ln(h), w_head).square().mean()
    g_emb, g_head = torch.autograd.grad(loss2, [w_emb, w_head])
    torch.testing.assert_close(g_tied, g_emb + g_head, atol=TOL, rtol=0)


def test_training_step_updates_the_tied_weight_once():
    torch.manual_seed(0)
    lit = CausalLM(TINY, lr=1e-2)
    emb, head = lit.model[0].token.weight, lit.model[-1].weight
    before = emb.detach().clone()
    opt = lit.configure_optimizers()["optimizer"]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(lit.parameters()))
    ids = torch.randint(0, 23, (2, 6))
    loss = lit._loss((ids, ids.roll(-1, 1)))
    loss.backward()
    opt.step()
    assert lit.model[-1].weight is lit.model[0].token.weight
    assert not torch.equal(emb, before)
    torch.testing.assert_close(head, emb, atol=0, rtol=0)


# ---------------------------------------------------------------- recomputation


@pytest.mark.parametrize("build", [build_gpt, build_bert])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_gives_the_same_loss_and_gradients_bit_for_bit(build, dropout):
    """Recomputation replays the forward (dropout masks included: checkpoint restores the RNG
    state), so the loss and every gradient are identical, not merely close."""
    losses, grads = {}, {}
    for recompute in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**TINY.__dict__, "dropout": dropout, "recompute": recompute})
        model = build(cfg).double().train()
        assert all(b.recompute == recompute for b in list(model)[1:-1])
        ids = torch.randint(0, 23, (3, 7), generator=torch.Generator().manual_seed(1))
        inputs = ids if build is build_gpt else (ids, padding_mask())
        torch.manual_seed(123)  # the same dropout masks in both runs
        out = model(inputs)
        if dropout:  # dropout does act here, so the comparison covers replayed masks
            with torch.no_grad():
                assert not torch.equal(out, model.eval()(inputs))
            model.train()
        loss = out.square().mean()
        loss.backward()
        losses[recompute] = loss.detach()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(losses[True], losses[False])
    for name, g in grads[False].items():
        assert g.abs().sum() > 0, name  # every parameter takes part
        torch.testing.assert_close(grads[True][name], g, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------- registry

PAPER_MILLIONS = {"gpt2-345m": 345, "gpt2-762m": 762, "gpt2-1.3b": 1314, "bert-large": 340}  # AutoPipe Table I


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_registry_builds_on_meta_with_paper_sizes(name):
    cfg = get_model_config(name)
    build = build_bert if name.startswith("bert") else build_gpt
    with torch.device("meta"):
        model = build(cfg)
    assert len(model) == 2 * cfg.n_layer + 2
    assert isinstance(model[1], ResidualAttentionBlock) and isinstance(model[2], ResidualFFNBlock)
    assert model[-1].weight is model[0].token.weight
    assert all(p.is_meta for p in model.parameters())
    n = count_parameters(model)
    if name in PAPER_MILLIONS:
        assert abs(n / 1e6 - PAPER_MILLIONS[name]) <= 0.05 * PAPER_MILLIONS[name], n
    else:
        assert cfg.vocab_size == BYTE_VOCAB_SIZE and PAD_ID == 256


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model name 'gpt5'.*gpt2-345m.*bert-tiny"):
        get_model_config("gpt5")
    with pytest.raises(ValueError, match="allowed names"):
        CausalLM("gpt5")


def test_config_overrides_and_validation():
    assert get_model_config("gpt-tiny", recompute=True).recompute
    assert not MODEL_CONFIGS["gpt-tiny"].recompute
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=10, n_layer=1, n_head=3, d_model=8, max_seq_len=4)


def test_sequence_longer_than_positions_is_refused():
    with pytest.raises(ValueError, match="max_seq_len=12"):
        build_gpt(TINY)(torch.zeros(1, 13, dtype=torch.int64))


# ---------------------------------------------------------------- LightningModules


def test_warmup_cosine_schedule():
    f = lambda s: warmup_cosine(s, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and abs(f(9) - 0.55) < 1e-12 and abs(f(14) - 0.1) < 1e-12 and abs(f(100) - 0.1) < 1e-12
    assert warmup_cosine(50, 0, None, 0.1) == 1.0


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_module_holds_only_the_pipeline(cls):
    lit = cls()
    path, pipeline = find_pipeline(lit)
    assert path == "model" and pipeline is lit.model
    check_no_outside_parameters(lit, path)
    assert lit.hparams.model == cls.default_model


def lm_batches(n=2, B=4, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 256, (n * B, T + 1), generator=g)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=B)


def mlm_batches(n=2, B=4, T=16, masked=3, seed=0):
    """Every sample has exactly `masked` predicted positions (see MaskedLM's docstring)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n * B, T), generator=g)
    mask = torch.ones(n * B, T, dtype=torch.int64)
    mask[::2, T - 4 :] = 0
    ids[mask == 0] = PAD_ID
    labels = torch.full((n * B, T), -100)
    for b in range(n * B):
        pos = torch.randperm(int(mask[b].sum()), generator=g)[:masked]
        labels[b, pos] = ids[b, pos]
        ids[b, pos] = MASK_ID
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=B)


def fit_fast(lit, batches):
    trainer = L.Trainer(
        fast_dev_run=True, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(lit, batches, batches)
    return trainer


def causal_lm_loss_by_hand(logits, targets):
    """Mean over all tokens of -log softmax(logits)[target]."""
    logp = logits.double().log_softmax(-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).mean()


def masked_lm_loss_and_accuracy_by_hand(logits, labels):
    """Mean of -log softmax(logits)[label] and of argmax == label over the labelled positions only."""
    rows, cols = (labels != -100).nonzero(as_tuple=True)
    picked, target = logits.double()[rows, cols], labels[rows, cols]
    loss = -picked.log_softmax(-1).gather(-1, target.unsqueeze(-1)).mean()
    return loss, (picked.argmax(-1) == target).double().mean()


def test_causal_lm_trains_with_a_lightning_trainer():
    torch.manual_seed(0)
    lit = CausalLM("gpt-tiny", lr=1e-3, warmup_steps=2, max_steps=10)
    before = lit.model[0].token.weight.detach().clone()
    trainer = fit_fast(lit, lm_batches())
    m = trainer.callback_metrics
    assert abs(m["train_loss"].item() - math.log(BYTE_VOCAB_SIZE)) < 1.0  # about uniform at init
    assert lit.model[-1].weight is lit.model[0].token.weight
    assert not torch.equal(lit.model[0].token.weight, before)
    # fast_dev_run: one training step, then validation on the first batch with the updated weights
    ids, targets = next(iter(lm_batches()))
    lit.eval()
    with torch.no_grad():
        logits = lit.model(ids)
    torch.testing.assert_close(m["val_loss"].double(), causal_lm_loss_by_hand(logits, targets), atol=1e-5, rtol=0)
    torch.testing.assert_close(m["val_ppl"], m["val_loss"].exp())
    # prediction is the model's logits for the batch's inputs
    predicted = trainer.predict(lit, lm_batches())[0]
    torch.testing.assert_close(predicted, logits, atol=0, rtol=0)


def test_masked_lm_trains_with_a_lightning_trainer():
    torch.manual_seed(0)
    lit = MaskedLM(get_model_config("bert-tiny", recompute=True), lr=1e-3)
    before = lit.model[0].token.weight.detach().clone()
    trainer = fit_fast(lit, mlm_batches())
    m = trainer.callback_metrics
    assert isinstance(lit.hparams.model, dict) and lit.hparams.model["recompute"]
    assert not torch.equal(lit.model[0].token.weight, before)
    # validation = the masked-token loss and accuracy of the first batch, computed here by hand
    ids, mask, labels = next(iter(mlm_batches()))
    lit.eval()
    with torch.no_grad():
        logits = lit.model((ids, mask))
    loss, acc = masked_lm_loss_and_accuracy_by_hand(logits, labels)
    torch.testing.assert_close(m["val_loss"].double(), loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(m["val_acc"].double(), acc, atol=1e-6, rtol=0)
    torch.testing.assert_close(m["val_ppl"], m["val_loss"].exp())  # over the labelled positions only
    predicted = trainer.predict(lit, mlm_batches())[0]
    torch.testing.assert_close(predicted, logits, atol=0, rtol=0)


def test_masked_lm_loss_counts_only_the_predicted_positions():
    """BERT's loss: cross-entropy at the labelled (masked) positions only; the logits elsewhere get
    no gradient, and the mean is over predicted positions, not over all tokens."""
    torch.manual_seed(0)
    lit = MaskedLM(TINY).double()
    ids, mask, labels = next(iter(mlm_batches(n=1, B=4, T=10)))
    ids = ids % TINY.vocab_size
    labels = torch.where(labels == -100, labels, labels % TINY.vocab_size)
    loss, logits, _ = lit._forward((ids, mask, labels))
    torch.testing.assert_close(loss, masked_lm_loss_and_accuracy_by_hand(logits, labels)[0], atol=TOL, rtol=0)
    (grad,) = torch.autograd.grad(loss, logits)
    predicted = labels != -100
    assert int(predicted.sum()) == 4 * 3
    assert bool((grad[~predicted] == 0).all()) and bool((grad[predicted].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_a_few_optimizer_steps_reduce_the_loss_on_a_fixed_batch(cls):
    """The module's own optimizer (AdamW, parameter groups, schedule) learns: 8 steps on one batch
    lower its loss by a clear margin, step after step."""
    torch.manual_seed(0)
    lit = cls(TINY, lr=1e-2)
    opts = lit.configure_optimizers()
    opt, sched = opts["optimizer"], opts["lr_scheduler"]["scheduler"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY.vocab_size - 2, (4, 10), generator=g)
    if cls is CausalLM:
        batch = (ids, ids.roll(-1, 1))
    else:
        labels = torch.full_like(ids, -100)
        labels[:, [1, 4, 7]] = ids[:, [1, 4, 7]]
        batch = (ids.index_fill(1, torch.tensor([1, 4, 7]), TINY.vocab_size - 1), torch.ones_like(ids), labels)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = lit._loss(batch) if cls is CausalLM else lit._forward(batch)[0]
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3, losses


def test_masked_lm_loss_is_the_mean_over_samples_when_counts_are_equal():
    """The micro-batching assumption: with equal predicted positions per sample, the token mean of
    the whole batch equals the sample-weighted mean of micro-batch losses."""
    torch.manual_seed(0)
    lit = MaskedLM(TINY).double()
    ids, mask, labels = next(iter(mlm_batches(n=1, B=6, T=10)))
    ids = ids % TINY.vocab_size
    labels = torch.where(labels == -100, labels, labels % TINY.vocab_size)
    full = lit._forward((ids, mask, labels))[0]
    parts = [lit._forward((ids[s], mask[s], labels[s]))[0] * 2 / 6 for s in (slice(0, 2), slice(2, 4), slice(4, 6))]
    torch.testing.assert_close(sum(parts), full, atol=TOL, rtol=0)


def test_checkpoint_round_trip_keeps_config_and_tying(tmp_path):
    torch.manual_seed(0)
    lit = CausalLM(TINY, lr=2e-3)
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = DataLoader(TensorDataset(torch.randint(0, 23, (2, 5)), torch.randint(0, 23, (2, 5))), batch_size=2)
    trainer.fit(lit, data)
    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)
    loaded = CausalLM.load_from_checkpoint(path)
    assert loaded.config == TINY and loaded.hparams.lr == 2e-3
    assert loaded.model[-1].weight is loaded.model[0].token.weight
    for (n, a), b in zip(lit.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("cls,name", [(CausalLM, "gpt-tiny"), (MaskedLM, "bert-tiny")])
def test_hyperparameters_of_a_config_object_save_as_yaml(tmp_path, cls, name):
    # what a logger does with them (CSVLogger writes hparams.yaml): a ModelConfig (a frozen dataclass)
    # must have become a plain dict in every __init__ frame save_hyperparameters reads
    from lightning.pytorch.core.saving import save_hparams_to_yaml

    module = cls(get_model_config(name))
    save_hparams_to_yaml(tmp_path / "hparams.yaml", module.hparams)
    assert isinstance(module.hparams.model, dict) and "n_layer" in (tmp_path / "hparams.yaml").read_text()
