"""GRPO math against hand-computed values (numbers written out, derivations in comments)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_grpo.algo import (
    aggregate,
    entropy_from_logits,
    forward_kl_from_logits,
    group_advantages,
    grpo_loss,
    kl_estimate,
    mismatch_metrics,
    token_logprobs_from_logits,
)
from omni_grpo.algo.step import MetricSums
from omni_grpo.config import AlgoConfig

LN = math.log
NAN = float("nan")


# ------------------------------------------------------------------------------------- advantages
def test_group_advantages_hand_values() -> None:
    # group 1: mean .5, unbiased std sqrt(4 * .25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 2: constant rewards -> 0 (std 0, eps keeps it finite)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    torch.testing.assert_close(
        a, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0]), atol=1e-5, rtol=0
    )
    # [0, 1, 2]: mean 1, std 1 -> [-1, 0, 1] / (1 + 1e-6)
    torch.testing.assert_close(
        group_advantages(torch.tensor([0.0, 1.0, 2.0]), 3),
        torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6),
    )


def test_dr_grpo_and_n1() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(
        group_advantages(r, 4, std_normalize=False), torch.tensor([[0.5, -0.5, -0.5, 0.5]])
    )
    a1 = group_advantages(torch.tensor([3.0, -1.0]), 1)
    assert torch.equal(a1, torch.zeros(2)) and torch.isfinite(a1).all()


def test_group_advantages_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"\[G, 4\]"):
        group_advantages(torch.zeros(2, 3), 4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=8, max_size=8), st.sampled_from([2, 4, 8]))
def test_advantages_are_centred_and_scaled(vals: list[float], n: int) -> None:
    r = torch.tensor(vals, dtype=torch.float64)
    a = group_advantages(r, n).view(-1, n)
    assert torch.allclose(a.sum(1), torch.zeros(a.shape[0]), atol=1e-4)
    g = r.view(-1, n).float()
    spread = g.std(1) > 1e-2
    assert torch.allclose(a.std(1)[spread], torch.ones(int(spread.sum())), atol=1e-3)


# ---------------------------------------------------------------------------------------------- KL
def test_kl_estimators_hand_values() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.1, -1.8])  # d = [0.1, -0.2]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.1, -0.2]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.005, 0.02]))
    # exp(-0.1) - 1 + 0.1 = 0.0048374180; exp(0.2) - 1 - 0.2 = 0.0214027582
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k3"), torch.tensor([0.0048374180, 0.0214027582])
    )
    torch.testing.assert_close(
        kl_estimate(logp, ref, "low_var_kl"), torch.tensor([0.0048374180, 0.0214027582])
    )
    # d = -20: exp(20) - 21 -> clamped to 10; d = 30: 29 + exp(-30) -> 10
    torch.testing.assert_close(
        kl_estimate(torch.tensor([-20.0, 30.0]), torch.zeros(2), "low_var_kl"),
        torch.tensor([10.0, 10.0]),
    )
    with pytest.raises(ValueError, match="unknown kl_type"):
        kl_estimate(logp, ref, "k4")


# ------------------------------------------------------------------------------ logprobs, entropy
def test_logprobs_and_entropy_hand_values() -> None:
    logits = torch.tensor([[[0.0, LN(3)], [0.0, 0.0]]])  # probs [.25, .75] and [.5, .5]
    lp = token_logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[LN(0.75), LN(0.5)]]))
    # H([.25,.75]) = .25 ln 4 + .75 ln(4/3) = 0.5623351446; H([.5,.5]) = ln 2
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[0.5623351446, LN(2)]]))
    # temperature 2 on [0, ln 9] is [0, ln 3]
    hot = torch.tensor([[0.0, LN(9)]])
    torch.testing.assert_close(
        token_logprobs_from_logits(hot, torch.tensor([0]), temperature=2.0),
        torch.tensor([LN(0.25)]),
    )
    torch.testing.assert_close(
        entropy_from_logits(hot, temperature=2.0), torch.tensor([0.5623351446])
    )


def test_logprobs_alignment_error() -> None:
    with pytest.raises(ValueError, match="not aligned"):
        token_logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(2, 40), st.integers(1, 5), st.floats(0.3, 2.0))
def test_chunked_matches_full_with_grad(n: int, v: int, chunk: int, temp: float) -> None:
    g = torch.Generator().manual_seed(n * 100 + v)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64).requires_grad_()
    tgt = torch.randint(0, v, (n,), generator=g)
    lp = token_logprobs_from_logits(logits, tgt, temp, chunk_rows=chunk, recompute=n % 2 == 0)
    ent = entropy_from_logits(logits, temp, chunk_rows=chunk)
    ref_lsm = torch.log_softmax(logits.float() / temp, -1)
    ref_lp = ref_lsm.gather(-1, tgt[:, None]).squeeze(-1)
    ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (gl,) = torch.autograd.grad((lp.sum() + ent.sum()), logits)
    (gr,) = torch.autograd.grad((ref_lp.sum() + ref_ent.sum()), logits)
    torch.testing.assert_close(gl, gr.to(gl.dtype), atol=1e-5, rtol=1e-4)


def test_forward_kl_hand_values() -> None:
    # ref = (1/2, 1/2), pi = (3/4, 1/4): KL(ref || pi) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    logits = torch.tensor([[LN(3.0), 0.0]], requires_grad=True)
    kl = forward_kl_from_logits(logits, torch.zeros(1, 2))
    assert kl.item() == pytest.approx(0.5 * LN(4 / 3), abs=1e-7)
    # d/dz = softmax(z) - softmax(z_ref) = (1/4, -1/4): bounded, unlike k3's 1 - ref/pi
    kl.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[0.25, -0.25]]))
    # a deterministic policy keeps the full pull towards the reference (k3's sampled gradient
    # on the argmax token fades with 1 - pi)
    sure = torch.tensor([[30.0, 0.0]], requires_grad=True)
    forward_kl_from_logits(sure, torch.zeros(1, 2)).sum().backward()
    torch.testing.assert_close(sure.grad, torch.tensor([[0.5, -0.5]]))
    with pytest.raises(ValueError, match="reference logits"):
        forward_kl_from_logits(torch.zeros(1, 3), torch.zeros(1, 2))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 9), st.integers(2, 40), st.integers(1, 5), st.floats(0.3, 2.0))
def test_forward_kl_chunked_matches_autograd(n: int, v: int, chunk: int, temp: float) -> None:
    g = torch.Generator().manual_seed(n * 100 + v)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref_logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    got = forward_kl_from_logits(logits, ref_logits, temp, chunk_rows=chunk)
    ref_lsm = torch.log_softmax(ref_logits / temp, -1)
    want = (ref_lsm.exp() * (ref_lsm - torch.log_softmax(logits / temp, -1))).sum(-1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    (gg,) = torch.autograd.grad((got * upstream).sum(), logits)
    (gw,) = torch.autograd.grad((want * upstream).sum(), logits)
    torch.testing.assert_close(gg, gw, atol=1e-5, rtol=1e-4)


def test_logprob_gradient_for_any_upstream_grad() -> None:
    """The fused backward against autograd through float64 log_softmax, bf16 logits, chunked."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 7, 300, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    tgt = torch.randint(0, 300, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)
    lp = token_logprobs_from_logits(logits, tgt, 0.7, chunk_rows=3)
    (got,) = torch.autograd.grad((lp * upstream).sum(), logits)
    ref_in = logits.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_in / 0.7, -1).gather(-1, tgt[..., None])[..., 0]
    (want,) = torch.autograd.grad((ref * upstream.double()).sum(), ref_in)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_logprobs_bf16_upcast() -> None:
    logits = torch.tensor([[0.0, LN(3)]], dtype=torch.bfloat16)
    out = token_logprobs_from_logits(logits, torch.tensor([1]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([LN(0.75)]), atol=2e-3, rtol=0)


# ------------------------------------------------------------------------------------ aggregation
def test_aggregate_sequence_vs_token() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, NAN, float("inf")]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # sequence: (mean(1,2,3)=2 + mean(10)=10) / 2 = 6 ; token: (1+2+3+10) / 4 = 4
    assert aggregate(x, m, "sequence").item() == 6.0
    assert aggregate(x, m, "token").item() == 4.0
    # global normalisers for micro-batching: sum of per-sample means / 4 samples, token sum / 8 tokens
    assert aggregate(x, m, "sequence", num_samples=4).item() == 3.0
    assert aggregate(x, m, "token", num_tokens=8).item() == 2.0


# -------------------------------------------------------------------------------------- the loss
def _case() -> dict[str, torch.Tensor]:
    # ratios row 0: [1.5, 0.5, 1.0] with A = +1; row 1: [0.5, 1.5, <pad>] with A = -1
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -2.0, 0.0]])
    logp = old + torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(0.5), LN(1.5), NAN]])
    return {
        "logp": logp.requires_grad_(),
        "old": old,
        "adv": torch.tensor([1.0, -1.0]),
        "mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }


def test_ppo_clip_hand_values_sequence() -> None:
    c = _case()
    loss, met = grpo_loss(c["logp"], c["old"], c["adv"], c["mask"], AlgoConfig(loss_agg="sequence"))
    # per token pg = max(-rA, -clip(r, .8, 1.28)A):
    #   row 0: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); r=.5 -> max(-.5, -.8) = -.5; r=1 -> -1
    #   row 1: r=.5 -> max(.5, .8) = .8 (clipped);         r=1.5 -> max(1.5, 1.28) = 1.5
    # sequence: (-2.78/3 + 2.3/2) / 2 = 0.11166667
    assert loss.item() == pytest.approx(0.11166667, abs=1e-6)
    assert met["pg_loss"] == pytest.approx(0.11166667, abs=1e-6)
    assert met["pg_clipfrac"] == pytest.approx(0.4)
    # ppo_kl = mean(old - logp) = -(2 ln 1.5 + 2 ln .5) / 5 = 0.11507283
    assert met["ppo_kl"] == pytest.approx(0.11507283, abs=1e-6)
    assert met["ois"] == pytest.approx((1.5 + 0.5 + 1 + 0.5 + 1.5) / 5)
    assert met["response_tokens"] == 5
    loss.backward()
    g = c["logp"].grad
    # d/dlogp of -rA/len for unclipped tokens, /2 samples: row0 t1: -.5/3/2; t2: -1/3/2; row1 t1: 1.5/2/2
    expected = torch.tensor([[0.0, -0.5 / 6, -1 / 6], [0.0, 1.5 / 4, 0.0]])
    torch.testing.assert_close(g, expected)


def test_ppo_clip_hand_values_token_and_higher_clip() -> None:
    c = _case()
    loss, _ = grpo_loss(c["logp"], c["old"], c["adv"], c["mask"], AlgoConfig(loss_agg="token"))
    assert loss.item() == pytest.approx((-2.78 + 2.3) / 5, abs=1e-6)  # -0.096
    # symmetric clip 0.2/0.2: row0 t0 -> -1.2 instead of -1.28
    loss_sym, _ = grpo_loss(
        c["logp"], c["old"], c["adv"], c["mask"], AlgoConfig(loss_agg="token", clip_eps_high=0.2)
    )
    assert loss_sym.item() == pytest.approx((-2.7 + 2.3) / 5, abs=1e-6)


def test_dual_clip() -> None:
    # A = -1, ratio 5: pg = max(5, 1.28) = 5, dual clip c=3 caps it at 3; ratio 2 -> 2 < 3 stays
    logp = torch.tensor([[LN(5), LN(2)]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2)
    loss, met = grpo_loss(logp, old, adv, mask, AlgoConfig(dual_clip_c=3.0, loss_agg="token"))
    assert loss.item() == pytest.approx((3 + 2) / 2)
    assert met["pg_dual_clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 2]]))


def test_kl_and_entropy_terms() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.1, -1.8]])
    ent = torch.tensor([[0.5, 1.5]])
    cfg = AlgoConfig(kl_coef=0.1, kl_type="k3", entropy_coef=0.01, loss_agg="token")
    loss, met = grpo_loss(
        logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2), cfg, ref_logp=ref, entropy=ent
    )
    # pg = -A * 1 = -2 per token; kl = mean(0.0048374180, 0.0214027582) = 0.0131200881; ent = 1.0
    assert met["pg_loss"] == pytest.approx(-2.0)
    assert met["kl_loss"] == pytest.approx(0.0131200881, abs=1e-7)
    assert met["entropy_loss"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * 0.0131200881 - 0.01 * 1.0, abs=1e-6)


def test_full_kl_term_is_the_given_per_token_kl() -> None:
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    kl = torch.tensor([[0.2, 0.4, float("nan")]], requires_grad=True)  # masked NaN is harmless
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = AlgoConfig(kl_coef=0.5, kl_type="full", loss_agg="token")
    loss, met = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), mask, cfg, kl=kl)
    assert met["kl_loss"] == pytest.approx(0.3)
    assert loss.item() == pytest.approx(0.15)
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([[0.25, 0.25, 0.0]]))
    with pytest.raises(ValueError, match="kl_type full needs the per-token kl"):
        grpo_loss(logp, logp.detach(), torch.tensor([0.0]), mask, cfg, ref_logp=logp.detach())
    with pytest.raises(ValueError, match="kl_unbiased does not apply"):
        AlgoConfig(kl_type="full", kl_unbiased=True)


def test_unbiased_kl_multiplies_ratio() -> None:
    logp = torch.tensor([[LN(2.0) - 1.0]])  # ratio 2 vs old -1; d to ref (-1) = ln 2
    cfg = AlgoConfig(kl_coef=1.0, kl_type="k1", kl_unbiased=True)
    _, met = grpo_loss(
        logp,
        torch.tensor([[-1.0]]),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        cfg,
        ref_logp=torch.tensor([[-1.0]]),
    )
    assert met["kl_loss"] == pytest.approx(2 * LN(2), abs=1e-6)


def test_missing_inputs_are_named() -> None:
    x, m, a = torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, a, m, AlgoConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(x, x, a, m, AlgoConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logp"):
        grpo_loss(x, x, a, m, AlgoConfig(tis={"enabled": True}))
    with pytest.raises(ValueError, match="rollout_logp"):
        grpo_loss(x, None, a, m, AlgoConfig(use_rollout_logprobs=True))


def test_tis_truncate_and_icepop() -> None:
    # old - rollout = [ln 3, ln .5] -> raw weights [3, .5]; ratio 1 so pg = -A = -1 per token
    old = torch.tensor([[-1.0, -1.0]])
    rollout = old - torch.tensor([[LN(3), LN(0.5)]])
    logp = old.clone().requires_grad_()
    a, m = torch.tensor([1.0]), torch.ones(1, 2)
    tis = {"enabled": True, "clip_low": 0.0, "clip_high": 2.0}
    loss, met = grpo_loss(
        logp, old, a, m, AlgoConfig(tis=tis, loss_agg="token"), rollout_logp=rollout
    )
    # truncate: w = [2, .5] -> loss = (-2 - .5) / 2
    assert loss.item() == pytest.approx(-1.25)
    assert met["tis"] == pytest.approx(1.25) and met["tis_clipfrac"] == 0.5
    assert met["tis_abs"] == pytest.approx((2 + 0.5) / 2)
    loss_ice, met_ice = grpo_loss(
        logp,
        old,
        a,
        m,
        AlgoConfig(tis={**tis, "mode": "icepop"}, loss_agg="token"),
        rollout_logp=rollout,
    )
    # icepop: w = [0, .5] -> loss = -.5 / 2
    assert loss_ice.item() == pytest.approx(-0.25) and met_ice["tis_clipfrac"] == 0.5


def test_use_rollout_logprobs_replaces_old() -> None:
    rollout = torch.tensor([[-1.0]])
    logp = torch.tensor([[-1.0 + LN(1.1)]], requires_grad=True)
    loss, met = grpo_loss(
        logp,
        None,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        AlgoConfig(use_rollout_logprobs=True),
        rollout_logp=rollout,
    )
    assert loss.item() == pytest.approx(-1.1)
    assert "train_rollout_kl" not in met  # old == rollout: mismatch would be trivially 0


def test_nan_on_masked_tokens_is_harmless() -> None:
    logp = torch.tensor([[-1.0, NAN, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("inf"), NAN]])
    m = torch.tensor([[1, 0, 0]])
    cfg = AlgoConfig(kl_coef=0.1, entropy_coef=0.1, tis={"enabled": True})
    loss, met = grpo_loss(
        logp,
        old,
        torch.tensor([1.0]),
        m,
        cfg,
        ref_logp=old,
        rollout_logp=old,
        entropy=torch.tensor([[0.1, NAN, NAN]]),
    )
    assert math.isfinite(loss.item()) and all(
        math.isfinite(v) or k.endswith("pearson") for k, v in met.items()
    )
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1:].eq(0).all()


# ---------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_all_equal_logprobs_give_an_exact_fraction_of_exactly_one(device: str) -> None:
    """Bitwise-equal logprobs report 1.0, not 0.99999994: per micro-batch of any size, and
    through the step's token-weighted :class:`MetricSums` over micro-batches of unequal sizes."""
    gen = torch.Generator().manual_seed(3)
    sums = MetricSums()
    for n in (1, 3, 4097, 5003, 16381, 65537):
        logp = -torch.rand(1, n, generator=gen).to(device)
        mask = torch.ones(1, n, device=device)
        frac = mismatch_metrics(logp, logp.clone(), mask)["train_rollout_logprob_exact_fraction"]
        assert frac.item() == 1.0, n
        sums.add({"train_rollout_logprob_exact_fraction": float(frac.float())}, float(n))
    assert sums.means()["train_rollout_logprob_exact_fraction"] == 1.0


def test_mismatch_metrics_hand_values() -> None:
    train = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
    roll = torch.tensor([[-1.0, -2.5, -2.5, 5.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    met = {k: v.item() for k, v in mismatch_metrics(train, roll, m).items()}
    assert met["train_rollout_logprob_abs_diff"] == pytest.approx((0 + 0.5 + 0.5) / 3)
    assert met["train_rollout_logprob_exact_fraction"] == pytest.approx(1 / 3)  # masked 4th ignored
    # centred train [1, 0, -1], rollout [1, -.5, -.5]: 1.5 / (sqrt 2 * sqrt 1.5) = 0.8660254
    assert met["train_rollout_logprob_pearson"] == pytest.approx(0.8660254, abs=1e-6)
    # ratios exp(train - rollout) = [1, e^.5, e^-.5]; median 1
    assert met["train_rollout_ratio_p50"] == pytest.approx(1.0)
    w = [1.0, math.exp(0.5), math.exp(-0.5)]  # = [1, 1.6487213, 0.6065307]
    assert met["ess_ratio"] == pytest.approx(
        sum(w) ** 2 / (3 * sum(x * x for x in w)), abs=1e-6
    )  # 10.5967 / 12.2585
    assert met["ess_ratio"] == pytest.approx(0.864435, abs=1e-5)
    # low_var_kl(rollout, train): d = rollout - train = [0, -.5, .5]: (0 + e^.5-1.5 + e^-.5-.5)/3
    assert met["train_rollout_kl"] == pytest.approx((0 + 0.1487213 + 0.1065307) / 3, abs=1e-6)
    # p5 / p95 by linear interpolation over the sorted [0.6065, 1, 1.6487]: 0.6065 + .1*(0.3935)
    assert met["train_rollout_ratio_p5"] == pytest.approx(0.6458776, abs=1e-5)
    assert met["train_rollout_ratio_p95"] == pytest.approx(1.0 + 0.9 * 0.6487213, abs=1e-5)


@pytest.mark.parametrize("tokens", [0, 1, 2, 37])
def test_mismatch_metrics_are_those_of_the_selected_tokens(tokens: int) -> None:
    """The masked arithmetic (no host read) gives what the selected tokens give to torch's own
    reductions: means, Pearson, ``torch.quantile``'s linear interpolation, NaN where undefined."""
    gen = torch.Generator().manual_seed(tokens)
    train, roll = -torch.rand(3, 20, generator=gen) * 3, -torch.rand(3, 20, generator=gen) * 3
    roll[0, :4] = train[0, :4]  # some bitwise-equal tokens
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask.view(-1)[torch.randperm(60, generator=gen)[:tokens]] = True
    met = mismatch_metrics(train, roll, mask)
    t, r = train[mask], roll[mask]
    w = torch.exp(t - r)
    if tokens == 0:
        assert all(math.isnan(v) for v in met.values())
        empty = mismatch_metrics(train[:, :0], roll[:, :0], mask[:, :0])  # no positions at all
        assert set(empty) == set(met) and all(math.isnan(v) for v in empty.values())
        return
    qs = torch.quantile(w, torch.tensor([0.05, 0.5, 0.95]))
    want = {
        "train_rollout_logprob_abs_diff": (t - r).abs().mean(),
        "train_rollout_logprob_exact_fraction": (t == r).double().mean(),
        "train_rollout_kl": kl_estimate(r, t, "low_var_kl").mean(),
        "train_rollout_ratio_p5": qs[0],
        "train_rollout_ratio_p50": qs[1],
        "train_rollout_ratio_p95": qs[2],
        "ess_ratio": w.sum() ** 2 / (w.numel() * (w * w).sum()),
    }
    if tokens >= 2:
        a, b = t - t.mean(), r - r.mean()
        want["train_rollout_logprob_pearson"] = (a * b).sum() / (a.norm() * b.norm())
    else:
        assert math.isnan(met["train_rollout_logprob_pearson"])
    for key, value in want.items():
        assert met[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key


def test_mismatch_reported_by_loss() -> None:
    old = torch.tensor([[-1.0, -2.0]])
    roll = torch.tensor([[-1.1, -1.8]])
    _, met = grpo_loss(
        old.clone().requires_grad_(),
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        AlgoConfig(),
        rollout_logp=roll,
    )
    assert met["train_rollout_logprob_abs_diff"] == pytest.approx(0.15)
    # (exp(.1) - 1.1 + exp(-.2) - .8) / 2 = 0.0119508356
    assert met["train_rollout_kl"] == pytest.approx(0.0119508356, abs=1e-7)
    assert met["ess_ratio"] == pytest.approx(0.97831396, abs=1e-6)


def test_bf16_logp_computed_in_float32() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    loss, _ = grpo_loss(logp, old, torch.tensor([0.3]), torch.ones(1, 2), AlgoConfig())
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-0.3)
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16
