"""Sub-layer cuts of a traced model's blocks: each block as its attention half and its MLP half where
the block verifies the cut, in one process against the model itself (forward and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import UserLM, loader

from lightning_pipe.frontend import convert, trace
from lightning_pipe.runtime.call import Call

pytest.importorskip("transformers")


def chained(pipeline, call):
    """The pipeline's blocks one after the other, each on a fresh leaf as a stage receives it."""
    x = call
    for block in pipeline:
        if isinstance(x, tuple):
            x = tuple(t.detach().requires_grad_(t.requires_grad) for t in x)
        x = block(x)
    return x


def loss_and_grads(module, batch):
    """The step's loss and every parameter's gradient by its name in the model's state dict."""
    module.zero_grad()
    loss = module.training_step(batch, 0)
    loss.backward()
    named = {id(p): n for n, p in module.state_dict(keep_vars=True).items()}  # the model's own names, also when cut
    return loss.detach(), {named[id(p)]: p.grad.clone() for p in module.parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "kind,child,halves",
    [
        ("gpt2", "ln_2", ["ln_1", "attn"]),
        ("llama", "post_attention_layernorm", ["input_layernorm", "self_attn"]),
        ("bert", "intermediate", ["attention"]),
    ],
)
def test_blocks_cut_in_halves_compute_the_model(kind, child, halves):
    torch.manual_seed(0)
    ref = UserLM(kind, 3)
    module = copy.deepcopy(ref)
    batch = next(iter(loader(4)))
    path, pipeline = convert(module)
    trace(module, path, pipeline, batch)
    assert pipeline.frontend.halves.cut.child == child
    assert len(pipeline) == 2 * 3 + 2
    assert sorted(n.rsplit("/", 1)[1] for n in pipeline[1]._modules) == sorted(halves)
    want_loss, want = loss_and_grads(ref, batch)
    # the pipeline's blocks one by one (what the stages run), from the step's own call of the model
    got_loss, got = loss_and_grads(module, batch)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-12, atol=1e-14), name


def test_a_block_whose_later_code_reads_its_input_again_stays_whole():
    # the looped model's Residual: h + gelu(mix(norm(h))) reads h after its last child; a cut before
    # `mix` passes every shape check but not the run on block 0's call, so the blocks stay whole
    torch.manual_seed(0)
    module = UserLM("looped", 3)
    batch = next(iter(loader(4)))
    path, pipeline = convert(module)
    trace(module, path, pipeline, batch)
    assert pipeline.frontend.halves is None and len(pipeline) == 3 + 2


def test_sublayers_off_keeps_whole_blocks():
    torch.manual_seed(0)
    module = UserLM("gpt2", 3)
    path, pipeline = convert(module)
    trace(module, path, pipeline, next(iter(loader(4))), sublayers=False)
    assert pipeline.frontend.halves is None and len(pipeline) == 3 + 2


def test_the_chain_of_halves_equals_the_model():
    torch.manual_seed(0)
    ref = UserLM("llama", 3)
    module = copy.deepcopy(ref)
    batch = next(iter(loader(4)))
    path, pipeline = convert(module)
    trace(module, path, pipeline, batch)
    ids = batch["ids"]
    out = chained(pipeline, Call((), {"input_ids": ids, "labels": ids}))
    assert torch.equal(out.loss, ref.model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize(
    "kind,child", [("gpt2", "ln_2"), ("llama", "post_attention_layernorm"), ("bert", "intermediate"), ("looped", None)]
)
def test_a_model_created_empty_is_cut_alike(kind, child):
    # its trace runs on zeros: the halves are checked on a copy of block 0 with values and a random input
    with torch.device("meta"):
        module = UserLM(kind, 3)
    path, pipeline = convert(module)
    trace(module, path, pipeline, next(iter(loader(4))))
    halves = pipeline.frontend.halves
    assert (halves.cut.child if halves is not None else None) == child
