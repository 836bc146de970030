"""examples/_autograd.py on NumPy: gradients, the reference cycles of a step, SGD; its two users."""

import gc
import importlib.util
import weakref
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "examples_autograd", REPO / "examples" / "_autograd.py"
)
autograd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(autograd)


def _problem(sizes=(5, 7, 4), rows=6, seed=0):
    """A float64 MLP (for finite differences), inputs and labels."""
    rng = np.random.RandomState(seed)
    model = autograd.MLP(sizes, rng)
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    x = rng.standard_normal((rows, sizes[0]))
    labels = rng.randint(0, sizes[-1], size=rows)
    return model, x, labels


def _loss(model, x, labels):
    return autograd.mean(autograd.softmax_cross_entropy(model(autograd.Tensor(x)), labels))


def test_array_module_of_a_numpy_array_is_numpy():
    assert autograd.array_module(np.zeros(3)) is np


def test_mlp_gradients_match_central_differences():
    model, x, labels = _problem()
    _loss(model, x, labels).backward()
    eps = 1e-6
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.data.shape
        numeric = np.empty_like(p.data)
        for index in np.ndindex(p.data.shape):
            saved = p.data[index]
            p.data[index] = saved + eps
            up = float(_loss(model, x, labels).data)
            p.data[index] = saved - eps
            down = float(_loss(model, x, labels).data)
            p.data[index] = saved
            numeric[index] = (up - down) / (2 * eps)
        np.testing.assert_allclose(p.grad, numeric, rtol=1e-5, atol=1e-8)


def test_loss_and_logits_match_a_direct_computation():
    model, x, labels = _problem()
    (w1, b1), (w2, b2) = [(w.data, b.data) for w, b in model.layers]
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    expected = -log_probs[np.arange(len(labels)), labels].mean()
    assert float(_loss(model, x, labels).data) == pytest.approx(expected, rel=1e-12)
    np.testing.assert_array_equal(model.predict(x), logits.argmax(axis=1))


def test_backward_drops_passed_on_gradients_unless_kept():
    model, x, labels = _problem()
    hidden = model(autograd.Tensor(x))
    loss = autograd.mean(autograd.softmax_cross_entropy(hidden, labels))
    loss.backward()
    assert hidden.grad is None and loss.grad is None
    assert all(p.grad is not None for p in model.parameters())

    kept_model, x, labels = _problem()
    hidden = kept_model(autograd.Tensor(x))
    loss = autograd.mean(autograd.softmax_cross_entropy(hidden, labels))
    loss.backward(keep_grads=True)
    assert hidden.grad is not None and hidden.grad.shape == hidden.data.shape
    for kept, dropped in zip(kept_model.parameters(), model.parameters(), strict=True):
        np.testing.assert_array_equal(kept.grad, dropped.grad)


def test_sgd_update_with_weight_decay_is_in_place_and_drops_the_gradient():
    model, x, labels = _problem()
    _loss(model, x, labels).backward()
    params = model.parameters()
    buffers = [p.data for p in params]
    expected = [p.data - 0.1 * (p.grad + 0.01 * p.data) for p in params]
    autograd.sgd_update(params, 0.1, weight_decay=0.01)
    for p, buffer, want in zip(params, buffers, expected, strict=True):
        assert p.data is buffer and p.grad is None
        np.testing.assert_allclose(p.data, want, rtol=1e-12)


def _step(model, x, labels, refs):
    loss = _loss(model, x, labels)
    refs.append(weakref.ref(loss))
    refs.append(weakref.ref(loss._parents[0]))  # the per-row losses
    loss.backward()
    autograd.sgd_update(model.parameters(), 0.1)


def test_a_training_step_leaves_its_graph_in_reference_cycles():
    model, x, labels = _problem()
    refs = []
    gc.collect()
    gc.disable()
    try:
        _step(model, x, labels, refs)
        # Nothing outside refers to the graph, yet reference counting cannot free it.
        assert all(ref() is not None for ref in refs)
        assert gc.collect() > 0
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


OPS = {
    "matmul": lambda a, b, labels: autograd.matmul(a, b),
    "add": lambda a, b, labels: autograd.add(a, b),
    "relu": lambda a, b, labels: autograd.relu(a),
    "softmax_cross_entropy": lambda a, b, labels: autograd.softmax_cross_entropy(a, labels),
    "mean": lambda a, b, labels: autograd.mean(a),
}


@pytest.mark.parametrize("op", OPS)
def test_every_op_result_is_in_a_cycle_with_its_backward(op):
    a = autograd.Tensor(np.ones((3, 3)), requires_grad=True)
    b = autograd.Tensor(np.ones((3, 3)), requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(OPS[op](a, b, np.zeros(3, dtype=np.int64)))
        assert ref() is not None
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()


def test_training_lowers_the_loss():
    model, x, labels = _problem()
    first = float(_loss(model, x, labels).data)
    for _ in range(50):
        _step(model, x, labels, [])
    assert float(_loss(model, x, labels).data) < 0.5 * first


def test_bench_region_memory_imports_it_and_prints_help(run_script):
    proc, output = run_script("bench/region_memory.py", "--help", timeout=120)
    assert proc.returncode == 0, output
    assert "--steps" in proc.stdout and "--gc-steps" in proc.stdout
