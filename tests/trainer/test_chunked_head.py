"""Chunked output-layer log-probs equal the full-logits computation, values and gradients,
by torch ops and by the trainer's fused kernels, and no tensor of tokens x vocabulary is kept
for backward."""

import pytest
import torch

from dorarl.trainer.chunked_head import chunked_head_logprobs
from dorarl.trainer.kernels import load_ops
from dorarl.trainer.loss import token_entropy, token_logprobs

needs_kernels = pytest.mark.skipif(load_ops() is None, reason="the kernels did not build here")


def _full(hidden, head, targets, temperature):
    logits = head(hidden)
    return token_logprobs(logits, targets, temperature), token_entropy(logits, temperature)


def _grads(fn, hidden, head, targets, temperature, g_logp, g_entropy):
    hidden = hidden.detach().clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    logp, entropy = fn(hidden, head, targets, temperature)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return logp.detach(), entropy.detach(), grads


FUSED = [False, pytest.param(True, marks=needs_kernels)]


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", FUSED)
def test_chunked_equals_full_logits(chunk, temperature, bias, fused):
    torch.manual_seed(chunk)
    n, hidden_size, vocab = 37, 16, 300
    head = torch.nn.Linear(hidden_size, vocab, bias=bias)
    hidden = torch.randn(n, hidden_size) * 3
    targets = torch.randint(0, vocab, (n,))
    g_logp, g_entropy = torch.randn(n), torch.randn(n)

    def chunked(h, hd, t, temp):
        return chunked_head_logprobs(h, hd, t, temp, chunk_tokens=chunk, fused=fused)

    got = _grads(chunked, hidden, head, targets, temperature, g_logp, g_entropy)
    want = _grads(_full, hidden, head, targets, temperature, g_logp, g_entropy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", FUSED)
def test_logprob_only_gradient_and_no_entropy_gradient(fused):
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    logp, _ = chunked_head_logprobs(hidden, head, targets, 1.0, chunk_tokens=3, fused=fused)
    logp.sum().backward()
    reference = hidden.detach().clone().requires_grad_()
    token_logprobs(head(reference), targets).sum().backward()
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_bfloat16_head_matches_its_full_logits():
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 64, bias=False).to(torch.bfloat16)
    hidden = torch.randn(12, 16, dtype=torch.bfloat16)
    targets = torch.randint(0, 64, (12,))
    logp, entropy = chunked_head_logprobs(hidden, head, targets, 0.9, chunk_tokens=5)
    want_logp, want_entropy = _full(hidden, head, targets, 0.9)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_bad_chunk_size_is_refused():
    head = torch.nn.Linear(4, 8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_head_logprobs(torch.randn(2, 4), head, torch.zeros(2, dtype=torch.long), 1.0, 0)


@pytest.mark.parametrize("fused", FUSED)
def test_entropy_only_gradient_over_a_large_vocabulary_and_far_apart_logits(fused):
    """Entropy alone drives the gradient; logits tens apart, a vocabulary of full 16-float
    vectors and a tail."""
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 4099, bias=False)
    hidden = torch.randn(6, 8) * 8
    targets = torch.randint(0, 4099, (6,))
    g_entropy = torch.randn(6)

    def chunked(h, hd, t, temp):
        return chunked_head_logprobs(h, hd, t, temp, chunk_tokens=4, fused=fused)

    got = _grads(chunked, hidden, head, targets, 1.3, torch.zeros(6), g_entropy)
    want = _grads(_full, hidden, head, targets, 1.3, torch.zeros(6), g_entropy)
    for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", FUSED)
def test_only_hidden_states_and_per_token_values_are_saved_for_backward(fused):
    tokens, hidden_size, vocab = 96, 32, 4000
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = chunked_head_logprobs(hidden, head, targets, 1.0, 16, fused=fused)
    assert sorted(saved) == sorted([tokens * hidden_size, vocab * hidden_size] + [tokens] * 3)
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None
