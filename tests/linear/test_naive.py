"""The references of the fast ops (``sp_attention/linear/naive.py``) against the recurrence in
fp64: fla's chunk states (``chunk_start_states``), the output kernel's reference
(``output_from_states_ref``: linearity, the zero-start chunk states plus ``λ^(n·C) S_in``) and
the state-sum kernel's (``decayed_state_sum_ref``)."""

from __future__ import annotations

import pytest

from local_cases import TOL, inputs, slopes_of
from sp_attention.linear.leaf import leaf_state, state_grad_local
from sp_attention.linear.naive import (chunk_start_states, decayed_state_sum_ref,
                                       output_from_states_ref, recurrent_linear_attention)
from sp_attention.testing import assert_close


@pytest.mark.parametrize("kind", ["mixed", "zero", "huge"])
@pytest.mark.parametrize("T", [1, 64, 130])
def test_output_from_states_reference_matches_recurrence(kind, T):
    """Linearity the CP forward relies on: the zero-start chunk states plus ``λ^(n·C) S_in``
    give the output of the recurrence entered with ``S_in`` (fp64, exact)."""
    q, k, v, S0, _, _ = inputs(B=2, T=T, H=3)
    slopes = slopes_of(kind, 3)
    o_ref, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3, initial_state=S0)
    h = chunk_start_states(k, v, slopes, 64)
    assert h.shape == (2, -(-T // 64), 3, 4, 5)
    assert_close(output_from_states_ref(q, k, v, h, S0, slopes, 0.3), o_ref, TOL)
    assert_close(chunk_start_states(k, v, slopes, 64, S0)[:, 0], S0, TOL, "first chunk = S_in")
    # the one-pass state sums: end state from zero, and the state-gradient contribution
    assert_close(decayed_state_sum_ref(k, v, slopes, T - 1, -1), leaf_state(k, v, slopes), TOL)
    assert_close(0.3 * decayed_state_sum_ref(q, v, slopes, 1, 1),
                 state_grad_local(q, v, slopes, 0.3), TOL)
