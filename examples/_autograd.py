"""A tiny reverse-mode autograd, an MLP and SGD on it, for NumPy or CuPy arrays.

Shared by ``examples/train_digits.py`` and ``bench/region_memory.py``. It is written the way
Python autograd engines are, on purpose: every result node keeps its parents and a backward
closure that refers back to the node, so a training step's graph (its activations) is a
reference cycle that only Python's cyclic garbage collector frees, and the device memory it
holds waits with it. That is the memory behaviour both programs show; do not break the cycle.

An op finds the array module (``numpy`` or ``cupy``) from its operands' arrays, as
``cupy.get_array_module`` does; CuPy is never imported here.
"""

import sys

import numpy as np


def array_module(array):
    """``cupy`` for a CuPy array, else ``numpy``; CuPy is not imported if it is not yet.

    Parameters
    ----------
    array : numpy.ndarray or cupy.ndarray

    Notes
    -----
    Follows ``cupy.get_array_module``; where CuPy was never imported no CuPy array can exist.
    """
    cupy = sys.modules.get("cupy")
    return np if cupy is None else cupy.get_array_module(array)


class Tensor:
    """A node of the graph: an array, its gradient, its parents and how to pass gradients on.

    Parameters
    ----------
    data : numpy.ndarray or cupy.ndarray
        The value; kept, not copied.
    parents : tuple of Tensor
        The nodes ``data`` was computed from (empty for a leaf).
    requires_grad : bool
        Whether ``backward`` fills ``.grad``; a node whose parent requires it does too.
    """

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "__weakref__")

    def __init__(self, data, parents=(), requires_grad=False):
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad or any(p.requires_grad for p in parents)
        self._parents = parents
        self._backward = None

    def __matmul__(self, other):
        return matmul(self, other)

    def __add__(self, other):
        return add(self, other)

    def backward(self, keep_grads=False):
        """Fill ``.grad`` of every leaf that requires it, from this (scalar) node back.

        Parameters
        ----------
        keep_grads : bool
            Leave every node's gradient in place. By default a node's gradient is dropped once
            it has been passed on to the node's parents, as an autograd engine does: only the
            leaves keep theirs, while the activations stay in the graph until it is collected.
        """
        self.grad = array_module(self.data).ones_like(self.data)
        for node in reversed(_topological_order(self)):
            if node._backward is not None and node.grad is not None:
                node._backward()
                if not keep_grads:
                    node.grad = None


def _topological_order(root):
    """Nodes reachable from root, each after all of its parents."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, parents_done = stack.pop()
        if parents_done:
            order.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((parent, False) for parent in node._parents)
    return order


def _accumulate(node, grad):
    if node.requires_grad:
        node.grad = grad if node.grad is None else node.grad + grad


def _unbroadcast(grad, shape):
    """Sum grad over the axes that broadcasting added or stretched to reach it from shape."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


# Each op's _backward closure refers to `out`, the node that holds it: the cycle every Python
# autograd engine makes, and the reason a step's memory waits for the cyclic collector.


def matmul(a, b):
    """``a @ b`` of two Tensors of 2-D arrays."""
    out = Tensor(a.data @ b.data, (a, b))

    def _backward():
        if a.requires_grad:
            _accumulate(a, out.grad @ b.data.T)
        if b.requires_grad:
            _accumulate(b, a.data.T @ out.grad)

    out._backward = _backward
    return out


def add(a, b):
    """``a + b`` of two Tensors, with NumPy broadcasting (a bias row added to every row)."""
    out = Tensor(a.data + b.data, (a, b))

    def _backward():
        _accumulate(a, _unbroadcast(out.grad, a.data.shape))
        _accumulate(b, _unbroadcast(out.grad, b.data.shape))

    out._backward = _backward
    return out


def relu(x):
    """``max(x, 0)`` elementwise."""
    out = Tensor(array_module(x.data).maximum(x.data, 0), (x,))

    def _backward():
        _accumulate(x, out.grad * (x.data > 0))

    out._backward = _backward
    return out


def softmax_cross_entropy(logits, labels):
    """Per-row ``-log softmax(logits)[label]``; the row maximum is subtracted first, for stability.

    Parameters
    ----------
    logits : Tensor
        A 2-D array, one row per example.
    labels : numpy.ndarray or cupy.ndarray
        Integer class indices, one per row of ``logits``, of the same array module.
    """
    xp = array_module(logits.data)
    rows = xp.arange(labels.shape[0])
    shifted = logits.data - logits.data.max(axis=1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    out = Tensor(-log_probs[rows, labels], (logits,))

    def _backward():
        grad = xp.exp(log_probs)
        grad[rows, labels] -= 1
        _accumulate(logits, grad * out.grad[:, None])

    out._backward = _backward
    return out


def mean(x):
    """The mean of all elements of x, a 0-d Tensor."""
    xp = array_module(x.data)
    out = Tensor(x.data.mean(), (x,))

    def _backward():
        _accumulate(x, xp.ones_like(x.data) * (out.grad / x.data.size))

    out._backward = _backward
    return out


# --- model and optimizer -------------------------------------------------------------------------


class MLP:
    """Dense layers with a ReLU between them, He-initialised from a NumPy RandomState (float32).

    Parameters
    ----------
    sizes : sequence of int
        Widths from input to output: ``(64, 128, 10)`` is two layers, 64 -> 128 -> 10.
    rng : numpy.random.RandomState
        Draws each layer's weights in turn (biases start at 0).
    xp : module
        ``numpy`` or ``cupy``: where the parameters live.
    """

    def __init__(self, sizes, rng, xp=np):
        self.layers = [
            (
                _parameter(rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in), xp),
                _parameter(np.zeros(n_out), xp),
            )
            for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)
        ]

    def parameters(self):
        """The weight and bias Tensors, layer by layer."""
        return [p for layer in self.layers for p in layer]

    def __call__(self, x):
        """The output Tensor for the input Tensor x (rows are examples); builds the graph."""
        return self._forward(x, lambda h, w, b: h @ w + b, relu)

    def predict(self, x):
        """Class indices (the largest output) for the rows of array x; builds no graph."""
        xp = array_module(x)
        logits = self._forward(x, lambda h, w, b: h @ w.data + b.data, lambda h: xp.maximum(h, 0))
        return logits.argmax(axis=1)

    def _forward(self, h, dense, activation):
        last = len(self.layers) - 1
        for i, (weight, bias) in enumerate(self.layers):
            h = dense(h, weight, bias)
            if i < last:
                h = activation(h)
        return h


def _parameter(host_array, xp):
    return Tensor(xp.asarray(host_array.astype(np.float32)), requires_grad=True)


def sgd_update(parameters, lr, weight_decay=0.0):
    """Plain SGD, in place, unfused (each expression makes a temporary); drops the gradients.

    Parameters
    ----------
    parameters : iterable of Tensor
        Each with ``.grad`` filled by ``backward``.
    lr : float
        The learning rate.
    weight_decay : float
        L2 weight decay: the step is ``grad + weight_decay * data``.

    Notes
    -----
    ``data`` is updated in place, so a parameter keeps the buffer it got before training, and
    ``grad`` is set to None, so that no buffer of the step outlives it outside the cycles.
    """
    for p in parameters:
        step = p.grad + weight_decay * p.data if weight_decay else p.grad
        p.data -= lr * step
        p.grad = None
