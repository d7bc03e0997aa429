"""Notebook 04's exercises: a right answer passes; each classic wrong answer is named."""

from __future__ import annotations

import pytest
import torch

from minillm.exercises import nb04


def _angles(position, head_dim, theta):
    return position * (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def _rope(x, position_ids, theta):
    d = x.shape[-1]
    angles = position_ids.float()[:, None, :, None] * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    angles = torch.cat([angles, angles], dim=-1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _half_to_interleaved(head_dim):
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def _unpermute(w, n_heads):
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize(
    "check, right",
    [
        (nb04.check_rope_angles, _angles),
        (nb04.check_rope_half, _rope),
        (nb04.check_half_to_interleaved, _half_to_interleaved),
        (nb04.check_unpermute_rows, _unpermute),
    ],
    ids=["angles", "rope_half", "half_to_interleaved", "unpermute_rows"],
)
def test_right_answers_pass(capsys, check, right):
    assert check(right) is True
    assert "✅" in capsys.readouterr().out


def test_a_stub_is_waiting(capsys):
    def rope_half(x, position_ids, theta):
        raise NotImplementedError

    assert nb04.check_rope_half(rope_half) is False
    assert "⏳ rope_half: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda m, d, t: m / t ** (torch.arange(d // 2).float() / d), "your exponent is i / head_dim"),
        (lambda m, d, t: m * t ** (torch.arange(0, d, 2).float() / d), "note the minus sign"),
        (lambda m, d, t: 1.0 / t ** (torch.arange(0, d, 2).float() / d), "multiply by `position`"),
        (lambda m, d, t: torch.rad2deg(_angles(m, d, t)), "these are degrees"),
        (lambda m, d, t: _angles(m, d, 100000.0), "instead of the `theta` argument"),
    ],
    ids=["exponent-i", "growing", "no-position", "degrees", "notebook-theta"],
)
def test_angle_mistakes_are_named(capsys, wrong, says):
    assert nb04.check_rope_angles(wrong) is False
    assert says in capsys.readouterr().out


def _rope_variant(table="cat", sign=1.0, shift=0, head_axis=True, exponent_step=2, second_half=True):
    def rope_half(x, position_ids, theta):
        d = x.shape[-1]
        inv_freq = 1.0 / theta ** (torch.arange(0, d, exponent_step)[: d // 2].float() / d)
        pos = position_ids.float() + shift
        angles = pos[:, None, :, None] * inv_freq if head_axis else pos[..., None] * inv_freq
        if table == "cat":
            angles = torch.cat([angles, angles], dim=-1)
        elif table == "repeat_interleave":
            angles = angles.repeat_interleave(2, dim=-1)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        if table == "half":  # cos/sin left at head_dim/2 columns
            rotated = torch.cat([-x2, x1], dim=-1)
            return x * angles.cos() + rotated * angles.sin()
        if not second_half:
            a = angles[..., : d // 2]
            return torch.cat([x1 * a.cos() - x2 * a.sin(), x2], dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return x * angles.cos() + sign * rotated * angles.sin()

    return rope_half


def _rope_positions(positions_of, theta_of=lambda t: t, swap=False):
    """A right rotation by the wrong positions (or theta), or with cos and sin swapped."""

    def rope_half(x, position_ids, theta):
        d = x.shape[-1]
        pos = positions_of(x, position_ids).float()
        angles = pos[:, None, :, None] * (1.0 / theta_of(theta) ** (torch.arange(0, d, 2).float() / d))
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = (angles.sin(), angles.cos()) if swap else (angles.cos(), angles.sin())
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin

    return rope_half


def _rope_interleaved_pairs(x, position_ids, theta):
    d = x.shape[-1]
    angles = position_ids.float()[:, None, :, None] * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_rope_interleaved_pairs, "you paired adjacent coordinates"),
        (_rope_variant(sign=-1.0), "your rotation turns the wrong way"),
        (_rope_variant(shift=1), "you rotated by position + 1"),
        (_rope_variant(table="repeat_interleave"), "that is the interleaved table"),
        (_rope_variant(head_axis=False), "Add the head axis: [batch, 1, seq, head_dim]"),
        (_rope_variant(second_half=False), "only the first half is rotated"),
        (_rope_variant(exponent_step=1), "exponent i / head_dim"),
        (_rope_variant(table="half"), "concatenate the angles for both halves"),
        (_rope_positions(lambda x, p: torch.arange(x.shape[-2]).expand(x.shape[0], -1)), "not by `position_ids`"),
        (_rope_positions(lambda x, p: p[:1].expand(x.shape[0], -1)), "the first row's positions"),
        (_rope_positions(lambda x, p: p, swap=True), "cos and sin are swapped"),
        (_rope_positions(lambda x, p: p, theta_of=lambda t: 100000.0), "instead of the `theta` argument"),
    ],
    ids=["interleaved-pairs", "sin-sign", "position-plus-one", "interleaved-table", "no-head-axis",
         "first-half-only", "exponent-i", "cos-not-concatenated", "positions-ignored", "first-row-positions",
         "cos-sin-swapped", "notebook-theta"],
)
def test_rope_mistakes_are_named(capsys, wrong, says):
    assert nb04.check_rope_half(wrong) is False
    assert says in capsys.readouterr().out


def test_half_to_interleaved_forward_instead_of_inverse_is_named(capsys):
    from minillm.model.rope import interleaved_to_half

    assert nb04.check_half_to_interleaved(interleaved_to_half) is False
    assert "that is interleaved_to_half itself" in capsys.readouterr().out


def test_half_to_interleaved_identity_is_named(capsys):
    assert nb04.check_half_to_interleaved(lambda d: torch.cat([torch.arange(d // 2), torch.arange(d // 2, d)])) is False
    assert "that is the identity" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda w, n: w.view(n, 2, w.shape[0] // n // 2, -1).transpose(1, 2).reshape(w.shape), "instead of undoing it"),
        (lambda w, n: w.view(1, w.shape[0] // 2, 2, -1).transpose(1, 2).reshape(w.shape), "as if they were one head"),
        (lambda w, n: w.reshape(n, -1, 2, w.shape[1]).reshape(w.shape), "a reshape alone moves nothing"),
        (lambda w, n: w.clone(), "a reshape alone moves nothing"),
        (lambda w, n: _unpermute(w, n).view(n, 2, -1, w.shape[1]).flip(1).reshape(w.shape), "halves are swapped"),
        (lambda w, n: _unpermute(w.T.contiguous(), n).T, "you permuted the columns"),
    ],
    ids=["permute-again", "one-head", "no-swap", "identity", "halves-swapped", "columns"],
)
def test_unpermute_mistakes_are_named(capsys, wrong, says):
    assert nb04.check_unpermute_rows(wrong) is False
    assert says in capsys.readouterr().out


def test_hints_come_in_three_tiers(capsys):
    nb04.check_rope_half(_rope_variant(sign=-1.0), hint=3)
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 3/3" in out and "Stuck?" not in out


@pytest.mark.parametrize(
    "check, solution",
    [
        (nb04.check_rope_angles, nb04.rope_angles_solution),
        (nb04.check_rope_half, nb04.rope_half_solution),
        (nb04.check_half_to_interleaved, nb04.half_to_interleaved_solution),
        (nb04.check_unpermute_rows, nb04.unpermute_rows_solution),
    ],
    ids=["angles", "rope_half", "half_to_interleaved", "unpermute_rows"],
)
def test_reference_solutions_pass(capsys, check, solution):
    assert check(solution) is True, capsys.readouterr().out


def test_unpermute_solution_undoes_the_converters_permute():
    """On a weight with known rows: llama.cpp's converter permute, then the solution, is the identity."""
    w = torch.arange(3 * 8 * 2, dtype=torch.float32).view(24, 2)  # 3 heads of head_dim 8
    permuted = w.view(3, 2, 4, 2).transpose(1, 2).reshape(24, 2)  # HF -> GGUF, as the converter writes it
    assert torch.equal(nb04.unpermute_rows_solution(permuted, 3), w)
