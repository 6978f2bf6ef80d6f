import pytest
import torch

from qbench.engine.sampling import SamplingParams, filter_probs, make_generator, sample_token
from qbench.errors import QBenchError


def test_top_p_one_short_circuits_even_when_float32_cumsum_ends_below_one():
    # a peaked distribution over a large vocabulary: the float32 cumulative sum ends below 1.0
    logits = torch.full((128_256,), -4.0)
    logits[0] = 8.0
    p32 = torch.softmax(logits, -1)
    assert torch.cumsum(p32, 0)[-1] < 1.0  # the seeds' trap
    probs = torch.softmax(logits.double(), -1)
    assert torch.equal(filter_probs(probs, 0, 1.0), probs)


def test_temperature_zero_is_greedy_and_ignores_the_generator():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    g = make_generator(0)
    state = g.get_state()
    assert sample_token(logits, SamplingParams(temperature=0.0, top_p=0.5), g) == 1
    assert torch.equal(g.get_state(), state)


def test_top_p_keeps_tokens_tied_with_the_cutoff_together():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    out = filter_probs(probs, 0, 0.5)  # cutoff lands on a 0.2 that ties with two others
    assert (out > 0).tolist() == [True, True, True, True]
    probs = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64)
    out = filter_probs(probs, 0, 0.7)
    assert (out > 0).tolist() == [True, True, False, False]
    assert out.sum().item() == pytest.approx(1.0)


def test_top_k_keeps_ties_with_the_kth_token():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.15], dtype=torch.float64)
    assert (filter_probs(probs, 3, 1.0) > 0).tolist() == [True, True, True, True]
    assert (filter_probs(probs, 2, 1.0) > 0).tolist() == [True, True, False, False]


def test_sampling_is_reproducible_per_seed_and_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    sp = SamplingParams(temperature=1.0, seed=3)
    a = [sample_token(logits, sp, g) for g in [make_generator(3)] for _ in range(50)]
    b = [sample_token(logits, sp, g) for g in [make_generator(3)] for _ in range(50)]
    assert a == b
    g = make_generator(0)
    draws = torch.tensor([sample_token(logits, sp, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), atol=0.03)
    g = make_generator(0)
    assert {sample_token(logits, SamplingParams(temperature=1.0, top_k=1), g) for _ in range(50)} == {0}


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"top_k": 2.5}, {"max_new_tokens": 0}, {"seed": -1}, {"stop": ("",)},
])
def test_invalid_parameters_are_refused_with_the_field_named(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(QBenchError, match=f"invalid sampling parameter {name}="):
        SamplingParams(**kwargs)
