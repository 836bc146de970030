"""The workloads of bench/_models.py: their per-step shapes and argument checks on any machine,
and, where PyTorch and transformers are installed, the new workloads' code paths on the CPU at
a tiny size (the GPU runs are bench/real_models.py's and bench/record_trace.py's)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))

import _models  # noqa: E402


def test_shapes_are_drawn_step_by_step_so_a_short_run_is_a_long_runs_start():
    long = _models.batch_shapes(24, (2, 4, 8), (256, 2048))
    assert _models.batch_shapes(12, (2, 4, 8), (256, 2048)) == long[:12]
    assert {b for b, _ in long} <= {2, 4, 8} and len({b for b, _ in long}) > 1
    assert all(256 <= n <= 2048 for _, n in long) and len({n for _, n in long}) > 12
    triples = _models.batch_shapes(5, *_models.GENERATE)
    assert all(len(t) == 3 and 64 <= t[1] <= 512 and 16 <= t[2] <= 48 for t in triples)
    assert len(_models.batch_shapes(0, (1,), (1, 1))) == 1


def test_every_model_has_a_description_and_the_defaults_are_the_first_five():
    assert set(_models.DESCRIPTIONS) == set(_models.MODELS)
    assert _models.DEFAULT_MODELS == ("resnet50", "gpt2", "gpt2-varlen", "vit", "bert-varlen")


@pytest.mark.parametrize("name, tiny, message", [("nope", False, "unknown model 'nope'"),
                                                 ("resnet50", True, "no tiny form")])
def test_make_refuses_unknown_models_and_tiny_forms_it_lacks(name, tiny, message):
    with pytest.raises(ValueError, match=message):
        _models.make(name, 3, device="cpu", tiny=tiny)


@pytest.mark.parametrize("name", ["gpt2-ckpt", "llama-ckpt", "gpt2-generate"])
def test_tiny_workloads_run_on_the_cpu_and_repeat_exactly(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    work = _models.make(name, 3, device="cpu", tiny=True)
    phases = []
    first = [float(_models.step(work, i, on_phase=phases.append)) for i in range(3)]
    again = _models.make(name, 3, device="cpu", tiny=True)
    assert first == [float(_models.step(again, i)) for i in range(3)]
    if name == "gpt2-generate":
        assert work.optimizer is None and phases == ["forward"] * 3
        assert work.model.dtype == torch.bfloat16
        prompt, new = work.batch(0)
        assert (prompt.shape[0], prompt.shape[1], new) == _models.batch_shapes(
            3, *_models.TINY_GENERATE)[0]
    else:
        assert phases == ["forward", "backward"] * 3
        assert work.model.is_gradient_checkpointing and work.autocast == torch.bfloat16
        assert tuple(work.batch(1).shape) == _models.batch_shapes(
            3, *_models.TINY_CHECKPOINTED[:1], _models.TINY_CHECKPOINTED[1:])[1]
